"""Speed of the embedder at the call sizes rewards and searches make, through its public API.

    python bench/embed_calls.py [--rounds 3] [--out FILE] [--compare EARLIER.json] [--quick]

Calls of 1, 2, 5, 16, 48 and 128 reward texts (the plan node texts of bench/rewards.py) and of
64 wiki passages, each call uncached (``encode(..., cache=False)``) on the rewards' embedder
(``get_embedder()``, fp32). Each size is timed over 24 texts' worth of calls (at least one call),
best of ``--rounds``; CPU and wall milliseconds per call. The script uses only
``deepr.corpus.embed.get_embedder`` and ``Embedder.encode``, so the same command times any
version of deepr: ``--compare`` reads a run of an earlier version and adds the ratios
now / earlier (CPU time: the machine may be shared). ``--quick`` (the test suite's run): calls of 1
and 5 texts and one of 64 passages, one round. Writes bench/results/embed_calls.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import rewards as bench_rewards  # noqa: E402

from deepr.corpus.embed import get_embedder  # noqa: E402
from deepr.records import PlanNode  # noqa: E402
from deepr.rewards.plan_reward import node_text  # noqa: E402


def reward_texts() -> list[str]:
    groups = bench_rewards.build(128, 8, 0)
    texts = list(dict.fromkeys(node_text(PlanNode(**n)) for _, plans in groups for pl in plans for n in pl["nodes"]))
    random.Random(0).shuffle(texts)
    return texts


def per_call(encode, chunks: list[list[str]], rounds: int) -> dict:
    encode(chunks[0])  # first-call costs (model load, session start) stay out
    best_w = best_c = float("inf")
    for _ in range(rounds):
        w, c = time.perf_counter(), time.process_time()
        for ch in chunks:
            encode(ch)
        best_w, best_c = min(best_w, time.perf_counter() - w), min(best_c, time.process_time() - c)
    return {"calls": len(chunks), "wall_ms": best_w / len(chunks) * 1e3, "cpu_ms": best_c / len(chunks) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "embed_calls.json"))
    ap.add_argument("--compare", default=None, help="an earlier run's JSON (e.g. of the former code)")
    ap.add_argument("--quick", action="store_true", help="sizes 1 and 5, one call of 64 passages, one round")
    args = ap.parse_args()
    from index_build import sample_passages

    emb = get_embedder()
    encode = lambda texts: emb.encode(texts, cache=False)  # noqa: E731
    texts, wiki = reward_texts(), sample_passages(256)
    res: dict = {"embedder": emb.name, "cores": len(os.sched_getaffinity(0)), "load_avg_start": os.getloadavg(),
                 "calls": {}}
    sets = {f"{n} reward texts": [texts[i * n:(i + 1) * n] for i in range(max(1, 24 // n))]
            for n in ((1, 5) if args.quick else (1, 2, 5, 16, 48, 128))}
    sets["64 wiki passages"] = [wiki[i * 64:(i + 1) * 64] for i in range(1 if args.quick else 2)]
    for name, chunks in sets.items():
        res["calls"][name] = per_call(encode, chunks, 1 if args.quick else args.rounds)
        print(name, json.dumps(res["calls"][name]), flush=True)
    res["load_avg_end"] = os.getloadavg()
    if args.compare:
        before = json.loads(Path(args.compare).read_text(encoding="utf-8"))
        res["compared_with"] = {"file": args.compare, "embedder": before.get("embedder")}
        for name, now in res["calls"].items():
            old = before["calls"].get(name)
            if old:
                now["cpu_ratio_to_earlier"] = now["cpu_ms"] / old["cpu_ms"]
                now["wall_ratio_to_earlier"] = now["wall_ms"] / old["wall_ms"]
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
