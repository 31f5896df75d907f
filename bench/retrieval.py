"""Retrieval benchmark: index build speed, search latency and quality with no hand labels.

    python bench/retrieval.py [--limit N] [--queries 1000] [--baseline-docs 1000]

1. Encoder speed on a subset: a plain SentenceTransformer (fp32) against deepr's Embedder in fp32
   and int8 (the index default) on the same passages, as speed-up ratios.
2. Full index build time (fresh cache) for each of ``--precisions``.
3. Quality: query = an article's ``description``, target = that article; recall@1/5/10 and MRR@10
   for dense, bm25, hybrid; fusion tuned on one half of the queries (dev), reported on the other.
4. Latency p50/p95 of single searches over ``--queries`` test queries, embedder cache cleared.

Writes bench/results/retrieval.json (load average and CPU seconds recorded).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, timed, write_json

from deepr.corpus import ChunkConfig, Embedder, FusionConfig, chunk_documents, load_documents  # noqa: E402
from deepr.corpus import open_retriever, rrf_fuse  # noqa: E402
from deepr.corpus.embed import default_model_path  # noqa: E402
from deepr.corpus.index import embed_text  # noqa: E402
from deepr.corpus.sources import spread_over_topics  # noqa: E402

MODES = ("dense", "bm25", "hybrid")
GRID_K = (2, 3, 5, 10, 20, 60)
GRID_W = (0.5, 0.75, 1.0, 1.5, 2.0)


def encoder_speed(docs, n: int) -> dict:
    """Seconds to embed the passages of ``n`` documents: naive baseline vs deepr settings."""
    from sentence_transformers import SentenceTransformer

    texts = [embed_text(p) for p in chunk_documents(spread_over_topics(docs, n))]
    naive = SentenceTransformer(default_model_path(), device="cpu")
    naive.encode(texts[:8])  # warm-up, as for the others
    _, bw, bc = timed(lambda: naive.encode(texts))
    out = {"docs": n, "passages": len(texts), "baseline": {"wall_s": bw, "cpu_s": bc}}
    for prec in ("fp32", "int8"):
        emb = Embedder(precision=prec, use="index")
        emb.encode_passages(texts[:8])
        _, w, c = timed(lambda: emb.encode_passages(texts))
        out[emb.name] = {"wall_s": w, "cpu_s": c, "speedup_wall": bw / w, "speedup_cpu": bc / c}
    return out


def split_queries(docs) -> tuple[list, list]:
    """(dev, test) lists of (description, doc id), split by a hash of the id."""
    dev, test = [], []
    for d in docs:
        if d.description and d.text.strip():
            half = int(hashlib.sha1(d.id.encode()).hexdigest(), 16) % 2
            (dev if half == 0 else test).append((d.description, d.id))
    return dev, test


def metrics(ranked_docs: list[list[str]], targets: list[str]) -> dict:
    ranks = [docs.index(t) + 1 if t in docs else None for docs, t in zip(ranked_docs, targets)]
    n = len(targets)
    out = {f"recall@{k}": sum(1 for r in ranks if r and r <= k) / n for k in (1, 5, 10)}
    out["mrr@10"] = sum(1 / r for r in ranks if r and r <= 10) / n
    return out


def rankings(r, queries: list[str], mode: str, k: int) -> list[list[str]]:
    return [[h.id for h in hits] for hits in r.search_many(queries, k=k, mode=mode)]


def tune_fusion(r, dev: list) -> tuple[FusionConfig, dict]:
    """Grid over RRF k and the dense/BM25 weight ratio, on dev queries only."""
    queries, targets = [q for q, _ in dev], [t for _, t in dev]
    depth = FusionConfig().depth
    dense, sparse = rankings(r, queries, "dense", depth), rankings(r, queries, "bm25", depth)
    doc_of = {p.id: p.doc_id for p in r.passages}
    grid = {}
    for k in GRID_K:
        for w in GRID_W:
            fused = [[doc_of[p] for p, _ in rrf_fuse([d, s], [w, 1.0], k)[:10]] for d, s in zip(dense, sparse)]
            grid[(k, w)] = metrics(fused, targets)
    best = max(grid, key=lambda kw: (grid[kw]["mrr@10"], grid[kw]["recall@10"]))
    table = {f"k={k},w_dense={w}": m for (k, w), m in grid.items()}
    return FusionConfig(rrf_k=best[0], dense_weight=best[1], bm25_weight=1.0), table


def quality(r, test: list, modes: tuple = MODES) -> dict:
    queries, targets = [q for q, _ in test], [t for _, t in test]
    doc_of = {p.id: p.doc_id for p in r.passages}
    return {m: metrics([[doc_of[p] for p in ids] for ids in rankings(r, queries, m, 10)], targets)
            for m in modes}


def latency(r, queries: list[str]) -> dict:
    out = {}
    for mode in MODES:
        r.embedder.clear_cache()
        times = []
        for q in queries:
            t = time.perf_counter()
            r.search(q, k=10, mode=mode)
            times.append((time.perf_counter() - t) * 1000)
        qs = statistics.quantiles(times, n=100)
        out[mode] = {"p50_ms": statistics.median(times), "p95_ms": qs[94], "queries": len(times)}
    return out


def build(docs, cache: Path, precision: str) -> tuple:
    emb = Embedder(precision=precision, use="index")
    r, wall, cpu = timed(lambda: open_retriever(docs, cache_dir=cache, embedder=emb, progress=True))
    return r, {"embedder": emb.name, "passages": len(r.passages), "built_now": r.built, "build_s": r.build_seconds,
               "wall_s": wall, "cpu_s": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=None, help="documents of the wiki corpus (default: all)")
    ap.add_argument("--queries", type=int, default=1000, help="single-search latency sample size")
    ap.add_argument("--baseline-docs", type=int, default=1000, help="subset size for the encoder speed ratio")
    ap.add_argument("--precisions", default="fp32,auto",
                    help="full index builds, in order; build ratios are against the first (fp32)")
    ap.add_argument("--cache-dir", default=None,
                    help="keep indexes here (default: a fresh temp dir, so build times are measured)")
    ap.add_argument("--out", default=str(RESULTS / "retrieval.json"))
    args = ap.parse_args()

    res: dict = {"load_avg_start": os.getloadavg(), "cores": len(os.sched_getaffinity(0))}
    docs = load_documents("wiki", limit=args.limit)
    res["corpus"] = {"documents": len(docs), "chunking": ChunkConfig().model_dump()}
    if args.baseline_docs > 0:  # bench/index_build.py compares the encoders in more detail
        print(f"encoder speed on {args.baseline_docs} docs ...", file=sys.stderr)
        res["encoder_speed"] = encoder_speed(docs, min(args.baseline_docs, len(docs)))
    dev, test = split_queries(docs)
    res["queries"] = {"dev": len(dev), "test": len(test)}
    with tempfile.TemporaryDirectory(prefix="deepr-bench-") as tmp:
        tmp = args.cache_dir or tmp
        variants, first = args.precisions.split(","), None
        for prec in variants:
            print(f"full build ({prec}) ...", file=sys.stderr)
            r, info = build(docs, Path(tmp), prec)
            fusion, grid = tune_fusion(r, dev)
            q = quality(r, test)  # with deepr's default fusion
            r.fusion = FusionConfig(rrf_k=60.0, dense_weight=1.0, bm25_weight=1.0)
            q["hybrid, classic RRF k=60"] = quality(r, test, ("hybrid",))["hybrid"]
            r.fusion = fusion
            q["hybrid, tuned on dev"] = quality(r, test, ("hybrid",))["hybrid"]
            res[info["embedder"]] = {"build": info, "quality_test": q,
                                     "fusion_default": FusionConfig().model_dump(),
                                     "fusion_tuned": fusion.model_dump(), "fusion_grid_dev": grid}
            if prec == "auto":
                res[info["embedder"]]["latency"] = latency(r, [q for q, _ in test][: args.queries])
            first = first or info
            info["build_ratio_to_first"] = info["build_s"] / first["build_s"] if first["build_s"] else None  # reused index
            info["first"] = first["embedder"]
    res["load_avg_end"] = os.getloadavg()
    write_json(args.out, res)
    report(res)


def report(res: dict) -> None:
    if sp := res.get("encoder_speed"):
        print(f"encoder speed, {sp['passages']} passages: naive {sp['baseline']['wall_s']:.1f} s; " + "; ".join(
            f"{k} {v['wall_s']:.1f} s (x{v['speedup_wall']:.2f} wall, x{v['speedup_cpu']:.2f} cpu)"
            for k, v in sp.items() if isinstance(v, dict) and "speedup_wall" in v))
    print(f"{res['corpus']['documents']} docs, {res['queries']['test']} test queries: R@1 R@5 R@10 MRR@10, p50/p95 ms")
    for name, v in res.items():
        if isinstance(v, dict) and "quality_test" in v:
            for mode, m in v["quality_test"].items():
                lat = v.get("latency", {}).get(mode)
                print(f"{name:28} {mode:26}", *(f"{m[x]:.3f}" for x in ("recall@1", "recall@5", "recall@10", "mrr@10")),
                      f"{lat['p50_ms']:6.1f} {lat['p95_ms']:6.1f}" if lat else "")
            print(f"{name}: build {v['build']['build_s']:.1f} s (cpu {v['build']['cpu_s']:.1f} s); fusion default "
                  f"{v['fusion_default']}, tuned on dev {v['fusion_tuned']}")
    print(f"load average start {res['load_avg_start']}, end {res['load_avg_end']}")


if __name__ == "__main__":
    main()
