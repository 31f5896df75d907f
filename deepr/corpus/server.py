"""A retrieval server: one opened corpus over HTTP, for every process of a training cluster.

Input: any retriever deepr opens (a local index, a Milvus collection); output: a Starlette
app (served by uvicorn from ``deepr serve-index``) with three APIs over the same searches:

- deepr's own (``/v1/...``): ``POST /v1/search {"queries", "k", "mode"}`` -> hits with their
  passage ids, ``GET /v1/document/{id}``, ``GET /v1/passage/{id}``, ``POST /v1/embed``
  (the retriever's embedder, for on-topic checks), ``POST /v1/seeds`` (build-trees' seed
  topics), ``GET /v1/stats``. ``deepr ... --corpus http://HOST:PORT`` speaks it
  (deepr/corpus/remote.py).
- Search-R1 / verl / ASearcher / SkyRL: ``POST /retrieve {"queries" (or "query"), "topk",
  "return_scores"}`` -> ``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}``,
  ``contents`` being ``"<title>"\\n<text>`` as in those projects' corpora.
- FlashRAG: ``POST /search {"query", "top_n", "return_score"}`` and ``POST /batch_search``
  (``query`` a list); ``GET /health``.

Searches of concurrent requests are batched: while one ``search_many`` runs (in a worker
thread), new requests queue, and the next call takes all of them at once, so 32 clients
asking one query each cost one embedding call of 32 queries. Requests with different
``k`` or mode go in separate calls, so each gets exactly what it would get alone.

Example::

    deepr serve-index --corpus wiki --port 8000 &
    curl -s 127.0.0.1:8000/retrieve -d '{"queries": ["Mona Lisa painter"], "topk": 3, "return_scores": true}'
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("deepr.serve")
MAX_K = 1000
MAX_QUERIES = 4096
Seeder = Callable[[Sequence[Any], int, int, int], list[dict[str, Any]]]


class BadRequest(ValueError):
    """A request the server answers with 400 and this one-line reason."""


class Batcher:
    """Queue searches and run them as few ``search_many`` calls as the load allows."""

    def __init__(self, retriever: Any, max_batch: int = 256):
        self.retriever, self.max_batch = retriever, max_batch
        self._pending: list[tuple[list[str], int, str | None, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.calls = 0  # search_many calls made
        self.queries = 0  # queries searched

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def search(self, queries: list[str], k: int, mode: str | None) -> list[list[Any]]:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((queries, k, mode, fut))
        assert self._wake is not None, "Batcher.start() was not called"
        self._wake.set()
        return await fut

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._one_batch()

    async def _one_batch(self) -> None:
        """All queued requests of the first request's (k, mode), up to max_batch queries."""
        k, mode = self._pending[0][1], self._pending[0][2]
        group, rest, size = [], [], 0
        for item in self._pending:
            if item[1] == k and item[2] == mode and (size == 0 or size + len(item[0]) <= self.max_batch):
                group.append(item)
                size += len(item[0])
            else:
                rest.append(item)
        self._pending = rest
        texts = [q for item in group for q in item[0]]
        try:
            found = await asyncio.to_thread(self.retriever.search_many, texts, k, mode)
        except Exception as e:  # one bad batch answers its own requests, the server goes on
            for *_, fut in group:
                if not fut.done():
                    fut.set_exception(e)
            return
        self.calls += 1
        self.queries += len(texts)
        at = 0
        for queries, *_, fut in group:
            if not fut.done():
                fut.set_result(found[at:at + len(queries)])
            at += len(queries)


class Stats:
    """Request counts and latencies, summarised in the log when the server stops."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.errors = 0
        self.latencies: list[float] = []

    def add(self, route: str, seconds: float, ok: bool) -> None:
        self.counts[route] += 1
        self.errors += 0 if ok else 1
        self.latencies.append(seconds)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(p: float) -> float | None:
            return round(1000 * lat[min(len(lat) - 1, int(p * len(lat)))], 2) if lat else None

        return {"requests": len(lat), "errors": self.errors, "by_route": dict(self.counts),
                "latency_ms": {"p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99),
                               "max": round(1000 * lat[-1], 2) if lat else None}}


# --- request parsing -------------------------------------------------------------------------


async def _body(request: Any) -> dict[str, Any]:
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadRequest("body must be a JSON object")
    return data


def _queries(data: dict[str, Any], *names: str) -> list[str]:
    """The request's queries from the first field present: a string or a list of strings."""
    name = next((n for n in names if n in data), None)
    if name is None:
        raise BadRequest(f"missing field {names[0]!r}" + (f" (or {names[1]!r})" if len(names) > 1 else ""))
    value = data[name]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(q, str) for q in value):
        raise BadRequest(f"field {name!r} must be a string or a list of strings")
    if not value:
        raise BadRequest(f"field {name!r} is empty")
    if len(value) > MAX_QUERIES:
        raise BadRequest(f"field {name!r}: {len(value)} queries, at most {MAX_QUERIES} per request")
    return value


def _int(data: dict[str, Any], name: str, default: int, low: int = 1, high: int = MAX_K) -> int:
    value = data.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"field {name!r} must be an integer")
    if not low <= value <= high:
        raise BadRequest(f"field {name!r}={value}: must be between {low} and {high}")
    return value


def _flag(data: dict[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(f"field {name!r} must be true or false")
    return value


def _contents(hit: Any) -> str:
    """Search-R1's and FlashRAG's corpus rows: ``"<title>"\\n<text>`` (their tools split on the newline)."""
    return f'"{hit.title}"\n{hit.text}' if hit.title else hit.text


def _doc(hit: Any) -> dict[str, Any]:
    return {"id": hit.id, "contents": _contents(hit), "title": hit.title, "doc_id": hit.doc_id}


# --- the app ---------------------------------------------------------------------------------


def make_app(retriever: Any, *, default_k: int = 3, seeder: Seeder | None = None,
             max_batch: int = 256) -> Any:
    """The Starlette app serving ``retriever``; ``seeder(documents, n, seed, min_words)``
    answers ``/v1/seeds`` (build-trees' topic sampling, given by the caller: it lives above
    the corpus layer)."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from deepr.corpus.index import UnknownIdError

    batcher, stats = Batcher(retriever, max_batch=max_batch), Stats()

    def route(path: str, fn: Callable[..., Any], methods: list[str]) -> Route:
        async def endpoint(request: Any) -> Any:
            t0 = time.perf_counter()
            status = 200
            try:
                result = await fn(request)
            except BadRequest as e:
                status, result = 400, {"error": str(e)}
            except UnknownIdError as e:
                status, result = 404, {"error": str(e)}
            except ValueError as e:  # the retriever refused the request (e.g. a mode it has no index for)
                status, result = 400, {"error": str(e).splitlines()[0] if str(e) else type(e).__name__}
            stats.add(path, time.perf_counter() - t0, status == 200)
            return JSONResponse(result, status_code=status)
        return Route(path, endpoint, methods=methods)

    async def health(request: Any) -> Any:
        return {"status": "healthy", "corpus": retriever.corpus_name,
                "retrievers": {"total": 1, "available": 1}}

    async def v1_search(request: Any) -> Any:
        data = await _body(request)
        mode = data.get("mode")
        if mode is not None and mode not in ("dense", "bm25", "hybrid"):
            raise BadRequest(f"field 'mode'={mode!r}: expected dense, bm25 or hybrid")
        found = await batcher.search(_queries(data, "queries", "query"), _int(data, "k", 5), mode)
        return {"hits": [[h.model_dump() for h in hits] for hits in found]}

    async def retrieve(request: Any) -> Any:
        data = await _body(request)
        queries = _queries(data, "queries", "query")
        found = await batcher.search(queries, _int(data, "topk", default_k), None)
        if _flag(data, "return_scores"):
            return {"result": [[{"document": _doc(h), "score": h.score} for h in hits] for hits in found]}
        return {"result": [[_doc(h) for h in hits] for hits in found]}

    async def flash_search(request: Any) -> Any:
        data = await _body(request)
        if not isinstance(data.get("query"), str) or not data["query"].strip():
            raise BadRequest("field 'query' must be a non-empty string (use /batch_search for a list)")
        hits = (await batcher.search([data["query"]], _int(data, "top_n", 10), None))[0]
        docs = [{"id": h.id, "contents": _contents(h)} for h in hits]
        return [docs, [h.score for h in hits]] if _flag(data, "return_score") else docs

    async def flash_batch(request: Any) -> Any:
        data = await _body(request)
        found = await batcher.search(_queries(data, "query"), _int(data, "top_n", 10), None)
        docs = [[{"id": h.id, "contents": _contents(h)} for h in hits] for hits in found]
        return [docs, [[h.score for h in hits] for hits in found]] if _flag(data, "return_score") else docs

    async def document(request: Any) -> Any:
        doc = await asyncio.to_thread(retriever.get_document, request.path_params["doc_id"])
        return doc.model_dump()

    async def passage(request: Any) -> Any:
        p = await asyncio.to_thread(retriever.get_passage, request.path_params["pid"])
        return p.model_dump()

    async def embed(request: Any) -> Any:
        data = await _body(request)
        texts = _queries(data, "texts")
        vecs = await asyncio.to_thread(retriever.embedder.encode, texts)
        return {"model": retriever.embedder.name, "vectors": [[float(x) for x in v] for v in vecs]}

    async def seeds(request: Any) -> Any:
        data = await _body(request)
        if seeder is None:
            raise BadRequest("this server samples no seed topics")
        n, seed = _int(data, "n", 1, high=10_000_000), _int(data, "seed", 0, low=-(2 ** 62), high=2 ** 62)
        min_words = _int(data, "min_words", 30, low=0, high=1_000_000)
        topics = await asyncio.to_thread(seeder, retriever.documents, n, seed, min_words)
        return {"topics": topics}

    async def v1_stats(request: Any) -> Any:
        info = await asyncio.to_thread(retriever.describe)
        return {**info, "fusion": retriever.fusion.model_dump() if getattr(retriever, "fusion", None) else None,
                "embedder_dim": retriever.embedder.dim if getattr(retriever, "embedder", None) else None,
                "served": {**stats.summary(), "search_calls": batcher.calls, "queries": batcher.queries}}

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        batcher.start()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            await batcher.stop()
            s = stats.summary()
            log.warning("served %d requests (%d errors) in %.1f s: %d queries in %d search calls; "
                        "latency ms p50 %s p90 %s p99 %s max %s; by route %s", s["requests"], s["errors"],
                        time.perf_counter() - t0, batcher.queries, batcher.calls, *s["latency_ms"].values(),
                        json.dumps(s["by_route"], sort_keys=True))

    routes = [route("/health", health, ["GET"]), route("/v1/stats", v1_stats, ["GET"]),
              route("/v1/search", v1_search, ["POST"]), route("/v1/embed", embed, ["POST"]),
              route("/v1/seeds", seeds, ["POST"]), route("/v1/document/{doc_id:path}", document, ["GET"]),
              route("/v1/passage/{pid:path}", passage, ["GET"]), route("/retrieve", retrieve, ["POST"]),
              route("/search", flash_search, ["POST"]), route("/batch_search", flash_batch, ["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.stats, app.state.batcher = stats, batcher
    return app


def serve(retriever: Any, host: str = "127.0.0.1", port: int = 8000, **kw: Any) -> None:
    """Run the app with uvicorn until interrupted; the request summary is logged on exit."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    uvicorn.run(make_app(retriever, **kw), host=host, port=port, log_level="warning", access_log=False)
