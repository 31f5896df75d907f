"""Where R_plan spends its time once embeddings are cached (issue 16 item 3).

    python bench/rplan_profile.py [--plans 256]

Scores the plans of bench/rewards.py twice with one embedder (torch model loaded first, as
in GRPO): the first pass fills the cache, the second runs under cProfile. Reports the share of
the cached pass spent in ``Embedder.encode`` (cache look-ups) and the functions with the most
own time, as fractions of the total. Writes bench/results/rplan_profile.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rewards as bench_rewards  # noqa: E402

from deepr.corpus.embed import Embedder  # noqa: E402
from deepr.rewards.plan_reward import plan_reward  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", type=int, default=256)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "rplan_profile.json"))
    args = ap.parse_args()
    emb = Embedder()
    emb.model  # noqa: B018  loaded up front, as in a GRPO run
    groups = bench_rewards.build(args.plans, 8, 0)
    t = time.perf_counter()
    for p, plans in groups:
        for pl in plans:
            plan_reward(pl, p["rubrics"], emb.encode)
    uncached_s = time.perf_counter() - t
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for p, plans in groups:
        for pl in plans:
            plan_reward(pl, p["rubrics"], emb.encode)
    prof.disable()
    cached_s = time.perf_counter() - t
    stats = pstats.Stats(prof).stats
    total = sum(v[2] for v in stats.values())  # own time of every function
    encode_cum = sum(v[3] for k, v in stats.items() if k[2] == "encode" and k[0].endswith("embed.py"))
    own = sorted(((v[2] / total, f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, v in stats.items()), reverse=True)
    res = {"load_avg": os.getloadavg(), "plans": sum(len(ps) for _, ps in groups),
           "first_pass_s (encodes)": uncached_s, "cached_pass_s": cached_s,
           "ratio first/cached": uncached_s / cached_s,
           "cached: share in Embedder.encode": encode_cum / max(total, 1e-9),
           "cached: top own time": [{"share": round(s, 3), "function": f} for s, f in own[:15]]}
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
