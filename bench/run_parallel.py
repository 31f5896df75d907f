"""Benchmark: ``deepr run --queries`` one question at a time vs ``--parallel N``, same questions.

Both runs use the same command line (greedy, schema formats, ``--no-cache``) but for
``--parallel``; with a local hf model, the parallel run's waiting calls are decoded as one batch.
Reported: wall seconds of each command, the ratio, and how many questions got the same model
replies (padding a batch row changes float sums slightly, so a greedy tie may flip).

    python bench/run_parallel.py --queries learn-work/heldout.jsonl      # SmolLM2, 4 at once
    python bench/run_parallel.py --queries q.jsonl --llm hf:runs/sft-merged --parallel 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.learning_setup import write_atomic  # noqa: E402


def run(queries: Path, out: Path, a: argparse.Namespace, parallel: int) -> float:
    cmd = [sys.executable, "-m", "deepr", "run", "--queries", str(queries), "--out", str(out), "--mode", a.mode,
           "--llm", a.llm, "--corpus", a.corpus, "--top-k", "3", "--temperature", "0", "--max-tokens",
           str(a.max_tokens), "--max-reasks", "0", "--formats", "schema", "--no-cache", "--allow-fallback",
           "--timeout", "1800", "--parallel", str(parallel)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if proc.returncode not in (0, 3):
        raise SystemExit(f"deepr run --parallel {parallel} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return secs


def replies(out: Path) -> dict[str, list[str]]:
    rows = [json.loads(x) for x in (out / "reports.jsonl").read_text().splitlines() if x.strip()]
    return {r["id"]: [c.get("reply") for c in json.loads(Path(r["trace_path"]).read_text())["calls"]] for r in rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queries", type=Path, required=True)
    p.add_argument("--llm", default="smollm2")
    p.add_argument("--mode", default="dag")
    p.add_argument("--corpus", default="wiki")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "run_parallel.json")
    a = p.parse_args(argv)
    queries = a.queries.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        one = run(queries, Path(tmp) / "one", a, 1)
        many = run(queries, Path(tmp) / "many", a, a.parallel)
        r1, rn = replies(Path(tmp) / "one"), replies(Path(tmp) / "many")
    res = {"llm": a.llm, "mode": a.mode, "queries": len(r1), "max_tokens": a.max_tokens,
           "wall_s": {"parallel 1": round(one, 1), f"parallel {a.parallel}": round(many, 1)},
           "parallel_vs_one": round(many / one, 3), "same_replies": sum(r1[i] == rn.get(i) for i in r1),
           "load_average_at_end": round(os.getloadavg()[0], 2)}
    write_atomic(a.out, res)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
