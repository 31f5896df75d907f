"""Search results that rest on the read page, for building evidence trees from the web.

DeepRubric grows its evidence trees from pages it reads, not from the search engine's
snippets. :class:`PageReadingRetriever` wraps a :class:`~deepr.search.source.SourceRetriever`:
every web result of a search is read (the same reader, cache, address guard and limits as
``browse``; the page was usually fetched already when the search verified it), cut with the
corpus chunker, and the hit becomes the page's passage most relevant to that query, ranked
as the run's retriever ranks (hybrid for the web alone), with that passage's id
``<url>#<chunk>``. One passage, not several joined: a tree node records the hit's id as the
``snippet_id`` of the statements it extracts from the hit's text, so the text must be exactly
the passage the id names. Different queries of one tree pick different passages of the same
page. Corpus results and pages that cannot be read keep their snippet. Everything else
(``embedder``, ``summary``, ``close``...) is the wrapped source's.

Example::

    deepr build-trees --topics topics.txt --out trees.jsonl --search searxng:http://127.0.0.1:8888
"""

from __future__ import annotations

from typing import Any

from deepr.records import Hit


class PageReadingRetriever:
    """``search``/``search_many`` of ``source`` with each web hit replaced by its page's best passage."""

    def __init__(self, source: Any):
        self.source = source
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
            best = self.source.read_passages(hit.url, query, 1)
        except (PermissionError, ValueError):  # recorded by the source; the snippet stays the evidence
            return hit
        if not best:
            return hit
        self.source.stats["pages_read"] += 1
        return hit.model_copy(update={"id": best[0].id, "text": best[0].text,
                                      "snippet": getattr(hit, "snippet", "") or hit.text})
