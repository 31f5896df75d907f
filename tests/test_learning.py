"""The learning experiment's own logic (deepr.learn, run by `make learn`): what a user relies on
when reading its numbers. No model runs here; the experiment itself is `make learn`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from deepr.learn import config as learning_setup
from deepr.learn import pipeline as learning
from deepr.learn.stats import (METRICS, answer_writers, bootstrap_ci, grpo_step_stats, markdown_table, paired_ci,
                               plot_grpo, plot_stages, read_metrics_rows, run_metrics, split_by_topic, summarize)


def _corpus(n_topics: int = 6, per_topic: int = 4) -> tuple[list[dict], list[dict]]:
    trees, pairs = [], []
    for t in range(n_topics):
        for k in range(per_topic):
            tid = f"tree-{t}-{k}"
            trees.append({"id": tid, "topic": f"seed title {t}.{k}", "category": f"cat{t}"})
            pairs.append({"id": f"q-{t}-{k}", "tree_id": tid, "question": f"question {t} {k}?"})
    return trees, pairs


@pytest.mark.parametrize("seed", range(5))
def test_topic_split_never_puts_a_heldout_topic_in_training(seed):
    trees, pairs = _corpus()
    random.Random(seed).shuffle(pairs)
    train, held, rec = split_by_topic(pairs, trees, heldout_topics=2, seed=seed)
    cat = {t["id"]: t["category"] for t in trees}
    train_topics = {cat[p["tree_id"]] for p in train}
    held_topics = {cat[p["tree_id"]] for p in held}
    assert len(held_topics) == 2 and not train_topics & held_topics
    assert sorted(p["id"] for p in train + held) == sorted(p["id"] for p in pairs)  # nothing dropped
    assert rec["heldout_topics"] == sorted(held_topics)
    assert set(rec["train_ids"]) == {p["id"] for p in train} and set(rec["heldout_ids"]) == {p["id"] for p in held}


def test_topic_split_caps_sizes_without_leaking_and_refuses_unknown_trees():
    trees, pairs = _corpus()
    train, held, rec = split_by_topic(pairs, trees, heldout_topics=3, seed=1, max_heldout=5, max_train=7)
    assert len(held) == 5 and len(train) == 7
    assert {rec["topic_of"][p["id"]] for p in train}.isdisjoint(rec["heldout_topics"])
    with pytest.raises(ValueError, match="trees not in the trees file"):
        split_by_topic(pairs + [{"id": "x", "tree_id": "nowhere", "question": "?"}], trees, heldout_topics=1)
    with pytest.raises(ValueError, match="leave at least 1 for training"):
        split_by_topic(pairs, trees, heldout_topics=6)


def test_bootstrap_interval_on_known_cases():
    # two questions scoring 0 and 1: resampled means are 0, .5, 1 with chances 1/4, 1/2, 1/4,
    # so the 95 % percentile interval is the whole [0, 1]
    mean, lo, hi = bootstrap_ci([[0.0], [1.0]], n_boot=4000)
    assert (mean, lo, hi) == (0.5, 0.0, 1.0)
    assert bootstrap_ci([[0.3, 0.3], [0.3, 0.3]]) == pytest.approx((0.3, 0.3, 0.3))
    # many Bernoulli(0.5) questions: close to the normal interval 0.5 ± 1.96·0.5/√n
    rng = random.Random(3)
    vals = [[float(rng.random() < 0.5)] for _ in range(400)]
    m, lo, hi = bootstrap_ci(vals, n_boot=3000)
    half = 1.96 * (m * (1 - m) / 400) ** 0.5
    assert lo == pytest.approx(m - half, abs=0.015) and hi == pytest.approx(m + half, abs=0.015)


def test_paired_interval_sees_a_consistent_gain_the_unpaired_spread_hides():
    rng = random.Random(0)
    base = [[rng.random() for _ in range(3)] for _ in range(10)]
    better = [[x + 0.05 for x in row] for row in base]
    d, lo, hi = paired_ci(better, base)
    assert d == pytest.approx(0.05) and lo == pytest.approx(0.05) and hi == pytest.approx(0.05)
    _, blo, bhi = bootstrap_ci(better)
    assert blo < bootstrap_ci(base)[2]  # the unpaired intervals overlap
    with pytest.raises(ValueError, match="same questions"):
        paired_ci(better, base[:5])


def test_run_metrics_do_not_credit_the_fallback_plan():
    trace = {"plans": [{"turn": "initial", "by": "extractive-fallback"}, {"turn": "revised", "by": "previous-plan"}],
             "calls": [{"ok": False}, {"ok": True, "truncated": True}, {"ok": True}, {"ok": True}]}
    score = {"plan_reward": 0.7, "rubric": 0.4, "citation_claims": [{"ids": ["N1-R1"], "precision": 1.0},
                                                                   {"ids": ["N1-R2"], "precision": 0.0},
                                                                   {"ids": [], "precision": 0.0}]}
    m = run_metrics(trace, score)
    assert m == {"plan_valid": 0.0, "r_plan": 0.0, "answer_by_model": 1.0, "rubric": 0.4, "cite_precision": 0.5,
                 "format_fail": 0.5, "rubric_any_writer": 0.4}
    trace["plans"] = [{"turn": "initial", "by": "llm"}, {"turn": "revised", "by": "llm"}]
    assert run_metrics(trace, score)["r_plan"] == 0.7 and run_metrics(trace, score)["plan_valid"] == 1.0
    # a refused revision keeps the model's own first plan: that is the plan eval scored
    trace["plans"] = [{"turn": "initial", "by": "llm"}, {"turn": "revised", "by": "previous-plan"}]
    assert run_metrics(trace, score)["r_plan"] == 0.7
    trace["plans"] = [{"turn": "initial", "by": "llm"}, {"turn": "revised", "by": "extractive-fallback"}]
    assert run_metrics(trace, score)["r_plan"] == 0.0
    trace["plans"] = [{"turn": "initial", "by": "llm"}, {"turn": "revised", "by": "llm"}]
    # the extractive writer stood in for the final answer: its rubric and citations are not the model's
    trace["failures"] = [{"where": "answerer/final", "reason": "the reply was cut at max_tokens (2048)"}]
    m = run_metrics(trace, score)
    assert (m["answer_by_model"], m["rubric"], m["cite_precision"], m["r_plan"]) == (0.0, 0.0, 0.0, 0.7)
    assert m["rubric_any_writer"] == 0.4  # kept apart, to compare the two writers


def test_answer_writers_and_grpo_steps_are_summarised_per_stage():
    def cell(by_model, rubric):
        return {"answer_by_model": by_model, "rubric": rubric if by_model else 0.0, "rubric_any_writer": rubric}

    per_run = {"sft": {0: {"q1": cell(1.0, 0.6), "q2": cell(0.0, 0.3)}, 1: {"q1": cell(1.0, 0.2), "q2": cell(1.0, 0.4)}},
               "base": {0: {"q1": cell(0.0, 0.5), "q2": cell(0.0, 0.1)}}}
    w = answer_writers(per_run, ["q1", "q2"])
    assert w["sft"] == {"runs": 4, "model_written": 3, "model_share": 0.75, "model_rubric_mean": 0.4,
                        "extractive_written": 1, "extractive_rubric_mean": 0.3}
    assert w["base"]["model_written"] == 0 and w["base"]["model_rubric_mean"] is None
    assert w["base"]["extractive_rubric_mean"] == 0.3
    logs = {"seed 0": [{"step": 1, "rewards/plan_reward/mean": 0.2, "zero_advantage_frac": 0.5, "kl": 0.0,
                        "time/generate": 30.0},
                       {"step": 2, "rewards/plan_reward/mean": 0.3, "frac_reward_zero_std": 0.0},
                       {"step": 2, "train_runtime": 9.0}],  # TRL's closing row is not a step
            "seed 1": [{"step": 1, "rewards/plan_reward/mean": 0.1, "zero_advantage_frac": 1.0}]}
    g = grpo_step_stats(logs)
    assert g["steps"] == 3 and g["zero_advantage_mean"] == 0.5
    assert g["per_seed"]["seed 0"][0] == {"step": 1, "kl": 0.0, "zero_advantage_frac": 0.5, "time/generate": 30.0,
                                          "reward": 0.2}
    assert [r["reward"] for r in g["per_seed"]["seed 0"]] == [0.2, 0.3]


def test_grpo_curves_draws_named_runs_and_refuses_a_file_without_rewards(tmp_path):
    from deepr.learn.__main__ import curves

    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "reward": 0.1 * s, "kl": 0.01 * s}) + "\n" for s in (1, 2)))
    assert curves([f"probe={log}", "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "sft.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    with pytest.raises(SystemExit, match="no step with a reward"):
        curves([f"sft={tmp_path / 'sft.jsonl'}", "--out", str(tmp_path / "d.png")])
    with pytest.raises(SystemExit, match="give NAME=path"):
        curves([str(log), "--out", str(tmp_path / "d.png")])


def test_plots_are_written_from_a_small_metrics_file(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "rewards/plan_reward/mean": 0.1 * s, "kl": 0.01 * s}) + "\n"
                           for s in range(1, 5)), encoding="utf-8")
    grpo_png = plot_grpo({"seed 0": read_metrics_rows(log)}, tmp_path / "img" / "grpo.png")
    cells = {q: {m: 0.5 for m in METRICS} for q in ("q1", "q2")}
    per_run = {"base": {0: cells, 1: cells}, "sft": {0: cells, 1: cells},
               "grpo": {0: {q: {**c, "r_plan": c["r_plan"] + 0.25} for q, c in cells.items()}}}
    summary = summarize(per_run, ["q1", "q2"], n_boot=200)
    assert summary["stages"]["sft"]["r_plan"]["seeds"] == [0, 1] and summary["stages"]["grpo"]["r_plan"]["seeds"] == [0]
    # a difference uses only the seeds both stages finished, paired cell by cell
    assert summary["differences"]["grpo_minus_base"]["r_plan"] == {"mean": 0.25, "ci95": [0.25, 0.25], "seeds": [0]}
    bars_png = plot_stages(summary, tmp_path / "img" / "stages.png")
    table = markdown_table(summary)
    assert "| R_plan (model's plan) | 0.500 [0.500, 0.500] | 0.500 [0.500, 0.500] | 0.750 [" in table
    assert "SFT+GRPO − base" in table
    for png in (grpo_png, bars_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    (tmp_path / "bad.jsonl").write_text('{"step": 1}\nnot json\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_metrics_rows(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("argv, message", [
    (["--minutes", "0"], "--minutes 0.0: must be at least 1"),
    (["--seeds", "1,1"], "give distinct seeds"),
    (["--seeds", "a,b"], "comma-separated integers"),
    (["--num-generations", "1"], "--num-generations 1: must be at least 2"),
    (["--trees", "4", "--heldout-topics", "3"], "too few to hold out 3 topics"),
    (["--grpo-lr", "2"], "--grpo-lr 2.0: must be in (0, 1)"),
    (["--heldout", "0"], "--heldout 0: must be at least 1"),
    (["--sft-actions", "plan,answer"], "--sft-actions 'plan,answer': give plan, optionally with revise and final"),
    (["--sft-batch", "0"], "--sft-batch 0: must be at least 1"),
    (["--grpo-train-turns", "3"], "--grpo-train-turns 3: give 1"),
    (["--grpo-dynamic-sampling", "5"], "--grpo-dynamic-sampling 5: give 0"),
    (["--formats", "free"], "--formats 'free': 'free' is not a mode"),
    (["--formats", "schema,answerr=strict"], "no role 'answerr' has strict formats"),
    (["--sft-graph", "deep"], "--sft-graph 'deep': give teacher, flat or ordered"),
    (["--eval-parallel", "0"], "--eval-parallel 0: must be at least 1"),
    (["--sft-repeat", "revise=3"], "--sft-repeat 'revise=3': give ACTION=N pairs"),
    (["--sft-repeat", "plan=0"], "--sft-repeat 'plan=0': give ACTION=N pairs, N from 1 to 10"),
    (["--sft-repeat", "plan"], "--sft-repeat 'plan': give ACTION=N pairs"),
])
def test_size_and_budget_flags_are_checked_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        learning.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_sft_processes_that_would_not_fit_in_memory_together_are_refused_before_anything_runs(monkeypatch, capsys):
    """Two SFT jobs on revision turns peak near 2 x 19 GB with stored activations: on a 24 GB machine
    the kernel would kill one an hour in, so the flags are refused with the two ways out."""
    monkeypatch.setattr(learning_setup, "machine_gb", lambda: 24.0)
    with pytest.raises(SystemExit) as e:
        learning.parse_args(["--sft-actions", "plan,revise,final"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "2 SFT processes need ~39 GB at once, this machine has 24 GB" in err and "--sft-checkpointing" in err
    assert learning.parse_args(["--sft-actions", "plan,revise,final", "--sft-checkpointing"]).sft_checkpointing
    assert learning.parse_args(["--sft-actions", "plan,revise,final", "--jobs", "1"]).jobs == 1
    assert learning.parse_args(["--sft-actions", "plan,revise,final", "--seeds", "0"]).seeds == [0]
    assert learning.parse_args([]).sft_actions == "plan,final"  # two 9 GB processes fit
    monkeypatch.setattr(learning_setup, "machine_gb", lambda: 16.0)
    with pytest.raises(SystemExit):
        learning.parse_args([])


def test_flags_scale_the_experiment():
    cfg = learning.parse_args(["--trees", "120", "--heldout", "40", "--grpo-steps", "60", "--seeds", "0,1,2,3,4",
                               "--use-vllm", "--minutes", "600"])
    assert (cfg.trees, cfg.heldout, cfg.grpo_steps, cfg.seeds, cfg.use_vllm) == (120, 40, 60, [0, 1, 2, 3, 4], True)
    assert learning.parse_args([]).minutes == 60


def test_compact_teacher_plan_keeps_the_graph_and_still_validates():
    from deepr.evidence.plan import validate_plan

    long = " ".join(f"word{i}" for i in range(40))
    plan = {"nodes": [{"id": "N1", "type": "search", "query": "volcano eruption magma " + long, "key_points": [long]},
                      {"id": "N2", "type": "search", "query": "plate tectonics subduction zones", "inputs": []},
                      {"id": "N3", "type": "aggregate", "need": long, "key_points": [long, long], "inputs": ["N1", "N2"]},
                      {"id": "N4", "type": "answer", "need": "why volcanoes erupt " + long, "inputs": ["N3"]}],
            "fetch": ["N1-R1"]}
    short = json.loads(learning.compact_plan(json.dumps(plan)))
    assert validate_plan(short)[1] == [] and short["fetch"] == ["N1-R1"]
    assert [(n["id"], n["type"], n.get("inputs") or []) for n in short["nodes"]] == [
        (n["id"], n["type"], n.get("inputs") or []) for n in plan["nodes"]]
    assert short["nodes"][0]["query"] == "volcano eruption magma word0 word1 word2 word3"
    assert all("key_points" not in n for n in short["nodes"]) and len(json.dumps(short)) < len(json.dumps(plan)) / 3
    assert learning.compact_plan("not json") is None and learning.compact_plan('{"answer": "x"}') is None
    # a second-level aggregate: the answer reads every aggregate, and the plan still validates
    wider = dict(plan, nodes=[*plan["nodes"][:3], {"id": "N5", "type": "aggregate", "need": "how they connect",
                                                   "inputs": ["N3", "N1"]},
                              dict(plan["nodes"][3], inputs=["N5"])])
    short = json.loads(learning.compact_plan(json.dumps(wider)))
    assert short["nodes"][-1]["inputs"] == ["N3", "N5"] and validate_plan(short)[1] == []


def teacher_plan(*inputs: list[str]) -> dict:
    """Five searches N1-N5, aggregates N6-N9 reading ``inputs`` (N9 reads two aggregates), and the
    answer N10 reading N9 and N7, as the teacher writes them."""
    s = [{"id": f"N{i}", "type": "search", "query": f"topic {i} history facts"} for i in range(1, 6)]
    needs = ["first", "second", "third", "how N6 and N8 connect"]
    aggs = [{"id": f"N{6 + k}", "type": "aggregate", "need": need, "inputs": list(ins)}
            for k, (need, ins) in enumerate(zip(needs, inputs))]
    return {"nodes": [*s, *aggs, {"id": "N10", "type": "answer", "need": "the answer", "inputs": ["N9", "N7"]}]}


def test_flat_graphs_keep_one_level_of_aggregates_renumbered_and_valid():
    from deepr.evidence.plan import validate_plan

    teacher = teacher_plan(["N1", "N3"], ["N4", "N5"], ["N1", "N2"], ["N6", "N8"])
    flat = json.loads(learning.compact_plan(json.dumps(teacher), graph="flat"))
    assert [(n["id"], n["type"], n.get("inputs")) for n in flat["nodes"][5:]] == [
        ("N6", "aggregate", ["N1", "N3"]), ("N7", "aggregate", ["N4", "N5"]), ("N8", "aggregate", ["N1", "N2"]),
        ("N9", "answer", ["N6", "N7", "N8"])]
    assert validate_plan(flat)[1] == []
    assert json.loads(learning.compact_plan(json.dumps(teacher)))["nodes"][-1]["id"] == "N10"  # teacher: as written
    # a fetch list names result ids of the nodes: such a plan keeps its ids
    fetched = json.loads(learning.compact_plan(json.dumps({**teacher, "fetch": ["N1-R1"]}), graph="flat"))
    assert len(fetched["nodes"]) == 10


def test_ordered_graphs_are_the_teachers_graphs_with_ids_in_reading_order():
    """`--sft-graph ordered`: the same edges, relabelled so each aggregate reads the next unread
    searches and lists its inputs ascending; a plan with a fetch list keeps its ids."""
    from deepr.evidence.plan import validate_plan

    teacher = teacher_plan(["N3", "N1"], ["N2", "N5"], ["N1", "N4"], ["N8", "N6"])
    out = json.loads(learning.compact_plan(json.dumps(teacher), graph="ordered"))
    assert [n["query"] for n in out["nodes"][:5]] == [f"topic {i} history facts" for i in (3, 1, 2, 5, 4)]
    assert [(n["id"], n.get("inputs")) for n in out["nodes"][5:]] == [
        ("N6", ["N1", "N2"]), ("N7", ["N3", "N4"]), ("N8", ["N2", "N5"]), ("N9", ["N6", "N8"]),
        ("N10", ["N6", "N7", "N8", "N9"])]
    assert validate_plan(out)[1] == []

    def edges(plan):  # edges as (reader need or query, read query or need): label-free
        text = {n["id"]: n.get("query") or n.get("need") for n in plan["nodes"]}
        return {(text[n["id"]], text[i]) for n in plan["nodes"] for i in n.get("inputs", [])}

    assert edges(out) == edges(json.loads(learning.compact_plan(json.dumps(teacher))))
    fetched = json.loads(learning.compact_plan(json.dumps({**teacher, "fetch": ["N1-R1"]}), graph="ordered"))
    assert fetched["nodes"][5]["inputs"] == ["N3", "N1"]


def test_compact_teacher_plan_is_what_the_planner_decoding_schema_admits():
    """SFT teaches the plan form the small profile decodes under with `--formats schema`: a plan
    its schema refuses (a search node with `"inputs": []`) taught a form the model could not write."""
    from pydantic import ValidationError

    from deepr.profiles.small.planner import _PlanShape

    teacher = {"nodes": [{"id": "N1", "type": "search", "query": "volcano eruption magma chambers", "inputs": [],
                          "key_points": ["Magma rises."]},
                         {"id": "N2", "type": "aggregate", "need": "why volcanoes erupt", "inputs": ["N1"],
                          "key_points": ["pressure"]},
                         {"id": "N3", "type": "answer", "need": "how the nine steps combine", "inputs": ["N2"]}]}
    with pytest.raises(ValidationError):
        _PlanShape.model_validate(teacher)
    short = json.loads(learning.compact_plan(json.dumps(teacher)))
    _PlanShape.model_validate(short)
    assert list(short["nodes"][0]) == ["id", "type", "query"]


def test_sft_data_keeps_the_chosen_planner_turns_in_compact_form(tmp_path):
    plan = {"nodes": [{"id": "N1", "type": "search", "query": "one two three four five six seven eight nine",
                       "key_points": ["copied evidence"]},
                      {"id": "N2", "type": "aggregate", "need": "what the search shows", "inputs": ["N1"]},
                      {"id": "N3", "type": "answer", "need": "how the nine steps combine", "inputs": ["N2"]}]}

    def example(action, role="planner", reply=json.dumps(plan)):
        return {"id": action, "role": role, "action": action,
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}]}

    src = tmp_path / "sft.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in [
        example("plan"), example("revise"), example("final", role="answerer"), example("plan", reply="not json")]))
    counts = learning.compact_sft(src, tmp_path / "plans.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "plans.jsonl").read_text().splitlines()]
    assert counts == {"planner_examples": 1, "answer_examples": 0, "not_a_plan": 1, "refused_by_the_run": 0,
                      "answer_without_citation": 0, "rows": 1}
    assert [r["action"] for r in rows] == ["plan"]
    node = json.loads(rows[0]["messages"][-1]["content"])["nodes"][0]
    assert node["query"] == "one two three four five six seven" and "key_points" not in node
    learning.compact_sft(src, tmp_path / "both.jsonl", actions=("plan", "revise"))
    assert [json.loads(x)["action"] for x in (tmp_path / "both.jsonl").read_text().splitlines()] == ["plan", "revise"]
    counts = learning.compact_sft(src, tmp_path / "mix.jsonl", actions=("plan", "revise"), repeat={"plan": 3, "revise": 1})
    mix = [json.loads(x) for x in (tmp_path / "mix.jsonl").read_text().splitlines()]
    assert [r["action"] for r in mix] == ["plan"] * 3 + ["revise"] and counts["rows"] == 4
    assert counts["planner_examples"] == 2 and counts["repeat"] == {"plan": 3, "revise": 1}
    assert mix[0] == mix[1] == mix[2]


def test_sft_repeat_is_checked_against_the_data_a_work_folder_holds(tmp_path):
    """SFT data is made once per --work: asked for another --sft-repeat (or other actions) on the same
    folder, the run stops and says so instead of training on data made for other flags."""
    cfg = learning.parse_args(["--work", str(tmp_path), "--sft-actions", "plan,revise", "--sft-repeat", "plan=3",
                               "--jobs", "1"])
    assert learning_setup.repeat_counts(cfg) == {"plan": 3, "revise": 1}
    learning_setup.mark(tmp_path / "sft-data", planner_examples=4, repeat={"plan": 3, "revise": 1})
    assert learning.teacher_sft_data(cfg, tmp_path / "train.jsonl", tmp_path / "log") == tmp_path / "sft-data" / "sft-compact.jsonl"
    learning_setup.mark(tmp_path / "sft-data", planner_examples=4)  # made before the flag: each turn once
    with pytest.raises(RuntimeError, match=r"holds SFT data of plan=1,revise=1, not plan=3,revise=1 .*give a new --work"):
        learning.teacher_sft_data(cfg, tmp_path / "train.jsonl", tmp_path / "log")


def test_default_form_is_what_the_default_planner_schema_decodes():
    """Under the default profile the planner decodes in PlanShape's strict schema: every node has its
    six fields in the schema's order, null or empty where the type has none. Taught that form, the
    model writes what its grammar lets it; the graph and the cut texts are the small form's."""
    from deepr.evidence.plan import validate_plan
    from deepr.agent.planner import PlanShape, RevisionShape

    teacher = {"nodes": [{"id": "N1", "type": "search", "query": "volcano eruption magma chambers and more words here",
                          "inputs": [], "key_points": ["Magma rises."]},
                         {"id": "N2", "type": "aggregate", "need": "why volcanoes erupt", "inputs": ["N1"],
                          "key_points": ["pressure"]},
                         {"id": "N3", "type": "answer", "need": "how the nine steps combine", "inputs": ["N2"]}],
               "fetch": ["N1-R2"]}
    short = json.loads(learning.compact_plan(json.dumps(teacher), form="default"))
    RevisionShape.model_validate(short)
    PlanShape.model_validate({"nodes": short["nodes"]})
    assert [list(n) for n in short["nodes"]] == [list(PlanShape.model_fields["nodes"].annotation.__args__[0].model_fields)] * 3
    assert short["nodes"][0] == {"id": "N1", "type": "search", "query": "volcano eruption magma chambers and more words",
                                 "need": None, "key_points": [], "inputs": []}
    assert short["nodes"][2]["query"] is None and short["nodes"][2]["inputs"] == ["N2"]
    assert short["fetch"] == ["N1-R2"] and validate_plan(short)[1] == []


def test_teacher_answers_are_cut_to_cited_sentences_within_the_budget(tmp_path):
    long = " ".join(["Magma rises through the crust [N1-R1]."] * 3 + ["Pressure builds until the rock gives way [N2-R1]."] * 20)
    short = learning.compact_answer(f"<answer>{long}</answer>", words=40)
    assert short.startswith("<answer>Magma rises") and short.endswith("[N2-R1].</answer>")
    assert len(short.split()) <= 40 and short.count("[N1-R1]") == 3
    assert learning.compact_answer("no tags here [N1-R1].") is None
    assert learning.compact_answer("<answer>Nothing cited here. Nor here.</answer>") is None
    rows = [{"id": "f", "role": "answerer", "action": "final",
             "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"<answer>{long}</answer>"}]},
            {"id": "w", "role": "answerer", "action": "wave",
             "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "{}"}]}]
    src = tmp_path / "sft.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = learning.compact_sft(src, tmp_path / "out.jsonl", actions=("plan", "final"))
    kept = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert counts["answer_examples"] == 1 and [r["action"] for r in kept] == ["final"]
    assert len(kept[0]["messages"][-1]["content"].split()) <= 90


def test_sft_data_drops_plans_the_run_would_refuse_and_trims_dangling_words(tmp_path):
    """A cut query can end in a function word or keep one content word; `deepr run` refuses a
    plan with such a query, so the model is not taught to write one."""
    def plan(query):
        return {"nodes": [{"id": "N1", "type": "search", "query": query},
                          {"id": "N2", "type": "search", "query": "Genoa maritime republic trade"},
                          {"id": "N3", "type": "aggregate", "need": "what the searches show", "inputs": ["N1", "N2"]},
                          {"id": "N4", "type": "answer", "need": "why Genoa traded by sea", "inputs": ["N3"]}]}

    rows = [{"id": q[:5], "role": "planner", "action": "plan",
             "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": json.dumps(plan(q))}]}
            for q in ("What roles do Liguria, Giacomo Casanova and Italy play", "Optics and optics")]
    src = tmp_path / "sft.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = learning.compact_sft(src, tmp_path / "plans.jsonl")
    kept = [json.loads(x) for x in (tmp_path / "plans.jsonl").read_text().splitlines()]
    assert counts["planner_examples"] == 1 and counts["refused_by_the_run"] == 1
    assert json.loads(kept[0]["messages"][-1]["content"])["nodes"][0]["query"] == "What roles do Liguria, Giacomo Casanova"


def test_report_only_skips_an_evaluation_with_no_finished_question(tmp_path, monkeypatch):
    """`--report-only` during a run: an evaluation that has started (reports.jsonl exists) but
    finished no question has nothing to score; it is listed as not finished instead of making
    `deepr eval` fail on an empty folder and the whole report with it."""
    from deepr.learn import report as learning_report

    work = tmp_path / "w"
    (work / "runs" / "sft-s0").mkdir(parents=True)
    (work / "runs" / "sft-s0" / "reports.jsonl").write_text("")
    (work / "runs" / "sft-s0" / "reports.jsonl.meta.json").write_text("{}")
    (work / "heldout.jsonl").write_text(json.dumps({"id": "q1", "question": "q?"}) + "\n")
    (work / "split.json").write_text(json.dumps({"heldout_topics": ["cat0"], "train_topics": ["cat1"], "train_ids": ["t1"]}))
    called: list = []
    monkeypatch.setattr(learning_report, "deepr", lambda args, *a, **k: called.append(args))
    cfg = learning.parse_args(["--work", str(work), "--results", str(tmp_path / "r"), "--img", str(tmp_path / "i"),
                               "--report-only", "--seeds", "0"])
    res = learning_report.rescore(cfg)
    assert called == []
    assert "sft-s0" in res["status"] and res["status"].startswith("partial")


def _finished_data(work: Path, cfg_args: list[str], tmp_path: Path, monkeypatch) -> list:
    """A --work whose data stage finished (no model runs: the three data commands are recorded)."""
    trees, pairs = _corpus(n_topics=6, per_topic=4)
    work.mkdir(parents=True, exist_ok=True)
    (work / "trees.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trees))
    (work / "verified.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    calls: list = []
    monkeypatch.setattr(learning, "deepr", lambda args, *a, **k: calls.append(args[0]) or 0)
    cfg = learning.parse_args(["--work", str(work), "--results", str(tmp_path / "r"), "--img", str(tmp_path / "i"),
                               "--trees", "12", *cfg_args])
    learning.build_data(cfg, work / "log")
    return calls


def test_a_larger_heldout_on_a_finished_work_extends_the_split_and_keeps_training(tmp_path, monkeypatch):
    work = tmp_path / "w"
    calls = _finished_data(work, ["--heldout-topics", "2", "--heldout", "3", "--max-train", "10"], tmp_path, monkeypatch)
    assert calls == ["build-trees", "synthesize-rubrics", "verify"]
    read = lambda name: [r["id"] for r in learning.read_jsonl(work / name)]  # noqa: E731
    train, held = read("train.jsonl"), read("heldout.jsonl")
    assert len(held) == 3 and len(train) == 10
    calls = _finished_data(work, ["--heldout-topics", "2", "--heldout", "8", "--max-train", "10"], tmp_path, monkeypatch)
    assert calls == []  # nothing rebuilt
    grown = read("heldout.jsonl")
    assert len(grown) == 8 and grown[:3] == held and read("train.jsonl") == train
    split = json.loads((work / "split.json").read_text())
    assert split["heldout_ids"] == grown and not {split["topic_of"][q] for q in grown} & set(split["train_topics"])
    with pytest.raises(RuntimeError, match="change the training questions"):
        _finished_data(work, ["--heldout-topics", "2", "--heldout", "8", "--max-train", "6"], tmp_path, monkeypatch)


def test_an_evaluation_reruns_only_when_the_heldout_set_has_questions_it_did_not_run(tmp_path, monkeypatch):
    work = tmp_path / "w"
    runs = work / "runs" / "base"
    runs.mkdir(parents=True)
    (runs / "reports.jsonl").write_text(json.dumps({"id": "q1"}) + "\n")
    (runs / "reports.rejects.jsonl").write_text(json.dumps({"id": "q2", "reason": "x"}) + "\n")
    (runs / ".done").write_text(json.dumps({"spec": "hf:m"}))  # a marker from before ids were kept
    held = work / "heldout.jsonl"
    calls: list = []
    monkeypatch.setattr(learning, "deepr", lambda args, *a, **k: calls.append(args[0]) or 0)
    cfg = learning.parse_args(["--work", str(work), "--results", str(tmp_path / "r"), "--img", str(tmp_path / "i")])
    held.write_text("".join(json.dumps({"id": q}) + "\n" for q in ("q1", "q2")))
    learning.evaluate(cfg, "hf:m", "base", held, 0, work / "log")
    assert calls == []  # both questions ran (one was rejected: that is a result too)
    held.write_text("".join(json.dumps({"id": q}) + "\n" for q in ("q1", "q2", "q3")))
    learning.evaluate(cfg, "hf:m", "base", held, 0, work / "log")
    assert calls == ["run", "eval"]  # deepr run and eval skip the ids they already have
    assert json.loads((runs / ".done").read_text())["ids"] == ["q1", "q2", "q3"]
    learning.evaluate(cfg, "hf:m", "base", held, 0, work / "log")
    assert calls == ["run", "eval"]


def test_every_stage_is_evaluated_with_the_planner_free_and_the_answerer_strict(tmp_path, monkeypatch):
    """The planner decodes its own schema (R_plan scores the model's graph); the answerer the cited
    prose over the ids it is shown, which the 135M model's answers passed in 33 of 33 probes against
    18 of 33 under their own tags (docs/learning.md). --formats passes through as deepr run takes it."""
    calls: list = []
    monkeypatch.setattr(learning, "deepr", lambda args, *a, **k: calls.append(args) or 0)
    held = tmp_path / "heldout.jsonl"
    held.write_text(json.dumps({"id": "q1"}) + "\n")
    for argv, formats in (([], "schema,answerer=strict"), (["--formats", "schema"], "schema")):
        calls.clear()
        cfg = learning.parse_args(["--work", str(tmp_path / formats), *argv])
        learning.evaluate(cfg, "hf:m", "sft-seed0", held, 0, tmp_path / "log")
        run = next(a for a in calls if a[0] == "run")
        assert run[run.index("--formats") + 1] == formats and run[run.index("--profile") + 1] == "default"


def test_sft_runs_in_fp32_and_grpo_in_bf16_unless_told(tmp_path, monkeypatch):
    """SFT trains in fp32 by default (on a CPU without native bf16 TRL's fused LM head makes a bf16
    step many times slower; --sft-bf16 asks for it), GRPO with bf16 weights (--grpo-fp32 gives the
    fp32 run back; GRPO's None: bf16 only where a GPU has it). Evaluations never get a bf16 flag."""
    calls: list = []
    monkeypatch.setattr(learning, "deepr", lambda args, *a, **k: calls.append(args) or 0)
    for k, (argv, flag) in enumerate((([], "--no-bf16"), (["--sft-bf16"], "--bf16"))):
        calls.clear()
        cfg = learning.parse_args(["--work", str(tmp_path / f"w{k}"), *argv])
        learning.train_sft(cfg, "base-folder", tmp_path / "sft.jsonl", 0, tmp_path / "log")
        sft = next(a for a in calls if a[0] == "sft")
        assert flag in sft and ({"--bf16", "--no-bf16"} - {flag}).isdisjoint(sft)
        assert [a[0] for a in calls] == ["sft", "export"] and {"--bf16", "--no-bf16"}.isdisjoint(calls[1])
    for argv, bf16 in (([], True), (["--grpo-fp32"], None)):
        cfg = learning.parse_args(["--work", str(tmp_path / f"g{bf16}"), *argv])
        learning.train_grpo(cfg, tmp_path / "merged", tmp_path / "train.jsonl", 0, tmp_path / "log")
        assert json.loads((cfg.work / "seed0" / "grpo.json").read_text())["bf16"] is bf16


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_every_seed_runs_whatever_the_number_of_jobs(tmp_path, monkeypatch, jobs):
    """With --jobs 1 the base evaluation holds the only slot at first: the seeds must still run
    after it (they were silently skipped, and the run reported itself complete)."""
    from deepr.learn import report as lr

    monkeypatch.setattr(learning_setup, "machine_gb", lambda: 64.0)  # three SFT jobs' memory: not what this tests
    held = tmp_path / "heldout.jsonl"
    held.write_text('{"id": "q1"}\n', encoding="utf-8")
    ran: list = []
    monkeypatch.setattr(learning, "build_data", lambda cfg, log: (tmp_path / "train.jsonl", held))
    monkeypatch.setattr(learning, "teacher_sft_data", lambda cfg, train, log: tmp_path / "sft.jsonl")
    monkeypatch.setattr(learning, "teacher_heldout", lambda cfg, held, log: ran.append("teacher-heldout"))
    monkeypatch.setattr(learning, "base_model", lambda cfg: "base")
    monkeypatch.setattr(learning, "evaluate", lambda cfg, spec, name, *a: ran.append(name))
    monkeypatch.setattr(learning, "seed_pipeline", lambda cfg, *a: ran.append(a[-2]) or {"sft": {}, "grpo": {}})
    monkeypatch.setattr(lr, "collect", lambda *a, **k: {})
    monkeypatch.setattr(lr, "report", lambda cfg, per_run, ids, budget, status: {"status": status})
    cfg = learning.parse_args(["--work", str(tmp_path / "w"), "--jobs", str(jobs), "--seeds", "0,1,2"])
    assert learning.experiment(cfg)["status"] == "complete"
    assert sorted(ran, key=str) == [0, 1, 2, "base", "teacher-heldout"]


def test_the_teachers_heldout_runs_are_recorded_once_and_again_for_a_grown_heldout_set(tmp_path, monkeypatch):
    """The answer probe's prompts: the teacher's held-out runs, recorded apart from the training
    trajectories; a finished record is reused, a grown held-out set runs again (deepr run resumes)."""
    calls: list = []
    monkeypatch.setattr(learning, "deepr", lambda args, *a, **k: calls.append(args) or 0)
    cfg = learning.parse_args(["--work", str(tmp_path / "w")])
    held = tmp_path / "heldout.jsonl"
    held.write_text('{"id": "q1"}\n', encoding="utf-8")
    traj = learning.teacher_heldout(cfg, held, tmp_path / "log")
    (run,) = calls
    assert run[:3] == ["run", "--queries", str(held)] and run[run.index("--record") + 1] == str(traj)
    assert traj.name == "trajectories-heldout.jsonl" and "trajectories.jsonl" not in " ".join(run)
    learning.teacher_heldout(cfg, held, tmp_path / "log")
    assert len(calls) == 1
    held.write_text('{"id": "q1"}\n{"id": "q2"}\n', encoding="utf-8")
    learning.teacher_heldout(cfg, held, tmp_path / "log")
    assert len(calls) == 2


def test_grpo_dynamic_sampling_reaches_a_config_deepr_grpo_accepts(tmp_path, monkeypatch):
    """--grpo-dynamic-sampling goes into grpo.json, and the file is one `deepr grpo --config` takes
    (its fields are checked strictly: a misspelt key would stop the run after SFT, an hour in)."""
    from deepr.train.grpo import GrpoConfig

    monkeypatch.setattr(learning, "deepr", lambda args, *a, **k: 0)
    for argv, rounds in (([], 0), (["--grpo-dynamic-sampling", "2"], 2)):
        cfg = learning.parse_args(["--work", str(tmp_path / f"d{rounds}"), *argv])
        learning.train_grpo(cfg, tmp_path / "merged", tmp_path / "train.jsonl", 0, tmp_path / "log")
        conf = json.loads((cfg.work / "seed0" / "grpo.json").read_text())
        parsed = GrpoConfig(stage="planner", model=str(tmp_path / "merged"), out=tmp_path / "rl", **conf)
        assert parsed.dynamic_sampling == rounds
