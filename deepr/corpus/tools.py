"""Agent tools over a retriever (002 App. D): ``search``, ``browse`` and optional ``scholar``.

Input: a :class:`~deepr.corpus.index.Retriever` (and optionally a second one for ``scholar``);
output: ranked :class:`Hit` snippets with stable ids, and full document text for ids the agent
has already seen. ``browse`` opens ONLY documents that an earlier search of the same tools
object returned (by doc id, or by passage id mapped to its doc): an agent cannot read arbitrary
ids, paths or URLs. Every call is logged in ``tools.log`` for run traces.

Example::

    python -c "from deepr.corpus import open_retriever, ResearchTools; \
t = ResearchTools(open_retriever('wiki')); print(t.call('search', query='Mona Lisa painter'))"
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from deepr.corpus.index import Retriever
from deepr.records import Hit


class BrowseRefused(PermissionError):
    """``browse`` was asked for an id that no earlier search of this tools object returned."""


class ResearchTools:
    """Search/browse tools bound to one agent run; ``log`` lists every call in order."""

    def __init__(self, retriever: Retriever, k: int = 5, *, scholar: Retriever | None = None,
                 max_chars: int | None = None):
        if k < 1:
            raise ValueError(f"tools k={k}: must return at least one result")
        self.retriever, self.scholar_retriever = retriever, scholar
        self.k, self.max_chars = k, max_chars
        self.log: list[dict[str, Any]] = []
        self._seen_docs: dict[str, Retriever] = {}
        self._seen_passages: dict[str, str] = {}

    def fresh(self) -> ResearchTools:
        """The same sources and limits for another run: an empty log, and nothing seen to browse."""
        return ResearchTools(self.retriever, self.k, scholar=self.scholar_retriever, max_chars=self.max_chars)

    @property
    def names(self) -> list[str]:
        return ["search", "browse"] + (["scholar"] if self.scholar_retriever is not None else [])

    def search(self, query: str) -> list[Hit]:
        """Top-k snippets of the main corpus for ``query``."""
        return self._search("search", self.retriever, query)

    def scholar(self, query: str) -> list[Hit]:
        """Top-k snippets of the second (scholarly) corpus."""
        if self.scholar_retriever is None:
            raise ValueError("no scholar corpus was given to these tools")
        return self._search("scholar", self.scholar_retriever, query)

    def _search(self, name: str, retriever: Retriever, query: str) -> list[Hit]:
        t0 = time.perf_counter()
        hits = retriever.search(query, k=self.k)
        for h in hits:
            self._seen_docs[h.doc_id] = retriever
            self._seen_passages[h.id] = h.doc_id
        self._record(name, {"query": query}, [h.id for h in hits], t0)
        return hits

    def browse(self, doc_id: str) -> str:
        """Full text of a document returned by an earlier search; raises BrowseRefused otherwise."""
        t0 = time.perf_counter()
        try:
            resolved = self._resolve(doc_id)
        except BrowseRefused as e:
            self._record("browse", {"doc_id": doc_id}, [], t0, error=str(e))
            raise
        text = self._seen_docs[resolved].get_document(resolved).text
        if self.max_chars is not None and len(text) > self.max_chars:
            text = text[: self.max_chars] + " [truncated]"
        self._record("browse", {"doc_id": doc_id}, [resolved], t0)
        return text

    def browse_passages(self, doc_id: str, need: str = "", n: int | None = None) -> list[Hit] | None:
        """The passages of a returned web page most relevant to ``need``, each with its own id
        (``<url>#<chunk>``), best first; None when the retriever reads whole documents (the
        corpus), so the caller uses :meth:`browse`. Refusals as for :meth:`browse`."""
        t0 = time.perf_counter()
        try:
            resolved = self._resolve(doc_id)
        except BrowseRefused as e:
            self._record("browse", {"doc_id": doc_id}, [], t0, error=str(e))
            raise
        reader = getattr(self._seen_docs[resolved], "read_passages", None)
        if reader is None or not resolved.startswith(("http://", "https://")):
            return None
        hits = reader(resolved, need or None, n)
        self._record("browse", {"doc_id": doc_id, "need": need}, [h.id for h in hits], t0)
        return hits

    def _resolve(self, ident: str) -> str:
        ident = (ident or "").strip()
        if ident in self._seen_docs:
            return ident
        if ident in self._seen_passages:
            return self._seen_passages[ident]
        doc_part = ident.rsplit("#", 1)[0]
        if "#" in ident and doc_part in self._seen_docs:
            return doc_part
        raise BrowseRefused(
            f"browse refused: {ident!r} was not returned by an earlier search in this run; "
            "search first, then browse one of the returned doc ids or snippet ids"
        )

    def _record(self, name: str, args: dict[str, Any], ids: list[str], t0: float,
                error: str | None = None) -> None:
        self.log.append({"name": name, "arguments": args, "ids": ids,
                         "seconds": round(time.perf_counter() - t0, 6), "ok": error is None, "error": error})

    # -- text interface for agents ----------------------------------------------------

    def call(self, name: str, **arguments: Any) -> str:
        """Run a tool by name and render its result as text; refusals come back as text too."""
        if name not in self.names:
            return f"unknown tool {name!r}; available tools: {', '.join(self.names)}"
        try:
            if name == "browse":
                return self.browse(str(arguments.get("doc_id", "")))
            return format_hits(getattr(self, name)(str(arguments.get("query", ""))))
        except BrowseRefused as e:
            return str(e)

    def functions(self) -> list[Callable[..., str]]:
        """Plain typed functions with docstrings, as tool-calling trainers (TRL) expect."""
        def search(query: str) -> str:
            """Search the corpus and return ranked snippets with stable ids.

            Args:
                query: What to look for, in a few words.
            """
            return self.call("search", query=query)

        def browse(doc_id: str) -> str:
            """Read the full text of a document returned by an earlier search.

            Args:
                doc_id: A doc id or snippet id from the search results.
            """
            return self.call("browse", doc_id=doc_id)

        def scholar(query: str) -> str:
            """Search the scholarly corpus and return ranked snippets with stable ids.

            Args:
                query: What to look for, in a few words.
            """
            return self.call("scholar", query=query)

        fns = {"search": search, "browse": browse, "scholar": scholar}
        return [fns[n] for n in self.names]


def format_hits(hits: list[Hit]) -> str:
    """Ranked snippets, one block per hit, each headed by its citable id."""
    if not hits:
        return "no results"
    return "\n\n".join(f"[{h.id}] {h.title} (doc {h.doc_id})\n{h.text}" for h in hits)
