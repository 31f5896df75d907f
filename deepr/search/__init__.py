"""Search sources for agents: the local corpus and the web behind one interface.

Modules: ``config`` (``--search`` specs and limits), ``providers`` (each web API's request and
response shape), ``mcp_client`` (any MCP search tool), ``net`` (requests with limits and
retries), ``guard`` (which addresses a fetch may reach), ``ratelimit``, ``cache`` (disk cache
and replay), ``reader`` (page fetch and main-text extraction), ``passages`` (a read page's
chunks ranked against a need), ``source`` (the combined retriever agents use), ``reading``
(search results carrying their read page, for tree building), ``drb`` (DeepResearch Bench
submission export).

Example::

    deepr run "What changed in the EU AI Act this year?" --search searxng:http://127.0.0.1:8888
"""

from __future__ import annotations

from typing import Any

from deepr.search.config import SearchConfig, parse_spec


def open_source(config: SearchConfig, open_corpus: Any = None) -> Any:
    """The retriever agents should use: the corpus retriever itself for ``--search corpus``
    (unchanged offline behaviour), else a SourceRetriever; ``open_corpus()`` is called only
    when the spec includes the corpus."""
    kinds = [k for k, _ in parse_spec(config.spec)]
    corpus = open_corpus() if "corpus" in kinds and open_corpus is not None else None
    if kinds == ["corpus"]:
        return corpus
    from deepr.search.source import SourceRetriever

    return SourceRetriever(config, corpus=corpus)


def open_reader(config: SearchConfig) -> Any:
    """A page reader with the same cache, limits and address guard, for checking cited URLs
    (FACT): ``fetch_many(urls)`` returns page records; no search is involved."""
    from deepr.search.source import SourceRetriever

    return SourceRetriever(config, reader_only=True)


__all__ = ["SearchConfig", "open_reader", "open_source", "parse_spec"]
