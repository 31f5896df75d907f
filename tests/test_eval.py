"""`deepr eval` end to end: inputs of every kind, joins, resume, failures, summary, HTML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.cli import app
from deepr.eval.evaluate import EvalContext, item_from_record, score_item
from deepr.eval.summary import summarize

RUBRIC = {"id": "R1", "type": "factual", "description": "The Eiffel Tower was completed in 1889", "weight": 1.0}
PLAN = {"nodes": [{"id": "S1", "type": "search", "query": "Eiffel Tower construction year"},
                  {"id": "S2", "type": "search", "query": "Eiffel Tower height"},
                  {"id": "A1", "type": "aggregate", "need": "tower facts",
                   "key_points": ["completion year", "height"], "inputs": ["S1", "S2"]},
                  {"id": "ANS", "type": "answer", "need": "answer", "inputs": ["A1"]}]}


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def rows(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def invoke(*args: str):
    return CliRunner().invoke(app, ["eval", *map(str, args)])


def test_em_f1_gold_join_resume_and_limit(tmp_path):
    preds = jsonl(tmp_path / "preds.jsonl", [
        {"id": "a", "question": "Capital of France?", "prediction": "the city of Paris"},
        {"id": "b", "question": "Red planet?", "prediction": "Mars."},
        {"id": "c", "question": "Who wrote Hamlet?", "prediction": "Shakespeare", "answers": ["William Shakespeare"]}])
    gold = jsonl(tmp_path / "gold.jsonl", [{"id": "a", "answers": ["Paris"]},
                                           {"id": "zz", "question": "red  planet?", "answers": ["Mars"]}])
    out = tmp_path / "scores.jsonl"
    r = invoke(preds, "--metric", "em,f1", "--gold", gold, "--out", out, "--limit", "2")
    assert r.exit_code == 0, r.output
    assert set(rows(out)) == {"a", "b"}
    r = invoke(preds, "--metric", "em,f1", "--gold", gold, "--out", out)
    assert r.exit_code == 0 and "2 already scored, 1 to score" in r.output
    s = rows(out)
    # "city of paris" vs "paris": P = 1/3, R = 1 -> F1 = 0.5
    assert (s["a"]["em"], s["a"]["f1"]) == (0.0, pytest.approx(0.5))
    assert s["b"]["em"] == 1.0  # joined by normalised question text
    assert s["c"]["f1"] == pytest.approx(2 * 0.5 * 1.0 / 1.5)  # inline answers win over --gold
    meta = json.loads((tmp_path / "scores.jsonl.meta.json").read_text())
    assert meta["counts"]["total_scored"] == 3 and meta["config"]["metrics"] == ["em", "f1"]
    assert "em" in r.output and "mean" in r.output


def test_plan_records_invalid_plans_and_missing_rubrics(tmp_path):
    inp = jsonl(tmp_path / "plans.jsonl", [
        {"id": "good", "plan": PLAN, "rubrics": [RUBRIC]},
        {"id": "cyclic", "plan": {"nodes": [{"id": "S1", "type": "search", "query": "x", "inputs": ["S1"]}]},
         "rubrics": [RUBRIC]},
        {"id": "norubric", "plan": PLAN}])
    out = tmp_path / "s.jsonl"
    r = invoke(inp, "--metric", "plan_reward,structure", "--out", out)
    assert r.exit_code == 3, r.output  # some items failed a metric: exit 3 (issue 18)
    s = rows(out)
    assert s["good"]["valid"] and 0 < s["good"]["plan_reward"] <= 1 and s["good"]["waves"] == 1
    for k in ("C_rub", "Q_search", "C_search", "D_search", "E_graph", "B_synth", "I_cross", "B_search"):
        assert k in s["good"]
    assert s["cyclic"]["plan_reward"] == 0.0 and not s["cyclic"]["valid"] and s["cyclic"]["plan_errors"]
    assert "no rubrics for item norubric" in s["norubric"]["failures"]["plan_reward"]
    assert "plan_reward" not in s["norubric"] and s["norubric"]["nodes"] == 4
    table = {(x["metric"], x["field"]): x for x in summarize(list(s.values()), ["plan_reward"])}
    assert table[("plan_reward", "plan_reward")]["n"] == 2 and table[("plan_reward", "plan_reward")]["failures"] == 1


def test_plan_rewards_of_a_chunk_are_one_embed_call_with_the_per_item_values():
    import asyncio

    import numpy as np

    from deepr.eval.evaluate import evaluate
    from deepr.rewards.plan_reward import plan_reward

    calls: list[int] = []

    def embed(texts):  # deterministic bag-of-letters vectors; counts the calls
        calls.append(len(texts))
        return np.array([[t.lower().count(c) + 0.1 for c in "aeioulnrst"] for t in texts], dtype=np.float32)

    other = {"id": "R2", "type": "factual", "description": "It is 330 metres tall", "weight": 0.5}
    items = [item_from_record({"id": f"p{k}", "plan": PLAN, "rubrics": [RUBRIC, other][: 1 + k % 2]}, where="x")
             for k in range(5)] + [item_from_record({"id": "norubric", "plan": PLAN}, where="x")]
    ctx = EvalContext(embed=embed)
    scores: list = []
    asyncio.run(evaluate(items, ["plan_reward"], ctx, sink=scores.append, concurrency=4))
    assert len(calls) == 2  # the first chunk of 4 in one call; the second has one scorable item
    by_id = {s.id: s.model_dump() for s in scores}
    for k in range(5):
        alone = plan_reward(PLAN, [RUBRIC, other][: 1 + k % 2], embed).plan_reward
        assert by_id[f"p{k}"]["plan_reward"] == pytest.approx(alone, abs=1e-6)
    assert "no rubrics for item norubric" in by_id["norubric"]["failures"]["plan_reward"]
    assert ctx.plan_batch == {}  # every precomputed score was used


def test_answer_records_with_partial_credit(tmp_path):
    outputs = {"A1": "The tower was completed in 1889 [S1-R1]. It is about 330 metres high [S2-R1]."}
    inp = jsonl(tmp_path / "ans.jsonl", [
        {"id": "full", "plan": PLAN, "node_outputs": outputs, "answer": "It was completed in 1889.",
         "rubrics": [RUBRIC]},
        {"id": "noanswer", "plan": PLAN, "node_outputs": outputs, "answer": None, "rubrics": [RUBRIC]}])
    out = tmp_path / "s.jsonl"
    assert invoke(inp, "--metric", "answer_reward", "--out", out).exit_code == 0
    s = rows(out)
    full, part = s["full"], s["noanswer"]
    assert full["judge"] == "extractive" and full["J_rub"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert full["answer_reward"] == pytest.approx(0.5 * full["R_exec"] + 0.5 * full["R_synth"])
    assert set(full["r_v"]) == {"A1"} and full["r_v"]["A1"] > 0
    assert part["partial"] == "answer_unparsed" and part["answer_reward"] == pytest.approx(0.5 * part["R_exec"])


def _sidecar(folder: Path, name: str, report: str, citations: dict, tools: int = 2) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    # deepr run records every plan turn wrapped, and the dag answerer's node outputs and answer
    trace = {"query": "When was the Eiffel Tower completed?", "mode": "dag", "calls": [],
             "plans": [{"cycle": 1, "turn": "initial", "plan": {"nodes": []}},
                       {"cycle": 1, "turn": "revised", "plan": PLAN}],
             "node_outputs": {"A1": report}, "answer": report,
             "tools": [{"name": "search", "args": {"query": "q"}}] * tools + [{"name": "browse", "error": "x"}],
             "citations": citations, "report": report}
    (folder / f"{name}.json").write_text(json.dumps(trace))
    (folder / f"{name}.md").write_text(report + "\n\n## References\n[S1-R1] Eiffel Tower\n")


def test_run_sidecar_folder_report_metrics(tmp_path):
    cites = {"S1-R1": {"doc_id": "Eiffel_Tower", "title": "Eiffel Tower",
                       "text": "The Eiffel Tower was completed in 1889 as the entrance to the World's Fair."}}
    _sidecar(tmp_path / "runs" / "a", "report",
             "# Eiffel Tower\nThe Eiffel Tower was completed in 1889 [S1-R1]. It is made of iron [S9-R9].", cites)
    _sidecar(tmp_path / "runs" / "b", "report", "", cites)
    rub = jsonl(tmp_path / "verified.jsonl", [{"id": "q1", "question": "When was the Eiffel Tower completed?",
                                               "rubrics": [RUBRIC]}])
    out = tmp_path / "s.jsonl"
    r = invoke(tmp_path / "runs", "--metric", "rubric,citation,fact,structure,search,plan_reward,answer_reward",
               "--rubrics", rub,
               "--out", out, "--html", tmp_path / "s.html")
    assert r.exit_code == 0, r.output
    s = rows(out)
    a, b = s[str(Path("a") / "report")], s[str(Path("b") / "report")]
    assert a["judge"] == "extractive" and a["rubric"] > 0 and a["failures"] == {}
    assert a["cite_v"] == 0.5 and a["cite_unknown_ids"] == 1 and a["unknown_cited_ids"] == ["S9-R9"]
    assert a["unique_sources"] == 1 and a["sections"] == 1
    assert a["fact_supported"] == 1 and a["fact_unknown"] == 1  # S9-R9 has no source text
    assert a["R_search"] == pytest.approx(2 / 6) and a["tool_calls"] == 2  # the failed browse does not count
    assert a["valid"] and a["plan_reward"] > 0 and a["waves"] == 1  # the revised plan, unwrapped
    assert a["answer_reward"] > 0 and a["partial"] is None and set(a["r_v"]) == {"A1"}
    assert b["rubric"] == 0.0 and "empty report" in b["rubric_note"] and b["R_cite"] == 0.0
    assert b["partial"] == "answer_unparsed"  # an empty answer earns execution credit only
    assert "fact_citation_accuracy: 1" in r.output
    page = (tmp_path / "s.html").read_text()
    assert page.count("<svg") >= 4 and "<script" not in page and "http" not in page


def test_judge_failures_are_recorded_and_excluded_from_means(tmp_path):
    replay = jsonl(tmp_path / "replies.jsonl", [{"reply": '{"verdict": "YES"}'}] + [{"reply": "no idea"}] * 3)
    inp = jsonl(tmp_path / "p.jsonl", [{"id": "1", "prediction": "Paris", "answers": ["Paris"]},
                                       {"id": "2", "prediction": "Lyon", "answers": ["Paris"]}])
    out = tmp_path / "s.jsonl"
    r = invoke(inp, "--metric", "lj,f1", "--judge-llm", f"replay:{replay}", "--out", out, "--concurrency", "1")
    assert r.exit_code == 3, r.output  # item 2's judge failed: exit 3 (issue 18)
    s = rows(out)
    assert s["1"]["lj"] == 1.0 and "lj" not in s["2"] and "gave up" in s["2"]["failures"]["lj"]
    assert s["2"]["f1"] == 0.0  # other metrics of the item are still scored
    table = {x["field"]: x for x in summarize(list(s.values()), ["lj"])}
    assert table["lj"] == {"metric": "lj", "field": "lj", "mean": 1.0, "std": 0.0, "n": 1, "failures": 1,
                           "top_failure": table["lj"]["top_failure"]}
    assert table["lj"]["top_failure"].startswith("1× lj judge failed")


def test_race_from_benchmark_files(tmp_path):
    criteria = {"id": 7, "prompt": "Compare solar and wind power.",
                "dimension_weight": {"comprehensiveness": 0.5, "insight": 0.5},
                "criterions": {"comprehensiveness": [{"criterion": "Compares the costs of solar and wind",
                                                      "explanation": "", "weight": 1.0}],
                               "insight": [{"criterion": "Explains intermittency trade-offs",
                                            "explanation": "", "weight": 1.0}]}}
    crit = jsonl(tmp_path / "criteria.jsonl", [criteria])
    ref = jsonl(tmp_path / "reference.jsonl", [{"id": 7, "prompt": criteria["prompt"],
                                                "article": "Solar and wind costs fell; intermittency needs storage."}])
    tgt = jsonl(tmp_path / "target.jsonl", [{"id": "7", "prompt": criteria["prompt"],
                                             "article": "Solar costs and wind costs compared [1].\n## References\n"}])
    out = tmp_path / "race.jsonl"
    r = invoke(tgt, "--metric", "race", "--race-criteria", crit, "--race-reference", ref, "--out", out)
    assert r.exit_code == 0, r.output
    s = rows(out)["7"]
    assert 0.0 < s["race"] < 1.0 and {"race_comprehensiveness", "race_insight"} <= set(s)
    assert "race_benchmark_score" in r.output
    r = invoke(tgt, "--metric", "race", "--race-criteria", crit, "--out", tmp_path / "x.jsonl")
    assert r.exit_code == 2 and "--race-reference" in r.output


def test_agent_completions_format_search_composite(tmp_path):
    completion = ('<think>search first</think><tool_call>{"name": "search", "arguments": {"query": "eiffel"}}'
                  '</tool_call><answer>The tower opened in 1889 <cite id="S1-R1">The Eiffel Tower was completed '
                  'in 1889</cite>.</answer>')
    inp = jsonl(tmp_path / "c.jsonl", [{"id": "x", "query": "When?", "completion": completion, "rubrics": [RUBRIC],
                                        "citations": {"S1-R1": "The Eiffel Tower was completed in 1889."}},
                                       {"id": "plain", "report": "No tags here."}])
    out = tmp_path / "s.jsonl"
    assert invoke(inp, "--metric", "composite,format", "--out", out).exit_code == 3  # "plain" fails format
    s = rows(out)
    x = s["x"]
    assert x["R_format"] == 1.0 and x["R_search"] == pytest.approx(1 / 6)
    assert x["composite"] == pytest.approx(0.5 * x["rubric"] + 0.2 + 0.2 * x["R_cite"] + 0.1 / 6)
    assert "raw agent completion" in s["plain"]["failures"]["format"]


@pytest.mark.parametrize("case", ["bad_json", "unknown_metric", "missing", "no_weight", "dup_id", "bad_sidecar",
                                  "bad_shape"])
def test_bad_input_gives_a_clear_error_and_exit_2(tmp_path, case):
    inp = jsonl(tmp_path / "in.jsonl", [{"id": "a", "prediction": "x", "answers": ["x"]}])
    extra: list = []
    metric = "em"
    if case == "bad_json":
        inp.write_text('{"id": "a", "prediction": "x"}\n{"id": "b", oops}\n')
        want = "in.jsonl:2"
    elif case == "unknown_metric":
        metric, want = "em,bleu", "unknown metric(s) bleu"
    elif case == "missing":
        inp, want = tmp_path / "nope.jsonl", "no such input"
    elif case == "no_weight":
        rub = jsonl(tmp_path / "rub.jsonl", [{"id": "q", "rubrics": [{"id": "R1", "type": "factual",
                                                                      "description": "d"}]}])
        extra, want = ["--rubrics", rub], "rub.jsonl:1 field 'rubrics'"
    elif case == "dup_id":
        jsonl(inp, [{"id": "a"}, {"id": "a"}])
        want = "appears twice"
    elif case == "bad_shape":
        jsonl(inp, [{"id": "a", "report": "x", "citations": ["S1-R1"]}])
        want = "in.jsonl:1 field 'citations': expected an object"
    else:
        inp = tmp_path / "report.json"
        inp.write_text('{"mode": "dag"}')
        want = "not a deepr run sidecar"
    r = invoke(inp, "--metric", metric, "--out", tmp_path / "o.jsonl", *extra)
    assert r.exit_code == 2, r.output
    assert want in " ".join(r.output.split()) and "Traceback" not in r.output


def test_dry_run_scores_nothing(tmp_path):
    inp = jsonl(tmp_path / "p.jsonl", [{"id": "a", "prediction": "x", "answers": ["x"]}])
    r = invoke(inp, "--metric", "em,lj", "--out", tmp_path / "o.jsonl", "--dry-run")
    assert r.exit_code == 0 and "1 to score" in r.output and not (tmp_path / "o.jsonl").exists()


def test_score_item_direct_api_without_cli():
    import asyncio

    item = item_from_record({"id": "z", "prediction": "Paris", "answers": ["paris"]}, "mem")
    score = asyncio.run(score_item(item, ["em", "lj"], EvalContext()))
    assert score.em == 1.0 and "needs a judge" in score.failures["lj"]


def test_empty_answers_score_zero_and_only_absent_fields_fail(tmp_path):
    # Issue 15.2: "" used to be recorded as "has no 'prediction'" and left out of the mean, so a
    # model that answered nothing raised its score. An empty value scores; only absence fails.
    inp = jsonl(tmp_path / "p.jsonl", [
        {"id": "right", "prediction": "Tokyo", "answers": ["Tokyo"]},
        {"id": "empty", "prediction": "", "answers": ["Tokyo"]},
        {"id": "absent", "answers": ["Tokyo"]}])
    out = tmp_path / "s.jsonl"
    r = invoke(inp, "--metric", "em,f1,lj", "--out", out)
    assert r.exit_code == 3, r.output  # the absent-field item is a failure: some records failed
    s = rows(out)
    assert (s["empty"]["em"], s["empty"]["f1"], s["empty"]["lj"]) == (0.0, 0.0, 0.0)
    assert s["empty"]["failures"] == {}
    assert "has no 'prediction'" in s["absent"]["failures"]["em"] and "em" not in s["absent"]
    table = {x["field"]: x for x in summarize(list(s.values()), ["em", "f1"])}
    assert table["em"]["mean"] == 0.5 and table["em"]["n"] == 2 and table["em"]["failures"] == 1


@pytest.mark.parametrize("answer", ["", None, "drop"])
def test_a_run_that_answered_nothing_scores_zero_in_the_mean(tmp_path, answer):
    """A deepr run sidecar whose answer is empty, null or missing scores 0 on EM / F1 / LJ and
    counts in the mean (it used to be a failure, left out, so answering nothing raised the mean)."""
    runs = tmp_path / "runs"
    _sidecar(runs / "a", "report", "Paris is the capital.", {})
    _sidecar(runs / "b", "report", "", {})
    trace = json.loads((runs / "b" / "report.json").read_text())
    if answer == "drop":
        trace.pop("answer")
    else:
        trace["answer"] = answer
    (runs / "b" / "report.json").write_text(json.dumps(trace))
    gold = jsonl(tmp_path / "gold.jsonl", [{"id": f"{d}/report", "answers": ["Paris is the capital."]}
                                           for d in ("a", "b")])
    out = tmp_path / "s.jsonl"
    r = invoke(runs, "--metric", "em,f1,lj", "--gold", gold, "--out", out)
    s = list(rows(out).values())
    empty = next(x for x in s if x["id"] == "b/report")
    assert (empty["em"], empty["f1"], empty["lj"]) == (0.0, 0.0, 0.0) and empty["failures"] == {}, r.output
    table = {x["field"]: x for x in summarize(s, ["em", "f1"])}
    assert table["em"]["n"] == 2 and table["em"]["mean"] == 0.5 and table["em"]["failures"] == 0


def test_empty_report_plan_completion_and_answer_are_scored_not_failed(tmp_path):
    inp = jsonl(tmp_path / "r.jsonl", [
        {"id": "empty", "query": "When?", "report": "", "completion": "", "plan": "", "node_outputs": {},
         "answer": "", "rubrics": [RUBRIC]},
        {"id": "absent", "query": "When?", "rubrics": [RUBRIC]}])
    out = tmp_path / "s.jsonl"
    r = invoke(inp, "--metric", "rubric,format,search,structure,plan_reward,answer_reward", "--out", out)
    assert r.exit_code == 3, r.output  # the absent-field item is a failure: some records failed
    s = rows(out)
    e, a = s["empty"], s["absent"]
    assert e["failures"] == {}, e["failures"]
    assert e["rubric"] == 0.0 and e["R_format"] == 0.0 and e["R_search"] == 0.0 and e["sections"] == 0
    assert e["plan_reward"] == 0.0 and not e["valid"]  # an empty plan is an invalid plan
    assert e["answer_reward"] == 0.0
    for metric in ("rubric", "format", "structure", "plan_reward", "answer_reward"):
        assert metric in a["failures"], metric
    assert "has no report" in a["failures"]["rubric"]
