"""deepr.learn.episodes (`python bench/learning.py episodes`): held-out planner episodes scored
with GRPO's own reward."""

from __future__ import annotations

import json

import pytest
from test_grpo import PLAN, REVISED, _pairs, scripted

from deepr.learn import episodes as pe


def test_an_episode_gets_the_reward_grpo_trains_on_and_an_invalid_plan_scores_zero_with_its_reason(tok, retriever):
    from deepr.train.environments import PlannerEnvironment

    env = PlannerEnvironment(retriever, k=2)
    good = pe.episodes(scripted(tok, [json.dumps(PLAN), json.dumps(REVISED)]), tok, [tok.eos_token_id], _pairs(2),
                       env, budget=4000, turn_cap=2000)
    assert [r["id"] for r in good] == [p.id for p in _pairs(2)]
    assert all(r["scored"] == "revised" and r["initial_valid"] == 1.0 and r["refused"] is None for r in good)
    assert all(0.0 < r["r_plan"] <= 1.0 for r in good)
    bad = pe.episodes(scripted(tok, ['{"nodes": [{"id": "N1", "type": "search"}]}']), tok, [tok.eos_token_id],
                      _pairs(1), env, budget=4000, turn_cap=2000)
    # an invalid first plan is a measured 0 with its reason, not a missing score
    assert bad[0]["r_plan"] == 0.0 and bad[0]["scored"] == "refused" and "G0 is not a valid plan" in bad[0]["refused"]


def test_paired_differences_match_the_questions_and_refuse_an_empty_match():
    a = [{"id": "q1", "r_plan": 0.2}, {"id": "q2", "r_plan": 0.4}, {"id": "q3", "r_plan": None}]
    b = [{"id": "q2", "r_plan": 0.5}, {"id": "q1", "r_plan": 0.3}, {"id": "q9", "r_plan": 0.9}]
    d = pe.paired(a, b)
    assert d["questions"] == 2 and d["mean"] == pytest.approx(0.1)
    assert d["ci95"][0] == pytest.approx(0.1) and d["ci95"][1] == pytest.approx(0.1)  # the same gain everywhere
    with pytest.raises(ValueError, match="no question"):
        pe.paired(a, [{"id": "q9", "r_plan": 0.9}])


def test_a_baseline_from_an_earlier_output_is_found_by_label_or_first_and_a_bad_one_named(tmp_path):
    runs = {"sft": {"questions": [{"id": "q1", "r_plan": 0.1}]}, "grpo": {"questions": [{"id": "q1", "r_plan": 0.4}]}}
    out = tmp_path / "episodes.json"
    out.write_text(json.dumps({"runs": runs}))
    assert pe.baseline_run(str(out)) == ("sft", runs["sft"]["questions"])
    assert pe.baseline_run(f"{out}:grpo") == ("grpo", runs["grpo"]["questions"])
    with pytest.raises(SystemExit, match="no run 'rl'.*sft, grpo"):
        pe.baseline_run(f"{out}:rl")
    (tmp_path / "log.txt").write_text("not json")
    with pytest.raises(SystemExit, match="log.txt: not an output of the planner episodes"):
        pe.baseline_run(str(tmp_path / "log.txt"))


def test_greedy_generation_is_repeatable_and_cut_after_the_end_token(tiny, tok):
    from deepr.train.rollouts import prompt_ids

    model, tok2 = pe.load_policy(str(tiny))
    eos = pe.eos_of(model, tok2)
    gen = pe.greedy_generate(model, tok2, eos)
    seqs = [prompt_ids(tok, [{"role": "user", "content": q}]) for q in ("plates?", "volcanoes and their ash?")]
    first, lps = gen(seqs, True, 12)
    assert lps is None and first == gen(seqs, True, 12)[0]
    for row in first:
        assert 0 < len(row) <= 12
        assert all(t not in eos for t in row[:-1])  # nothing after an end token


def test_pooled_seeds_resample_questions_and_seeds_and_need_two_runs(tmp_path):
    base = [{"id": f"q{i}", "r_plan": 0.1} for i in range(6)] + [{"id": "q9", "r_plan": None}]
    up = [{"id": f"q{i}", "r_plan": 0.3} for i in range(6)]
    flat = [{"id": f"q{i}", "r_plan": 0.1} for i in range(5)]  # q5 unscored by this seed: left out for all
    res = pe.pooled([("s0", up), ("s1", flat)], [base])
    assert res["questions"] == 5 and res["seeds"] == 2 and res["mean"] == pytest.approx(0.1)
    # a bootstrap draw may take the seed that gained nothing twice: one good seed does not make the interval
    assert res["ci95"][0] == pytest.approx(0.0) and res["ci95"][1] == pytest.approx(0.2)
    assert res["per_run"]["s0"]["mean"] == pytest.approx(0.2)
    assert pe.pooled([("s0", up), ("s1", up)], [base])["ci95"] == [pytest.approx(0.2), pytest.approx(0.2)]
    with pytest.raises(ValueError, match="two runs or more"):
        pe.pooled([("s0", up)], [base])
    files = []
    for label, rows in (("sft", base), ("s0", up), ("s1", flat)):
        files.append(tmp_path / f"{label}.json")
        files[-1].write_text(json.dumps({"runs": {label: {"questions": rows}}}))
    out = tmp_path / "pooled.json"
    assert pe.main(["--pool", str(files[1]), "--pool", str(files[2]), "--baseline", str(files[0]),
                    "--out", str(out)]) == 0
    assert json.loads(out.read_text())["pooled"]["mean"] == pytest.approx(0.1)
    with pytest.raises(SystemExit):  # checkpoints and --pool do not mix
        pe.main(["ckpt", "--pool", str(files[1]), "--baseline", str(files[0]), "--out", str(out)])


def test_pooled_pipeline_seeds_compare_each_run_with_its_own_baseline(tmp_path):
    """Seeds of the whole pipeline: seed s's GRPO minus seed s's SFT, not minus one shared SFT."""
    sft0 = [{"id": f"q{i}", "r_plan": 0.1} for i in range(4)]
    sft1 = [{"id": f"q{i}", "r_plan": 0.5} for i in range(4)]
    grpo0 = [{"id": f"q{i}", "r_plan": 0.2} for i in range(4)]
    grpo1 = [{"id": f"q{i}", "r_plan": 0.6} for i in range(3)] + [{"id": "q3", "r_plan": None}]
    res = pe.pooled([("g0", grpo0), ("g1", grpo1)], [sft0, sft1])
    assert res["questions"] == 3 and res["mean"] == pytest.approx(0.1)  # q3: unscored by g1, left out
    assert res["ci95"] == [pytest.approx(0.1), pytest.approx(0.1)]
    assert res["per_run"]["g1"]["mean"] == pytest.approx(0.1)
    # against seed 0's SFT alone, seed 1's run would look like a +0.5 gain
    assert pe.pooled([("g0", grpo0), ("g1", grpo1)], [sft0])["mean"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="one --baseline or 2"):
        pe.pooled([("g0", grpo0), ("g1", grpo1)], [sft0, sft1, sft0])
    files = {}
    for label, rows in (("sft0", sft0), ("sft1", sft1), ("g0", grpo0), ("g1", grpo1)):
        files[label] = tmp_path / f"{label}.json"
        files[label].write_text(json.dumps({"runs": {label: {"questions": rows}}}))
    out = tmp_path / "pooled.json"
    assert pe.main(["--pool", str(files["g0"]), "--pool", str(files["g1"]), "--baseline", str(files["sft0"]),
                    "--baseline", str(files["sft1"]), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["baseline"] == ["sft0", "sft1"] and doc["pooled"]["mean"] == pytest.approx(0.1)
    with pytest.raises(SystemExit):  # three baselines for two runs
        pe.main(["--pool", str(files["g0"]), "--pool", str(files["g1"]), "--baseline", str(files["sft0"]),
                 "--baseline", str(files["sft1"]), "--baseline", str(files["sft0"]), "--out", str(out)])
    with pytest.raises(SystemExit):  # scoring checkpoints compares with one baseline
        pe.main(["ckpt", "--questions", "q.jsonl", "--baseline", str(files["sft0"]),
                 "--baseline", str(files["sft1"]), "--out", str(out)])


def test_an_earlier_output_keeps_its_runs_and_keys_when_more_are_written_into_it(tmp_path, capsys):
    """The documented commands write to the results file by default: a new call adds its runs beside
    the earlier ones (a label scored again is replaced, and said so) instead of wiping the record."""
    out = tmp_path / "episodes.json"
    out.write_text(json.dumps({"command": "first", "runs": {"sft": {"questions": [{"id": "q1", "r_plan": 0.1}]}},
                               "paired_differences": {"a - sft": {"mean": 0.0}}, "notes": {"kept": True}}))
    pe.write_output(out, {"command": "second", "runs": {"grpo": {"questions": [{"id": "q1", "r_plan": 0.4}]}},
                          "paired_differences": {"grpo - sft": {"mean": 0.3}}})
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"sft", "grpo"} and set(doc["paired_differences"]) == {"a - sft", "grpo - sft"}
    assert doc["notes"] == {"kept": True} and doc["commands"] == ["first", "second"] and "command" not in doc
    assert pe.baseline_run(f"{out}:sft")[1] == [{"id": "q1", "r_plan": 0.1}]  # still a baseline for later calls
    pe.write_output(out, {"command": "third", "runs": {"sft": {"questions": [{"id": "q1", "r_plan": 0.2}]}},
                          "pooled": {"mean": 0.1}})
    doc = json.loads(out.read_text())
    assert doc["runs"]["sft"]["questions"][0]["r_plan"] == 0.2 and doc["pooled"] == {"mean": 0.1}
    assert doc["commands"] == ["first", "second", "third"] and "replaced runs: sft" in capsys.readouterr().err
    (tmp_path / "log.txt").write_text("not json")
    with pytest.raises(SystemExit, match="log.txt: not an output of the planner episodes"):
        pe.write_output(tmp_path / "log.txt", {"command": "x", "runs": {}})
    assert (tmp_path / "log.txt").read_text() == "not json"  # refused, not overwritten
