"""Web search providers: each provider's documented request and response shape.

A provider turns ``(query, k)`` into one HTTP request and parses the JSON reply into plain
hits ``{"url", "title", "snippet"}``. Parsing is strict about what matters (a list of
results, each with an http(s) URL) and lenient about the rest; a reply that is not JSON,
lacks the results field or is cut short raises :class:`ProviderError`, which the source
records as a failed search (never a traceback, never cached).

Keys come only from the environment variables in :data:`KEY_ENV` and travel only in
request headers; they are never part of a cache key, a trace, a log line or an error
message. Endpoints can be redirected with ``DEEPR_<NAME>_URL`` (used by the tests'
loopback fake). ``COST_PER_QUERY`` is a rough USD estimate from public price lists.

Example::

    python -c "from deepr.search.providers import parse; \
print(parse('serper', {'organic': [{'link': 'https://a.org', 'title': 'A', 'snippet': 's'}]}))"
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

KEY_ENV = {"serper": "SERPER_API_KEY", "tavily": "TAVILY_API_KEY", "brave": "BRAVE_API_KEY",
           "jina": "JINA_API_KEY"}
ENDPOINTS = {"serper": "https://google.serper.dev/search", "tavily": "https://api.tavily.com/search",
             "brave": "https://api.search.brave.com/res/v1/web/search", "jina": "https://s.jina.ai/"}
# USD per search call (list prices at the lowest paid tier; self-hosted SearXNG and MCP are free)
COST_PER_QUERY = {"serper": 0.001, "tavily": 0.008, "brave": 0.005, "jina": 0.002, "searxng": 0.0,
                  "mcp": 0.0, "corpus": 0.0}
JINA_READ_COST = 0.001


class ProviderError(RuntimeError):
    """A provider call that produced no usable results (with the reason)."""


@dataclass(frozen=True)
class Request:
    method: str
    url: str
    params: dict[str, Any] | None = None
    json: dict[str, Any] | None = None
    headers: dict[str, str] | None = None


def endpoint(name: str) -> str:
    return os.environ.get(f"DEEPR_{name.upper()}_URL") or ENDPOINTS[name]


def api_key(name: str) -> str:
    env = KEY_ENV[name]
    key = os.environ.get(env, "").strip()
    if not key:
        raise ProviderError(f"--search {name}: set the environment variable {env} to your API key")
    return key


def build_request(name: str, query: str, k: int, *, base: str | None = None) -> Request:
    """The documented search request of ``name`` (``base`` is the SearXNG instance URL)."""
    if name == "searxng":
        return Request("GET", base.rstrip("/") + "/search", params={"q": query, "format": "json"},
                       headers={"Accept": "application/json"})
    key = api_key(name)
    if name == "serper":
        return Request("POST", endpoint(name), json={"q": query, "num": k},
                       headers={"X-API-KEY": key, "Content-Type": "application/json"})
    if name == "tavily":
        return Request("POST", endpoint(name), json={"query": query, "max_results": k},
                       headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    if name == "brave":
        return Request("GET", endpoint(name), params={"q": query, "count": k},
                       headers={"X-Subscription-Token": key, "Accept": "application/json"})
    if name == "jina":
        return Request("GET", endpoint(name), params={"q": query},
                       headers={"Authorization": f"Bearer {key}", "Accept": "application/json",
                                "X-Respond-With": "no-content"})
    raise ValueError(f"unknown search provider {name!r}")


def decode(name: str, body: bytes, content_type: str) -> Any:
    """JSON body of a provider reply; HTML or a truncated body raises ProviderError."""
    text = body.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError as e:
        looks = "an HTML page" if text.lstrip()[:1] == "<" else f"invalid JSON ({e.msg} at char {e.pos})"
        raise ProviderError(f"{name}: reply is {looks}, not the JSON search response "
                            f"(content-type {content_type or 'unset'})") from None


_RESULTS = {  # provider -> (path to the results list, url field, snippet fields)
    "searxng": (("results",), "url", ("content",)),
    "serper": (("organic",), "link", ("snippet",)),
    "tavily": (("results",), "url", ("content",)),
    "brave": (("web", "results"), "url", ("description", "extra_snippets")),
    "jina": (("data",), "url", ("description", "content")),
}


def parse(name: str, data: Any) -> list[dict[str, str]]:
    """Hits ``{"url", "title", "snippet"}`` from a decoded reply; malformed replies raise."""
    path, url_field, snippet_fields = _RESULTS[name]
    node = data
    for step in path:
        if not isinstance(node, dict) or step not in node:
            if name == "brave" and isinstance(data, dict) and step == "web" and "web" not in data:
                return []  # Brave omits "web" when nothing matched
            raise ProviderError(f"{name}: reply has no {'.'.join(path)!r} field "
                                f"(keys: {', '.join(map(str, data)) if isinstance(data, dict) else type(data).__name__})")
        node = node[step]
    if not isinstance(node, list):
        raise ProviderError(f"{name}: {'.'.join(path)!r} is {type(node).__name__}, expected a list")
    hits, skipped = [], 0
    for item in node:
        url = item.get(url_field) if isinstance(item, dict) else None
        if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https"):
            skipped += 1
            continue
        snippet = ""
        for f in snippet_fields:
            v = item.get(f)
            if isinstance(v, list):
                v = " ".join(str(x) for x in v)
            if isinstance(v, str) and v.strip():
                snippet = v.strip()
                break
        hits.append({"url": url, "title": str(item.get("title") or url), "snippet": snippet})
    if not hits and skipped:
        raise ProviderError(f"{name}: none of the {skipped} results has an http(s) {url_field!r} field")
    return hits
