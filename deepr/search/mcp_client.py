"""``--search mcp:<command or URL>``: any MCP server that exposes a search tool.

The server is started once per run (stdio: the command is split like a shell would; a
``http(s)://`` spec uses the streamable HTTP transport) through the official ``mcp`` SDK.
The first tool whose name contains "search" is used; its query argument is the first
required string parameter (``query``/``q`` preferred), and a count parameter
(``k``/``max_results``/``num``/``count``/``limit``) is filled when the schema has one.
Results may come as structured content or as JSON text; each item needs a URL (``url`` or
``link``) or an ``id``; items with only an id become corpus-like hits (``mcp:<id>``) whose
text is the snippet itself.

The SDK's transports must be opened and closed by one task, so one long-lived task owns
the session and answers requests from a queue.

Example::

    deepr search "Mona Lisa" --search "mcp:python my_search_server.py"
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import tempfile
from contextlib import AsyncExitStack
from typing import Any

from deepr.search.providers import ProviderError

_COUNT = ("k", "max_results", "num", "count", "limit", "top_k", "num_results")


class MCPSearch:
    """A running MCP session plus its search tool; use ``search`` from the owning loop."""

    def __init__(self, spec: str, timeout: float = 30.0):
        self.spec, self.timeout = spec, timeout
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._ready: asyncio.Future | None = None
        self._errlog: Any = None

    async def _serve(self) -> None:
        from mcp import ClientSession, StdioServerParameters

        try:
            async with AsyncExitStack() as stack:
                if self.spec.startswith(("http://", "https://")):
                    from mcp.client.streamable_http import streamable_http_client

                    streams = await stack.enter_async_context(streamable_http_client(self.spec))
                else:
                    from mcp.client.stdio import stdio_client

                    argv = shlex.split(self.spec)
                    if not argv:
                        raise ProviderError("--search mcp: give a command or URL after 'mcp:'")
                    # the server's stderr goes to a private file (its tail is shown if it fails to
                    # start), never into deepr's own output; it inherits the environment so a
                    # server that needs its own key finds it
                    self._errlog = stack.enter_context(tempfile.TemporaryFile("w+", encoding="utf-8"))
                    streams = await stack.enter_async_context(stdio_client(
                        StdioServerParameters(command=argv[0], args=argv[1:], env=dict(os.environ)),
                        errlog=self._errlog))
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                tool = _pick_tool((await session.list_tools()).tools, self.spec)
                self._ready.set_result(True)
                while (job := await self._queue.get()) is not None:
                    query, k, fut = job
                    try:
                        res = await session.call_tool(tool.name, _arguments(tool, query, k))
                        fut.set_result(res)
                    except Exception as e:  # a tool error is a failed search, not a crash
                        fut.set_exception(ProviderError(f"mcp: tool call failed: {type(e).__name__}: {e}"))
        except Exception as e:
            if not self._ready.done():
                self._ready.set_exception(ProviderError(f"mcp: cannot start {self.spec!r}: "
                                                        f"{type(e).__name__}: {str(e)[:200]}{self._stderr_tail()}"))

    def _stderr_tail(self) -> str:
        try:
            self._errlog.seek(0)
            tail = self._errlog.read()[-300:].strip()
        except (AttributeError, OSError, ValueError):
            return ""
        return f" (server said: {tail})" if tail else ""

    async def start(self) -> None:
        if self._task is None:
            self._queue, self._ready = asyncio.Queue(), asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._serve())
        await asyncio.wait_for(asyncio.shield(self._ready), self.timeout)

    async def search(self, query: str, k: int) -> list[dict[str, str]]:
        await self.start()
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put((query, k, fut))
        res = await asyncio.wait_for(fut, self.timeout)
        if getattr(res, "is_error", False):
            raise ProviderError(f"mcp: the search tool reported an error: {_text(res)[:200]}")
        return parse_result(res)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            await self._queue.put(None)
            try:
                await asyncio.wait_for(self._task, 10)
            except (asyncio.TimeoutError, Exception):
                self._task.cancel()


def _pick_tool(tools: list[Any], spec: str) -> Any:
    found = [t for t in tools if "search" in t.name.lower()]
    if not found:
        raise ProviderError(f"mcp server {spec!r} has no search tool (tools: {', '.join(t.name for t in tools)})")
    return found[0]


def _arguments(tool: Any, query: str, k: int) -> dict[str, Any]:
    schema = getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None) or {}
    props = schema.get("properties", {})
    strings = [n for n, p in props.items() if p.get("type") == "string"]
    names = [n for n in ("query", "q") if n in props] + [n for n in schema.get("required", []) if n in strings]
    args = {(names or strings or ["query"])[0]: query}
    for n in _COUNT:
        if n in props:
            args[n] = k
            break
    return args


def _text(res: Any) -> str:
    return "\n".join(getattr(c, "text", "") for c in getattr(res, "content", []) or [])


def parse_result(res: Any) -> list[dict[str, str]]:
    data = getattr(res, "structured_content", None) or getattr(res, "structuredContent", None)
    if isinstance(data, dict) and isinstance(data.get("result"), list):
        data = data["result"]
    if data is None:
        blocks = [getattr(c, "text", "") for c in getattr(res, "content", []) or []]
        try:
            data = [json.loads(b) for b in blocks if b.strip()]
        except ValueError:
            raise ProviderError("mcp: search tool returned text that is not JSON results") from None
        if len(data) == 1 and isinstance(data[0], list):
            data = data[0]
    if isinstance(data, dict):
        data = data.get("results") or data.get("items") or []
    if not isinstance(data, list):
        raise ProviderError(f"mcp: search result is {type(data).__name__}, expected a list of items")
    hits = []
    for item in data:
        if not isinstance(item, dict):
            continue
        url = item.get("url") or item.get("link")
        ident = item.get("id") or item.get("doc_id")
        if not url and not ident:
            continue
        snippet = next((str(item[f]) for f in ("snippet", "content", "description", "text") if item.get(f)), "")
        hits.append({"url": str(url) if url else "", "id": str(ident or ""),
                     "title": str(item.get("title") or url or ident), "snippet": snippet})
    return hits
