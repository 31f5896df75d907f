"""One source interface over the local corpus and the web.

:class:`SourceRetriever` looks like the corpus :class:`~deepr.corpus.index.Retriever` to
agents (``search``/``search_many``/``get_document``/``embedder``), so ``ResearchTools``,
the dag/warp/decor/tools loops, tree building and GRPO rollouts use the web unchanged.
``search`` asks every configured provider, merges their rankings round-robin (duplicates
by URL dropped) and returns hits carrying URL, title, snippet, provider, rank and
retrieval time. ``get_document(url)`` reads a page that an earlier search returned (and
nothing else), splits it with the corpus chunker and keeps the passages that best match
the searches that led to it (BM25). Every search and fetch goes through the disk cache;
:attr:`stats` counts searches, fetches, bytes, cache hits, failures and estimated cost.

Example::

    deepr search "Mona Lisa" --search searxng:http://127.0.0.1:8888
"""

from __future__ import annotations

import asyncio
import html
import re
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

from deepr.activity import note
from deepr.records import Document, Hit
from deepr.search.cache import CacheMiss, DiskCache
from deepr.search.config import SearchConfig, parse_spec
from deepr.search.guard import parse_allow
from deepr.search.net import USER_AGENT, FetchError, NetConfig, request
from deepr.search.passages import best_passages, page_chunks, rank_chunks, ranked_chunks  # noqa: F401
from deepr.search.providers import COST_PER_QUERY, JINA_READ_COST, ProviderError, build_request, decode, \
    endpoint, parse
from deepr.search.ratelimit import Limiter
from deepr.search.reader import now_iso, read_page

FAILURE_TTL = 3600.0  # a failed fetch is retried after an hour (replay reuses the failure)
_CTRL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class WebHit(Hit):
    """A search hit with its origin: provider, rank within that provider, retrieval time."""

    provider: str = ""
    retrieved_at: str = ""
    snippet: str = ""  # the provider's own snippet when ``text`` is a passage of the read page


def untrusted(text: str) -> str:
    """Page or snippet text made inert: no control characters, and square brackets turned into
    parentheses so nothing a page says can look like a citation id such as ``[S99]``."""
    text = _CTRL.sub(" ", text or "").replace("[", "(").replace("]", ")")
    return re.sub(r"<{3,}|>{3,}", "", text)  # the evidence fence is <<< ... >>>


def strip_fragment(url: str) -> str:
    return url.split("#", 1)[0]


def safe_url(url: str) -> str:
    """A provider's URL with quotes, angle brackets and spaces percent-encoded, so it cannot
    break out of a markdown ``<url>`` or an HTML attribute when rendered."""
    from urllib.parse import quote

    return quote(strip_fragment(url.strip()), safe=":/?@!$&()*+,;=%~-._")


class _Loop:
    """A private event loop in a daemon thread, so sync callers inside other loops can wait."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="deepr-search")
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


class SourceRetriever:
    """Corpus and/or web search behind the Retriever interface the agents use."""

    def __init__(self, config: SearchConfig, corpus: Any = None, embedder: Any = None, *,
                 reader_only: bool = False):
        self.config = config
        self.sources = [] if reader_only else parse_spec(config.spec)
        if any(k == "corpus" for k, _ in self.sources) and corpus is None:
            raise ValueError("--search includes 'corpus' but no corpus retriever was opened")
        self.corpus = corpus
        self._embedder = embedder
        self.corpus_name = "+".join(k if not a else f"{k}:{a}" for k, a in self.sources)
        self.mode = getattr(corpus, "mode", "web")
        root = Path(config.cache_dir) if config.cache_dir else _default_cache_dir()
        self.cache = DiskCache(root / "search", config.cache, ttl=config.ttl_hours * 3600)
        self.net = NetConfig(timeout=config.timeout, max_bytes=config.max_bytes,
                             allow=parse_allow(config.allow_hosts))
        self.limiter = Limiter(rate=config.rate, per_host=config.per_host, total=config.concurrency)
        self.stats: dict[str, Any] = {"searches": 0, "results": 0, "fetches": 0, "bytes": 0, "cache_hits": 0,
                                      "network_requests": 0, "failures": [], "cost_usd": 0.0}
        self.pages: dict[str, dict[str, Any]] = {}
        self._returned: dict[str, list[str]] = defaultdict(list)  # url -> queries that returned it
        self._lock = threading.Lock()
        self._loop: _Loop | None = None
        self._client: httpx.AsyncClient | None = None
        self._mcp: dict[str, Any] = {}

    # -- plumbing -----------------------------------------------------------------------

    @property
    def embedder(self) -> Any:
        if self.corpus is not None:
            return self.corpus.embedder
        if self._embedder is None:
            from deepr.corpus.embed import get_embedder

            self._embedder = get_embedder(None)
        return self._embedder

    def _run(self, coro: Any) -> Any:
        with self._lock:
            if self._loop is None:
                self._loop = _Loop()
        return self._loop.run(coro)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=False, timeout=self.config.timeout,
                                             headers={"User-Agent": USER_AGENT}, trust_env=False,
                                             limits=httpx.Limits(max_connections=self.config.concurrency * 2))
        return self._client

    def _fail(self, kind: str, what: str, reason: str) -> None:
        self.stats["failures"].append({"kind": kind, "what": what, "reason": reason})

    def close(self) -> None:
        if self._loop is None:
            return
        async def shut() -> None:
            for m in self._mcp.values():
                await m.close()
            if self._client is not None:
                await self._client.aclose()
        try:
            self._run(shut())
        finally:
            self._loop.loop.call_soon_threadsafe(self._loop.loop.stop)
            self._loop = None

    # -- searching ------------------------------------------------------------------------

    def search(self, query: str, k: int = 5, mode: Any = None) -> list[Hit]:
        return self.search_many([query], k)[0]

    def search_many(self, queries: list[str], k: int = 5, mode: Any = None) -> list[list[Hit]]:
        async def all_() -> list[list[Hit]]:
            return list(await asyncio.gather(*(self._search_one(q, k) for q in queries)))
        return self._run(all_())

    async def _search_one(self, query: str, k: int) -> list[Hit]:
        if not isinstance(query, str) or not query.strip():
            return []
        query = query.strip()
        note("search")
        per_source = await asyncio.gather(*(self._provider(kind, arg, query, k) for kind, arg in self.sources))
        merged, seen = [], set()
        for rank in range(max((len(h) for h in per_source), default=0)):
            for hits in per_source:
                if rank < len(hits) and hits[rank].doc_id not in seen:
                    seen.add(hits[rank].doc_id)
                    merged.append(hits[rank])
        if self.config.verify_pages:  # a result whose page cannot be read is never offered for citation
            pool = merged[: 2 * k]
            pages = await asyncio.gather(*(self._fetch(h.url) if h.url else _none() for h in pool))
            merged = [self._as_passage(h, p, query) for h, p in zip(pool, pages) if p is None or p["ok"]]
        out = [h.model_copy(update={"rank": i}) for i, h in enumerate(merged[:k], start=1)]
        self.stats["results"] += len(out)
        for h in out:
            if h.url and h.doc_id == h.url:
                self._returned[h.url].append(query)
        return out

    def _as_passage(self, hit: Hit, page: dict[str, Any] | None, query: str) -> Hit:
        """A verified web hit carries the page passage that best matches the query, with its own
        id ``<url>#<chunk>`` (like corpus passages); the provider's snippet is kept as ``snippet``."""
        if page is None or not hit.url or hit.doc_id != hit.url:
            return hit
        best = ranked_chunks(hit.url, page["title"], page["text"], query, 1)
        if not best:
            return hit
        k, text = best[0]
        return hit.model_copy(update={"id": f"{hit.url}#{k}", "text": untrusted(text), "snippet": hit.text})

    async def _provider(self, kind: str, arg: str, query: str, k: int) -> list[Hit]:
        label = kind if not arg else f"{kind}:{arg}"
        if kind == "corpus":
            now = now_iso()
            return [WebHit(**h.model_dump(), provider="corpus", retrieved_at=now)
                    for h in await asyncio.to_thread(self.corpus.search, query, k)]
        where = arg or (endpoint(kind) if kind != "mcp" else "")
        parts = ["search", label, query, {"k": k, "endpoint": where}]
        self.stats["searches"] += 1
        try:
            cached = self.cache.get(parts)
        except CacheMiss as e:
            self._fail("search", f"{label}: {query}", str(e))
            raise
        if cached is not None:
            self.stats["cache_hits"] += 1
            raw, at = cached["hits"], cached["retrieved_at"]
        else:
            try:
                raw = await self._live_search(kind, arg, query, k)
            except (ProviderError, FetchError) as e:
                reason = str(getattr(e, "reason", None) or e)
                self._fail("search", f"{label}: {query}", reason if reason.startswith(kind) else f"{kind}: {reason}")
                return []
            at = now_iso()
            if not raw:  # nothing usable: recorded, and not cached so a later run asks again
                self._fail("search", f"{label}: {query}", f"{kind}: no results")
                return []
            self.cache.put(parts, {"hits": raw, "retrieved_at": at})
        return [self._hit(kind, h, i, at) for i, h in enumerate(raw[:k], start=1)]

    def _hit(self, provider: str, h: dict[str, str], rank: int, at: str) -> WebHit:
        url = safe_url(h.get("url") or "")
        doc_id = url or f"mcp:{h.get('id')}"
        # providers pass on titles and snippets as the page had them in HTML ("Doesn&#x27;t"):
        # decoded once here; every renderer escapes once for its own format
        title, snippet = (html.unescape(str(h.get(f) or "")) for f in ("title", "snippet"))
        return WebHit(id=doc_id, doc_id=doc_id, title=untrusted(title)[:300],
                      text=untrusted(snippet), url=url or None, score=1.0 / rank, rank=rank,
                      provider=provider, retrieved_at=at)

    async def _live_search(self, kind: str, arg: str, query: str, k: int) -> list[dict[str, str]]:
        self.stats["network_requests"] += 1
        self.stats["cost_usd"] += COST_PER_QUERY.get(kind, 0.0)
        if kind == "mcp":
            from deepr.search.mcp_client import MCPSearch

            client = self._mcp.setdefault(arg, MCPSearch(arg, timeout=max(30.0, self.config.timeout)))
            return await client.search(query, k)
        req = build_request(kind, query, k, base=arg or None)
        resp = await request(self._http(), self.limiter, req.method, req.url, self.net, guarded=False,
                             params=req.params, json=req.json, headers=req.headers)
        self.stats["bytes"] += len(resp.body)
        if resp.status >= 400:
            raise ProviderError(f"HTTP {resp.status} from the search endpoint")
        return parse(kind, decode(kind, resp.body, resp.content_type))

    # -- reading --------------------------------------------------------------------------

    def returned(self, url: str) -> bool:
        return strip_fragment(url) in self._returned

    def get_document(self, doc_id: str) -> Document:
        """A corpus document, or the best passages of a page an earlier search returned."""
        if doc_id.startswith("mcp:"):
            raise ValueError(f"{doc_id}: this MCP result has no page to read; cite its snippet")
        if not doc_id.startswith(("http://", "https://")):
            if self.corpus is None:
                raise KeyError(f"no document {doc_id!r}: this run searches only the web")
            return self.corpus.get_document(doc_id)
        return self.read(doc_id)

    def read(self, url: str, need: str | None = None) -> Document:
        """Read one returned page; a failed fetch raises ValueError with the recorded reason."""
        url, page = self._returned_page(url)
        hits = self._passages(url, page, need)
        text = "\n\n".join(h.text for h in sorted(hits, key=lambda h: int(h.id.rsplit("#", 1)[1])))
        return Document(id=url, title=hits[0].title if hits else untrusted(page["title"])[:300], text=text,
                        url=url, retrieved_at=page["retrieved_at"], final_url=page["final_url"])

    def read_passages(self, url: str, need: str | None = None, n: int | None = None) -> list[WebHit]:
        """The ``n`` (``--passages``) passages of a returned page most relevant to ``need`` (default:
        the searches that returned it), best first, each with its own id ``<url>#<chunk>``; ranked
        as the corpus retriever ranks (its mode and fusion; hybrid for the web alone). A page no
        search returned raises PermissionError, a failed fetch ValueError with the reason."""
        return self._passages(*self._returned_page(url), need, n)

    def _returned_page(self, url: str) -> tuple[str, dict[str, Any]]:
        """The fetched page of a URL a search of this run returned (fetched once per read)."""
        url = safe_url(url)
        if url not in self._returned:
            raise PermissionError(f"browse refused: {url!r} was not returned by a search in this run")
        page = self.fetch_many([url])[0]
        if not page["ok"]:
            raise ValueError(f"fetch failed: {page['reason']}")
        return url, page

    def _passages(self, url: str, page: dict[str, Any], need: str | None, n: int | None = None) -> list[WebHit]:
        need = need or " ".join(dict.fromkeys(self._returned[url]))
        mode = getattr(self.corpus, "mode", "hybrid")
        emb = self.embedder if mode in ("dense", "hybrid") else None
        chunks = page_chunks(url, page["title"], page["text"])
        ranked = rank_chunks(chunks, need, mode, emb, getattr(self.corpus, "fusion", None))
        title = untrusted(page["title"])[:300]
        return [WebHit(id=f"{url}#{i}", doc_id=url, title=title, text=untrusted(chunks[i]), url=url, score=score,
                       rank=r, provider="page", retrieved_at=page["retrieved_at"])
                for r, (i, score) in enumerate(ranked[: n or self.config.passages], start=1)]

    def fetch_many(self, urls: list[str], *, miss_is_failure: bool = False) -> list[dict[str, Any]]:
        """Page records for ``urls`` fetched concurrently (within the limits), cached. In replay,
        an uncached URL raises CacheMiss, or (``miss_is_failure``) becomes a failed record."""
        async def one(u: str) -> dict[str, Any]:
            try:
                return await self._fetch(u)
            except CacheMiss as e:
                if not miss_is_failure:
                    raise
                self._fail("fetch", u, str(e))
                return {"url": u, "final_url": u, "ok": False, "status": None, "content_type": "", "title": "",
                        "text": "", "bytes": 0, "reason": f"not cached (replay): {u}", "retrieved_at": ""}

        async def all_() -> list[dict[str, Any]]:
            return list(await asyncio.gather(*(one(u) for u in urls)))
        return self._run(all_())

    async def _fetch(self, url: str) -> dict[str, Any]:
        if url in self.pages:
            return self.pages[url]
        parts = ["fetch", self.config.reader, url, {"max_bytes": self.config.max_bytes,
                                                     "types": list(self.config.content_types)}]
        fail_parts = ["fetch-failure", *parts[1:]]
        self.stats["fetches"] += 1
        page = self._cached_page(parts, fail_parts)
        if page is not None:
            self.stats["cache_hits"] += 1
        else:
            self.stats["network_requests"] += 1
            page = await read_page(self._http(), self.limiter, url, self.net, tuple(self.config.content_types),
                                   reader=self.config.reader)
            self.stats["bytes"] += page["bytes"]
            if self.config.reader == "jina":
                self.stats["cost_usd"] += JINA_READ_COST
            if page["ok"]:
                self.cache.put(parts, page)
            else:
                self.cache.put(fail_parts, {**page, "stored": time.time()})
        if not page["ok"]:
            self._fail("fetch", url, page["reason"])
        self.pages[url] = page
        return page

    def _cached_page(self, parts: list[Any], fail_parts: list[Any]) -> dict[str, Any] | None:
        """A cached page, else a recent cached failure (replayed as a failure, never as content);
        in replay mode a URL with neither raises CacheMiss."""
        try:
            page = self.cache.get(parts)
        except CacheMiss:
            page = None
        if page is not None:
            return page
        try:
            failed = self.cache.get(fail_parts)
        except CacheMiss:
            raise CacheMiss(f"--search-cache replay: page {parts[2]!r} was never fetched into "
                            f"{self.cache.root}; run once without replay to fill the cache") from None
        if failed and (self.cache.mode == "replay" or time.time() - float(failed.get("stored", 0)) <= FAILURE_TTL):
            return failed
        return None

    def summary(self) -> dict[str, Any]:
        s = dict(self.stats)
        s["failed"] = len(s.pop("failures"))
        s["failed_searches"] = sum(1 for f in self.stats["failures"] if f["kind"] == "search")
        s["cost_usd"] = round(s["cost_usd"], 6)
        return {"search": self.corpus_name, "cache": self.cache.mode, **s,
                "failures": list(self.stats["failures"])[:50]}

    def describe(self) -> dict[str, Any]:
        base = self.corpus.describe() if self.corpus is not None else {}
        return {**base, "search": self.corpus_name, "search_config": self.config.public()}


async def _none() -> None:
    return None


def _default_cache_dir() -> Path:
    from deepr.corpus.index import cache_root

    return cache_root(None)
