"""grpo --stage decor: role-wise advantages and the −1 format gate against hand-computed values,
team episodes with masked observations, and a CPU training step with the tiny model."""

from __future__ import annotations

import json
import math

import pytest

from deepr.train.decor_stage import QARecord

Q = "What causes earthquakes?"
GOOD = {"planner": "<think>need the cause</think><search>earthquake tectonic plates</search>",
        "stop": "<think>enough</think><search>STOP</search>",
        "filter": "<think>keep the cause</think><filter>Earthquakes come from tectonic plates [S1-R1].</filter>",
        "answerer": "<think>from the facts</think><answer>tectonic plates [S1-R1]</answer>"}


def role_aware(tok, broken_at: set[int] = frozenset()):
    """A generator that writes each role's reply from the system prompt it sees; rollouts whose
    index (within a batch call) is in ``broken_at`` write text that breaks the protocol."""
    def generate(seqs, first, max_new):
        out = []
        for j, ids in enumerate(seqs):
            text = tok.decode(ids, skip_special_tokens=True)
            if "You plan the searches" in text:
                reply = GOOD["stop"] if "Searches made: earthquake" in text.rsplit("Question:", 1)[-1] else \
                    GOOD["planner"]
            elif "You filter search results" in text:
                reply = GOOD["filter"]
            else:
                reply = GOOD["answerer"]
            if j in broken_at and len(seqs) > 1:
                reply = "no tags at all"
            out.append((tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:max_new])
        return out, None
    return generate


def test_config_has_table5_defaults(tmp_path):
    from deepr.train.decor_stage import DecorStageConfig

    c = DecorStageConfig(model="m", out=tmp_path)
    assert (c.epsilon, c.epsilon_high, c.importance_sampling_level) == (3e-4, 4e-4, "sequence")
    assert (c.learning_rate, c.num_generations, c.decor_steps, c.alpha, c.lam) == (2e-6, 8, 4, 0.6, 0.5)


def test_role_wise_advantages_match_hand_computation():
    from deepr.train.decor_stage import role_group_advantages

    keys = [("q1", "planner")] * 3 + [("q1", "answerer")] * 2 + [("q2", "planner"), ("q1", "planner")]
    rewards = [-1.0, 0.7, 0.1, 0.5, 0.5, 0.3, math.nan]
    adv = role_group_advantages(rewards, keys)
    # (q1, planner): μ = −0.2/3, σ (population) = sqrt(1.4866667/3) = 0.7039571; A = dev / σ
    assert adv[:3] == pytest.approx([-1.325837, 1.089080, 0.236757], abs=1e-5)
    assert adv[3:] == [0.0, 0.0, 0.0, 0.0]  # equal rewards, a group of one, an unscored row


def test_format_gate_and_hybrid_reward_by_hand(embedder):
    from deepr.llm.base import run_sync
    from deepr.train.decor_stage import DecorRewardFn, role_group_advantages

    fn = DecorRewardFn(embed=embedder.encode)
    steps = [{"context": "facts", "output": GOOD["answerer"]}]
    wrong = [{"context": "facts", "output": "<think>guess</think><answer>volcanic ash</answer>"}]
    logged: dict[str, float] = {}
    out = run_sync(fn(prompts=[""] * 4, completions=[""] * 4, role=["answerer"] * 3 + ["filter"],
                      question=[Q] * 4, answers=[["tectonic plates"]] * 4,
                      team_answer=["tectonic plates [S1-R1]", "", "volcanic ash", ""],
                      role_steps=[steps, [{"context": "", "output": "oops"}], wrong, []],
                      format_valid=[True, False, True, True], log_metric=lambda k, v: logged.__setitem__(k, v)))
    # right answer (citation markers are not part of it): F1 1, LJ 1 → R_team 1, role +1 → 0.6·1 + 0.4·1;
    # broken format → −1; wrong answer: F1 0, LJ 0, role −1 → −0.4; a role that never spoke → no reward
    assert out[:3] == pytest.approx([1.0, -1.0, -0.4]) and out[3] is None
    assert logged["decor/format_ok"] == pytest.approx(2 / 3) and logged["decor/answerer/R_total"] == \
        pytest.approx((1.0 - 1.0 - 0.4) / 3)
    adv = role_group_advantages(out[:3], [("q", "answerer")] * 3)
    assert adv == pytest.approx([1.352455, -1.034226, -0.318223], abs=1e-5)


def test_each_role_step_is_its_own_call_under_its_own_prompt(tok, retriever):
    from deepr.train.decor_stage import context_factory, decor_dataset, decor_rollouts

    rows, lookup = decor_dataset([QARecord(id="q", question=Q, answers=["tectonic plates"])])
    played, extra = decor_rollouts([r["prompt"] for r in rows], lookup, context_factory(retriever, 2),
                                   role_aware(tok), tok, budget=6000, eos_ids=[tok.eos_token_id])
    planner, filt, answerer = played
    assert len(planner.calls) == 2 and all(len(p) == 2 for p in planner.prompts)  # fresh prompts, no continuation
    second = planner.prompts[1][-1]["content"]
    assert "Earthquakes come from tectonic plates" in second and "Searches made: earthquake" in second
    assert planner.texts == [GOOD["planner"], GOOD["stop"]]
    assert GOOD["planner"] not in tok.decode(planner.calls[1].prompt_ids)  # its own earlier reply is not context
    assert len(filt.calls) == 1 and "[S1-R1]" in tok.decode(filt.calls[0].prompt_ids)
    assert "<search>" not in tok.decode(filt.calls[0].completion_ids)  # no other role's text is trained
    assert answerer.texts == [GOOD["answerer"]]
    assert extra["team_answer"] == ["tectonic plates [S1-R1]"] * 3 and all(extra["format_valid"])
    assert [len(s) for s in extra["role_steps"]] == [2, 1, 1] and extra["spoke"] == [True] * 3


def test_decor_steps_have_the_same_token_ids_in_run_sft_and_rl(tok, retriever):
    """Issue 15.6: every DECOR role step renders to the same ids through `deepr run --mode decor`,
    the SFT example built from its record, and the GRPO rollout."""
    from deepr.agent.decor import run_decor
    from deepr.evidence.env import Ctx, RunConfig
    from deepr.evidence.trace import Tracer
    from deepr.corpus.tools import ResearchTools
    from deepr.llm.base import run_sync
    from deepr.train.decor_stage import context_factory, decor_dataset, decor_rollouts
    from deepr.train.rollouts import prompt_ids
    from deepr.train.sft import to_row
    from deepr.train.trajectories import turn_examples
    from tree_helpers import ScriptedLLM

    def reply(messages):
        text = " ".join(m["content"] for m in messages)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return tok.decode(role_aware(tok)([ids], False, 999)[0][0], skip_special_tokens=True)

    ctx = Ctx(ScriptedLLM(reply), ResearchTools(retriever, k=2), RunConfig(mode="decor", k=2), Tracer(Q, "decor"))
    run_sync(run_decor(ctx, Q))
    run_turns = ctx.tracer.turns
    assert [t.role for t in run_turns] == ["decor_planner", "decor_filter", "decor_planner", "decor_answerer"]
    examples = turn_examples(ctx.tracer.trajectory("d1", report="r"))
    rows, lookup = decor_dataset([QARecord(id="q", question=Q, answers=["tectonic plates"])])
    (planner, filt, answerer), _ = decor_rollouts([r["prompt"] for r in rows], lookup, context_factory(retriever, 2),
                                                  role_aware(tok), tok, budget=6000, eos_ids=[tok.eos_token_id])
    rl = [planner.calls[0], filt.calls[0], planner.calls[1], answerer.calls[0]]
    for turn, ex, call in zip(run_turns, examples, rl):
        assert prompt_ids(tok, turn.messages) == prompt_ids(tok, to_row(ex, "completion")["prompt"]) == call.prompt_ids


def test_a_broken_planner_truncates_and_silences_later_roles(tok, retriever):
    from deepr.train.decor_stage import context_factory, decor_dataset, decor_rollouts

    rows, lookup = decor_dataset([QARecord(id="q", question=Q, answers="tectonic plates")])
    gen = role_aware(tok, broken_at={0})
    (p, f), extra = decor_rollouts([rows[0]["prompt"], rows[1]["prompt"]], lookup, context_factory(retriever, 2),
                                   gen, tok, budget=6000, eos_ids=[tok.eos_token_id])
    # the planner row's own turn broke: format gate, no answer; the filter row's team was fine
    assert extra["format_valid"][0] is False and extra["team_answer"][0] == "" and "planner" in extra["broken"][0]
    assert extra["spoke"] == [True, True] and len(p.calls) == 1
    # a batch in which no row's role got to speak (the planner broke first) has no samples, no reward
    (f,), extra = decor_rollouts([rows[1]["prompt"]], lookup, context_factory(retriever, 2),
                                 lambda seqs, first, n: ([tok("junk")["input_ids"]] * len(seqs), None), tok,
                                 budget=6000, eos_ids=[tok.eos_token_id])
    assert extra["spoke"] == [False] and f.calls == []


def test_decor_stage_trains_with_role_wise_advantages(tiny, tok, retriever, tmp_path):
    from deepr.train import decor_stage as ds
    from deepr.train import stage as rs

    cfg = ds.DecorStageConfig(model=str(tiny), out=tmp_path / "rl", num_generations=2, prompts_per_step=1,
                              mini_batch_prompts=1, max_completion_length=3000, max_turn_tokens=64, max_steps=1,
                              lora_r=4, lora_alpha=8, k=2, learning_rate=1e-3, decor_steps=2)
    seen: list = []

    class Spy(ds.DecorRewardFn):
        async def __call__(self, prompts, completions, **cols):
            r = await super().__call__(prompts, completions, **cols)
            seen.append((r, list(zip(cols["qid"], cols["role"]))))
            return r

    store: list = []
    built = rs.build_stage_trainer

    def keep(*a, **kw):
        store.append(built(*a, **kw))
        return store[0]

    from transformers import TrainerCallback

    class Capture(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            inner = store[0]._generate_and_score_completions
            store[0]._generate_and_score_completions = lambda inputs: store.append(inner(inputs)) or store[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rs, "build_stage_trainer", keep)
        res = ds.train_decor(cfg, [QARecord(id="q", question=Q, answers=["tectonic plates"])], retriever,
                             generate_for=lambda trainer: role_aware(tok, broken_at={1}), callbacks=[Capture()],
                             reward_fn=Spy())
    assert res.steps == 1 and type(store[0]).__name__ == "DecorTrainer"
    rewards, keys = seen[0]
    assert rewards[1] == -1.0 and rewards[0] > -1.0  # the second rollout broke its format
    want = ds.role_group_advantages(rewards, keys)
    assert store[0]._decor_advantages == pytest.approx(want, abs=1e-5)
    live = store[1]["completion_mask"].sum(dim=1) > 0  # one row per call, with its episode's advantage
    assert set(round(a, 5) for a in store[1]["advantages"][live].tolist()) <= {round(a, 5) for a in want}
    assert want == pytest.approx([1.0, -1.0], abs=1e-5)  # TRL's own (unbiased σ) would give ±0.707
    log = [json.loads(x) for x in (res.out / "metrics.jsonl").read_text().splitlines()]
    assert {"decor/R_total", "decor/format_ok", "rewards/decor_reward/mean"} <= set(log[0])
    assert (res.out / "adapter_config.json").is_file()
    meta = json.loads((res.out / "deepr_meta.json").read_text())
    assert meta["status"] == "done"
    from deepr.llm import get_llm

    llm = get_llm(meta["llm_spec"])  # one adapter serves the three roles `deepr run --mode decor` calls
    assert set(llm.config.adapters) == {"decor_planner", "decor_filter", "decor_answerer"}
    assert isinstance(llm.chat([{"role": "user", "content": "hi"}], role="decor_filter", max_tokens=4), str)


def test_cli_decor_stage_reads_qa_jsonl(tiny, retriever, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import deepr.corpus
    from deepr.cli import app

    monkeypatch.setattr(deepr.corpus, "open_retriever", lambda *a, **kw: retriever)  # the session's index
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"id": "q", "question": Q, "answers": ["tectonic plates"]}) + "\n")
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"num_generations": 2, "prompts_per_step": 1, "mini_batch_prompts": 1, "lora_r": 4,
                               "lora_alpha": 8, "max_completion_length": 64, "max_turn_tokens": 16,
                               "decor_steps": 1}))
    args = ["grpo", "--stage", "decor", "--model", str(tiny), "--data", str(data), "--out", str(tmp_path / "rl"),
            "--config", str(cfg), "--max-steps", "1"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "grpo --stage decor" in r.output and (tmp_path / "rl" / "adapter_config.json").is_file()
    assert "adapter=decor_planner:" in json.loads((tmp_path / "rl" / "deepr_meta.json").read_text())["llm_spec"]
    data.write_text(json.dumps({"id": "q", "question": Q, "answers": []}) + "\n")
    r = CliRunner().invoke(app, [*args[:8], str(tmp_path / "rl2"), *args[9:]])
    assert r.exit_code == 2 and "qa.jsonl:1" in r.output and "answers" in r.output
