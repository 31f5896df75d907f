"""Scaling benchmark: exact vs IVF dense index on 200k synthetic passages and on the wiki.

    python bench/scaling.py [--passages 200000] [--queries 500] [--wiki-cache DIR]
    python bench/scaling.py --passages 0 --wiki-cache DIR --out bench/results/scaling_wiki.json

1. Synthetic corpus (bench/synthetic_corpus.py), indexed with deepr's own build (chunking,
   embedding cache, dense index, BM25) once with an exact and once with an IVF dense index,
   each in a fresh process: build seconds per 10k passages, peak RSS of the build and of a
   process that loads the index and searches, dense search p50/p95 (one thread), and IVF
   recall@10 against exact search. The embedder here is a cheap deterministic one (feature
   hashing of words into 384 dimensions): real MiniLM embedding of 200k passages would take
   hours on 2 cores, so its throughput is measured separately (bench/index_build.py) and the
   arithmetic in docs/scaling.md adds it.
2. Wiki (real MiniLM vectors from a built index, ``--wiki-cache``): IVF recall@10 against
   exact search for the wiki's description queries, at several ``nprobe``.

Writes bench/results/scaling.json. Timings on a shared machine: the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from deepr.corpus.embed import Embedder  # noqa: E402

DIM = 384


class HashEmbedder(Embedder):
    """Words hashed to fixed random unit directions, summed and normalised: deterministic, fast."""

    def __init__(self) -> None:
        super().__init__("hash384", precision="fp32", cache_size=0)
        self._table = np.random.default_rng(0).standard_normal((1 << 14, DIM)).astype(np.float32)

    @property
    def dim(self) -> int:
        return DIM

    def _encode_model(self, texts: list[str], *, passages: bool = False) -> np.ndarray:
        import zlib

        from deepr.corpus.index import tokenize

        out = np.zeros((len(texts), DIM), dtype=np.float32)
        for i, words in enumerate(tokenize(texts)):
            if words:
                out[i] = self._table[[zlib.crc32(w.encode()) & 0x3FFF for w in words]].sum(0)
        self.encoded += len(texts)
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def phase_build(corpus: str, cache: str, dense: str) -> dict:
    from deepr.corpus import open_retriever

    t = time.perf_counter()
    r = open_retriever(corpus, retriever="dense", cache_dir=cache, embedder=HashEmbedder(), progress=False,
                       dense=dense)
    return {"build_s": time.perf_counter() - t, "passages": len(r.passages), "peak_rss_mb": peak_rss_mb(),
            "dense_index": r.describe()["dense_index"], "path": str(r.path)}


def phase_search(corpus: str, cache: str, dense: str, queries: int) -> dict:
    """Load the index (built before) and time single dense searches; return the top-10 ids."""
    from deepr.corpus import open_retriever
    from deepr.corpus.index import embed_text

    t = time.perf_counter()
    r = open_retriever(corpus, retriever="dense", cache_dir=cache, embedder=HashEmbedder(), progress=False,
                       dense=dense)
    load_s = time.perf_counter() - t
    assert not r.built, "the search phase must find the index built by the build phase"
    rng = np.random.default_rng(1)
    picks = rng.choice(len(r.passages), queries, replace=False)
    # a query = half of a passage's words, so it is near, but not equal to, its passage
    qs = [" ".join(embed_text(r.passages[i]).split()[::2]) for i in picks]
    times, tops = [], []
    for q in qs:
        t = time.perf_counter()
        hits = r.search(q, k=10, mode="dense")
        times.append((time.perf_counter() - t) * 1000)
        tops.append([h.id for h in hits])
    qn = statistics.quantiles(times, n=100)
    return {"load_s": load_s, "p50_ms": statistics.median(times), "p95_ms": qn[94], "queries": queries,
            "peak_rss_mb": peak_rss_mb(), "tops": tops}


def child(phase: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--phase", phase, *args], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if out.returncode != 0:
        raise SystemExit(f"phase {phase} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def recall(approx: list[list[str]], exact: list[list[str]]) -> float:
    return statistics.mean(len(set(a) & set(e)) / max(1, len(e)) for a, e in zip(approx, exact))


def synthetic(n: int, queries: int, workdir: Path) -> dict:
    from synthetic_corpus import generate

    corpus = workdir / f"synth{n}.jsonl"
    t = time.perf_counter()
    with open(corpus, "w", encoding="utf-8") as f:
        for row in generate(n):
            f.write(json.dumps(row) + "\n")
    out: dict = {"passages_requested": n, "generate_s": time.perf_counter() - t}
    for dense in ("flat", "ivf"):
        cache = str(workdir / "cache")  # shared: the IVF build reuses the cached vectors
        b = child("build", str(corpus), cache, dense)
        s = child("search", str(corpus), cache, dense, str(queries))
        b["build_s_per_10k"] = b["build_s"] / b["passages"] * 10_000
        out[dense] = {"build": b, "search": {k: v for k, v in s.items() if k != "tops"}, "tops": s["tops"]}
        print(f"  {dense}: build {b['build_s']:.0f} s, p50 {s['p50_ms']:.1f} ms", file=sys.stderr)
    out["ivf_recall@10_vs_exact"] = recall(out["ivf"].pop("tops"), out["flat"].pop("tops"))
    out["ratios"] = {"ivf/flat p50": out["ivf"]["search"]["p50_ms"] / out["flat"]["search"]["p50_ms"],
                     "ivf/flat build": out["ivf"]["build"]["build_s"] / out["flat"]["build"]["build_s"],
                     "ivf/flat search peak rss": out["ivf"]["search"]["peak_rss_mb"] / out["flat"]["search"]["peak_rss_mb"]}
    return out


def wiki_ivf(cache: str, queries: int) -> dict:
    """IVF vs exact on real MiniLM wiki vectors (the index must exist in ``cache``)."""
    import faiss

    from deepr.corpus import Embedder, load_documents, open_retriever
    from deepr.corpus.dense import build_dense

    r = open_retriever("wiki", retriever="dense", cache_dir=cache, progress=False)
    vecs = r._dense.reconstruct_n(0, r._dense.ntotal)
    docs = [d for d in load_documents("wiki") if d.description][:queries]
    q = Embedder().encode([d.description for d in docs])
    faiss.omp_set_num_threads(1)
    exact_t = time.perf_counter()
    _, exact = r._dense.search(q, 10)
    exact_ms = (time.perf_counter() - exact_t) * 1000 / len(q)
    t = time.perf_counter()
    ivf = build_dense(vecs, kind="ivf")
    out: dict = {"passages": len(vecs), "nlist": int(ivf.nlist), "build_s": time.perf_counter() - t,
                 "exact_ms_per_query": exact_ms, "nprobe": {}}
    for nprobe in (4, 8, 16, 32, 64):
        ivf.nprobe = nprobe
        t = time.perf_counter()
        _, got = ivf.search(q, 10)
        ms = (time.perf_counter() - t) * 1000 / len(q)
        rec = statistics.mean(len(set(a) & set(e)) / 10 for a, e in zip(got.tolist(), exact.tolist()))
        out["nprobe"][nprobe] = {"recall@10_vs_exact": rec, "ms_per_query": ms}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--passages", type=int, default=200_000)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--wiki-cache", default=None, help="cache dir holding a built wiki index (skip wiki if absent)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "scaling.json"))
    args = ap.parse_args()
    if args.phase == "build":
        print(json.dumps(phase_build(*args.rest)))
        return
    if args.phase == "search":
        c, cache, dense, n = args.rest
        print(json.dumps(phase_search(c, cache, dense, int(n))))
        return
    res: dict = {"load_avg_start": os.getloadavg(), "cores": len(os.sched_getaffinity(0))}
    if args.wiki_cache:
        print("wiki IVF vs exact ...", file=sys.stderr)
        res["wiki"] = wiki_ivf(args.wiki_cache, args.queries)
    if args.passages > 0:  # 0: only the wiki part
        with tempfile.TemporaryDirectory(prefix="deepr-scaling-") as tmp:
            print(f"synthetic {args.passages} ...", file=sys.stderr)
            res["synthetic"] = synthetic(args.passages, args.queries, Path(tmp))
    res["load_avg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
