"""The benchmarks in bench/ run as docs/benchmarks.md documents them: every script answers --help,
each one runs a quick mode end to end into tmp and its output is checked, every results file
is named by docs/benchmarks.md, and the README's Results table reads what those files hold."""

from __future__ import annotations

import json
import math
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


def bench(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """One documented command, as a user types it from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", **(env or {})}
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
    from deepr.corpus.embed import Embedder

    kept = json.loads((RESULTS / "retrieval.json").read_text())
    # the kept run is of the index default (`--precisions auto`, the run with latencies), which is
    # bf16 or int8 depending on the CPU that ran it
    (index_default,) = [k for k, v in kept.items() if isinstance(v, dict) and "latency" in v]
    assert index_default in {Embedder(precision=p).name for p in ("bf16", "int8")}
    run = kept[index_default]
    assert round(run["quality_test"]["hybrid"]["recall@10"], 3) == float(recall)
    assert round(run["latency"]["hybrid"]["p50_ms"]) == int(p50)


def _sft_rows(path: Path, n: int = 2) -> Path:
    plan = json.dumps({"nodes": [{"id": "S1", "type": "search", "query": "river floods"}]})
    path.write_text("".join(json.dumps({"id": f"e{i}", "role": "planner", "action": "plan", "messages": [
        {"role": "system", "content": "You plan research."}, {"role": "user", "content": f"Question {i}: why?"},
        {"role": "assistant", "content": plan}]}) + "\n" for i in range(n)))
    return path


@pytest.fixture(scope="module")
def quick(request, tmp_path_factory):
    """The other scripts' quick runs, each writing into its own tmp folder (never bench/results/),
    started together and run two at a time: each is one process mostly importing on one core, and
    the machine has two. A test takes its run's JSON (or its failure) with ``quick[name].result()``."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import wiki_rows

    d = tmp_path_factory.mktemp("quick")
    corpus, sft = d / "corpus.jsonl", _sft_rows(d / "sft.jsonl")
    corpus.write_text("".join(json.dumps(r) + "\n" for r in wiki_rows(2) if r["description"]))
    runs = {  # longest first; the two that train the tiny model start once it is built
        "pages": ["pages.py", "--passes", "1", "--rounds", "1", "--repeats", "1"],
        "index_build": ["index_build.py", "--passages", "16", "--rounds", "1", "--docs", "10"],
        "cold_start": ["cold_start.py", "--equality-only", "--passages", "8"],
        "grpo_overhead": ["grpo_overhead.py", "--render-ab"],
        "embed_calls": ["embed_calls.py", "--quick", "--compare", str(RESULTS / "embed_calls.json")],
        "rewards": ["rewards.py", "--plans", "4", "--answers", "4", "--rollouts", "2"],
        "serve_index": ["serve_index.py", "--corpus", str(corpus), "--clients", "2", "--per-client", "3",
                        "--skip-milvus", "--work", str(d / "milvus")],
    }

    def run(name: str, args: list[str], env: dict | None = None) -> dict:
        out = d / f"{name}.json"
        if env:  # the shell script takes its output path from OUT
            bench(*args, env={**env, "OUT": str(out)}, timeout=300)
        else:
            bench(*args, "--out", str(out), timeout=300)
        return json.loads(out.read_text())

    selected = " ".join(item.name for item in request.session.items)  # each test names its script
    with ThreadPoolExecutor(2) as pool:
        started = {name: pool.submit(run, name, args) for name, args in runs.items() if name in selected}
        if "gpu_check" in selected or "sft_memory" in selected:
            tiny = request.getfixturevalue("tiny")
            (d / "tiny").symlink_to(tiny)  # the GPU check's inputs: INPUTS/tiny and INPUTS/sft.jsonl
            env = {"DEVICE": "cpu", "QUICK": "1", "INPUTS": str(d), "PYTHON": sys.executable}
            started["gpu_check"] = pool.submit(run, "gpu_check", ["gpu_check.sh"], env)
            started["sft_memory"] = pool.submit(run, "sft_memory", ["sft_memory.py", "--model", str(tiny), "--data",
                                                                    str(sft), "--label", "quick", "--code", ".",
                                                                    "--steps", "2"])
        yield started


def _ratio(a: float, b: float, got: float, places: int = 3) -> bool:
    return math.isfinite(got) and abs(got - a / b) <= 10 ** -places


def test_rewards_quick(quick):
    """Every mode scored the same items (the script exits if caching changed a score), and each
    speed-up is against the uncached mode timed in the same run."""
    res = quick["rewards"].result()
    for part, modes in (("R_plan", {"uncached", "cached", "grouped", "eval"}), ("R_ans", {"uncached", "cached"})):
        rows = res[part]
        assert set(rows) == modes and rows["uncached"]["speedup_vs_uncached"] == 1
        for row in rows.values():
            assert row["items_per_s"] > 0 and _ratio(rows["uncached"]["seconds"], row["seconds"],
                                                     row["speedup_vs_uncached"], 9)
            assert 0 < row["texts_encoded"] <= rows["uncached"]["texts_encoded"]  # the cache only saves calls


def test_embed_calls_quick_compares_with_the_kept_run(quick):
    earlier = json.loads((RESULTS / "embed_calls.json").read_text())
    res = quick["embed_calls"].result()
    assert set(res["calls"]) == {"1 reward texts", "5 reward texts", "64 wiki passages"}
    for name, row in res["calls"].items():
        assert row["calls"] >= 1 and 0 < row["cpu_ms"] and math.isfinite(row["wall_ms"]) and row["wall_ms"] > 0
        assert _ratio(row["cpu_ms"], earlier["calls"][name]["cpu_ms"], row["cpu_ratio_to_earlier"], 9)


def test_serve_index_quick(quick):
    """Two clients against `deepr serve-index` on a 24-article corpus: no errors, the server's
    recall@10 is the local index's, and the throughput ratio is to the one-process baseline."""
    res = quick["serve_index"].result()
    assert res["server"]["requests"] == 6 and res["server"]["errors"] == 0
    assert res["server"]["p50_ms"] <= res["server"]["p99_ms"]
    assert _ratio(res["server"]["qps"], res["baseline_one_process"]["qps"], res["throughput_ratio"], 9)
    rec = res["recall@10"]
    assert rec["queries"] > 0 and 0 < rec["local_hybrid"] == rec["server_hybrid"] <= 1
    assert res["targets"]["server_recall_equals_local"] and res["targets"]["zero_errors"]


def test_sft_memory_quick(quick):
    res = quick["sft_memory"].result()
    row = res["full"]["runs"]["quick"]
    assert row["steps"] == 2 == len(row["step_seconds"]) == len(row["losses"]) and row["rejected"] == 0
    assert 100 < row["peak_rss_mb"] < 16_000 and row["cpu_seconds_per_step"] > 0
    assert all(math.isfinite(x) for x in row["losses"])


def test_gpu_check_dry_run_on_cpu(quick):
    """bench/gpu_check.sh's code path without a GPU: the tiny model's SFT step under accelerate
    launch, figures read back from the trainer's files."""
    res = quick["gpu_check"].result()
    assert res["status"] == "complete" and res["failed"] == [] and res["info"]["quick"]
    (sft,) = res["steps"]
    assert sft["step"] == "sft" and sft["rc"] == 0 and "accelerate.commands.launch" in sft["command"]
    assert (sft.get("steps_per_s") or sft["steps_per_s_incl_loading"]) > 0 and sft["peak_rss_mib_any_child"] > 0


def test_pages_quick(quick):
    res = quick["pages"].result()
    assert set(res["quality"]) == {"favor_precision", "default", "favor_recall"}
    assert sum(m["chosen"] for m in res["quality"].values()) == 1
    assert all(0 <= m["recall"] <= 1 and 0 <= m["leakage"] <= 1 for m in res["quality"].values())
    cost = res["cost"]
    assert cost["ratio_to_lock"]["threads_with_lock"] == 1
    for k, v in cost["median_seconds"].items():
        assert v > 0 and abs(cost["ratio_to_lock"][k] - v / cost["median_seconds"]["threads_with_lock"]) < 0.01
    locked = res["crashes_with_lock"]
    assert locked["native_crashes"] == locked["other_failures"] == 0 and locked["pages_read"] == cost["pages"]


def test_cold_start_equality_quick(quick):
    eq = quick["cold_start"].result()["equality"]
    assert eq["passages"] == 8
    fp32 = eq["fp32 (queries, rewards)"]
    assert fp32["ok"] and 0.999 <= fp32["cos_min"] <= fp32["cos_mean"] <= 1.0001
    (int8,) = [v for k, v in eq.items() if "not gated" in k]
    assert 0.9 < int8["cos_min"] <= int8["cos_mean"] <= 1.0001


def test_grpo_overhead_render_ab_quick(quick):
    ab = quick["grpo_overhead"].result()["render_ab"]
    assert set(ab) == {"command", "load_average", "tiny"}
    tiny = ab["tiny"]
    assert tiny["renders_before"] == 16 and tiny["renders_after"] == 2 and tiny["prompt_tokens"] > 0
    assert _ratio(tiny["after_s"], tiny["before_s"], tiny["ratio"], 2) and tiny["ratio"] < 1


def test_index_build_quick(quick):
    res = quick["index_build"].result()
    from deepr.corpus.embed import Embedder

    # int8 side by side where the index default is not int8 (bf16 on a CPU with native bf16)
    int8_default = Embedder(use="index").precision == "int8"
    assert res["passages"] == 16
    assert set(res["encoders"]) == {"index default", "fp32"} | (set() if int8_default else {"int8"})
    assert res["encoders"]["fp32"]["cos_min"] >= 0.999
    assert res["encoders"]["int8" if not int8_default else "index default"]["cpu_ratio_to_int8"] == 1
    for enc in res["encoders"].values():
        assert enc["passages_per_s"] > 0 and 0.9 < enc["cos_min"] <= enc["cos_mean"] <= 1.0001
    inc = res["incremental"]
    assert 0 < inc["rebuild_after_edit"]["embedded"] < inc["full"]["embedded"]
    assert _ratio(inc["rebuild_after_edit"]["embedded"], inc["full"]["embedded"], inc["ratio_embedded"], 9)
