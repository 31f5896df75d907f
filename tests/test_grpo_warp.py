"""grpo --stage warp-atomic: ability-specific rewards on real WARP action examples, a CPU run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

QUERY = "How do volcanoes form and what are their effects?"


@pytest.fixture(scope="module")
def examples(retriever):
    """Action-level examples of an extractive warp run, as prune-trajectories writes them."""
    from deepr.agent import RunConfig, run_agent
    from deepr.corpus.tools import ResearchTools
    from deepr.llm.extractive import ExtractiveLLM
    from deepr.train.trajectories import turn_examples

    res = run_agent(QUERY, tools=ResearchTools(retriever, k=3), llm=ExtractiveLLM(),
                    config=RunConfig(mode="warp", k=3, max_expansions=1))
    return turn_examples(res.trajectory)


def _by_action(rows, action):
    return next(r for r in rows if r["action"] == action)


def test_dataset_keeps_warp_actions_and_explains_skips(examples):
    from deepr.records import ChatExample
    from deepr.train.warp_stage import atomic_dataset

    bad = ChatExample(id="x", role="planner", action="plan", messages=[{"role": "user", "content": "q"}])
    rows, skipped = atomic_dataset([*examples, bad])
    assert {"initialize", "search", "write"} <= {r["action"] for r in rows}
    assert skipped == [("x", "action 'plan' is not a WARP action (initialize, search, write, expand, terminate)")]
    assert all(r["query"] == QUERY and r["prompt"][-1]["role"] == "user" for r in rows)


def test_atomic_rewards_per_ability(examples, retriever):
    from deepr.train.warp_stage import WarpAtomicRewardFn, atomic_dataset

    rows, _ = atomic_dataset(examples)
    fn = WarpAtomicRewardFn(retriever, k=3)
    # retrieval: the teacher's own keywords recall all its documents; unrelated ones recall fewer
    s = _by_action(rows, "search")
    assert fn.score("search", s["reference"], s["reference"], QUERY, s["prompt"])["reward"] == 1.0
    other = fn.score("search", '{"name": "search", "keywords": ["medieval poetry"]}', s["reference"], QUERY,
                     s["prompt"])["reward"]
    assert 0.0 <= other < 1.0
    assert fn.score("search", "no json", s["reference"], QUERY, s["prompt"]) == \
        {"action": "search", "parse_fail": 1.0, "reward": 0.0}
    # writing: an invented citation id zeroes citation precision (and this short text fails length);
    # the teacher's own reply has citation F1 1
    w = _by_action(rows, "write")
    own = fn.score("write", w["reference"], w["reference"], QUERY, w["prompt"])
    assert own["citation_f1"] == 1.0 and own["reward"] >= 0.5
    assert fn.score("write", "<content>Lava flows [Z9-R9].</content>", w["reference"], QUERY,
                    w["prompt"])["reward"] == 0.0
    # planning: 2–7 sections pass, one section fails
    i = _by_action(rows, "initialize")
    three = json.dumps({"name": "initialize", "title": "t", "sections": [{"title": f"S{k}"} for k in range(3)]})
    one = json.dumps({"name": "initialize", "title": "t", "sections": [{"title": "only"}]})
    assert fn.score("initialize", three, i["reference"], QUERY, i["prompt"])["reward"] == 1.0
    assert fn.score("initialize", one, i["reference"], QUERY, i["prompt"])["reward"] == 0.0
    # decision: matching the pruned label scores 1, the other decision 0
    assert fn.score("terminate", '{"name": "terminate"}', "", QUERY, [])["reward"] == 1.0
    assert fn.score("terminate", json.dumps({"name": "expand", "position": "section-1", "subsections": []}), "",
                    QUERY, [])["reward"] == 0.0
    sub = json.dumps({"name": "expand", "position": "section-1", "subsections": [{"title": "a"}, {"title": "b"}]})
    assert fn.score("expand", sub, "", QUERY, [])["reward"] == 1.0


def test_warp_atomic_trains_on_cpu_and_logs_each_ability(examples, retriever, tmp_path: Path):
    from deepr.train.tiny import build_tiny_model, wiki_texts
    from deepr.train.warp_stage import WarpAtomicConfig, train_warp_atomic

    tiny = build_tiny_model(tmp_path / "tiny", corpus_texts=wiki_texts(300) or None, vocab_size=1500)
    wanted = [e for e in examples if e.action in ("search", "initialize")][:2]
    cfg = WarpAtomicConfig(model=str(tiny), out=tmp_path / "rl", num_generations=2, prompts_per_step=2,
                           mini_batch_prompts=2, max_completion_length=16, max_steps=1, lora_r=4, lora_alpha=8,
                           k=2, learning_rate=1e-3)
    res = train_warp_atomic(cfg, wanted, retriever)
    assert res.steps == 1 and res.rewards
    log = [json.loads(x) for x in (res.out / "metrics.jsonl").read_text().splitlines()]
    assert {"warp/reward", "warp/parse_fail", "rewards/warp_atomic_reward/mean"} <= set(log[0])
    assert (res.out / "adapter_config.json").is_file()
    meta = json.loads((res.out / "deepr_meta.json").read_text())
    assert meta["role"] == "warp" and meta["stage"] == "grpo-warp-atomic" and meta["status"] == "done"
    with pytest.raises(ValueError, match="no WARP action examples"):
        train_warp_atomic(cfg.model_copy(update={"out": tmp_path / "x"}), [], retriever)


# --- warp-report -----------------------------------------------------------------------------------


def warp_policy(tok):
    """Valid WARP replies chosen from the request: keywords, a 3-section outline, cited sections, stop."""
    import re

    def generate(seqs, first, max_new):
        out = []
        for ids in seqs:
            text = tok.decode(ids, skip_special_tokens=True)
            if "Give 1 to 5 search keywords" in text:
                reply = '{"name": "search", "keywords": ["volcano eruption"]}'
            elif "Write a sparse first outline" in text:
                reply = json.dumps({"name": "initialize", "title": "Volcanoes", "sections": [
                    {"title": "Formation of volcanoes", "plan": "how"}, {"title": "Eruption effects", "plan": "what"},
                    {"title": "Living near volcanoes", "plan": "risk"}]})
            elif "<content>" in text:
                cid = re.findall(r"\[(S\d+-R\d+)\]", text.rsplit("Retrieved information", 1)[-1])[0]
                reply = f"<content>Magma rises through the crust and erupts at the surface [{cid}].</content>"
            else:
                reply = '{"name": "terminate"}'
            out.append((tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:max_new])
        return out, None
    return generate


def test_warp_report_episode_is_one_masked_sample_and_is_scored(retriever, embedder, tmp_path: Path):
    from transformers import AutoTokenizer

    from deepr.agent.env import Ctx, RunConfig
    from deepr.agent.trace import Tracer
    from deepr.agent.warp import run_warp
    from deepr.corpus.tools import ResearchTools
    from deepr.llm.base import run_sync
    from deepr.rewards.judges import Judge
    from deepr.train.tiny import build_tiny_model, wiki_texts
    from deepr.train.warp_stage import WarpReportRewardFn, episode_rollout, policy_llm

    tok = AutoTokenizer.from_pretrained(str(build_tiny_model(tmp_path / "tiny", corpus_texts=wiki_texts(200) or None,
                                                             vocab_size=1200)))
    llm = policy_llm(warp_policy(tok), tok, 200)
    tracer = Tracer(QUERY, "warp")
    out = run_sync(run_warp(Ctx(llm, ResearchTools(retriever, k=2), RunConfig(mode="warp", k=2, max_reasks=0),
                                tracer), QUERY))
    report = out.outline.markdown()
    assert not tracer.failures and "Eruption effects" in report and "Magma rises" in report
    r = episode_rollout(llm.calls, tok, 100000, [tok.eos_token_id])
    model_runs = [m for m, _ in _runs(r)]
    assert model_runs[0] == 1 and model_runs == [1, 0] * (len(llm.calls) - 1) + [1]
    masked = tok.decode([t for t, m in zip(r.completion_ids, r.env_mask) if not m])
    written = tok.decode([t for t, m in zip(r.completion_ids, r.env_mask) if m], skip_special_tokens=True)
    assert "Retrieved information" in masked and "Retrieved information" not in written
    assert "Magma rises" in written and '"terminate"' in written
    short = episode_rollout(llm.calls, tok, 40, [tok.eos_token_id])
    assert short.truncated and len(short.completion_ids) <= 40
    fn = WarpReportRewardFn(Judge(None, embedder.encode))
    logged: dict[str, float] = {}
    rub = [{"id": "R1", "type": "factual", "description": "Magma rises and erupts at the surface.", "weight": 1}]
    got = run_sync(fn(prompts=["", ""], completions=["", ""], query=[QUERY] * 2, report=[report, report],
                      rubrics=[rub, []], log_metric=lambda k, v: logged.__setitem__(k, v)))
    assert all(0.0 <= g <= 1.0 for g in got) and {"report/R", "report/R_rubric", "report/readability"} <= set(logged)


def _runs(r):
    out = []
    for m in r.env_mask:
        if not out or out[-1][0] != m:
            out.append((m, 0))
    return out


def test_warp_report_trains_on_cpu(retriever, embedder, tmp_path: Path):
    from deepr.records import QRPair
    from deepr.rewards.judges import Judge
    from deepr.train.tiny import build_tiny_model, wiki_texts
    from deepr.train.warp_stage import WarpReportConfig, train_warp_report
    from transformers import AutoTokenizer

    tiny = build_tiny_model(tmp_path / "tiny", corpus_texts=wiki_texts(200) or None, vocab_size=1200)
    tok = AutoTokenizer.from_pretrained(str(tiny))
    cfg = WarpReportConfig(model=str(tiny), out=tmp_path / "rl", num_generations=2, prompts_per_step=1,
                           mini_batch_prompts=1, max_completion_length=6000, max_turn_tokens=200, max_steps=1,
                           lora_r=4, lora_alpha=8, k=2, learning_rate=1e-3, max_expansions=1)
    pair = QRPair(id="q", tree_id="t", question=QUERY, selected_leaf_ids=[], rubrics=[])
    res = train_warp_report(cfg, [pair], retriever, judge=Judge(None, embedder.encode),
                            generate_for=lambda trainer: warp_policy(tok))
    assert res.steps == 1 and res.rewards and 0.0 <= res.rewards[0][1] <= 1.0
    log = [json.loads(x) for x in (res.out / "metrics.jsonl").read_text().splitlines()]
    assert {"report/R", "report/comprehensiveness", "rollout/masked_token_share"} <= set(log[0])
    assert log[0]["rollout/extractive_fallback"] == 0.0 and (res.out / "adapter_config.json").is_file()
