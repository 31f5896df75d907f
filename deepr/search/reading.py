"""Search results that rest on the read page, for building evidence trees from the web.

DeepRubric grows its evidence trees from pages it reads, not from the search engine's
snippets. :class:`PageReadingRetriever` wraps a :class:`~deepr.search.source.SourceRetriever`:
every web result of a search is read (the same reader, cache, address guard and limits as
``browse``; the page was usually fetched already when the search verified it) and the hit's
text becomes the page's passages most relevant to that query, in page order, its id the best
passage's ``<url>#<chunk>``. Corpus results and pages that cannot be read keep their snippet.
Everything else (``embedder``, ``summary``, ``close``...) is the wrapped source's.

Example::

    deepr build-trees --topics topics.txt --out trees.jsonl --search searxng:http://127.0.0.1:8888
"""

from __future__ import annotations

from typing import Any

from deepr.records import Hit


class PageReadingRetriever:
    """``search``/``search_many`` of ``source`` with each web hit's text replaced by read passages."""

    def __init__(self, source: Any, passages: int | None = None):
        self.source, self.passages = source, passages
        self.source.stats.setdefault("pages_read", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def search(self, query: str, k: int = 5, mode: Any = None) -> list[Hit]:
        return self.search_many([query], k)[0]

    def search_many(self, queries: list[str], k: int = 5, mode: Any = None) -> list[list[Hit]]:
        found = self.source.search_many(list(queries), k)
        return [[self._read(h, q) for h in hits] for q, hits in zip(queries, found)]

    def _read(self, hit: Hit, query: str) -> Hit:
        if not hit.url or hit.doc_id != hit.url:  # a corpus passage or an MCP snippet: nothing to read
            return hit
        try:
            best = self.source.read_passages(hit.url, query, self.passages)
        except (PermissionError, ValueError):  # recorded by the source; the snippet stays the evidence
            return hit
        if not best:
            return hit
        self.source.stats["pages_read"] += 1
        ordered = sorted(best, key=lambda h: int(h.id.rsplit("#", 1)[1]))
        return hit.model_copy(update={"id": best[0].id, "text": "\n\n".join(h.text for h in ordered),
                                      "snippet": getattr(hit, "snippet", "") or hit.text})
