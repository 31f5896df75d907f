"""Corpora searched outside this process: ``--corpus http://HOST:PORT`` (a ``deepr serve-index``
server, deepr/corpus/remote.py) and ``--corpus milvus:...`` (a Milvus collection,
deepr/corpus/milvus.py). :func:`open_retriever` (what ``deepr.corpus`` exports) sends those specs
there and any other corpus to the local index, so every command that opens a corpus takes them.
"""

from __future__ import annotations

from typing import Any


def open_retriever(corpus: Any = "wiki", *, retriever: str = "hybrid", **kw: Any) -> Any:
    """Any corpus deepr can open: ``http://HOST:PORT`` (a ``deepr serve-index`` server),
    ``milvus:...`` (a Milvus collection), else the local index (:func:`deepr.corpus.index.open_retriever`,
    which takes the same keywords)."""
    if isinstance(corpus, str) and corpus.strip().lower().startswith(("http://", "https://", "milvus:")):
        if retriever not in ("dense", "bm25", "hybrid"):
            raise ValueError(f"--retriever {retriever!r}: expected one of dense, bm25, hybrid")
        return open_backend(corpus, retriever, embedder=kw.get("embedder"), fusion=kw.get("fusion"),
                            limit=kw.get("limit"), language=kw.get("language"))
    from deepr.corpus.index import open_retriever as open_local

    return open_local(corpus, retriever=retriever, **kw)


def open_backend(spec: str, mode: str, *, embedder: Any = None, fusion: Any = None, limit: int | None = None,
                 language: str | None = None) -> Any:
    """The retriever for a server URL or a Milvus spec; a server or collection that cannot be
    opened is a ValueError with one line (exit 2: nothing was run). ``language`` is checked
    against a Milvus collection's (a server tokenizes queries as its own index does)."""
    spec = spec.strip()
    if limit is not None:
        raise ValueError(f"--limit applies to a corpus loaded here, not to {spec}; index a smaller corpus instead")
    if spec.lower().startswith(("http://", "https://")):
        from deepr.corpus.remote import CorpusUnavailable, RemoteRetriever

        try:
            return RemoteRetriever(spec, mode=mode)
        except CorpusUnavailable as e:
            raise ValueError(f"--corpus {spec}: {e}") from None
    from deepr.corpus.milvus_search import open_milvus

    return open_milvus(spec, mode, embedder=embedder, fusion=fusion, language=language)
