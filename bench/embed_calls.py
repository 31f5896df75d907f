"""Speed of the embedder's two CPU paths at the call sizes rewards and searches make.

    python bench/embed_calls.py [--busy] [--out FILE]

1. torch (sentence-transformers fp32, 2 threads): batches of 64 (before) against 16 (now),
   on 64 and 256 reward texts (plan node texts of bench/rewards.py) and 256 wiki passages.
2. numpy encoder (deepr/corpus/npbert.py): one worker (before) against one per core (now:
   a lone batch is split so both cores run), on calls of 2, 5 and 16 reward texts.
3. Where torch (batch 16, all cores) overtakes the numpy encoder (one worker per core), on
   calls of 8 to 64 reward texts: on a CPU, calls under NUMPY_MAX_TEXTS texts run in numpy
   even with torch loaded (deepr/corpus/embed.py).

``--busy`` also runs 2 and 3 with one CPU-bound process per core beside it: threads that
block rather than spin should cost little there. Each line is the best of 3; the ratio is
before / now in this same run. Writes bench/results/embed_calls.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rewards as bench_rewards  # noqa: E402

from deepr.corpus.embed import Embedder, torch_threads  # noqa: E402
from deepr.corpus.npbert import usable_cores  # noqa: E402
from deepr.records import PlanNode  # noqa: E402
from deepr.rewards.plan_reward import node_text  # noqa: E402


def best_of(fn, rounds: int = 3) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def reward_texts() -> list[str]:
    groups = bench_rewards.build(128, 8, 0)
    texts = list(dict.fromkeys(node_text(PlanNode(**n)) for _, plans in groups for pl in plans for n in pl["nodes"]))
    random.Random(0).shuffle(texts)
    return texts


def torch_batches(emb: Embedder, sets: dict[str, list[str]]) -> dict:
    out = {}
    with torch_threads(usable_cores()):
        for name, texts in sets.items():
            secs = {bs: best_of(lambda bs=bs: emb.model.encode(texts, batch_size=bs, convert_to_numpy=True))
                    for bs in (64, 16)}
            out[name] = {"texts": len(texts), "batch_64_s": secs[64], "batch_16_s": secs[16],
                         "speedup": secs[64] / secs[16]}
    return out


def numpy_workers(lite, texts: list[str], sizes=(2, 5, 16), calls: int = 24) -> dict:
    out = {}
    for n in sizes:
        chunks = [texts[i * n:(i + 1) * n] for i in range(calls)]
        secs = {w: best_of(lambda w=w: [lite.encode(c, workers=w) for c in chunks]) / calls
                for w in (1, usable_cores())}
        one, many = secs[1], secs[usable_cores()]
        out[f"{n} texts a call"] = {"one_worker_ms": one * 1e3, "per_core_ms": many * 1e3, "speedup": one / many}
    return out


def crossover(emb: Embedder, lite, texts: list[str], sizes=(8, 16, 24, 32, 48, 64), calls: int = 4) -> dict:
    out = {}
    with torch_threads(usable_cores()):
        for n in sizes:
            chunks = [texts[i * n:(i + 1) * n] for i in range(calls)]
            t = best_of(lambda: [emb.model.encode(c, batch_size=16, convert_to_numpy=True) for c in chunks])
            m = best_of(lambda: [lite.encode(c, workers=usable_cores()) for c in chunks])
            out[f"{n} texts a call"] = {"torch_ms": t / calls * 1e3, "numpy_ms": m / calls * 1e3, "torch_over_numpy": t / m}
    return out


def _spin() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", action="store_true", help="also time the numpy calls beside one busy process per core")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "embed_calls.json"))
    args = ap.parse_args()
    from index_build import sample_passages

    emb = Embedder(precision="fp32")
    lite = emb._lite_encoder()
    texts = reward_texts()
    res: dict = {"cores": usable_cores(), "load_avg_start": os.getloadavg()}
    res["torch"] = torch_batches(emb, {"64 reward texts": texts[:64], "256 reward texts": texts[:256],
                                       "256 wiki passages": sample_passages(256)})
    res["numpy quiet"] = numpy_workers(lite, texts)
    res["torch against numpy (time ratio > 1: numpy is faster)"] = crossover(emb, lite, texts)
    if args.busy:
        hogs = [mp.Process(target=_spin, daemon=True) for _ in range(usable_cores())]
        for h in hogs:
            h.start()
        try:
            res["numpy busy (one spinning process per core)"] = numpy_workers(lite, texts)
            res["torch against numpy, busy"] = crossover(emb, lite, texts, sizes=(16, 32, 48, 64))
        finally:
            for h in hogs:
                h.terminate()
    res["load_avg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
