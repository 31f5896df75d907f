"""Opt-in learning check (`pytest -m slow tests/test_grpo_learning.py -s`): after a short SFT cold
start on the extractive planner's two turns, planner GRPO raises the mean R_plan on CPU.

Recipe from MACHINE-NOTES "TRL on CPU": full SFT warm-up of the random tiny model (LoRA alone
cannot move frozen random embeddings), then GRPO with LoRA r 16, lr 1e-2. The tokenizer is
trained on the wiki text plus the cold-start prompts and plans, so a plan is a few dozen tokens and a
step fits the CPU budget. The (step, reward) curve is printed and written to
``grpo_learning_curve.json`` in the test's folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepr.records import ChatExample, QRPair

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

QUESTIONS = ["What causes earthquakes and how dangerous are they?"]
RUBRICS = [{"id": "R1", "type": "factual", "description": "Explains the main causes.", "weight": 1.0},
           {"id": "R2", "type": "logical", "description": "Compares the consequences.", "weight": 0.5}]
STEPS = 8


def small_env(retriever):
    """One result per search node and few explored passages: short plans and revision turns, so
    a GRPO step stays within a CPU budget."""
    from deepr.agent.env import RunConfig
    from deepr.train.rollouts import PlannerEnvironment

    env = PlannerEnvironment(retriever, k=1, fetch_limit=0)
    env.config = RunConfig(k=1, fetch_limit=0, explore_k=2)
    return env


def cold_start(pairs: list[QRPair], env) -> list[ChatExample]:
    """Both planner turns of the extractive planner, as `deepr run` would prompt them."""
    from deepr.agent.planner import initial_plan, plan_json, revise_plan
    from deepr.llm.base import run_sync

    out = []
    for p in pairs:
        ctx = env.context(p.question)
        g0 = run_sync(initial_plan(ctx, p.question))
        g0_text = plan_json(g0)
        results = {n.id: ctx.search(n.id, n.query or "") for n in g0.nodes if n.type == "search"}
        g1, fetch = run_sync(revise_plan(ctx, p.question, g0, results))
        g1_text = json.dumps({**json.loads(plan_json(g1)), "fetch": fetch})
        msg, _ = env.feedback(p.question, g0_text)
        first = env_prompt(p.question)
        out.append(ChatExample(id=f"{p.id}-1", role="planner", action="plan",
                               messages=first + [{"role": "assistant", "content": g0_text}]))
        out.append(ChatExample(id=f"{p.id}-2", role="planner", action="revise",
                               messages=first + [{"role": "assistant", "content": g0_text},
                                                 {"role": "user", "content": msg},
                                                 {"role": "assistant", "content": g1_text}]))
    return out


def env_prompt(q: str) -> list[dict[str, str]]:
    from deepr.train.rollouts import planner_prompt

    return planner_prompt(q)


def test_planner_grpo_raises_mean_reward(retriever, tmp_path: Path):
    from transformers import AutoTokenizer

    from deepr.train import grpo
    from deepr.train.sft import SftConfig, train_sft
    from deepr.train.tiny import build_tiny_model, wiki_texts

    pairs = [QRPair(id=f"q{i}", tree_id="t", question=q, selected_leaf_ids=[], rubrics=RUBRICS)
             for i, q in enumerate(QUESTIONS)]
    env = small_env(retriever)
    examples = cold_start(pairs, env)
    texts = list(dict.fromkeys(m["content"] for e in examples for m in e.messages))  # prompts and replies
    base = build_tiny_model(tmp_path / "tiny", corpus_texts=wiki_texts(300) + texts * 30, vocab_size=3000)
    sft = tmp_path / "sft"
    train_sft(examples, SftConfig(model=str(base), out=sft, full=True, learning_rate=1e-2, max_steps=100,
                                  batch_size=2, grad_accum=1, save_steps=1000, logging_steps=5,
                                  lr_scheduler="constant", max_length=4096))
    rows, lookup = grpo.planner_dataset(pairs)
    tok = AutoTokenizer.from_pretrained(str(sft))
    # room for turn 1, the environment turn and turn 2 of the cold-start conversation, plus slack
    lengths = max(len(tok.apply_chat_template(e.messages, tokenize=True, return_dict=False))
                  - len(tok.apply_chat_template(e.messages[:2], tokenize=True, add_generation_prompt=True,
                                                return_dict=False)) for e in examples)
    turn = max(len(tok(m["content"])["input_ids"]) for e in examples for m in e.messages if m["role"] == "assistant")
    print("\nrollout budget (tokens):", lengths + 64, "turn cap:", turn + 16)
    cfg = grpo.GrpoConfig(stage="planner", model=str(sft), out=tmp_path / "rl", num_generations=4,
                          prompts_per_step=1, mini_batch_prompts=1, max_completion_length=lengths + 64, max_turn_tokens=turn + 16,
                          max_steps=STEPS, lora_r=16, lora_alpha=32, learning_rate=1e-2, k=1, fetch_limit=0,
                          save_steps=1000)
    res = grpo.train_grpo(cfg, rows, lookup, env=env)
    curve = [(s, round(r, 4)) for s, r in res.rewards]
    valid = [(h["step"], h.get("plan/valid")) for h in res.history if "plan/valid" in h]
    (tmp_path / "grpo_learning_curve.json").write_text(json.dumps({"reward": curve, "valid": valid}))
    print("\n(step, mean R_plan):", curve, "\n(step, validity):", valid)
    third = max(1, len(curve) // 3)
    first = sum(r for _, r in curve[:third]) / third
    last = sum(r for _, r in curve[-third:]) / third
    assert len(curve) == STEPS
    assert last > first + 0.05, f"mean reward did not rise: first third {first:.3f}, last third {last:.3f}"
