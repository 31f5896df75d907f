"""Index build speed: the embedder's passage path on a wiki subset, and incremental rebuilds.

    python bench/index_build.py [--passages 512] [--rounds 2] [--docs 300] [--compare EARLIER.json]
    python bench/index_build.py --full [--full-precisions auto,int8]   # real from-scratch wiki builds

1. ``Embedder.encode_passages`` (an index build's call) on ``--passages`` passages spread over the
   wiki, for the index default, fp32 and (where the default is bf16) int8, interleaved over
   ``--rounds`` (fastest kept), with each one's cosine to sentence-transformers' fp32 vectors and
   CPU ratio to int8. Public names only, so ``--compare`` can
   add ratios now / earlier to a run of an earlier version.
2. Incremental rebuild: index ``--docs`` wiki documents, edit 2 %, rebuild: passages embedded and
   seconds against the full build.
3. ``--full``: `deepr index --corpus wiki` per precision into a fresh DEEPR_CACHE, wall and CPU
   seconds of the child, ratios to the first; writes bench/results/index_build_full.json.

Writes bench/results/index_build.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import RESULTS, child_env, ratios_to_earlier, read_json, timed, write_json

from deepr.corpus import ChunkConfig, Embedder, chunk_documents, load_documents, open_retriever  # noqa: E402
from deepr.corpus.embed import default_model_path  # noqa: E402
from deepr.corpus.index import embed_text  # noqa: E402
from deepr.records import Document  # noqa: E402


def encoders(texts: list[str], rounds: int) -> dict:
    from sentence_transformers import SentenceTransformer

    from deepr.corpus.embed import get_embedder

    opts = {"index default": get_embedder(use="index"), "fp32": Embedder(precision="fp32")}
    if opts["index default"].precision != "int8":  # bf16 where the CPU has it: int8 side by side
        opts = {"int8": Embedder(precision="int8", use="index"), **opts}
    runs = {name: (lambda e=e: e.encode_passages(texts)) for name, e in opts.items()}
    for fn in runs.values():  # model loads and first-call costs stay out
        fn()
    best: dict[str, dict] = {}
    vecs: dict[str, np.ndarray] = {}
    for _ in range(rounds):
        for name, fn in runs.items():
            vecs[name], w, c = timed(fn)
            b = best.setdefault(name, {"wall_s": w, "cpu_s": c})
            b["wall_s"], b["cpu_s"] = min(b["wall_s"], w), min(b["cpu_s"], c)
    ref = SentenceTransformer(default_model_path(), device="cpu").encode(texts, normalize_embeddings=True)
    for name, v in best.items():
        cos = (vecs[name] * ref).sum(1)
        v.update({"embedder": opts[name].name, "passages_per_s": len(texts) / v["wall_s"],
                  "cos_min": float(cos.min()), "cos_mean": float(cos.mean())})
    int8 = best.get("int8", best["index default"])  # the default is int8 where no int8 entry
    for v in best.values():
        v["cpu_ratio_to_int8"] = v["cpu_s"] / int8["cpu_s"]
    return best


def sample_passages(n: int) -> list[str]:
    """``n`` passages spread evenly over the whole wiki corpus."""
    texts = [embed_text(p) for p in chunk_documents(load_documents("wiki"), ChunkConfig())]
    step = max(1, len(texts) // n)
    return texts[::step][:n]


def incremental(n_docs: int) -> dict:
    docs = load_documents("wiki", limit=n_docs)
    emb = Embedder(precision="auto", use="index")
    with tempfile.TemporaryDirectory(prefix="deepr-incr-") as tmp:
        e0 = emb.encoded
        _, full_w, full_c = timed(lambda: open_retriever(docs, cache_dir=tmp, embedder=emb, progress=False))
        full_n = emb.encoded - e0
        edited = list(docs)
        step = 50  # every 50th document changed: 2 %
        for i in range(0, len(edited), step):
            d = edited[i]
            edited[i] = Document(**{**d.model_dump(), "text": d.text + " (Edited for the benchmark.)"})
        e1 = emb.encoded
        _, inc_w, inc_c = timed(lambda: open_retriever(edited, cache_dir=tmp, embedder=emb, progress=False))
        inc_n = emb.encoded - e1
    return {"documents": len(docs), "edited_documents": len(range(0, len(docs), step)),
            "full": {"embedded": full_n, "wall_s": full_w, "cpu_s": full_c},
            "rebuild_after_edit": {"embedded": inc_n, "wall_s": inc_w, "cpu_s": inc_c},
            "ratio_wall": inc_w / full_w, "ratio_embedded": inc_n / full_n}


def full_build(precision: str, keep: str | None = None) -> dict:
    """One `deepr index --corpus wiki --precision P` into an empty cache, timed from outside."""
    import contextlib
    import resource
    import subprocess

    cmd = [sys.executable, "-m", "deepr", "index", "--corpus", "wiki", "--precision", precision]
    if keep and Path(keep, precision).exists():
        sys.exit(f"--full-cache {keep}: {Path(keep, precision)} exists; the build must start empty")
    where = (contextlib.nullcontext(str(Path(keep, precision))) if keep
             else tempfile.TemporaryDirectory(prefix="deepr-full-"))
    with where as tmp:
        env = child_env(DEEPR_CACHE=tmp)
        before, load0 = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()
        t = time.perf_counter()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if out.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
        metas = list(Path(tmp).glob("index/*/index.meta.json"))
        meta = json.loads(metas[0].read_text(encoding="utf-8")) if metas else {}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"command": " ".join(["deepr", *cmd[3:]]) + " (fresh DEEPR_CACHE)", "wall_s": wall, "cpu_s": cpu,
            "embedder": meta.get("config", {}).get("embedder"), "passages": meta.get("counts", {}).get("passages"),
            "build_s (index meta)": meta.get("timings", {}).get("build_s"),
            "load_avg_before": load0, "load_avg_after": os.getloadavg()}


def full_mode(precisions: list[str], out: Path, keep: str | None = None) -> None:
    res: dict = {"cores": len(os.sched_getaffinity(0)), "builds": {}}
    first = None
    for prec in precisions:
        print(f"full wiki build, --precision {prec} ...", file=sys.stderr, flush=True)
        r = full_build(prec, keep)
        first = first or r
        r["wall_ratio_to_first"], r["cpu_ratio_to_first"] = r["wall_s"] / first["wall_s"], r["cpu_s"] / first["cpu_s"]
        res["builds"][prec] = r
        print(json.dumps(r), flush=True)
    write_json(out, res)


def compare(res: dict, before: dict, path: str) -> None:
    """Ratios now / earlier of each encoder's seconds and of the incremental build's."""
    res["compared_with"] = path
    for name, now in res["encoders"].items():
        old = before.get("encoders", {}).get(name)
        if old:
            now["earlier_embedder"] = old.get("embedder")
        ratios_to_earlier(now, old)
    inc, old_inc = res.get("incremental", {}).get("full"), before.get("incremental", {}).get("full")
    if inc and old_inc:
        res["incremental"]["full_cpu_ratio_to_earlier"] = inc["cpu_s"] / old_inc["cpu_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passages", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--docs", type=int, default=300)
    ap.add_argument("--out", default=str(RESULTS / "index_build.json"))
    ap.add_argument("--compare", default=None, help="an earlier run's JSON (e.g. of the former code)")
    ap.add_argument("--full", action="store_true", help="time real from-scratch wiki builds instead")
    ap.add_argument("--full-precisions", default="auto", help="with --full: precisions, comma-separated")
    ap.add_argument("--full-cache", default=None,
                    help="with --full: keep each build's cache in DIR/<precision> (e.g. for bench/retrieval.py)")
    args = ap.parse_args()
    if args.full:
        out = Path(args.out).with_name("index_build_full.json") if "--out" not in sys.argv else Path(args.out)
        return full_mode(args.full_precisions.split(","), out, args.full_cache)
    res: dict = {"load_avg_start": os.getloadavg(), "cores": len(os.sched_getaffinity(0))}
    texts = sample_passages(args.passages)
    res["passages"] = len(texts)
    res["rounds"] = args.rounds
    res["encoders"] = encoders(texts, args.rounds)
    res["incremental"] = incremental(args.docs)
    res["load_avg_end"] = os.getloadavg()
    if args.compare:
        compare(res, read_json(args.compare), args.compare)
    write_json(args.out, res)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
