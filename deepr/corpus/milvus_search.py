"""Searching a Milvus collection loaded by :func:`deepr.corpus.milvus.load_to_milvus`: the local
Retriever's interface, each query batch in one Milvus call per ranking, ``hybrid`` fused by
deepr's own weighted reciprocal-rank fusion (see :mod:`deepr.corpus.milvus`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepr.corpus.milvus import (PASSAGE_FIELDS, analyzer_name, bm25_body, collection_language, collection_meta,
                                 connect, rows_by_ids, unavailable)
from deepr.records import Document, Hit, Passage


def open_milvus(spec: str, mode: str, *, embedder: Any = None, fusion: Any = None,
                language: str | None = None) -> MilvusRetriever:
    """The retriever over collection ``spec``; ``language`` (None or ``auto``: the collection's own)
    must be the one it was loaded as, since its BM25 analyzer cut the passages that way."""
    from deepr.corpus.embed import Embedder, get_embedder
    from deepr.corpus.index import FusionConfig
    from deepr.text.lang import name as language_name, resolve

    client, name = connect(spec)
    with unavailable(spec):
        meta = collection_meta(client, name)
    if meta is None:
        raise ValueError(f"--corpus {spec}: no collection {name!r}; load it with `deepr index --corpus X --to {spec}`")
    have = collection_language(meta)
    if (language or "auto").strip().lower() != "auto" and resolve(language) != have:
        raise ValueError(f"--corpus {spec}: collection {name!r} was loaded as {language_name(have)} ({have}, BM25 "
                         f"analyzer {analyzer_name(have)}); it cannot be searched as {language_name(resolve(language))}: "
                         f"pass --language {have} (or auto), or load the corpus again with "
                         f"--language {resolve(language)}")
    emb = embedder if isinstance(embedder, Embedder) else get_embedder(embedder, use="index")
    if mode != "bm25" and emb.name != meta["embedder"]:
        raise ValueError(f"--corpus {spec}: loaded with embedder {meta['embedder']!r}, this search uses {emb.name!r}; "
                         "pass the same --embedder/--precision")
    with unavailable(spec):
        client.load_collection(name)
        client.load_collection(f"{name}_docs")
    return MilvusRetriever(client, name, spec=spec, meta=meta, embedder=emb, mode=mode,
                           fusion=fusion or FusionConfig())


class MilvusRetriever:
    """The local Retriever's interface over a Milvus collection loaded by :func:`load_to_milvus`."""

    def __init__(self, client: Any, name: str, *, spec: str, meta: dict[str, Any], embedder: Any,
                 mode: str = "hybrid", fusion: Any = None):
        self._client, self.collection, self.spec, self.meta = client, name, spec, meta
        self.corpus_name, self.embedder, self.mode, self.fusion = meta.get("corpus") or name, embedder, mode, fusion
        self.path, self.built, self.build_seconds = None, False, 0.0
        self.language = collection_language(meta)  # the analyzer's language, so queries are cut the same way
        self._documents: list[Document] | None = None

    def search(self, query: str, k: int = 5, mode: str | None = None) -> list[Hit]:
        return self.search_many([query], k, mode)[0]

    def search_many(self, queries: Sequence[str], k: int = 5, mode: str | None = None) -> list[list[Hit]]:
        from deepr.corpus.index import live_queries, mode_ranking, tokenize

        mode = mode or self.mode
        live, texts = live_queries(queries, k, mode)
        out: list[list[Hit]] = [[] for _ in queries]
        if not live:
            return out
        depth = max(k, self.fusion.depth) if mode == "hybrid" else k
        rows: dict[int, dict[str, Any]] = {}
        dense = self._ranks(texts, "dense", depth, rows) if mode != "bm25" else None
        # a query of stop words matches nothing, as in the local index
        words = [j for j, t in enumerate(tokenize(texts, self.language)) if t]
        sparse = [[] for _ in texts] if mode != "dense" else None
        if mode != "dense" and words:
            for j, ranked in zip(words, self._ranks([texts[j] for j in words], "sparse", depth, rows)):
                sparse[j] = ranked
        for j, i in enumerate(live):
            ranked = mode_ranking(mode, dense and dense[j], sparse and sparse[j], self.fusion)
            out[i] = [self._hit(rows[p], s, r) for r, (p, s) in enumerate(ranked[:k], start=1)]
        return out

    def _ranks(self, texts: list[str], field: str, depth: int, rows: dict[int, dict[str, Any]]) -> list[list[tuple[int, float]]]:
        """(corpus position, score) per query, best first; BM25 distances come negated from Milvus."""
        data = self.embedder.encode(texts).tolist() if field == "dense" else \
            [bm25_body(t, self.language) for t in texts]
        params = {"metric_type": "IP", "params": self.meta.get("dense_index", {}).get("search", {})} \
            if field == "dense" else {"metric_type": "BM25"}
        with unavailable(self.spec):
            found = self._client.search(self.collection, data=data, anns_field=field, limit=depth,
                                        search_params=params, output_fields=PASSAGE_FIELDS)
        out = []
        for hits in found:
            ranked = []
            for h in hits:
                ent = h["entity"]
                rows[ent["pos"]] = ent
                score = float(h["distance"])
                ranked.append((ent["pos"], -score if field == "sparse" and score < 0 else score))
            if field == "sparse":
                ranked = [(p, s) for p, s in ranked if s > 0]
            out.append(ranked)
        return out

    @staticmethod
    def _hit(ent: dict[str, Any], score: float, rank: int) -> Hit:
        return Hit.model_construct(id=ent["pk"], doc_id=ent["doc_id"], title=ent["title"], text=ent["text"],
                                   url=ent["url"] or None, score=score, rank=rank)

    def get_passage(self, pid: str) -> Passage:
        from deepr.corpus.index import UnknownIdError

        with unavailable(self.spec):
            rows = rows_by_ids(self._client, self.collection, "pk", [pid], PASSAGE_FIELDS)
        if not rows:
            raise UnknownIdError(f"no passage {pid!r} in corpus {self.corpus_name!r}")
        r = rows[0]
        return Passage(id=r["pk"], doc_id=r["doc_id"], title=r["title"], text=r["text"], url=r["url"] or None)

    def get_document(self, doc_id: str) -> Document:
        from deepr.corpus.index import UnknownIdError

        with unavailable(self.spec):
            rows = rows_by_ids(self._client, f"{self.collection}_docs", "id", [doc_id], ["doc"])
        if not rows:
            raise UnknownIdError(f"no document {doc_id!r} in corpus {self.corpus_name!r}")
        return Document.model_validate_json(rows[0]["doc"])

    @property
    def documents(self) -> list[Document]:
        """Every document (read once, for seed sampling); in id order."""
        if self._documents is None:
            it = self._client.query_iterator(f"{self.collection}_docs", batch_size=4096, filter="",
                                             output_fields=["doc"])
            docs: list[Document] = []
            while rows := it.next():
                docs += [Document.model_validate_json(r["doc"]) for r in rows]
            it.close()
            self._documents = sorted(docs, key=lambda d: d.id)
        return self._documents

    def _count(self, collection: str) -> int:
        return int(self._client.get_collection_stats(collection).get("row_count", 0))

    def describe(self) -> dict[str, Any]:
        docs = self._count(f"{self.collection}_docs")
        return {"corpus": self.corpus_name, "mode": self.mode, "embedder": self.meta.get("embedder"),
                "language": self.language,
                "documents": docs, "passages": self._count(self.collection), "documents_without_text": None,
                "index": self.spec, "built_now": False,
                "dense_index": {"kind": f"milvus {self.meta.get('dense_index', {}).get('index_type', 'FLAT')}/IP"},
                "build_seconds": 0.0}

    def close(self) -> None:
        self._client.close()
