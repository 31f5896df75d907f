"""A real MCP server (the ``mcp`` SDK's server API) over stdio, serving ``search`` over a small
local JSONL corpus given as argv[1]: ``python mcp_search_server.py corpus.jsonl [http-port]``."""

from __future__ import annotations

import json
import sys

from mcp.server import MCPServer

DOCS = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8") if line.strip()]
app = MCPServer("deepr-test-search")


@app.tool()
def search(query: str, max_results: int = 5) -> list[dict]:
    """Rank corpus documents by shared words with the query."""
    words = set(query.lower().split())
    scored = sorted(DOCS, key=lambda d: -len(words & set((d["title"] + " " + d["text"]).lower().split())))
    return [{"url": d.get("url", ""), "id": d["id"], "title": d["title"], "snippet": d["text"][:300]}
            for d in scored[:max_results] if words & set((d["title"] + " " + d["text"]).lower().split())]


if __name__ == "__main__":
    if len(sys.argv) > 2:  # second argument: serve streamable HTTP on 127.0.0.1:<port> instead of stdio
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run("stdio")
