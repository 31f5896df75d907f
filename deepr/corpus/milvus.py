"""Milvus as the corpus engine past one machine: load a corpus into a collection, search it.

Specs: ``milvus://HOST:PORT/NAME`` (Milvus standalone or distributed; a token, if the server
needs one, is read from ``$MILVUS_TOKEN`` only) and ``milvus:PATH.db`` (Milvus Lite, the
embedded engine with the same API; collection ``deepr``, or ``milvus:PATH.db#NAME``).

Loading (``deepr index --corpus X --to SPEC [--shard K/N]``) writes two collections: ``NAME``,
one row per passage (its id, document id, title, text, url, corpus position, deepr's dense
vector, and a BM25 function field that Milvus fills from the text deepr's own BM25 indexes),
and ``NAME_docs``, one row per document. Rows are upserted in blocks by passage id, and a block
whose rows are already there with the same text is skipped, so a re-run is a no-op, an
interrupted load resumes, and N ``--shard K/N`` workers load disjoint parts in parallel.
Vectors come from deepr's embedding cache, so a corpus indexed locally is not embedded again.

Searching (``--corpus SPEC``, :mod:`deepr.corpus.milvus_search`): dense and BM25 rankings both
come from Milvus, each query batch in one call per ranking, and ``hybrid`` fuses them with
deepr's weighted reciprocal-rank fusion (:func:`deepr.corpus.index.rrf_fuse`, the same k, weights
and depth as the local index) rather than Milvus's ``RRFRanker``, which has no per-ranking
weights. BM25 tokens differ from deepr's own (Milvus's standard analyzer with deepr's English
stop words, k1 1.5, b 0.75), so rankings are close to, not identical with, the local index's.

The BM25 analyzer follows the corpus's language (``--language``, detected by default;
:func:`analyzer`): standard for languages written with spaces, Milvus's jieba for Chinese. Milvus
Lite knows no analyzer for Japanese, Thai and the other scripts without spaces (it has standard
and jieba only; a server's lindera and icu it refuses), so for those deepr cuts the text into its
own BM25 bigrams itself. The collection records its language, and a search that asks for
another is refused.

Example::

    deepr index --corpus wiki --to milvus:wiki.db && deepr search "Mona Lisa" --corpus milvus:wiki.db
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from deepr.records import Document, Passage

FORMAT = 1
BLOCK = 512
MAX_TEXT = 65535
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,200}$")
PASSAGE_FIELDS = ["pk", "doc_id", "title", "text", "url", "pos"]
_OPENED: set[str] = set()  # Milvus Lite files this process has opened (pymilvus reuses its server for them)


def parse_spec(spec: str) -> tuple[str, str]:
    """(uri for MilvusClient, collection name) of a ``milvus:`` spec."""
    import os

    raw = spec.strip()
    if raw.lower().startswith("milvus://"):
        rest = raw[len("milvus://"):]
        host, _, name = rest.partition("/")
        if not host or not name:
            raise ValueError(f"--corpus {spec}: expected milvus://HOST:PORT/COLLECTION")
        uri = f"http://{host}"
    elif raw.lower().startswith("milvus:"):
        path, _, name = raw[len("milvus:"):].partition("#")
        if not path.endswith(".db"):
            raise ValueError(f"--corpus {spec}: Milvus Lite needs a file ending in .db, e.g. milvus:corpus.db")
        uri, name = os.path.expanduser(path), name or "deepr"
    else:
        raise ValueError(f"--corpus {spec}: expected milvus://HOST:PORT/NAME or milvus:PATH.db")
    if not _NAME.match(name):
        raise ValueError(f"--corpus {spec}: collection name {name!r} must be letters, digits and underscores, "
                         "not starting with a digit")
    return uri, name


def connect(spec: str) -> tuple[Any, str]:
    import os

    from pymilvus import MilvusClient

    logging.getLogger("pymilvus").setLevel(logging.CRITICAL)  # it logs every refused RPC as an ERROR
    uri, name = parse_spec(spec)
    if uri.endswith(".db"):  # Milvus Lite's in-process gRPC server logs a traceback for each call it lacks
        logging.getLogger("grpc._server").setLevel(logging.CRITICAL)  # (query_iterator's AllocTimestamp)
        logging.getLogger("milvus_lite").setLevel(logging.CRITICAL)  # failures are reported below, in one line
        if os.path.abspath(uri) not in _OPENED:  # this process's own lock is no conflict
            _check_unlocked(spec, uri)
    try:
        client = MilvusClient(uri=uri, token=os.environ.get("MILVUS_TOKEN", ""))
    except Exception as e:  # pymilvus raises its own types for every connection failure
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"--corpus {spec}: cannot connect to Milvus at {uri} ({type(e).__name__}: {first})") from None
    if uri.endswith(".db"):
        _OPENED.add(os.path.abspath(uri))
    return client, name


@contextlib.contextmanager
def unavailable(spec: str) -> Iterator[None]:
    """Milvus's refusals and lost connections as one-line CorpusUnavailable errors."""
    from pymilvus.exceptions import MilvusException

    from deepr.corpus.remote import CorpusUnavailable

    try:
        yield
    except MilvusException as e:
        raise CorpusUnavailable(f"Milvus {spec}: {getattr(e, 'message', None) or e}") from None


def _check_unlocked(spec: str, uri: str) -> None:
    """Milvus Lite lets one process open a file (it holds an flock on ``<file>/LOCK``); say so in one line."""
    import fcntl
    import os

    from milvus_lite.db import LOCK_FILENAME

    lock = os.path.join(uri, LOCK_FILENAME)
    if not os.path.isfile(lock):
        return
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ValueError(f"--corpus {spec}: {uri} is open in another process, and Milvus Lite lets one process "
                             "open a file; serve it with `deepr serve-index` and give the others its URL") from None
        fcntl.flock(f, fcntl.LOCK_UN)


# --- loading ---------------------------------------------------------------------------------


def dense_index(n: int, kind: str = "auto") -> dict[str, Any]:
    """Milvus's dense index by deepr's rule (deepr/corpus/dense.py): exact below 250,000 passages,
    IVF_FLAT with about 2·sqrt(n) lists above (Milvus allows at most 65,536), 32 probed a query."""
    from deepr.corpus.dense import NPROBE, ivf_lists, resolve_kind

    if resolve_kind(n, kind) == "flat":
        return {"index_type": "FLAT", "params": {}, "search": {}}
    return {"index_type": "IVF_FLAT", "params": {"nlist": min(65536, ivf_lists(n))}, "search": {"nprobe": NPROBE}}


# Punctuation jieba emits as tokens of its own; Milvus Lite ignores the removepunct filter, so it goes
# with the stop words, which both engines apply.
_PUNCT = "，。！？；：、…—·～（）《》〈〉「」『』【】“”‘’,.!?;:()[]{}\"'-/"


def analyzer_name(language: str) -> str:
    from deepr.text.lang import UNSPACED

    return "jieba" if language == "zh" else "deepr" if language in UNSPACED else "standard"


def analyzer(language: str) -> tuple[str, dict[str, Any]]:
    """(name, Milvus ``analyzer_params``) of the BM25 field of a corpus in ``language``.

    ``standard`` with deepr's English stop words for every language written with spaces (the
    analyzer deepr always used); ``jieba`` (search mode) for Chinese, without deepr's Chinese and
    English stop words and punctuation, as the local index; ``deepr`` for the other scripts
    without spaces: Milvus Lite has no analyzer for them, so :func:`bm25_body` hands Milvus
    deepr's own bigrams as ASCII words that the standard analyzer keeps whole."""
    from deepr.corpus.index import _bm25s
    from deepr.text.lang import ZH_STOP

    english = _bm25s().stopwords.STOPWORDS_EN
    kind = analyzer_name(language)
    if kind == "jieba":
        stop = sorted(set(english) | ZH_STOP | set(_PUNCT))
        return "jieba", {"tokenizer": {"type": "jieba", "mode": "search", "hmm": True},
                         "filter": ["lowercase", {"type": "stop", "stop_words": stop}]}
    if kind == "deepr":
        return "deepr", {"tokenizer": "standard"}
    return "standard", {"tokenizer": "standard",
                        "filter": ["lowercase", {"type": "stop", "stop_words": sorted(english)}]}


def bm25_body(text: str, language: str) -> str:
    """What Milvus's analyzer reads of a passage or query: the text itself, or under the ``deepr``
    analyzer deepr's BM25 tokens, each spelled ``x<hex>x<hex>…`` by code point: one word to Lite's
    ``\\w+`` and to a server's Unicode word breaks, which would cut a bigram of Han into two."""
    from deepr.corpus.tokens import tokenize

    if analyzer_name(language) != "deepr":  # per passage: the name only, not the stop-word lists
        return text
    return " ".join("".join(f"x{ord(c):x}" for c in w) for w in tokenize([text], language)[0])


def collection_language(meta: dict[str, Any]) -> str:
    return meta.get("language", "en")  # collections loaded before languages were recorded are English


def _schemas(client: Any, dim: int, dense: dict[str, Any], language: str = "en") -> dict[str, tuple[Any, Any]]:
    """(schema, index params) of the passages, documents and meta collections."""
    from pymilvus import DataType, Function, FunctionType

    p = client.create_schema(auto_id=False)
    p.add_field("pk", DataType.VARCHAR, is_primary=True, max_length=1024)
    for name in ("doc_id", "title", "url", "hash"):
        p.add_field(name, DataType.VARCHAR, max_length=MAX_TEXT if name != "hash" else 64)
    p.add_field("text", DataType.VARCHAR, max_length=MAX_TEXT)
    p.add_field("pos", DataType.INT64)
    p.add_field("body", DataType.VARCHAR, max_length=MAX_TEXT, enable_analyzer=True,
                analyzer_params=analyzer(language)[1])
    p.add_field("dense", DataType.FLOAT_VECTOR, dim=dim)
    p.add_field("sparse", DataType.SPARSE_FLOAT_VECTOR)
    p.add_function(Function(name="bm25", function_type=FunctionType.BM25, input_field_names=["body"],
                            output_field_names=["sparse"]))
    pi = client.prepare_index_params()
    pi.add_index("dense", index_type=dense["index_type"], metric_type="IP", params=dense["params"])
    pi.add_index("sparse", index_type="SPARSE_INVERTED_INDEX", metric_type="BM25",
                 params={"bm25_k1": 1.5, "bm25_b": 0.75})
    out = {"": (p, pi)}
    for suffix, payload in (("_docs", "doc"), ("_meta", "json")):
        d = client.create_schema(auto_id=False)
        d.add_field("id", DataType.VARCHAR, is_primary=True, max_length=1024)
        d.add_field(payload, DataType.VARCHAR, max_length=MAX_TEXT)
        d.add_field("hash", DataType.VARCHAR, max_length=64)
        d.add_field("v", DataType.FLOAT_VECTOR, dim=2)  # Milvus wants a vector field in every collection
        di = client.prepare_index_params()
        di.add_index("v", index_type="FLAT", metric_type="L2")
        out[suffix] = (d, di)
    return out


def collection_meta(client: Any, name: str) -> dict[str, Any] | None:
    """What ``deepr index --to`` recorded about collection ``name`` (None: no such collection)."""
    if not client.has_collection(name):
        return None
    meta = None
    if client.has_collection(f"{name}_meta"):
        client.load_collection(f"{name}_meta")
        rows = rows_by_ids(client, f"{name}_meta", "id", ["meta"], ["json"])
        meta = json.loads(rows[0]["json"]) if rows else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"Milvus collection {name!r} was not written by `deepr index --to` (format {FORMAT}); "
                         "pick another name")
    return meta


def _ensure(client: Any, name: str, meta: dict[str, Any], dim: int) -> None:
    have = collection_meta(client, name)
    if have is None:
        for suffix, (schema, index) in _schemas(client, dim, meta["dense_index"], collection_language(meta)).items():
            if not client.has_collection(name + suffix):
                client.create_collection(name + suffix, schema=schema, index_params=index)
        # the meta row last: a collection without it was never completely created
        client.upsert(f"{name}_meta", [{"id": "meta", "json": json.dumps(meta, sort_keys=True), "hash": "",
                                        "v": [0.0, 0.0]}])
        client.flush(f"{name}_meta")
        return
    if collection_language(have) != collection_language(meta):
        raise ValueError(f"Milvus collection {name!r} was loaded as {collection_language(have)}, this load is "
                         f"{collection_language(meta)}; pass --language {collection_language(have)} or load into a new "
                         "collection name")
    for key in ("embedder", "dim", "chunking"):
        if have.get(key) != meta.get(key):
            raise ValueError(f"Milvus collection {name!r} holds {key} {have.get(key)!r}, this load {meta.get(key)!r}; "
                             "load into a new collection name (or drop this one)")
    client.load_collection(name)
    client.load_collection(f"{name}_docs")


def _hash(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _present(client: Any, collection: str, key: str, ids: Sequence[str]) -> dict[str, str]:
    """id -> stored hash of the rows already in ``collection``."""
    return {r[key]: r["hash"] for r in rows_by_ids(client, collection, key, ids, [key, "hash"])}


def rows_by_ids(client: Any, collection: str, key: str, ids: Sequence[str], fields: list[str]) -> list[dict[str, Any]]:
    """Rows by primary key. Ids hold quotes (``A_Doll's_House``), which ``client.get`` pastes into
    its filter unescaped: they go in as JSON strings (Milvus's escapes, minus ``\\u``)."""
    return client.query(collection, filter=f"{key} in {json.dumps(list(ids), ensure_ascii=False)}",
                        output_fields=fields)


def load_to_milvus(corpus: str, spec: str, *, embedder: Any, chunking: Any = None, cache_dir: Any = None,
                   limit: int | None = None, shard: tuple[int, int] | None = None,
                   progress: Callable[[int, int], None] | None = None, dense: str = "auto",
                   language: str | None = "auto") -> dict[str, Any]:
    """Upsert this shard's passages and documents; returns counts of what was written and skipped.
    ``dense`` picks the dense index of a new collection (:func:`dense_index`) from the whole corpus's size;
    ``language`` its BM25 analyzer (:func:`analyzer`), ``auto`` detected from the whole corpus so every shard agrees."""
    from deepr.corpus.chunking import ChunkConfig
    from deepr.corpus.index import load_corpus
    from deepr.text.lang import resolve

    chunking = chunking or ChunkConfig()
    cname, docs, passages = load_corpus(corpus, chunking, limit)
    lang = resolve(language, (p.text for p in passages))
    _check_sizes(docs, passages, lang)
    with unavailable(spec):
        return _load(spec, cname, docs, passages, embedder=embedder, chunking=chunking, cache_dir=cache_dir,
                     shard=shard, progress=progress, dense=dense, language=lang)


def _check_sizes(docs: Sequence[Document], passages: Sequence[Passage], language: str = "en") -> None:
    """Milvus text fields hold at most 65,535 bytes: refuse before writing anything, never truncate."""
    from deepr.corpus.index import embed_text

    for p in passages:
        fields = [("title", p.title), ("text", embed_text(p)), ("url", p.url or "")]
        if analyzer_name(language) == "deepr":  # its spelled-out bigrams are longer than the text
            fields.append(("BM25 words", bm25_body(embed_text(p), language)))
        for field, value in fields:
            if len(value.encode("utf-8")) > MAX_TEXT:
                raise ValueError(f"passage {p.id!r}: its {field} is longer than Milvus's {MAX_TEXT}-byte text field; "
                                 "use a smaller --max-words")
    for d in docs:
        if len(d.model_dump_json().encode("utf-8")) > MAX_TEXT:
            raise ValueError(f"document {d.id!r} is longer than Milvus's {MAX_TEXT}-byte text field; "
                             "split it into several documents")


def _load(spec: str, cname: str, docs: Sequence[Document], passages: Sequence[Passage], *, embedder: Any,
          chunking: Any, cache_dir: Any, shard: tuple[int, int] | None, progress: Any, dense: str,
          language: str = "en") -> dict[str, Any]:
    from deepr.corpus.embcache import EmbeddingCache
    from deepr.corpus.index import cache_root, embed_passages, embed_text
    from deepr.io import in_shard

    client, name = connect(spec)
    meta = {"format": FORMAT, "corpus": cname, "embedder": embedder.name, "dim": embedder.dim,
            "chunking": chunking.model_dump(), "dense_index": dense_index(len(passages), dense)}
    if language != "en":  # English collections' meta as before, so collections loaded earlier still match
        meta.update(language=language, analyzer=analyzer_name(language))
    _ensure(client, name, meta, embedder.dim)
    mine = [(i, p) for i, p in enumerate(passages) if in_shard(p.id, shard)]
    counts = {"passages": len(mine), "passages_written": 0, "documents": 0, "documents_written": 0,
              "stale_deleted": 0, "language": language, "analyzer": analyzer_name(language)}
    cache = EmbeddingCache(cache_root(cache_dir), embedder.name)
    try:
        for s in range(0, len(mine), BLOCK):
            block = mine[s:s + BLOCK]
            bodies = {p.id: embed_text(p) for _, p in block}
            have = _present(client, name, "pk", list(bodies))
            todo = [(i, p) for i, p in block if have.get(p.id) != _hash(bodies[p.id])]
            if todo:
                vecs = embed_passages([p for _, p in todo], embedder, cache)
                client.upsert(name, [{"pk": p.id, "doc_id": p.doc_id, "title": p.title, "text": p.text,
                                      "url": p.url or "", "pos": i, "hash": _hash(bodies[p.id]),
                                      "body": bm25_body(bodies[p.id], language), "dense": v.tolist()}
                                     for (i, p), v in zip(todo, vecs)])
                counts["passages_written"] += len(todo)
            if progress:
                progress(min(s + BLOCK, len(mine)), len(mine))
    finally:
        cache.close()
    counts.update(_load_documents(client, name, [d for d in docs if in_shard(d.id, shard)]))
    counts["stale_deleted"] = _delete_stale(client, name, {p.id for p in passages}, shard)
    client.flush(name)
    client.flush(f"{name}_docs")
    return counts


def _load_documents(client: Any, name: str, docs: Sequence[Document]) -> dict[str, int]:
    written = 0
    for s in range(0, len(docs), BLOCK):
        block = {d.id: d.model_dump_json() for d in docs[s:s + BLOCK]}
        have = _present(client, f"{name}_docs", "id", list(block))
        rows = [{"id": i, "doc": j, "hash": _hash(j), "v": [0.0, 0.0]} for i, j in block.items()
                if have.get(i) != _hash(j)]
        if rows:
            client.upsert(f"{name}_docs", rows)
            written += len(rows)
    return {"documents": len(docs), "documents_written": written}


def _delete_stale(client: Any, name: str, keep: set[str], shard: tuple[int, int] | None) -> int:
    """Rows of passages no longer in the corpus (this shard's part only)."""
    from deepr.io import in_shard

    it = client.query_iterator(name, batch_size=4096, filter="", output_fields=["pk"])
    stale: list[str] = []
    while True:
        rows = it.next()
        if not rows:
            break
        stale += [r["pk"] for r in rows if r["pk"] not in keep and in_shard(r["pk"], shard)]
    it.close()
    for s in range(0, len(stale), 4096):
        client.delete(name, ids=stale[s:s + 4096])
    return len(stale)
