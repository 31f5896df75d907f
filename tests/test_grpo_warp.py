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
    from deepr.train.trajectories import turn_examples

    res = run_agent(QUERY, tools=ResearchTools(retriever, k=3), llm=None,
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


def _episode(retriever, tmp_path, generate_for_tok, **cfg):
    from transformers import AutoTokenizer

    from deepr.train.tiny import build_tiny_model, wiki_texts
    from deepr.train.warp_stage import WarpReportConfig, play_episode

    tok = AutoTokenizer.from_pretrained(str(build_tiny_model(tmp_path / "tiny", corpus_texts=wiki_texts(200) or None,
                                                             vocab_size=1200)))
    config = WarpReportConfig(model="m", out=tmp_path / "o", k=2, max_turn_tokens=200, **cfg)
    return tok, play_episode(QUERY, generate_for_tok(tok), tok, retriever, config)


def test_warp_report_episode_records_each_call_under_its_own_prompt(retriever, embedder, tmp_path: Path):
    # Issue 15.3 (replaces the test of one concatenated, masked sample per episode): each call is kept
    # with the exact prompt it was sampled from and its own reply, nothing cut at a budget.
    from deepr.llm.base import run_sync
    from deepr.rewards.judges import Judge
    from deepr.train.warp_stage import WarpReportRewardFn

    tok, (calls, report, failed) = _episode(retriever, tmp_path, warp_policy)
    assert not failed and "Eruption effects" in report and "Magma rises" in report
    prompts = [tok.decode(c.prompt_ids, skip_special_tokens=True) for c in calls]
    replies = [tok.decode(c.completion_ids, skip_special_tokens=True) for c in calls]
    assert "Give 1 to 5 search keywords" in prompts[0] and "Write a sparse first outline" in prompts[1]
    writes = [i for i, p in enumerate(prompts) if "<content>" in p]
    assert writes and all("Magma rises" in replies[i] for i in writes)
    assert all("Retrieved information" not in r for r in replies)  # requests never enter a trained reply
    assert replies[-1] == '{"name": "terminate"}'  # the stop decision is a sample of its own
    fn = WarpReportRewardFn(Judge(None, embedder.encode))
    logged: dict[str, float] = {}
    rub = [{"id": "R1", "type": "factual", "description": "Magma rises and erupts at the surface.", "weight": 1}]
    got = run_sync(fn(prompts=["", "", ""], completions=["", "", ""], query=[QUERY] * 3,
                      report=[report, report, ""], rubrics=[rub, [], []], policy_failed=[False, False, True],
                      log_metric=lambda k, v: logged.__setitem__(k, v)))
    assert all(0.0 <= g <= 1.0 for g in got[:2]) and got[2] == -1.0
    assert {"report/R", "report/R_rubric", "report/readability", "report/policy_failed"} <= set(logged)


def test_a_reply_that_fails_to_parse_ends_the_episode_without_credit(retriever, tmp_path: Path):
    def broken_writer(tok):
        good = warp_policy(tok)

        def generate(seqs, first, max_new):
            text = tok.decode(seqs[0], skip_special_tokens=True)
            if "<content>" in text:
                return [tok("I would rather not.", add_special_tokens=False)["input_ids"]], None
            return good(seqs, first, max_new)
        return generate

    tok, (calls, report, failed) = _episode(retriever, tmp_path, broken_writer)
    assert failed and report == ""
    last = tok.decode(calls[-1].prompt_ids, skip_special_tokens=True)
    assert "<content>" in last  # the failed write is the last call: nothing after it was played
    assert not any('"terminate"' in tok.decode(c.completion_ids) for c in calls)


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
    from deepr.train import stage as rs

    batches: list = []
    built = rs.build_stage_trainer

    def keep(*a, **kw):
        trainer = built(*a, **kw)
        inner = trainer._generate_and_score_completions
        trainer._generate_and_score_completions = lambda inputs: batches.append(inner(inputs)) or batches[-1]
        return trainer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rs, "build_stage_trainer", keep)
        res = train_warp_report(cfg, [pair], retriever, judge=Judge(None, embedder.encode),
                                generate_for=lambda trainer: second_episode_fails(tok))
    assert res.steps == 1 and res.rewards and -1.0 <= res.rewards[0][1] <= 1.0
    log = [json.loads(x) for x in (res.out / "metrics.jsonl").read_text().splitlines()]
    assert {"report/R", "report/comprehensiveness", "rollout/calls_per_episode",
            "rollout/trained_tokens_per_episode"} <= set(log[0])
    # the batch trained on is one row per call of the 2 episodes, each under the prompt it was sampled from
    b = batches[0]
    calls = 2 * log[0]["rollout/calls_per_episode"]
    live = b["completion_mask"].sum(1) > 0
    assert b["prompt_ids"].shape[0] >= calls and int(live.sum()) == calls
    assert int(b["completion_mask"].sum()) == 2 * log[0]["rollout/trained_tokens_per_episode"]
    first = tok.decode(b["prompt_ids"][0][b["prompt_mask"][0].bool()], skip_special_tokens=True)
    assert first.count("User question:") == 1  # a call's own prompt, not a concatenated conversation
    # the failed episode (-1) and the full one: each call carries its episode's advantage, opposite signs
    adv = sorted(set(round(a, 4) for a in b["advantages"][live].tolist()))
    assert len(adv) == 2 and adv[0] < 0 < adv[1]
    assert log[0]["rollout/policy_failed"] == 0.5 and log[0]["grad_norm"] > 0
    assert (res.out / "adapter_config.json").is_file()


def second_episode_fails(tok):
    """warp_policy, except that in the second episode of a batch every write reply is unusable."""
    good, seen = warp_policy(tok), []

    def generate(seqs, first, max_new):
        text = tok.decode(seqs[0], skip_special_tokens=True)
        if "Write a sparse first outline" in text:
            seen.append(1)
        if len(seen) == 2 and "<content>" in text:
            return [tok("no section today", add_special_tokens=False)["input_ids"]], None
        return good(seqs, first, max_new)
    return generate
