"""Speed of the embedder's two CPU paths at the call sizes rewards and searches make.

    python bench/embed_calls.py [--busy] [--out FILE]

1. torch (sentence-transformers fp32, 2 threads): batches of 64 (before) against 16 (now),
   on 64 and 256 reward texts (plan node texts of bench/rewards.py) and 256 wiki passages.
2. numpy encoder (deepr/corpus/npbert.py): the one of commit FORMER (padded length-sorted
   batches, one thread per core, numpy's BLAS limited around each call; loaded from git)
   against now (packed texts, scratch arrays kept per thread, numpy's BLAS pinned to one
   thread), on calls of 1, 2, 5, 16 and 48 reward texts.
3. torch (batch 16, all cores) against the numpy encoder (one thread per core), on calls of
   16 to 256 reward texts and 64 and 256 wiki passages: on a CPU in fp32 every call but an
   index's passages runs in numpy (deepr/corpus/embed.py), so numpy should win at every size.

``--busy`` also runs 2 and 3 with one CPU-bound process per core beside it: threads that
block rather than spin should cost little there. Each line is the best of 3; the ratio is
before / now (or torch / numpy) in this same run. Writes bench/results/embed_calls.json.
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
from former import module_at, numpy_blas_threads  # noqa: E402

from deepr.corpus.embed import Embedder, default_model_path, torch_threads  # noqa: E402
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


FORMER = "be1ec8f"  # the numpy encoder of the round before this bench's last change


def numpy_former(lite, texts: list[str], sizes=(1, 2, 5, 16, 48), calls: int = 24) -> dict:
    old = module_at(FORMER, "deepr/corpus/npbert.py").NumpyBert.load(default_model_path())
    cores, out = usable_cores(), {}
    for n in sizes:
        chunks = [texts[i * n:(i + 1) * n] for i in range(calls)]
        with numpy_blas_threads(cores):  # the state that encoder ran in
            before = best_of(lambda: [old.encode(c, workers=cores) for c in chunks]) / calls
        now = best_of(lambda: [lite.encode(c, workers=cores) for c in chunks]) / calls
        out[f"{n} texts a call"] = {"former_ms": before * 1e3, "now_ms": now * 1e3, "speedup": before / now}
    return out


def crossover(emb: Embedder, lite, sets: dict[str, list[str]], sizes=(16, 32, 64, 128, 256), total: int = 256) -> dict:
    out = {}
    with torch_threads(usable_cores()):
        for name, texts in sets.items():
            for n in sizes:
                calls = max(1, total // n)
                chunks = [texts[i * n:(i + 1) * n] for i in range(calls)]
                t = best_of(lambda: [emb.model.encode(c, batch_size=16, convert_to_numpy=True) for c in chunks])
                m = best_of(lambda: [lite.encode(c, workers=usable_cores()) for c in chunks])
                out[f"{n} {name} a call"] = {"torch_ms": t / calls * 1e3, "numpy_ms": m / calls * 1e3,
                                             "torch_over_numpy": t / m}
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
    texts, wiki = reward_texts(), sample_passages(256)
    res: dict = {"cores": usable_cores(), "load_avg_start": os.getloadavg()}
    res["torch"] = torch_batches(emb, {"64 reward texts": texts[:64], "256 reward texts": texts[:256],
                                       "256 wiki passages": wiki})
    res[f"numpy quiet, {FORMER} against now"] = numpy_former(lite, texts)
    res["torch against numpy (time ratio > 1: numpy is faster)"] = {
        **crossover(emb, lite, {"reward texts": texts}),
        **crossover(emb, lite, {"wiki passages": wiki}, sizes=(64, 256))}
    if args.busy:
        hogs = [mp.Process(target=_spin, daemon=True) for _ in range(usable_cores())]
        for h in hogs:
            h.start()
        try:
            res[f"numpy busy (one spinning process per core), {FORMER} against now"] = numpy_former(lite, texts)
            res["torch against numpy, busy"] = crossover(emb, lite, {"reward texts": texts}, sizes=(64, 256))
        finally:
            for h in hogs:
                h.terminate()
    res["load_avg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
