"""R_plan's one-plan-per-call speed-up from the cache, on every CPU encoder at hand (issue 16).

bench/rewards.py's ``cached`` mode (one plan per call, the embedder's cache kept) stays under
its 3x goal while ``grouped`` and ``eval`` pass it. This bench asks whether another encoder
would change that. For each engine it scores the same plans in three modes (``uncached``: the
cache cleared before each call; ``cached``; ``grouped``: a prompt's 8 rollouts in one call),
best of --repeat runs, and counts the tokens each mode sends to the model. Then

    speed-up of cached = token ratio x efficiency,

where the token ratio (uncached tokens / cached tokens) is what caching can give at best,
and the efficiency is the cached calls' tokens per second over the uncached calls'. The
cached mode's calls are the first plan of each prompt (~15 texts, as big as uncached calls)
and then a few new texts per plan: 1-3 texts cannot fill two cores as well as 15 do.

Engines:

- ``numpy``: deepr's encoder (deepr/corpus/npbert.py) on numpy's OpenBLAS, with the kernels
  this environment gives it (OPENBLAS_CORETYPE, recorded);
- ``numpy, OpenBLAS <K>``: the same in a child process with OPENBLAS_CORETYPE=K
  (--coretypes; by default SkylakeX on a CPU with AVX-512 when the environment pins another);
- ``onnxruntime fp32``: the same graph on onnxruntime's MLAS kernels (deepr/corpus/onnxbert.py,
  float32 weights, one session over all cores, batches of 4): needs the ``onnx`` extra.

    python bench/rplan_engines.py [--plans 128] [--repeat 2] [--coretypes SkylakeX] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rewards as bench_rewards  # noqa: E402

from deepr.corpus.embed import Embedder, default_model_path  # noqa: E402
from deepr.corpus.npbert import usable_cores  # noqa: E402
from deepr.rewards.plan_reward import plan_rewards  # noqa: E402


class Counted:
    """Stands in for the embedder's numpy encoder: runs ``engine`` and records (texts, tokens,
    seconds) of every call that reaches it."""

    def __init__(self, engine, lite):
        self.engine, self.tok, self.dim, self.calls = engine, lite.tok, lite.dim, []

    def encode(self, texts: list[str], workers: int = 1):
        tokens = sum(len(e.ids) for e in self.tok.encode_batch(texts))
        t = time.perf_counter()
        out = self.engine(texts, workers)
        self.calls.append((len(texts), tokens, time.perf_counter() - t))
        return out


def modes(groups, emb: Embedder) -> dict:
    return {
        "uncached": lambda: bench_rewards.per_plan(groups, emb, uncached=True),
        "cached": lambda: bench_rewards.per_plan(groups, emb, uncached=False),
        "grouped": lambda: [r.plan_reward for p, plans in groups
                            for r in plan_rewards([(pl, p["rubrics"]) for pl in plans], emb.encode)],
    }


def measure(engine_name: str, groups, repeat: int) -> dict:
    emb = Embedder(precision="fp32")
    lite = emb._lite_encoder()
    if engine_name == "onnxruntime fp32":
        from deepr.corpus.onnxbert import OnnxBert

        ort = OnnxBert.load(default_model_path(), quantize=False, threads=usable_cores(), split_ops=True)
        engine = lambda texts, workers: ort.encode(texts, batch_size=4)  # noqa: E731
    else:
        engine = lite.encode
    counted = Counted(engine, lite)
    emb._lite = counted
    emb.encode(["warm up"])
    emb.encode(["warm up, two texts", "so that numpy's BLAS is pinned as in a run"])
    best: dict[str, dict] = {}
    for _ in range(repeat):
        for mode, score in modes(groups, emb).items():
            emb.clear_cache()
            counted.calls = []
            t = time.perf_counter()
            score()
            secs = time.perf_counter() - t
            if mode not in best or secs < best[mode]["seconds"]:
                best[mode] = {"seconds": secs, "calls": list(counted.calls)}
    return summarise(best)


def summarise(best: dict) -> dict:
    def rate(calls) -> float:
        return sum(c[1] for c in calls) / max(sum(c[2] for c in calls), 1e-9)

    out: dict = {}
    for mode, row in best.items():
        calls = row["calls"]
        out[mode] = {"seconds": round(row["seconds"], 3), "model_calls": len(calls),
                     "texts": sum(c[0] for c in calls), "tokens": sum(c[1] for c in calls),
                     "model_seconds": round(sum(c[2] for c in calls), 3),
                     "tokens_per_s": round(rate(calls)),
                     "tokens_per_s_by_call_size": {
                         label: round(rate(sel)) for label, lo, hi in (("1-3 texts", 1, 4), ("4-15", 4, 16),
                                                                       ("16+", 16, 10**9))
                         if (sel := [c for c in calls if lo <= c[0] < hi])}}
    u, c, g = out["uncached"], out["cached"], out["grouped"]
    out["speed-up"] = {"cached": round(u["seconds"] / c["seconds"], 3), "grouped": round(u["seconds"] / g["seconds"], 3)}
    out["token ratio (the most caching can give)"] = round(u["tokens"] / c["tokens"], 3)
    out["efficiency of cached calls (tokens/s vs uncached)"] = round(c["tokens_per_s"] / u["tokens_per_s"], 3)
    return out


def blas_kernel() -> str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "?"
    import numpy as np

    root = Path(np.__file__).resolve().parent
    for lib in threadpool_info():
        if lib.get("user_api") == "blas" and Path(lib["filepath"]).resolve().parent in (root, root.with_name("numpy.libs")):
            return f"{lib.get('internal_api')} {lib.get('version')} {lib.get('architecture')}"
    return "?"


def default_coretypes() -> list[str]:
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="ignore")
    except OSError:
        return []
    if "avx512f" in flags and "SkylakeX" not in blas_kernel():
        return ["SkylakeX"]
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--coretypes", default=None, help="OpenBLAS kernels to try in child processes (comma-separated)")
    ap.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # a child process's one engine
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "rplan_engines.json"))
    args = ap.parse_args()
    groups = bench_rewards.build(args.plans, 8, 0)
    if args.engine:
        return print(json.dumps(measure(args.engine, groups, args.repeat)))
    from deepr.corpus.onnxbert import available

    res: dict = {"load_avg_start": os.getloadavg(), "cores": usable_cores(), "plans": args.plans,
                 "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"), "engines": {}}
    res["engines"][f"numpy, OpenBLAS {blas_kernel()}"] = measure("numpy", groups, args.repeat)
    if available():
        res["engines"]["onnxruntime fp32"] = measure("onnxruntime fp32", groups, args.repeat)
    coretypes = default_coretypes() if args.coretypes is None else [c for c in args.coretypes.split(",") if c]
    for core in coretypes:
        child = subprocess.run([sys.executable, __file__, "--engine", "numpy", "--plans", str(args.plans),
                                "--repeat", str(args.repeat)], capture_output=True, text=True,
                               env={**os.environ, "OPENBLAS_CORETYPE": core})
        if child.returncode != 0:
            res["engines"][f"numpy, OPENBLAS_CORETYPE={core}"] = {"error": child.stderr.strip()[-500:]}
            continue
        res["engines"][f"numpy, OPENBLAS_CORETYPE={core}"] = json.loads(child.stdout.strip().splitlines()[-1])
    res["load_avg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(f"{'engine':38} {'uncached s':>10} {'cached s':>9} {'grouped s':>9} {'cached x':>8} {'grouped x':>9} "
          f"{'tokens x':>8} {'effic.':>6}")
    for name, r in res["engines"].items():
        if "error" in r:
            print(f"{name:38} error: {r['error'][:80]}")
            continue
        print(f"{name:38} {r['uncached']['seconds']:10.2f} {r['cached']['seconds']:9.2f} {r['grouped']['seconds']:9.2f} "
              f"{r['speed-up']['cached']:8.2f} {r['speed-up']['grouped']:9.2f} "
              f"{r['token ratio (the most caching can give)']:8.2f} {r['efficiency of cached calls (tokens/s vs uncached)']:6.2f}")


if __name__ == "__main__":
    main()
