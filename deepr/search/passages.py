"""Passages of a read page: split with the corpus chunker, ranked against the current need.

:func:`rank_chunks` orders a page's chunks the way the corpus retriever orders passages:
``bm25`` (Okapi BM25 over the corpus tokenizer), ``dense`` (cosine of the run's embedder) or
``hybrid`` (the two rankings fused with the corpus's reciprocal-rank fusion and weights).
A page has a handful of chunks, so BM25 is a plain loop here (about 5 ms less than building a
bm25s index per page). Chunks that match nothing keep page order behind those that do.

Example::

    python -c "from deepr.search.passages import page_chunks, rank_chunks; \
c = page_chunks('http://x/p', 't', 'Lamps light the sea. ' * 200 + 'The lighthouse lamp turns.'); \
print(rank_chunks(c, 'lighthouse lamp', 'bm25')[:1])"
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from deepr.records import Document


def page_chunks(url: str, title: str, text: str) -> list[str]:
    """The page's text cut by the corpus chunker (chunk ``i`` is passage id ``<url>#<i>``)."""
    from deepr.corpus.chunking import chunk_documents

    return [p.text for p in chunk_documents([Document(id=url, title=title, text=text)])]


def rank_chunks(chunks: list[str], need: str, mode: str = "bm25", embedder: Any = None,
                fusion: Any = None) -> list[tuple[int, float]]:
    """(chunk index, score) best first; ``mode`` as the corpus retriever's (dense and hybrid need
    an embedder with ``encode``; without one they fall back to BM25)."""
    if len(chunks) <= 1:
        return [(i, 1.0) for i in range(len(chunks))]
    from deepr.corpus.index import tokenize
    from deepr.text.lang import corpus_language

    lang = corpus_language(chunks)  # a Chinese page: jieba words, not one "word" per clause
    scores = bm25_scores(tokenize([need], lang)[0], tokenize(chunks, lang))
    sparse = sorted((i for i in range(len(chunks)) if scores[i] > 0), key=lambda i: (-scores[i], i))
    ranked = [(i, scores[i]) for i in sparse]
    if mode in ("dense", "hybrid") and callable(getattr(embedder, "encode", None)) and need.strip():
        import numpy as np

        mat = np.asarray(embedder.encode([need, *chunks]), dtype=np.float32)
        mat /= np.maximum(np.linalg.norm(mat, axis=1, keepdims=True), 1e-9)
        sims = mat[1:] @ mat[0]
        dense = sorted(range(len(chunks)), key=lambda i: (-float(sims[i]), i))
        if mode == "dense":
            ranked = [(i, float(sims[i])) for i in dense]
        else:
            from deepr.corpus.index import FusionConfig, rrf_fuse

            f = fusion or FusionConfig()
            ranked = rrf_fuse([dense, sparse], [f.dense_weight, f.bm25_weight], f.rrf_k)
    seen = {i for i, _ in ranked}
    return ranked + [(i, 0.0) for i in range(len(chunks)) if i not in seen]


def ranked_chunks(url: str, title: str, text: str, need: str, n: int, *, page_order: bool = False,
                  mode: str = "bm25", embedder: Any = None, fusion: Any = None) -> list[tuple[int, str]]:
    """(chunk index, text) of the ``n`` chunks of a page that best match ``need``; best first
    unless ``page_order``."""
    chunks = page_chunks(url, title, text)
    keep = [i for i, _ in rank_chunks(chunks, need, mode, embedder, fusion)[:n]]
    return [(i, chunks[i]) for i in (sorted(keep) if page_order else keep)]


def best_passages(url: str, title: str, text: str, need: str, n: int, **kw: Any) -> list[str]:
    """The ``n`` chunks of a page that best match ``need``, in page order."""
    return [t for _, t in ranked_chunks(url, title, text, need, n, page_order=True, **kw)]


def bm25_scores(query: list[str], docs: list[list[str]], k1: float = 1.5, b: float = 0.75) -> list[float]:
    """Okapi BM25 of each tokenised chunk for the query tokens."""
    n = len(docs)
    avg = sum(len(d) for d in docs) / max(n, 1) or 1.0
    df = Counter(t for d in docs for t in set(d))
    out = []
    for d in docs:
        tf = Counter(d)
        score = 0.0
        for t in set(query):
            if tf[t]:
                idf = math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
                score += idf * tf[t] * (k1 + 1) / (tf[t] + k1 * (1 - b + b * len(d) / avg))
        out.append(score)
    return out
