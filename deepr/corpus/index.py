"""Index and retrieval: dense FAISS + BM25 over passages, fused by reciprocal-rank fusion.

Inputs: a corpus spec (see :mod:`deepr.corpus.sources`) or a list of Documents; output: a
:class:`Retriever` whose ``search`` returns ranked :class:`Hit` snippets with stable ids.

The index is built once and cached under ``$DEEPR_CACHE`` (default ``~/.cache/deepr``) in
``index/<key>/``; the key hashes the passages' content, the embedder name and the chunking
config, so any change to one of them builds a new index and nothing stale is ever served.
Each passage's vector is kept in the embedding cache (``embeddings/``, keyed by text hash and
model; deepr/corpus/embcache.py), so an interrupted build resumes where it stopped and a
rebuild after a corpus edit embeds only new or changed passages; the index is written to
``index/<key>.partial/`` and appears complete by one rename. Above a size threshold the dense
half is an IVF index (deepr/corpus/dense.py); ``deepr index --shard/--merge`` spreads the
embedding over machines (deepr/corpus/shards.py).

Example::

    deepr index --corpus wiki && deepr search "who painted the Mona Lisa" -k 3
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from deepr.activity import note
from deepr.corpus.chunking import ChunkConfig, chunk_documents
from deepr.corpus.dense import DenseKind, build_dense, describe_dense, read_dense, resolve_kind, write_dense
from deepr.corpus.embcache import EmbeddingCache, cache_root, text_key
from deepr.corpus.embed import SMALL_BATCH, Embedder, get_embedder
from deepr.corpus.sources import corpus_name as spec_name
from deepr.corpus.sources import load_documents, slugify
from deepr.corpus.tokens import tokenize
from deepr.text.lang import resolve as resolve_language
from deepr.records import Document, Hit, Passage

Mode = Literal["dense", "bm25", "hybrid"]
MODES = ("dense", "bm25", "hybrid")
INDEX_FORMAT = 1  # bump when the on-disk layout changes, so old caches are rebuilt
SHARD = 1024  # passages embedded between two saves to the embedding cache (resume granularity)
Progress = Callable[[int, int], None]
_FAISS_THREADS = threading.Lock()


class FusionConfig(BaseModel):
    """How dense and BM25 rankings are combined in ``hybrid`` mode.

    Defaults come from the retrieval benchmark (docs/benchmarks.md; full wiki, query = an article's description, grid
    tuned on a dev half, reported on the test half): with the classic k=60 and equal weights
    the fused ranking lost recall@1 to BM25 alone; k=5 with the dense vote at 0.75 beat both
    single retrievers on recall@1/5/10 and MRR@10. Tune both for a corpus of your own.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    rrf_k: float = Field(5.0, gt=0, description="RRF constant k in 1/(k + rank); larger flattens ranks.")
    dense_weight: float = Field(0.75, ge=0, description="Weight of the dense ranking in the fused score.")
    bm25_weight: float = Field(1.0, ge=0, description="Weight of the BM25 ranking in the fused score.")
    depth: int = Field(50, ge=1, description="Candidates taken from each retriever before fusing.")


class UnknownIdError(KeyError):
    """A passage or document id that is not in this corpus."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown id"


def passages_hash(passages: Sequence[Passage]) -> str:
    h = hashlib.sha256()
    for p in passages:
        h.update(f"{p.id}\x00{p.title}\x00{p.text}\x1e".encode())
    return h.hexdigest()


def index_key(name: str, passages: Sequence[Passage], embedder_name: str, chunking: ChunkConfig,
              dense: str = "flat", language: str = "en") -> str:
    fields = {"format": INDEX_FORMAT, "passages": passages_hash(passages),
              "embedder": embedder_name, "chunking": chunking.model_dump()}
    if dense != "flat":  # flat keys stay as before, so existing caches remain valid
        fields["dense"] = dense
    if language != "en":  # the BM25 tokenizer (deepr/corpus/tokens.py); English keys as before
        fields["language"] = language
    ident = json.dumps(fields, sort_keys=True)
    return f"{slugify(name)[:40] or 'corpus'}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def live_queries(queries: Sequence[str], k: int, mode: str) -> tuple[list[int], list[str]]:
    """The positions and stripped texts of a search batch's non-blank queries, after checking
    ``mode`` and ``k``; every retriever answers a blank query with no hits."""
    if mode not in MODES:
        raise ValueError(f"retriever mode {mode!r}: expected one of {', '.join(MODES)}")
    if k < 1:
        raise ValueError(f"k={k}: ask for at least one result")
    live = [i for i, q in enumerate(queries) if isinstance(q, str) and q.strip()]
    return live, [queries[i].strip() for i in live]


def mode_ranking(mode: str, dense: Any, sparse: Any, fusion: FusionConfig) -> list:
    """What a retriever mode ranks by: the dense ranking, the BM25 one, or both fused (weighted RRF)."""
    if mode == "dense":
        return dense
    if mode == "bm25":
        return sparse
    return rrf_fuse([[p for p, _ in dense], [p for p, _ in sparse]], [fusion.dense_weight, fusion.bm25_weight],
                    fusion.rrf_k)


def rrf_fuse(rankings: Sequence[Sequence[int]], weights: Sequence[float],
             k: float) -> list[tuple[int, float]]:
    """Reciprocal-rank fusion: score(d) = sum_r w_r / (k + rank_r(d)), ranks counted from 1.

    Ties go to the item ranked best by any single list, then to the smaller index, so the
    order is deterministic.
    """
    scores: dict[int, float] = {}
    best: dict[int, int] = {}
    for ranking, w in zip(rankings, weights):
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + w / (k + rank)
            best[item] = min(best.get(item, rank), rank)
    return sorted(scores.items(), key=lambda kv: (-kv[1], best[kv[0]], kv[0]))


def _bm25s() -> Any:
    """bm25s, imported with its logger quiet: it sets that logger to DEBUG, so any root handler
    printed "Building index from tokens" on every build.

    bm25s runs one JAX top-k when it is imported if jax is installed. On a machine whose jax has
    a GPU, that first JAX call reserves 75 % of the card for the rest of the process (108 of the
    H200's 141 GB in the GPU check, beside the trainer and the policy). deepr asks bm25s for its
    numpy top-k (``_bm25_ranks``), so JAX is kept on the CPU unless the user chose its platform."""
    import logging

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s

    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return bm25s


def _build_bm25(texts: Sequence[str], folder: Path, language: str = "en") -> None:
    bm25s = _bm25s()

    bm25 = bm25s.BM25()
    bm25.index(tokenize(texts, language), show_progress=False)
    bm25.save(str(folder), show_progress=False)


def embed_text(p: Passage) -> str:
    """What the encoders see: the title gives a short passage its subject."""
    return p.text if not p.title or p.text.startswith(p.title) else f"{p.title}. {p.text}"


# --- building ---------------------------------------------------------------------------


def embed_passages(passages: Sequence[Passage], embedder: Embedder, cache: EmbeddingCache,
                   progress: Progress | None = None, *, require_cached: bool = False) -> np.ndarray:
    """Vectors of ``passages`` in order; only texts missing from ``cache`` go to the model.

    New vectors are stored in blocks of SHARD passages, so an interrupted build resumes at its
    last block and a rebuild after a corpus edit embeds only the new or changed passages.
    """
    texts = [embed_text(p) for p in passages]
    keys = [text_key(t) for t in texts]
    dim = embedder.dim
    out = np.empty((len(texts), dim), dtype=np.float32)
    found = cache.get(keys, dim)
    # longest first over the whole corpus, not per block: each batch pads to its own longest text
    todo = sorted((i for i, k in enumerate(keys) if k not in found), key=lambda i: -len(texts[i]))
    for i, k in enumerate(keys):
        if k in found:
            out[i] = found[k]
    if todo and require_cached:
        raise ValueError(f"{len(todo)} of {len(texts)} passages have no vector in {cache.path} "
                         f"(first: {passages[todo[0]].id!r}); a shard is missing or was built with another embedder")
    done = len(texts) - len(todo)
    if progress and done:
        progress(done, len(texts))
    for s in range(0, len(todo), SHARD):
        rows = todo[s:s + SHARD]
        vecs = embedder.encode_passages([texts[i] for i in rows])
        cache.put([keys[i] for i in rows], vecs)
        out[rows] = vecs
        if progress:
            progress(done + s + len(rows), len(texts))
    return out


def build_index(passages: Sequence[Passage], embedder: Embedder, target: Path,
                progress: Progress | None = None, meta: dict[str, Any] | None = None, *,
                dense: DenseKind | None = "auto", require_cached: bool = False, language: str = "en") -> float:
    """Build dense + BM25 indexes into ``target`` atomically; returns the seconds spent.

    Vectors come from (and go to) the embedding cache under ``target``'s cache root.
    ``dense=None`` builds the BM25 half alone: a BM25-only search needs neither the
    embedder's pass over the corpus nor faiss.
    """
    t0 = time.perf_counter()
    work = target.with_name(target.name + ".partial")
    work.mkdir(parents=True, exist_ok=True)
    index = None
    if dense is not None:
        cache = EmbeddingCache(target.parent.parent, embedder.name)
        try:
            vecs = embed_passages(passages, embedder, cache, progress, require_cached=require_cached)
        finally:
            cache.close()
        index = build_dense(vecs, kind=dense)
        write_dense(index, work / "dense.faiss")
    _build_bm25([embed_text(p) for p in passages], work / "bm25", language)
    (work / "ids.json").write_text(json.dumps([p.id for p in passages]), encoding="utf-8")
    seconds = time.perf_counter() - t0
    meta = dict(meta or {})
    meta["dense_index"] = describe_dense(index) if index is not None else None
    _write_index_meta(work, target, passages, embedder, seconds, meta)
    try:
        os.rename(work, target)
    except OSError:
        # another process finished the same key first; both built the same content
        shutil.rmtree(work, ignore_errors=True)
    return seconds


def _write_index_meta(work: Path, target: Path, passages: Sequence[Passage], embedder: Embedder,
                      seconds: float, meta: dict[str, Any]) -> None:
    from deepr.io import write_meta

    write_meta(work / "index", stage="index", config={"embedder": embedder.name, **meta.pop("config", {})},
               inputs=meta.pop("inputs", ()), counts={"passages": len(passages), **meta.pop("counts", {})},
               timings={"build_s": round(seconds, 3)},
               extra={"index_dir": str(target), "passages_sha256": passages_hash(passages), **meta})


# --- opening ----------------------------------------------------------------------------


def load_corpus(corpus: str | Sequence[Document], chunking: ChunkConfig,
                limit: int | None = None) -> tuple[str, list[Document], list[Passage]]:
    """(name, documents, passages) of a corpus spec or document list, with its sanity checks."""
    if isinstance(corpus, str):
        name, docs = spec_name(corpus), load_documents(corpus, limit=limit)
    else:
        name, docs = "memory", list(corpus)[:limit]
    if not docs:
        raise ValueError(f"corpus {name!r} has no documents; check the path or spec")
    if len({d.id for d in docs}) != len(docs):
        raise ValueError(f"corpus {name!r}: document ids are not unique; passage ids would be ambiguous")
    passages = chunk_documents(docs, chunking)
    if not passages:
        raise ValueError(f"corpus {name!r}: every document is blank, nothing to index")
    return name, docs, passages


def open_retriever(corpus: str | Sequence[Document] = "wiki", *, retriever: Mode = "hybrid",
                   cache_dir: str | Path | None = None, embedder: Embedder | str | None = None,
                   chunking: ChunkConfig | None = None, limit: int | None = None,
                   progress: bool | Progress = True, fusion: FusionConfig | None = None,
                   dense: DenseKind = "auto", require_cached: bool = False,
                   language: str | None = "auto") -> Retriever:
    """Load a corpus, build its index if no cached one matches, and return a Retriever (a server
    or Milvus collection: :func:`deepr.corpus.backends.open_retriever`, what ``deepr.corpus`` exports).

    ``dense``: exact ("flat"), approximate ("ivf") or by corpus size ("auto", see
    deepr/corpus/dense.py). ``require_cached``: fail instead of embedding (``index --merge``).
    ``language``: how BM25 tokenizes (deepr/corpus/tokens.py); ``auto`` detects it from the text.
    """
    if retriever not in MODES:
        raise ValueError(f"--retriever {retriever!r}: expected one of {', '.join(MODES)}")
    chunking = chunking or ChunkConfig()
    emb = embedder if isinstance(embedder, Embedder) else get_embedder(embedder, use="index")
    name, docs, passages = load_corpus(corpus, chunking, limit)
    lang = resolve_language(language, (p.text for p in passages))
    kind = resolve_kind(len(passages), dense)
    target = cache_root(cache_dir) / "index" / index_key(name, passages, emb.name, chunking, kind, lang)
    built, seconds = False, 0.0
    need_dense = retriever != "bm25"
    with _build_lock(target):  # a second process waits, then finds the index built
        if not _usable(target, passages, dense=need_dense):
            built, seconds = _build(corpus, name, docs, passages, emb, chunking, limit, target, progress,
                                    dense=kind if need_dense else None, require_cached=require_cached,
                                    language=lang)
    r = Retriever.load(target, name=name, documents=docs, passages=passages, embedder=emb,
                       mode=retriever, fusion=fusion or FusionConfig(), language=lang)
    r.built, r.build_seconds = built, seconds
    return r


@contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """One builder per index key across processes (they share the ``.partial`` resume folder)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no flock on this platform
        yield
        return
    locks = target.parent.parent / "locks"  # beside index/, whose listing is the set of indexes
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{target.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(corpus: Any, name: str, docs: Sequence[Document], passages: Sequence[Passage], emb: Embedder,
           chunking: ChunkConfig, limit: int | None, target: Path, progress: bool | Progress, *,
           dense: DenseKind | None = "auto", require_cached: bool = False,
           language: str = "en") -> tuple[bool, float]:
    shutil.rmtree(target, ignore_errors=True)
    meta = {"config": {"corpus": name, "limit": limit, "chunking": chunking.model_dump(), "language": language},
            "counts": {"documents": len(docs), "documents_without_text":
                       len(docs) - len({p.doc_id for p in passages})}, "inputs": _input_files(corpus)}
    bar = _progress_fn(progress, name)
    try:
        seconds = build_index(passages, emb, target, bar, meta, dense=dense, require_cached=require_cached,
                              language=language)
    finally:
        getattr(bar, "close", lambda: None)()
    return True, seconds


def _usable(target: Path, passages: Sequence[Passage], *, dense: bool = True) -> bool:
    """A cached index is used only if it is complete and lists exactly these passages.

    A BM25-only index (built for ``--retriever bm25``) is rebuilt whole when a dense or hybrid
    search asks for the same key; BM25 over 10k summaries takes under a second.
    """
    try:
        ids = json.loads((target / "ids.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    complete = (target / "bm25").is_dir() and (not dense or (target / "dense.faiss").is_file())
    return complete and ids == [p.id for p in passages]


def _input_files(corpus: str | Sequence[Document]) -> list[Path]:
    if not isinstance(corpus, str) or corpus == "wiki" or corpus.startswith("hf:"):
        return []
    path = Path(corpus).expanduser()
    return [path] if path.is_file() else []


def _progress_fn(progress: bool | Progress, name: str) -> Progress | None:
    if callable(progress):
        return progress
    if not progress:
        return None
    return RichProgress(f"embedding {name}")


class RichProgress:
    """A rich progress bar on stderr, started on first update and stopped when complete."""

    def __init__(self, label: str):
        self.label = label
        self._bar: Any = None
        self._task: Any = None

    def __call__(self, done: int, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        if self._bar is None:  # its own stderr console: the corpus layer must not import the CLI
            self._bar = Progress("[progress.description]{task.description}", BarColumn(),
                                 MofNCompleteColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                                 transient=False)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=total)
        self._bar.update(self._task, completed=done)

    def close(self) -> None:
        """Stop the live display, also when a build is interrupted, so the terminal is restored."""
        if self._bar is not None:
            self._bar.stop()


# --- searching --------------------------------------------------------------------------


class Retriever:
    """Search over one indexed corpus; every Hit carries a stable passage id and its doc id."""

    def __init__(self, *, name: str, documents: Sequence[Document], passages: Sequence[Passage],
                 embedder: Embedder, dense: Any, bm25: Any, mode: Mode = "hybrid",
                 fusion: FusionConfig | None = None, path: Path | None = None, language: str = "en"):
        if mode not in MODES:
            raise ValueError(f"retriever mode {mode!r}: expected one of {', '.join(MODES)}")
        self.corpus_name, self.embedder, self.mode, self.path = name, embedder, mode, path
        self.language = language  # how BM25 tokenized the passages, and so tokenizes queries
        self.documents, self.passages = list(documents), list(passages)
        self.fusion = fusion or FusionConfig()
        self._dense, self._bm25 = dense, bm25
        self._docs = {d.id: d for d in self.documents}
        self._pos = {p.id: i for i, p in enumerate(self.passages)}
        self.built, self.build_seconds = False, 0.0

    @classmethod
    def load(cls, folder: Path, **kw: Any) -> Retriever:
        bm25s = _bm25s()
        dense = folder / "dense.faiss"
        # a BM25 retriever leaves faiss unimported; its dense half, if any, opens on first use
        return cls(dense=read_dense(dense) if kw.get("mode", "hybrid") != "bm25" else None,
                   bm25=bm25s.BM25.load(str(folder / "bm25"), show_progress=False), path=folder, **kw)

    def search(self, query: str, k: int = 5, mode: Mode | None = None) -> list[Hit]:
        return self.search_many([query], k, mode)[0]

    def search_many(self, queries: Sequence[str], k: int = 5, mode: Mode | None = None) -> list[list[Hit]]:
        """Ranked hits per query; blank queries get an empty list. Query embeddings are batched."""
        mode = mode or self.mode
        live, texts = live_queries(queries, k, mode)
        out: list[list[Hit]] = [[] for _ in queries]
        if not live:
            return out
        note("search", len(live))
        depth = max(k, self.fusion.depth) if mode == "hybrid" else k
        dense = self._dense_ranks(texts, depth) if mode != "bm25" else None
        sparse = self._bm25_ranks(texts, depth) if mode != "dense" else None
        for j, i in enumerate(live):
            ranked = mode_ranking(mode, dense and dense[j], sparse and sparse[j], self.fusion)
            out[i] = [self._hit(p, s, r) for r, (p, s) in enumerate(ranked[:k], start=1)]
        return out

    def _dense_ranks(self, texts: list[str], depth: int) -> list[list[tuple[int, float]]]:
        import faiss

        if self._dense is None:
            path = self.path / "dense.faiss" if self.path else None
            if path is None or not path.is_file():
                raise ValueError(f"corpus {self.corpus_name!r} was indexed for BM25 alone; open it with "
                                 "--retriever dense or hybrid to build its dense half")
            self._dense = read_dense(path)
        vecs = self.embedder.encode(texts)
        with _FAISS_THREADS:  # the OpenMP thread count is process-wide
            before = faiss.omp_get_max_threads()
            # a few queries: one thread (a busy second core made single searches ~30x slower)
            faiss.omp_set_num_threads(1 if len(texts) < SMALL_BATCH else before)
            try:
                scores, idx = self._dense.search(vecs, min(depth, len(self.passages)))
            finally:
                faiss.omp_set_num_threads(before)
        return [[(int(i), float(s)) for i, s in zip(row_i, row_s) if i >= 0] for row_i, row_s in zip(idx, scores)]

    def _bm25_ranks(self, texts: list[str], depth: int) -> list[list[tuple[int, float]]]:
        tokens = tokenize(texts, self.language)
        out: list[list[tuple[int, float]]] = [[] for _ in texts]
        asked = [j for j, t in enumerate(tokens) if t]  # a query of stop words only matches nothing
        if asked:
            # n_threads=0 scores in this thread; 1 starts a one-worker thread pool on every call
            # (~2 ms, ten times the scoring of a few queries, on every search of `deepr run`)
            idx, scores = self._bm25.retrieve([tokens[j] for j in asked], k=min(depth, len(self.passages)),
                                              show_progress=False, n_threads=0, backend_selection="numpy")
            for j, row_i, row_s in zip(asked, idx, scores):
                out[j] = [(int(i), float(s)) for i, s in zip(row_i, row_s) if s > 0]
        return out

    def _hit(self, pos: int, score: float, rank: int) -> Hit:
        p = self.passages[pos]
        # fields of a validated Passage: re-validating cost ~0.4 ms a hit, ~1,600 hits a tree
        return Hit.model_construct(id=p.id, doc_id=p.doc_id, title=p.title, text=p.text, url=p.url,
                                   score=score, rank=rank)

    def get_passage(self, pid: str) -> Passage:
        if pid not in self._pos:
            raise UnknownIdError(f"no passage {pid!r} in corpus {self.corpus_name!r}")
        return self.passages[self._pos[pid]]

    def get_document(self, doc_id: str) -> Document:
        if doc_id not in self._docs:
            raise UnknownIdError(f"no document {doc_id!r} in corpus {self.corpus_name!r}")
        return self._docs[doc_id]

    def describe(self) -> dict[str, Any]:
        return {"corpus": self.corpus_name, "mode": self.mode, "embedder": self.embedder.name,
                "language": self.language,
                "documents": len(self.documents), "passages": len(self.passages),
                "documents_without_text": len(self.documents) - len({p.doc_id for p in self.passages}),
                "index": str(self.path) if self.path else None, "built_now": self.built,
                # None: opened for BM25 alone, its dense half (if any) not read
                "dense_index": describe_dense(self._dense) if self._dense is not None else None,
                "build_seconds": round(self.build_seconds, 3)}
