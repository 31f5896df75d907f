"""The benchmarks in bench/ run as docs/benchmarks.md documents them: every script answers --help,
the cheap ones run a quick mode end to end (the heavy ones under ``-m slow``), every results file
is named by docs/benchmarks.md, and the README's Results table reads what those files hold."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH, RESULTS = ROOT / "bench", ROOT / "bench" / "results"
DOC = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
# the commands; a module without a __main__ block would be a helper the commands import
SCRIPTS = sorted(p.name for p in BENCH.iterdir()
                 if p.suffix == ".sh" or p.suffix == ".py" and "__main__" in p.read_text(encoding="utf-8"))


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """One documented command, as a user types it from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    cmd = ["bash" if args[0].endswith(".sh") else sys.executable, str(BENCH / args[0]), *args[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"{' '.join(args)}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_and_has_a_row_in_the_docs(script):
    out = bench(script, "--help").stdout
    assert "usage" in out.lower() or script.endswith(".sh") and "GPU check" in out
    assert f"bench/{script}" in DOC, f"docs/benchmarks.md has no row for bench/{script}"


@pytest.mark.parametrize("sub", ["episodes", "answers", "curves"])
def test_the_learning_subcommands_answer_help(sub):
    assert f"usage: {sub}" in bench("learning.py", sub, "--help").stdout


def test_every_results_file_is_named_by_the_benchmarks_page():
    files = sorted(p.name for p in RESULTS.iterdir())
    assert len(files) <= 20
    assert [f for f in files if f"`{f}`" not in DOC] == []


def test_retrieval_quick(tmp_path):
    out = tmp_path / "retrieval.json"
    bench("retrieval.py", "--limit", "40", "--queries", "10", "--baseline-docs", "0", "--precisions", "auto",
          "--cache-dir", str(tmp_path / "cache"), "--out", str(out))
    (run,) = [v for k, v in json.loads(out.read_text()).items() if k.startswith("all-MiniLM")]
    for retriever in ("dense", "bm25", "hybrid"):
        assert 0 <= run["quality_test"][retriever]["recall@1"] <= run["quality_test"][retriever]["recall@10"] <= 1
        assert run["latency"][retriever]["p50_ms"] <= run["latency"][retriever]["p95_ms"]


def test_throughput_quick(tmp_path):
    """Two questions over the stub: every call found its recorded reply and the wall time is at
    least the critical-path bound it is compared with."""
    out = tmp_path / "throughput.json"
    bench("throughput.py", "--questions", "2", "--modes", "dag", "--parallel", "2", "--latency", "0.05",
          "--out", str(out))
    (mode,) = json.loads(out.read_text())["modes"].values()
    (run,) = mode["runs"].values()
    assert run["misses"] == 0 and run["calls"] > 0 and run["max_in_flight"] == 2
    assert run["batch_over_bound"] >= 0.95  # the bound is the chain of calls: nothing beats it


def test_learning_quick_pools_earlier_runs_and_draws_curves(tmp_path):
    def run_file(name: str, rewards: list[float]) -> Path:
        path = tmp_path / f"{name}.json"
        qs = [{"id": f"q{i}", "r_plan": r} for i, r in enumerate(rewards)]
        path.write_text(json.dumps({"runs": {name: {"questions": qs}}}))
        return path

    base = run_file("sft", [0.1, 0.2, 0.0, 0.3])
    a, b = run_file("grpo-s0", [0.3, 0.4, 0.2, 0.5]), run_file("grpo-s1", [0.2, 0.3, 0.1, 0.4])
    out = tmp_path / "episodes.json"
    bench("learning.py", "episodes", "--pool", str(a), "--pool", str(b), "--baseline", str(base), "--out", str(out))
    pooled = json.loads(out.read_text())["pooled"]
    assert pooled["mean"] == pytest.approx(0.15) and pooled["ci95"][0] > 0  # every pair gained
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "reward": 0.1 * s, "kl": 0.01 * s}) + "\n" for s in (1, 2)))
    bench("learning.py", "curves", f"run={log}", "--out", str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_real_model_merge_recomputes_the_readme_row_from_its_runs(tmp_path):
    """The README's per-mode format failures are what real_model.py's own summary gives for the
    recorded SmolLM2 runs (hf backend, small profile) kept in real_model.json."""
    session = json.loads((RESULTS / "real_model.json").read_text())["session_2026_11_24f_hf"]
    part, out = tmp_path / "part.json", tmp_path / "merged.json"
    part.write_text(json.dumps(session))
    bench("real_model.py", "--merge", str(part), "--out", str(out))
    got = {r["mode"]: r["format_failure_pct"] for r in json.loads(out.read_text())["summary"]}
    row = _readme_row("each agent mode")
    want = dict(re.findall(r"(dag|warp|decor|tools) ([0-9.]+) %", row))
    assert want and {m: float(p) for m, p in want.items()} == {m: got[m] for m in want}


def _readme_row(words: str) -> str:
    (row,) = [x for x in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
              if x.startswith("|") and words in x]
    return row.replace("−", "-")


def _intervals(obj) -> set[tuple[float, float, float]]:
    """Every (mean, low, high) a results file holds."""
    found = set()
    if isinstance(obj, dict):
        if isinstance(obj.get("mean"), float) and isinstance(obj.get("ci95"), list):
            found.add((obj["mean"], *obj["ci95"]))
        for v in obj.values():
            found |= _intervals(v)
    elif isinstance(obj, list):
        for v in obj:
            found |= _intervals(v)
    return found


def test_readme_learning_row_reads_the_kept_results():
    row = _readme_row("Does it learn?")
    quoted = {(float(m), float(lo), float(hi))
              for m, lo, hi in re.findall(r"([+-]?[0-9.]+) \[([+-]?[0-9.]+), ([+-]?[0-9.]+)\]", row)}
    assert len(quoted) == 4
    held = _intervals(json.loads((RESULTS / "plan_episodes.json").read_text()))
    for q in quoted:  # the docs quote 3 decimals of the file's 4
        assert any(all(abs(a - b) <= 0.00051 for a, b in zip(q, h)) for h in held), q
    k, n = map(int, re.search(r"(\d+) of (\d+)", row).groups())
    pooled = json.loads((RESULTS / "answer_probe.json").read_text())["pooled"]
    assert any(p["accepted"] == k and p["answers"] == n for p in pooled.values())


def test_readme_retrieval_row_reads_the_kept_results():
    row = _readme_row("Retrieval on the wiki")
    recall, p50 = re.search(r"recall@10 ([0-9.]+), p50 search (\d+) ms", row).groups()
    run = json.loads((RESULTS / "retrieval.json").read_text())["all-MiniLM-L6-v2+int8-onnx"]
    assert round(run["quality_test"]["hybrid"]["recall@10"], 3) == float(recall)
    assert round(run["latency"]["hybrid"]["p50_ms"]) == int(p50)


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ("pages.py", "--passes", "2", "--rounds", "1", "--repeats", "1"),
    ("cold_start.py", "--equality-only", "--passages", "20"),
    ("rewards.py", "--plans", "8", "--answers", "0", "--rollouts", "2"),
    ("grpo_overhead.py", "--render-ab"),
    ("index_build.py", "--passages", "16", "--rounds", "1", "--docs", "10", "--skip-incremental"),
], ids=lambda a: a[0])
def test_heavier_benchmarks_quick(tmp_path, args):
    out = tmp_path / "out.json"
    bench(*args, "--out", str(out), timeout=600)
    assert json.loads(out.read_text())
