"""Page reading: fetch a URL, keep only real content, extract its main text.

:func:`read_page` returns a page record ``{"url", "final_url", "ok", "status",
"content_type", "title", "text", "bytes", "reason", "retrieved_at"}``. A page is a failed
fetch (``ok`` false, with the reason) when the request fails or is blocked, the status is
not 2xx, the content type is not allowed, or the page is an error in disguise: a captcha or
bot check, an "enable JavaScript" shell, or no text at all. Failed fetches are recorded by
the caller and never cached as content. HTML goes through trafilatura's main-text
extraction (:mod:`deepr.search.extract`: one extraction at a time, blocks joined so that no
sentence is cut, titles decoded once), PDFs through pypdf, plain text as is;
``reader="jina"`` asks the Jina reader (``r.jina.ai``) for the text instead.

Example::

    python -c "from deepr.search.reader import looks_failed; print(looks_failed('Please enable JavaScript', ''))"
"""

from __future__ import annotations

import asyncio
import datetime as dt
import html as htmllib
import io
import json
import os
import re
from typing import Any

import httpx

from deepr.search.net import FetchError, NetConfig, request
from deepr.search.ratelimit import Limiter

DEFAULT_TYPES = ("text/html", "application/xhtml+xml", "text/plain", "application/pdf")
_BOT_CHECK = re.compile(r"captcha|are you a (?:human|robot)|verify (?:that )?you are (?:a )?human|"
                        r"unusual traffic|access denied|cf-chl|checking your browser|bot detection", re.I)
_NEEDS_JS = re.compile(r"enable javascript|javascript is (?:required|disabled)|turn on javascript|"
                       r"requires javascript", re.I)
MIN_CHARS = 40


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()


def looks_failed(text: str, title: str) -> str | None:
    """Why an extracted page is an error page in disguise, or None when it is content."""
    head = f"{title}\n{text[:2000]}"
    if _BOT_CHECK.search(head) and len(text) < 3000:
        return "bot check or captcha page"
    if _NEEDS_JS.search(head) and len(text) < 3000:
        return "page needs JavaScript to show its content"
    if len(text.strip()) < MIN_CHARS:
        return "empty page (no readable text)"
    return None


def extract(body: bytes, content_type: str) -> tuple[str, str]:
    """(title, main text) of a fetched body by its content type."""
    ctype = content_type.split(";")[0].strip().lower()
    if ctype == "application/pdf" or body[:5] == b"%PDF-":
        from pypdf import PdfReader

        reader = PdfReader(io.BytesIO(body))
        text = "\n\n".join((p.extract_text() or "") for p in reader.pages)
        title = str((reader.metadata or {}).get("/Title") or "")
        return title, text
    html = body.decode(charset(content_type, body), errors="replace")
    if ctype == "text/plain":
        return "", html
    from deepr.search.extract import html_text, page_title

    text = html_text(html)
    if not text.strip():  # very short pages: take the visible text
        text = re.sub(r"\s+", " ", re.sub(r"<(script|style)[^>]*>.*?</\1>|<[^>]+>", " ", html, flags=re.S | re.I))
        text = htmllib.unescape(text)
    return page_title(html), text.strip()


_CHARSET = re.compile(rb"""<meta[^>]+charset=["']?([A-Za-z0-9_.:-]+)""", re.I)


def charset(content_type: str, body: bytes) -> str:
    """The text encoding of a body: the Content-Type's charset, else the page's ``<meta>``
    charset, else UTF-8 (an encoding Python does not know counts as absent)."""
    import codecs

    m = re.search(r"charset=[\"']?([A-Za-z0-9_.:-]+)", content_type or "", re.I)
    found = m.group(1) if m else None
    if not found:
        meta = _CHARSET.search(body[:4096])
        found = meta.group(1).decode("ascii", "replace") if meta else None
    try:
        return codecs.lookup(found).name if found else "utf-8"
    except LookupError:
        return "utf-8"


def _record(url: str, **kw: Any) -> dict[str, Any]:
    rec = {"url": url, "final_url": url, "ok": False, "status": None, "content_type": "", "title": "",
           "text": "", "bytes": 0, "reason": "", "retrieved_at": now_iso()}
    rec.update(kw)
    return rec


async def read_page(client: httpx.AsyncClient, limiter: Limiter, url: str, cfg: NetConfig,
                    types: tuple[str, ...] = DEFAULT_TYPES, reader: str = "trafilatura") -> dict[str, Any]:
    """Fetch and extract one page; failures come back as a record with ``ok`` false."""
    if reader == "jina":
        return await _read_jina(client, limiter, url, cfg)
    try:
        resp = await request(client, limiter, "GET", url, cfg, headers={"Accept": ", ".join(types)})
    except FetchError as e:
        return _record(url, status=e.status, reason=e.reason)
    base = _record(url, final_url=resp.url, status=resp.status, content_type=resp.content_type,
                   bytes=len(resp.body))
    if not 200 <= resp.status < 300:
        why = {401: "login required", 403: "forbidden (often a bot block)", 404: "not found"}.get(resp.status, "")
        return {**base, "reason": f"HTTP {resp.status}" + (f" {why}" if why else "")}
    ctype = resp.content_type.split(";")[0].strip().lower()
    if ctype and ctype not in types:
        return {**base, "reason": f"content type {ctype!r} is not allowed ({', '.join(types)})"}
    if not ctype and b"\0" in resp.body[:1024]:
        return {**base, "reason": "binary body without a content type"}
    try:  # CPU-bound: off the event loop so other fetches keep their network waits overlapping
        title, text = await asyncio.to_thread(extract, resp.body, resp.content_type)
    except Exception as e:  # a broken PDF or HTML must not end the run
        return {**base, "reason": f"could not extract text: {type(e).__name__}: {str(e)[:120]}"}
    reason = looks_failed(text, title)
    if reason:
        return {**base, "title": title, "reason": reason}
    return {**base, "ok": True, "title": title or url, "text": text}


async def _read_jina(client: httpx.AsyncClient, limiter: Limiter, url: str, cfg: NetConfig) -> dict[str, Any]:
    from deepr.search.providers import ProviderError, api_key

    from deepr.search.guard import BlockedAddress, url_parts

    base_url = os.environ.get("DEEPR_JINA_READER_URL") or "https://r.jina.ai/"
    try:
        url_parts(url)  # http(s) only; the page itself is fetched by Jina, not from this machine
    except BlockedAddress as e:
        return _record(url, reason=f"blocked: {e}")
    try:
        headers = {"Authorization": f"Bearer {api_key('jina')}", "Accept": "application/json"}
        resp = await request(client, limiter, "GET", base_url + url, cfg, guarded=False, headers=headers)
        data = json.loads(resp.body.decode("utf-8", errors="replace")).get("data") or {}
        title, text = str(data.get("title") or ""), str(data.get("content") or "")
    except (FetchError, ProviderError, ValueError, AttributeError) as e:
        return _record(url, reason=f"jina reader: {getattr(e, 'reason', None) or e}")
    reason = looks_failed(text, title)
    return _record(url, ok=reason is None, status=resp.status, title=title or url, text=text if not reason else "",
                   bytes=len(resp.body), reason=reason or "", content_type="text/markdown")
