"""Corpus, chunking, embeddings, index and agent tools (the corpus and retrieval layer of every stage).

    from deepr.corpus import open_retriever, ResearchTools
    r = open_retriever("wiki", retriever="hybrid")      # builds + caches the index once
    hits = r.search("Who designed the Eiffel Tower?", k=5)
    tools = ResearchTools(r); tools.search("Eiffel Tower"); tools.browse(hits[0].doc_id)

Heavy libraries (torch, faiss, sentence-transformers) are imported only when an index is
built or searched, so importing this package is cheap.
"""

from deepr.corpus.chunking import ChunkConfig, chunk_documents, chunk_text
from deepr.corpus.embed import Embedder, get_embedder
from deepr.corpus.backends import open_retriever
from deepr.corpus.index import FusionConfig, Retriever, UnknownIdError, rrf_fuse
from deepr.corpus.sources import load_documents
from deepr.corpus.tools import BrowseRefused, ResearchTools

__all__ = [
    "BrowseRefused", "ChunkConfig", "Embedder", "FusionConfig", "ResearchTools", "Retriever",
    "UnknownIdError", "chunk_documents", "chunk_text", "get_embedder", "load_documents",
    "open_retriever", "rrf_fuse",
]
