"""`deepr eval`: a metric without its input is refused up front, a re-run computes the metrics
an item's row lacks, and the summary explains its fields and its failures."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from deepr.cli import app


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def invoke(*args: str):
    return CliRunner().invoke(app, ["eval", *map(str, args)])


def _preds(tmp_path: Path) -> Path:
    return jsonl(tmp_path / "preds.jsonl", [
        {"id": "a", "question": "Capital of France?", "prediction": "Paris", "answers": ["Paris"]},
        {"id": "b", "question": "Red planet?", "prediction": "Venus", "answers": ["Mars"]}])


def test_a_metric_without_its_input_is_a_clear_error_before_any_scoring(tmp_path):
    reports = jsonl(tmp_path / "reports.jsonl", [{"id": "r", "query": "q?", "report": "A claim [N1-R1]."}])
    out = tmp_path / "s.jsonl"
    r = invoke(reports, "--metric", "rubric,citation", "--out", out)
    assert r.exit_code == 2, r.output
    assert "--rubrics" in r.output and "rubric" in r.output
    assert not out.exists()  # nothing scored, no silent per-item failures
    r = invoke(reports, "--metric", "em", "--out", out)
    assert r.exit_code == 2 and "--gold" in r.output


def test_rerun_with_a_new_metric_computes_it_for_items_already_scored(tmp_path):
    preds, out = _preds(tmp_path), tmp_path / "s.jsonl"
    assert invoke(preds, "--metric", "em", "--out", out).exit_code == 0
    r = invoke(preds, "--metric", "em,f1", "--out", out)
    assert r.exit_code == 0, r.output
    assert "0 already scored, 2 to score" in r.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in lines] == ["a", "b"]  # one row per item, not one per run
    by_id = {x["id"]: x for x in lines}
    assert by_id["a"]["em"] == 1.0 and by_id["a"]["f1"] == 1.0 and by_id["b"]["f1"] == 0.0
    assert set(by_id["a"]["metrics"]) == {"em", "f1"}
    r = invoke(preds, "--metric", "f1,em", "--out", out)
    assert r.exit_code == 0 and "2 already scored, 0 to score" in r.output


def test_summary_has_a_legend_and_the_commonest_failure_reason(tmp_path):
    reports = jsonl(tmp_path / "r.jsonl", [
        {"id": "x", "query": "q?", "report": "Paris is the capital of France [N1-R1].",
         "citations": {"N1-R1": "Paris is the capital of France."}},
        {"id": "y", "query": "q?", "plan": {"nodes": []}}])
    out = tmp_path / "s.jsonl"
    r = CliRunner().invoke(app, ["eval", str(reports), "--metric", "citation", "--out", str(out)],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 3, r.output
    assert "cite_v: share of cited ids that exist" in r.output
    assert "R_fmt:" in r.output
    assert "commonest reason: 1× item y has no report" in r.output
