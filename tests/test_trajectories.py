"""prune-trajectories: validity filter, best-draft pruning, turn examples, split, balancing, CLI."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from deepr.agent.warp import FORCED
from deepr.records import ChatExample, RubricItem, Trajectory, Turn
from deepr.train.trajectories import (
    DraftScoreError,
    PruneConfig,
    balance,
    judge_scorer,
    prune_to_best_draft,
    prune_trajectories,
    split_by_query,
    turn_examples,
    validity_errors,
)

PLAN = {"nodes": [
    {"id": "S1", "type": "search", "query": "museum history", "key_points": ["founding"]},
    {"id": "S2", "type": "search", "query": "museum collection", "key_points": ["paintings"]},
    {"id": "A1", "type": "aggregate", "need": "history and holdings", "inputs": ["S1", "S2"]},
    {"id": "A2", "type": "aggregate", "need": "founding story", "inputs": ["S1"]},
    {"id": "N5", "type": "answer", "need": "overview", "inputs": ["A1", "A2"]},
]}


def turn(role: str, action: str, completion: str, **extra) -> Turn:
    return Turn(role=role, action=action, completion=completion, ok=extra.pop("ok", True),
                messages=[{"role": "system", "content": f"You are the {role}."},
                          {"role": "user", "content": extra.pop("prompt", f"Do the {action} step.")}], **extra)


def dag_traj(tid: str, query: str = "Who founded the museum?", **over) -> Trajectory:
    turns = [
        turn("planner", "plan", json.dumps(PLAN)),
        turn("planner", "revise", "<think>ok</think>```json\n" + json.dumps({**PLAN, "fetch": ["Doc#0"]}) + "\n```"),
        turn("answerer", "wave", json.dumps({"A1": "It opened in 1901 [S1-R1].", "A2": "Founded by a guild [S1-R2]."}),
             wave=1),
        turn("answerer", "final", "<answer>The museum was founded in 1901 [S1-R1].</answer>"),
    ]
    for i, t in over.items():
        turns[int(i[1:])] = t
    return Trajectory(id=tid, query=query, mode="dag", turns=turns)


def warp_traj(tid: str, n_drafts: int = 4, query: str = "Explain the museum.", final_decision: bool = False,
              rubrics: list[RubricItem] | None = None) -> Trajectory:
    """initialize, search, write, then per draft k: a forced deepening decision on draft k and the
    search + write turns of the new subsections (the shape `deepr run --mode warp --force-expand` records)."""
    turns = [turn("warp", "initialize", json.dumps({"name": "initialize", "title": "T", "sections": []})),
             turn("warp", "search", json.dumps({"name": "search", "keywords": ["museum"]})),
             turn("warp", "write", "<content>Section one body.</content>")]
    for k in range(n_drafts - 1 + final_decision):
        turns.append(turn("warp", "expand", json.dumps({"name": "expand", "position": "section-1",
                                                        "subsections": [{"title": "a"}, {"title": "b"}]}),
                          prompt=f"Current full report:\ndraft {k}\n\nSections that may be expanded: section-1, "
                                 f"section-2\n\nDecide. {FORCED}\nReply with JSON.", draft=k, forced=True))
        if k < n_drafts - 1:
            turns += [turn("warp", "search", json.dumps({"name": "search", "keywords": [f"k{k}"]})),
                      turn("warp", "write", f"<content>Subsection body {k}.</content>")]
    return Trajectory(id=tid, query=query, mode="warp", turns=turns, rubrics=rubrics or [],
                      drafts=[f"draft {k}" for k in range(n_drafts)], report=f"draft {n_drafts - 1}")


def scores_by_draft(scores: list[float]):
    return lambda traj, draft: scores[int(draft.split()[-1])]


# --- validity -------------------------------------------------------------------------------


def test_valid_dag_trajectory_passes_every_parser() -> None:
    assert validity_errors(dag_traj("ok")) is None


@pytest.mark.parametrize("replace,code,words", [
    ({"t0": turn("planner", "plan", json.dumps({"nodes": PLAN["nodes"][:4]}))}, "invalid_plan", "answer node"),
    ({"t1": turn("planner", "revise", "I would search for the museum first.")}, "invalid_plan", "no JSON"),
    ({"t2": turn("answerer", "wave", "A1: it opened in 1901", wave=1)}, "unparseable_answer", "wave reply"),
    ({"t2": turn("answerer", "wave", json.dumps({"A1": "text"}), wave=1)}, "unparseable_answer", "misses node A2"),
    ({"t2": turn("answerer", "wave", json.dumps({"A1": "x", "A2": "y", "S1": "z"}), wave=1)},
     "unparseable_answer", "'S1'"),
    ({"t3": turn("answerer", "final", "<answer>  </answer>")}, "unparseable_answer", "empty"),
    ({"t3": turn("answerer", "final", "<answer>x</answer>", ok=False)}, "failed_turn", "turn 4"),
])
def test_invalid_trajectories_are_dropped_with_reason(replace, code, words) -> None:
    got = validity_errors(dag_traj("bad", **replace))
    assert got is not None and got[0] == code and words in got[1]


def test_warp_action_must_match_its_tag() -> None:
    t = warp_traj("w", n_drafts=1)
    t.turns[1] = turn("warp", "search", json.dumps({"name": "write", "keywords": ["x"]}))
    assert validity_errors(t)[0] == "unparseable_action"


# --- best-draft pruning ---------------------------------------------------------------------


def test_cut_at_best_draft_relabels_terminate_and_unforces_prompts() -> None:
    t = warp_traj("w1", n_drafts=4)
    pruned, info = prune_to_best_draft(t, scores_by_draft([0.2, 0.9, 0.5, 0.4]))
    assert info["best"] == 1 and info["relabeled"]
    decisions = [x for x in pruned.turns if x.action in ("expand", "terminate")]
    assert [(d.action, d.model_extra["draft"]) for d in decisions] == [("expand", 0), ("terminate", 1)]
    assert pruned.turns[-1].action == "terminate" and json.loads(pruned.turns[-1].completion) == {"name": "terminate"}
    assert pruned.drafts == ["draft 0", "draft 1"] and pruned.report == "draft 1"
    assert len(t.turns) - len(pruned.turns) == info["turns_removed"] == 5
    assert FORCED in decisions[-1].messages[1]["content"]  # the record is kept as it was...
    for e in turn_examples(pruned):  # ...but no example tells the model it may not stop
        assert all(FORCED not in m["content"] for m in e.messages)
    assert turn_examples(pruned)[-1].messages[1]["content"] == (
        "Current full report:\ndraft 1\n\nSections that may be expanded: section-1, section-2\n\nDecide. \n"
        "Reply with JSON.")


def test_ties_cut_at_the_earliest_draft() -> None:
    pruned, info = prune_to_best_draft(warp_traj("w2", n_drafts=3), scores_by_draft([0.5, 0.5, 0.3]))
    assert info["best"] == 0
    assert [x.action for x in pruned.turns] == ["initialize", "search", "write", "terminate"]


def test_best_last_draft_without_decision_gets_a_terminate_example() -> None:
    # Issue 15.9 (changes what this test locked in: it used to assert that no TERMINATE appears).
    # The run stopped at its expansion limit, so nobody asked for a decision on the best (last)
    # draft: a TERMINATE turn is added, prompted with that draft and its expandable sections.
    t = warp_traj("w3", n_drafts=3)
    pruned, info = prune_to_best_draft(t, scores_by_draft([0.1, 0.2, 0.8]))
    assert info["best"] == 2 and info["relabeled"] and info["terminate_added"]
    assert [x.action for x in pruned.turns] == [x.action for x in t.turns] + ["terminate"]
    last = pruned.turns[-1]
    assert json.loads(last.completion) == {"name": "terminate"} and last.model_extra["draft"] == 2
    # the draft it decides on, and section-1 (expanded into a, b) replaced by its subsections
    assert last.messages[1]["content"] == ("Current full report:\ndraft 2\n\nSections that may be expanded: "
                                           "section-2, section-1.1, section-1.2\n\nDecide. \nReply with JSON.")
    assert pruned.report == "draft 2"
    assert all(FORCED not in m["content"] for e in turn_examples(pruned) for m in e.messages)


def test_decision_on_last_draft_is_relabeled() -> None:
    pruned, info = prune_to_best_draft(warp_traj("w4", n_drafts=3, final_decision=True),
                                       scores_by_draft([0.1, 0.2, 0.8]))
    assert info["best"] == 2 and pruned.turns[-1].action == "terminate" and info["turns_removed"] == 0


def _bag_of_words(texts: list[str]) -> np.ndarray:
    out = np.zeros((len(texts), 64), dtype=np.float32)
    for i, t in enumerate(texts):
        for w in t.lower().replace(".", " ").split():
            out[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % 64] += 1.0
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def test_judge_scorer_prefers_the_draft_that_covers_the_rubric() -> None:
    from deepr.rewards.judges import Judge

    rubric = [RubricItem(id="R1", type="factual", description="The museum opened in 1901 in Lyon.", weight=1.0)]
    t = warp_traj("w5", n_drafts=3, rubrics=rubric)
    t.drafts = ["Weather was mild.", "The museum opened in 1901 in Lyon.", "Weather and sports."]
    score = judge_scorer(lambda: Judge(None, _bag_of_words))
    pruned, info = prune_to_best_draft(t, score)
    assert info["best"] == 1 and pruned.turns[-1].action == "terminate"


def test_drafts_of_a_query_without_rubrics_are_scored_by_the_judge() -> None:
    # no rubrics -> the judge's report-quality criteria, not a dropped trajectory.
    from deepr.rewards.judges import Judge

    score = judge_scorer(lambda: Judge(None, _bag_of_words))
    t = warp_traj("w6", n_drafts=3, query="Explain the museum founding and its collection.")
    t.drafts = ["Weather.", "The museum founding and its collection are explained: founded 1901, paintings.",
                "Sports."]
    pruned, info = prune_to_best_draft(t, score)
    assert info["best"] == 1 and pruned.turns[-1].action == "terminate"
    assert all(0.0 <= x <= 1.0 for x in info["scores"]) and info["scores"][1] > info["scores"][0]


def test_an_unscorable_draft_is_dropped_with_the_judges_reason() -> None:
    class Broken:
        async def rubrics(self, *a, **k):
            from deepr.rewards.judges import Verdict

            return Verdict(False, reason="judge timed out")

    pruned, info = prune_to_best_draft(warp_traj("w7"), judge_scorer(lambda: Broken()))
    assert pruned is None and info["reason"][0] == "unscorable_drafts" and "judge timed out" in info["reason"][1]


# --- the stage: examples, split, balancing ----------------------------------------------------


def test_stage_drops_unscorable_warp_and_keeps_turn_examples() -> None:
    trajs = [dag_traj("d1"), dag_traj("d2", t0=turn("planner", "plan", "{}")), warp_traj("w", rubrics=[])]

    def unscorable(traj, draft):
        raise DraftScoreError("the judge could not score a draft: judge down")

    out, rejects, stats = prune_trajectories(trajs, PruneConfig(heldout=0.0, target_ratios="none"), unscorable)
    assert stats["kept"] == 1 and stats["dropped"] == {"invalid_plan": 1, "unscorable_drafts": 1}
    assert {r.id: r.code for r in rejects} == {"d2": "invalid_plan", "w": "unscorable_drafts"}
    ex = out["sft"]
    assert [(e.role, e.action) for e in ex] == [("planner", "plan"), ("planner", "revise"),
                                                ("answerer", "wave"), ("answerer", "final")]
    assert ex[0].messages[-1] == {"role": "assistant", "content": json.dumps(PLAN)}
    assert ex[0].messages[:-1] == trajs[0].turns[0].messages and out["rl"] == []


def test_split_never_shares_a_query_and_is_seeded() -> None:
    trajs = [dag_traj(f"d{i}", query=f"Question {i % 10}?") for i in range(20)]  # 10 queries, 2 runs each
    examples = [e for t in trajs for e in turn_examples(t)]
    sft, rl = split_by_query(examples, 0.3, seed=1)
    assert len({e.query_id for e in rl}) == 3 and not {e.query_id for e in sft} & {e.query_id for e in rl}
    assert [e.id for e in split_by_query(examples, 0.3, seed=1)[1]] == [e.id for e in rl]
    assert {e.query_id for e in split_by_query(examples, 0.3, seed=2)[1]} != {e.query_id for e in rl}


def _examples(counts: dict[str, int]) -> list[ChatExample]:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    return [ChatExample(id=f"{a}{i:03d}", role="warp", action=a, messages=msgs, query_id="q")
            for a, n in counts.items() for i in range(n)]


def test_balancing_moves_toward_targets_within_the_upsample_cap() -> None:
    ex = _examples({"search": 60, "write": 60, "expand": 12, "initialize": 4, "terminate": 4})
    cfg = PruneConfig(target_ratios="initialize=0.1,terminate=0.2", max_upsample=3, seed=0)
    out = balance(ex, cfg, "sft")
    counts = Counter(e.action for e in out)
    # terminate: 4 examples x 3 copies at most = 12 = 20% of 60 -> the split shrinks to 60
    assert counts["terminate"] == 12 and counts["initialize"] == 6 and sum(counts.values()) == 60
    assert counts["search"] == counts["write"] == 19 and counts["expand"] == 4
    assert len({e.id for e in out}) == len(out)
    assert max(Counter(e.id.split("~")[0] for e in out).values()) <= 3
    assert [e.id for e in balance(ex, cfg, "sft")] == [e.id for e in out]
    assert [e.id for e in balance(ex, cfg.model_copy(update={"seed": 5}), "sft")] != [e.id for e in out]


def test_uniform_default_and_natural_mix() -> None:
    ex = _examples({"search": 30, "plan": 5})
    assert Counter(e.action for e in balance(ex, PruneConfig(), "sft")) == {"search": 15, "plan": 15}
    assert balance(ex, PruneConfig(target_ratios="none"), "sft") == ex


@pytest.mark.parametrize("ratios,msg", [("plan=0.7,search=0.6", "sum to"), ("plan=lots", "action=number"),
                                         ("=0.3", "action=number"), ("plan=1.5", "between 0 and 1")])
def test_bad_target_ratios_are_refused(ratios: str, msg: str) -> None:
    with pytest.raises((ValueError, ValidationError), match=msg):
        PruneConfig(target_ratios=ratios)


# --- CLI ------------------------------------------------------------------------------------


def _write(path: Path, trajs: list[Trajectory]) -> Path:
    path.write_text("".join(t.model_dump_json() + "\n" for t in trajs), encoding="utf-8")
    return path


def test_cli_writes_splits_rejects_and_sidecars(tmp_path: Path) -> None:
    from deepr.cli import app
    from deepr.io import read_jsonl

    trajs = [dag_traj(f"d{i}", query=f"Question {i}?") for i in range(10)] + [
        dag_traj("bad", t2=turn("answerer", "wave", "not json", wave=1))]
    src = _write(tmp_path / "traj.jsonl", trajs)
    res = CliRunner().invoke(app, ["prune-trajectories", str(src), "--out-dir", str(tmp_path / "data"),
                                   "--heldout", "0.2", "--target-ratios", "plan=0.4"])
    assert res.exit_code == 0, res.output
    sft = list(read_jsonl(tmp_path / "data" / "sft.jsonl", ChatExample))
    rl = list(read_jsonl(tmp_path / "data" / "rl.jsonl", ChatExample))
    assert len({e.query_id for e in rl}) == 2 and len({e.query_id for e in sft}) == 8
    assert Counter(e.action for e in sft)["plan"] / len(sft) == pytest.approx(0.4, abs=0.03)
    rejects = [json.loads(x) for x in (tmp_path / "data" / "prune.rejects.jsonl").read_text().splitlines()]
    assert [(r["id"], r["code"]) for r in rejects] == [("bad", "unparseable_answer")]
    meta = json.loads((tmp_path / "data" / "sft.jsonl.meta.json").read_text())
    assert meta["counts"]["dropped"] == {"unparseable_answer": 1} and meta["inputs"][0]["sha256"]


def test_cli_names_the_bad_line(tmp_path: Path) -> None:
    from deepr.cli import app

    src = _write(tmp_path / "traj.jsonl", [dag_traj("d1")])
    with src.open("a") as f:
        f.write('{"id": "x", "query": "q", "mode": "dag", "turns": "nope"}\n')
    res = CliRunner().invoke(app, ["prune-trajectories", str(src), "--out-dir", str(tmp_path / "o")])
    assert res.exit_code == 2 and "traj.jsonl:2" in res.output and "turns" in res.output
    assert not (tmp_path / "o").exists()


def test_cli_scores_warp_drafts_with_rubrics_from_pairs(tmp_path: Path, embedder) -> None:
    from deepr.cli import app
    from deepr.io import read_jsonl
    from deepr.records import QRPair

    t = warp_traj("w", n_drafts=3, query="When did the Louvre open?")
    t.drafts = ["Paris has many bridges over the Seine.", "The Louvre opened as a public museum in 1793.",
                "Paris has many bridges. Football is popular in France."]
    pair = QRPair(id="p1", tree_id="t1", question="When did the  Louvre open?", selected_leaf_ids=[],
                  rubrics=[RubricItem(id="R1", type="factual", weight=1.0,
                                      description="The Louvre opened as a public museum in 1793.")])
    (tmp_path / "pairs.jsonl").write_text(pair.model_dump_json() + "\n")
    src = _write(tmp_path / "traj.jsonl", [t])
    res = CliRunner().invoke(app, ["prune-trajectories", str(src), "--out-dir", str(tmp_path / "d"), "--heldout",
                                   "0", "--target-ratios", "none", "--rubrics", str(tmp_path / "pairs.jsonl")])
    assert res.exit_code == 0, res.output
    ex = list(read_jsonl(tmp_path / "d" / "sft.jsonl", ChatExample))
    assert [e.action for e in ex] == ["initialize", "search", "write", "expand", "search", "write", "terminate"]
    assert ex[-1].model_extra["relabeled"] and ex[-1].model_extra["turn"] == 6
    assert json.loads(ex[-1].messages[-1]["content"]) == {"name": "terminate"}
