"""Speed of the embedder at the call sizes rewards and searches make, through its public API.

    python bench/embed_calls.py [--rounds 3] [--out FILE] [--compare EARLIER.json] [--quick]

Uncached ``get_embedder().encode`` calls of 1, 2, 5, 16, 48 and 128 reward texts (bench/rewards.py's
node texts) and of 64 wiki passages, each size over 24 texts' worth of calls, best of ``--rounds``:
CPU and wall ms per call. Public names only, so ``--compare`` adds ratios now / earlier to a run of
an earlier version. ``--quick`` (the suite's): sizes 1 and 5, one call of 64 passages, one round.
Writes bench/results/embed_calls.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import rewards as bench_rewards  # bench/rewards.py: its plans' node texts
from _common import RESULTS, ratios_to_earlier, read_json, write_json

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
    ap.add_argument("--out", default=str(RESULTS / "embed_calls.json"))
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
        before = read_json(args.compare)
        res["compared_with"] = {"file": args.compare, "embedder": before.get("embedder")}
        for name, now in res["calls"].items():
            ratios_to_earlier(now, before["calls"].get(name), unit="_ms")
    write_json(args.out, res)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
