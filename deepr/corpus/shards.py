"""Index a corpus on many machines: embed hash-partitioned shards, then merge them.

Inputs: a corpus spec, ``K/N`` (this worker's shard, 1 <= K <= N); outputs: one
``shard-K-of-N.npz`` per worker (passage ids, text hashes, vectors, the embedder's name)
in ``<cache>/shards/<index key>/`` or ``--shard-dir``; ``merge`` then loads every shard into
the embedding cache and builds the ordinary index from it without embedding anything, so a
merged index equals a single-machine build (tests/test_retrieval.py checks it; with int8 within
cosine 0.99, with bf16 within 0.999: onnxruntime scales int8 activations per batch, and bf16
rounds differently in another padded batch, so a passage's batch-mates move its vector slightly).

A passage belongs to shard ``sha1(passage id) mod N`` (deepr.io.in_shard, the split that
build-trees and the other stages use): stable across runs and machines, and balanced
whatever the corpus order. Every worker reads the whole corpus (to chunk it and to
agree on the index key) but embeds only its part; all workers must use the same embedder
name, so pass the same ``--embedder`` and ``--precision`` to every worker (see
deepr/corpus/embed.py). ``--precision auto`` depends on the CPU (bf16 where it is native, else
int8), so workers on mixed machines must pass an explicit ``--precision``; a merge refuses a
shard of another embedder name.

Example (4 workers, e.g. a SLURM array ``--array=1-4``, then one merge)::

    deepr index --corpus big.jsonl --shard $SLURM_ARRAY_TASK_ID/4 --precision fp32
    deepr index --corpus big.jsonl --merge --precision fp32
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from deepr.corpus.chunking import ChunkConfig
from deepr.corpus.embcache import EmbeddingCache, text_key
from deepr.corpus.embed import Embedder
from deepr.corpus.index import (DenseKind, Progress, Retriever, cache_root, embed_passages, embed_text,
                                index_key, load_corpus, open_retriever)

_NAME = re.compile(r"shard-(\d+)-of-(\d+)\.npz$")


def parse_shard(spec: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N) with 1 <= K <= N, as ``--shard`` in every other deepr stage."""
    from deepr.io import parse_shard as parse

    part = parse(spec)
    if part is None:
        raise ValueError("--shard: expected K/N, e.g. 2/8")
    return part


def shard_of(passage_id: str, n: int) -> int:
    """The shard (1..n) a passage belongs to: deepr.io.in_shard's hash split of its id."""
    from deepr.io import in_shard

    return next(k for k in range(1, n + 1) if in_shard(passage_id, (k, n)))


def default_shard_dir(cache_dir: str | Path | None, key: str) -> Path:
    return cache_root(cache_dir) / "shards" / key


def build_shard(corpus: str, k: int, n: int, *, embedder: Embedder, chunking: ChunkConfig | None = None,
                cache_dir: str | Path | None = None, limit: int | None = None, shard_dir: Path | None = None,
                progress: Progress | None = None) -> tuple[Path, int]:
    """Embed shard K of N and write its file; returns (path, passages in the shard)."""
    chunking = chunking or ChunkConfig()
    name, _, passages = load_corpus(corpus, chunking, limit)
    folder = shard_dir or default_shard_dir(cache_dir, index_key(name, passages, embedder.name, chunking))
    from deepr.io import in_shard

    mine = [p for p in passages if in_shard(p.id, (k, n))]
    cache = EmbeddingCache(cache_root(cache_dir), embedder.name)
    try:
        vecs = embed_passages(mine, embedder, cache, progress)
    finally:
        cache.close()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"shard-{k}-of-{n}.npz"
    keys = np.frombuffer(b"".join(text_key(embed_text(p)) for p in mine), dtype=np.uint8).reshape(-1, 16)
    meta = {"embedder": embedder.name, "corpus": name, "k": k, "n": n, "passages": len(mine),
            "corpus_passages": len(passages)}
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, ids=np.array([p.id for p in mine], dtype=str), keys=keys, vecs=vecs,
             meta=np.array(json.dumps(meta)))
    os.replace(tmp, path)  # a worker killed mid-write leaves no half shard
    return path, len(mine)


def _read_shard(path: Path) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    try:
        with np.load(path) as z:
            return json.loads(str(z["meta"])), z["keys"], z["vecs"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"shard file {path}: unreadable ({e}); build that shard again") from None


def find_shards(folder: Path) -> list[Path]:
    """All shard files of one complete set ``1..N`` in ``folder``, or a clear error."""
    found: dict[int, dict[int, Path]] = {}
    for p in folder.glob("shard-*-of-*.npz"):
        m = _NAME.search(p.name)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = p
    if not found:
        raise FileNotFoundError(f"no shard files (shard-K-of-N.npz) in {folder}; run `deepr index --shard K/N` first")
    if len(found) > 1:
        raise ValueError(f"{folder} holds shards of different splits (N = {sorted(found)}); keep one set")
    (n, parts), = found.items()
    missing = [k for k in range(1, n + 1) if k not in parts]
    if missing:
        raise FileNotFoundError(f"{folder}: shard(s) {', '.join(f'{k}/{n}' for k in missing)} missing")
    return [parts[k] for k in range(1, n + 1)]


def merge_shards(corpus: str, *, embedder: Embedder, chunking: ChunkConfig | None = None,
                 cache_dir: str | Path | None = None, limit: int | None = None, shard_dir: Path | None = None,
                 dense: DenseKind = "auto", retriever: str = "hybrid") -> Retriever:
    """Load every shard's vectors into the embedding cache, then build the index from it alone."""
    chunking = chunking or ChunkConfig()
    name, _, passages = load_corpus(corpus, chunking, limit)
    folder = shard_dir or default_shard_dir(cache_dir, index_key(name, passages, embedder.name, chunking))
    cache = EmbeddingCache(cache_root(cache_dir), embedder.name)
    try:
        for path in find_shards(folder):
            meta, keys, vecs = _read_shard(path)
            if meta.get("embedder") != embedder.name:
                raise ValueError(f"shard file {path}: embedded with {meta.get('embedder')!r}, merging with "
                                 f"{embedder.name!r}; pass the same --embedder/--precision to every step")
            cache.put([bytes(row) for row in keys], vecs)
    finally:
        cache.close()
    return open_retriever(corpus, retriever=retriever, cache_dir=cache_dir, embedder=embedder,
                          chunking=chunking, limit=limit, progress=False, dense=dense, require_cached=True)
