"""Corpora searched outside this process: ``--corpus http://HOST:PORT`` (a ``deepr serve-index``
server, deepr/corpus/remote.py) and ``--corpus milvus:...`` (a Milvus collection,
deepr/corpus/milvus.py). :func:`deepr.corpus.index.open_retriever` sends those specs here, so
every command that opens a corpus takes them.
"""

from __future__ import annotations

from typing import Any


def open_backend(spec: str, mode: str, *, embedder: Any = None, fusion: Any = None, limit: int | None = None) -> Any:
    """The retriever for a server URL or a Milvus spec; a server or collection that cannot be
    opened is a ValueError with one line (exit 2: nothing was run)."""
    spec = spec.strip()
    if limit is not None:
        raise ValueError(f"--limit applies to a corpus loaded here, not to {spec}; index a smaller corpus instead")
    if spec.lower().startswith(("http://", "https://")):
        from deepr.corpus.remote import CorpusUnavailable, RemoteRetriever

        try:
            return RemoteRetriever(spec, mode=mode)
        except CorpusUnavailable as e:
            raise ValueError(f"--corpus {spec}: {e}") from None
    from deepr.corpus.milvus import open_milvus

    return open_milvus(spec, mode, embedder=embedder, fusion=fusion)
