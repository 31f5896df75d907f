"""The dense half of an index: exact inner-product search, or IVF above a size threshold.

Input: unit-length float32 passage vectors; output: a faiss index written to ``dense.faiss``.
Below ``ANN_THRESHOLD`` passages the index is exact (``IndexFlatIP``); above it, an inverted
file (``IndexIVFFlat``: k-means cells, each query scans ``nprobe`` of them), which is read back
memory-mapped so a corpus of millions of passages does not have to fit in RAM twice.
The threshold and ``nprobe`` come from recall against exact search on the wiki and on 200k
synthetic passages (docs/experiments.md).

Example::

    python -c "import numpy as np; from deepr.corpus.dense import build_dense; \
x = np.eye(4, dtype='float32'); print(build_dense(x, kind='flat').ntotal)"
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import numpy as np

DenseKind = Literal["auto", "flat", "ivf"]
DENSE_KINDS = ("auto", "flat", "ivf")
# exact search over 250k x 384 floats is ~40 ms a query on one core and 384 MB of RAM: past
# that, IVF's ~1-2 % recall cost (docs/experiments.md) buys a flat query time
ANN_THRESHOLD = 250_000
NPROBE = 32
TRAIN_PER_LIST = 64  # k-means training points per cell (faiss warns below 39)


def resolve_kind(n: int, kind: DenseKind = "auto", threshold: int | None = None) -> str:
    if kind not in DENSE_KINDS:
        raise ValueError(f"--dense {kind!r}: expected one of {', '.join(DENSE_KINDS)}")
    if kind == "auto":
        return "ivf" if n >= (ANN_THRESHOLD if threshold is None else threshold) else "flat"
    return kind


def ivf_lists(n: int) -> int:
    """Number of k-means cells: about 2 sqrt(n) (so training stays cheap on a CPU), and never
    fewer than 39 points per cell."""
    return max(1, min(int(2 * math.sqrt(n)), n // 39))


def build_dense(vecs: np.ndarray, *, kind: DenseKind = "auto", threshold: int | None = None,
                nprobe: int = NPROBE, seed: int = 0) -> Any:
    import faiss

    n, dim = vecs.shape
    if resolve_kind(n, kind, threshold) == "flat" or n < 39:
        index = faiss.IndexFlatIP(dim)
        index.add(vecs)
        return index
    nlist = ivf_lists(n)
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(seed)
    sample = vecs if n <= nlist * TRAIN_PER_LIST else vecs[np.sort(rng.choice(n, nlist * TRAIN_PER_LIST, replace=False))]
    index.cp.seed = seed  # deterministic k-means: the same vectors give the same index
    index.train(np.ascontiguousarray(sample))
    index.add(vecs)
    index.nprobe = min(nprobe, nlist)
    return index


def write_dense(index: Any, path: Path) -> None:
    import faiss

    faiss.write_index(index, str(path))


def read_dense(path: Path) -> Any:
    """Flat indexes are read into memory; IVF lists are memory-mapped from the file."""
    import faiss

    with open(path, "rb") as f:
        ivf = f.read(2) == b"Iw"  # faiss's four-byte tag: "Iw.." are the IVF index types
    if ivf:
        try:
            return faiss.read_index(str(path), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
        except RuntimeError:  # a faiss build without mmap support: read it into memory
            pass
    return faiss.read_index(str(path))


def describe_dense(index: Any) -> dict[str, Any]:
    import faiss

    if isinstance(index, faiss.IndexIVF):
        return {"kind": "ivf", "nlist": int(index.nlist), "nprobe": int(index.nprobe), "vectors": int(index.ntotal)}
    return {"kind": "flat", "vectors": int(index.ntotal)}
