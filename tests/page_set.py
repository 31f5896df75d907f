"""The real-page set (tests/pages/MANIFEST.json): serve it on 127.0.0.1, read it through deepr's
reader, score the extraction.

Pages are read exactly as ``deepr run --search ...`` reads a result: a web
:class:`~deepr.search.source.SourceRetriever` (address guard, limits, the reader's fetch and
trafilatura extraction), with the cache off. A snippet is found when its words appear in order
in the extracted text, case, punctuation and spacing ignored (the reader adds full stops at
block ends and joins lines, which must not count as a miss).

Used by tests/test_pages_real.py and bench/pages.py.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent / "pages"


def manifest() -> list[dict[str, Any]]:
    """The pages with their bodies (``body``) loaded; a page whose bytes changed fails loudly."""
    import hashlib

    pages = json.loads((ROOT / "MANIFEST.json").read_text(encoding="utf-8"))["pages"]
    for p in pages:
        p["name"] = Path(p["file"]).stem
        p["body"] = (ROOT / p["file"]).read_bytes()
        if hashlib.sha256(p["body"]).hexdigest() != p["sha256"]:
            raise ValueError(f"{p['file']}: bytes differ from MANIFEST.json's sha256 (the pages are kept as saved)")
    return pages


def norm(text: str) -> str:
    return " " + " ".join(re.sub(r"[\W_]+", " ", text.lower()).split()) + " "


def found(snippet: str, text: str) -> bool:
    return norm(snippet) in norm(text)


@contextlib.contextmanager
def serve(pages: list[dict[str, Any]]) -> Iterator[Any]:
    """A loopback site serving ``/<name>`` (any query string) with the page's declared charset."""
    from search_fakes import Server

    by_name = {p["name"]: p for p in pages}

    def handle(method: str, path: str, headers: dict, body: bytes) -> tuple[int, dict, bytes]:
        page = by_name.get(path.split("?", 1)[0].lstrip("/"))
        if page is None:
            return 404, {"Content-Type": "text/plain"}, b"not here"
        return 200, {"Content-Type": f"text/html; charset={page['charset']}"}, page["body"]

    server = Server(handle)
    try:
        yield server
    finally:
        server.close()


def reader(port: int, cache_dir: Path, concurrency: int = 64) -> Any:
    """A web source that may fetch from the loopback site (cache off), as ``deepr run --search`` builds it."""
    from deepr.search import SearchConfig, open_reader

    cfg = SearchConfig(spec="searxng:http://127.0.0.1:9", allow_hosts=[f"127.0.0.1:{port}"], cache="off",
                       cache_dir=cache_dir, per_host=64, concurrency=concurrency, timeout=60)
    return open_reader(cfg)


def read_pages(port: int, names: list[str], cache_dir: Path, tag: str = "") -> list[dict[str, Any]]:
    """Page records of ``names`` fetched concurrently by one fresh reader."""
    src = reader(port, cache_dir)
    try:
        return src.fetch_many([f"http://127.0.0.1:{port}/{n}{'?' + tag if tag else ''}" for n in names])
    finally:
        src.close()


def score(pages: list[dict[str, Any]], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Main-text recall and boilerplate leakage over the set, with every miss and leak named."""
    main = leak_n = bp = hit = 0
    missed, leaked, failed = [], [], []
    for p, rec in zip(pages, records):
        if not rec["ok"]:
            failed.append({"page": p["name"], "reason": rec["reason"]})
        text = rec["text"] if rec["ok"] else ""
        for s in p["main"]:
            main += 1
            if found(s, text):
                hit += 1
            else:
                missed.append({"page": p["name"], "snippet": s})
        for s in p["boilerplate"]:
            bp += 1
            if found(s, text):
                leak_n += 1
                leaked.append({"page": p["name"], "snippet": s})
    return {"pages": len(pages), "main_snippets": main, "boilerplate_snippets": bp,
            "recall": round(hit / max(main, 1), 4), "leakage": round(leak_n / max(bp, 1), 4),
            "missed": missed, "leaked": leaked, "failed": failed}


def stress(port: int, names: list[str], cache_dir: Path, passes: int, rounds: int,
           expect: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``rounds`` times, ``passes`` threads each read the whole set through its own reader at the
    same moment (every reader has its own event loop and worker threads, so extractions overlap).
    Returns counts, and with ``expect`` (the records of a lone read) every page whose concurrent
    read differs from it; a native crash ends the process before it can return."""
    pages_read = ok = 0
    errors: list[str] = []
    differs: list[str] = []
    failed: list[str] = []
    for r in range(rounds):
        start = threading.Barrier(passes)
        results: list[list[dict[str, Any]]] = [[] for _ in range(passes)]

        def one(i: int, r: int = r, start: threading.Barrier = start,
                results: list[list[dict[str, Any]]] = results) -> None:
            start.wait()
            try:
                results[i] = read_pages(port, names, cache_dir, tag=f"r{r}p{i}")
            except Exception as e:  # recorded: the test fails on any
                errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=one, args=(i,)) for i in range(passes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for recs in results:
            pages_read += len(recs)
            ok += sum(1 for rec in recs if rec["ok"])
            failed += [f"{n}: {rec['reason']}" for n, rec in zip(names, recs) if not rec["ok"]]
            for name, rec, want in zip(names, recs, expect or []):
                if (rec["title"], rec["text"], rec["reason"]) != (want["title"], want["text"], want["reason"]):
                    differs.append(f"{name}: {rec['reason'] or 'text differs'}")
    return {"passes": passes, "rounds": rounds, "pages_read": pages_read, "pages_ok": ok, "errors": errors,
            "failed": failed[:20], "differs": differs[:20]}
