"""The real-model demo's per-stage table (examples/demo_llm_summary.py), from a fake demo folder."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def _summary():
    path = Path(__file__).resolve().parents[1] / "examples" / "demo_llm_summary.py"
    spec = importlib.util.spec_from_file_location("demo_llm_summary", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_table_counts_calls_failures_records_and_who_wrote_them(tmp_path: Path):
    d = tmp_path
    (d / "trees.jsonl").write_text('{"id": "t1"}\n{"id": "t2"}\n')
    (d / "trees.jsonl.meta.json").write_text(json.dumps(
        {"usage": {"calls": 20, "rejected": 2, "failures": 1}, "counts": {"ok": 1, "fallback": 1, "failed": 0}}))
    (d / "pairs.jsonl").write_text('{"id": "p1"}\n')
    (d / "pairs.jsonl.meta.json").write_text(json.dumps({"usage": {"calls": 1}, "counts": {"ok": 1}}))
    turns = [{"attempts": 1, "ok": True}, {"attempts": 3, "ok": False}, {"attempts": 0, "extractive": True}]
    (d / "trajectories.jsonl").write_text(json.dumps({"mode": "dag", "turns": turns}) + "\n")
    (d / "timings.tsv").write_text("index\t300\nbuild-trees\t60\nrubrics\t120\n")
    (d / "cpu.tsv").write_text("index\t410\nbuild-trees\t95.4\n")  # rubrics: no CPU line (older demo)
    mod = _summary()
    rows = {r[0]: r for r in mod.rows(d)}
    assert rows["build-trees"] == ["build-trees", "20", "15 % (1 failed)", "2", "model 1 / fallback 1 / rejected 0"]
    assert rows["rubrics"][1:4] == ["1", "0 %", "1"]
    assert rows["verify"][-1] == "not run"
    assert rows["run --mode dag"] == ["run --mode dag", "4", "75 %", "1", "turns: model 1 / fallback 1"]
    mod.main(d)
    md = (d / "summary.md").read_text()
    assert "| build-trees | 20 | 15 % (1 failed) | 2 |" in md
    assert "total 480 s (8.0 min; 3.0 min without the index step)" in md
    assert "index 300.0 s (CPU 410 s), build-trees 60.0 s (CPU 95 s), rubrics 120.0 s;" in md
