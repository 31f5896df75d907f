"""Index build speed: encoder options on a wiki subset, and incremental rebuilds.

    python bench/index_build.py [--passages 256] [--docs 300]

1. Embedding throughput of the same ``--passages`` wiki passages (passages/s, wall and CPU
   seconds), each option against deepr's current build encoder in this same run:
   - ``deepr bf16``: Embedder(precision="auto"): length-sorted batches of 64, bf16 autocast;
   - ``naive fp32``: a plain SentenceTransformer.encode, float32;
   - ``bf16 weights``: the model's weights cast to bfloat16 (no autocast);
   - ``batch 16`` / ``batch 128``: deepr bf16 with other batch sizes (padding vs overhead);
   - ``numpy fp32``: deepr/corpus/npbert.py (the query encoder), for reference.
   CPU seconds are the steadier figure on a shared machine; both are recorded.
2. Incremental rebuild: build an index of ``--docs`` wiki documents, edit 2 % of them, and
   rebuild: passages embedded and seconds, against the first (full) build.

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from deepr.corpus import ChunkConfig, Embedder, chunk_documents, load_documents, open_retriever  # noqa: E402
from deepr.corpus.embed import default_model_path  # noqa: E402
from deepr.corpus.index import embed_text  # noqa: E402
from deepr.records import Document  # noqa: E402


def timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def encoders(texts: list[str]) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    from deepr.corpus.npbert import NumpyBert

    deepr = Embedder(precision="auto")
    naive = SentenceTransformer(default_model_path(), device="cpu")
    bf16w = SentenceTransformer(default_model_path(), device="cpu").to(torch.bfloat16)
    small, large = Embedder(precision="auto", batch_size=16), Embedder(precision="auto", batch_size=128)
    npb = NumpyBert.load(default_model_path())
    opts = {
        "deepr bf16": lambda: deepr.encode(texts, cache=False),
        "naive fp32": lambda: naive.encode(texts),
        "bf16 weights": lambda: bf16w.encode(texts, convert_to_tensor=True).float(),
        "batch 16": lambda: small.encode(texts, cache=False),
        "batch 128": lambda: large.encode(texts, cache=False),
        "numpy fp32": lambda: npb.encode(texts),
    }
    warm = {
        "deepr bf16": lambda: deepr.encode(texts[:8], cache=False), "naive fp32": lambda: naive.encode(texts[:8]),
        "bf16 weights": lambda: bf16w.encode(texts[:8]), "batch 16": lambda: small.encode(texts[:8], cache=False),
        "batch 128": lambda: large.encode(texts[:8], cache=False), "numpy fp32": lambda: npb.encode(texts[:8]),
    }
    for fn in warm.values():  # model loads and first-call costs stay out of the timings
        fn()
    out = {name: dict(zip(("wall_s", "cpu_s"), timed(fn))) for name, fn in opts.items()}
    base = out["deepr bf16"]
    for v in out.values():
        v["passages_per_s"] = len(texts) / v["wall_s"]
        v["cpu_ratio_to_deepr_bf16"] = v["cpu_s"] / base["cpu_s"]
        v["wall_ratio_to_deepr_bf16"] = v["wall_s"] / base["wall_s"]
    return out


def incremental(n_docs: int) -> dict:
    docs = load_documents("wiki", limit=n_docs)
    emb = Embedder(precision="auto")
    with tempfile.TemporaryDirectory(prefix="deepr-incr-") as tmp:
        e0 = emb.encoded
        full_w, full_c = timed(lambda: open_retriever(docs, cache_dir=tmp, embedder=emb, progress=False))
        full_n = emb.encoded - e0
        edited = list(docs)
        step = 50  # every 50th document changed: 2 %
        for i in range(0, len(edited), step):
            d = edited[i]
            edited[i] = Document(**{**d.model_dump(), "text": d.text + " (Edited for the benchmark.)"})
        e1 = emb.encoded
        inc_w, inc_c = timed(lambda: open_retriever(edited, cache_dir=tmp, embedder=emb, progress=False))
        inc_n = emb.encoded - e1
    return {"documents": len(docs), "edited_documents": len(range(0, len(docs), step)),
            "full": {"embedded": full_n, "wall_s": full_w, "cpu_s": full_c},
            "rebuild_after_edit": {"embedded": inc_n, "wall_s": inc_w, "cpu_s": inc_c},
            "ratio_wall": inc_w / full_w, "ratio_embedded": inc_n / full_n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passages", type=int, default=256)
    ap.add_argument("--docs", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "index_build.json"))
    args = ap.parse_args()
    res: dict = {"load_avg_start": os.getloadavg(), "cores": len(os.sched_getaffinity(0))}
    texts = [embed_text(p) for p in chunk_documents(load_documents("wiki", limit=args.passages), ChunkConfig())]
    texts = texts[: args.passages]
    res["passages"] = len(texts)
    res["encoders"] = encoders(texts)
    res["incremental"] = incremental(args.docs)
    res["load_avg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
