"""One HTTP path for searches and page fetches: limits, guard, redirects and bounded retries.

``request`` sends one request through the shared :class:`~deepr.search.ratelimit.Limiter`,
follows redirects itself (at most ``max_redirects``) so that the address guard sees every
hop before anything is sent to it, checks the peer address of the real connection, streams
the body up to ``max_bytes`` and retries only what can pass: 429 (after Retry-After), 5xx
and timeouts, at most ``retries`` times. The result is a :class:`Response` or a
:class:`FetchError` carrying the reason; nothing here logs headers (they hold API keys).

Example::

    python -c "import asyncio, httpx; from deepr.search.net import request, NetConfig; \
from deepr.search.ratelimit import Limiter; print(NetConfig())"
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from deepr.search.guard import BlockedAddress, check_address, check_url, needs_resolution, url_parts
from deepr.search.ratelimit import MAX_RETRY_AFTER, Limiter, retry_after_seconds

USER_AGENT = "deepr-research-agent/0.1 (+https://github.com/deepr)"


class FetchError(RuntimeError):
    """A request that yielded no usable body; ``reason`` says why, ``status`` the HTTP code."""

    def __init__(self, reason: str, status: int | None = None):
        super().__init__(reason)
        self.reason, self.status = reason, status


@dataclass
class NetConfig:
    timeout: float = 15.0
    max_bytes: int = 5_000_000
    max_redirects: int = 5
    retries: int = 2
    allow: set[tuple[str, int | None]] = field(default_factory=set)


@dataclass
class Response:
    url: str
    status: int
    content_type: str
    body: bytes
    seconds: float
    redirects: list[str] = field(default_factory=list)


def _peer_ok(resp: httpx.Response, url: str, allow: set[tuple[str, int | None]]) -> None:
    stream = resp.extensions.get("network_stream")
    addr = stream.get_extra_info("server_addr") if stream is not None else None
    if addr:
        _, host, port = url_parts(url)
        check_address(str(addr[0]), host, port, allow)


async def _once(client: httpx.AsyncClient, method: str, url: str, cfg: NetConfig, guarded: bool,
                **kw: Any) -> tuple[int, str, bytes, str | None, httpx.Headers]:
    if guarded:  # name resolution blocks, so only a real lookup goes to a worker thread
        if needs_resolution(url, cfg.allow):
            await asyncio.to_thread(check_url, url, cfg.allow)
        else:
            check_url(url, cfg.allow)
    async with client.stream(method, url, **kw) as resp:
        if guarded:
            _peer_ok(resp, url, cfg.allow)
        ctype = resp.headers.get("content-type", "")
        declared = resp.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cfg.max_bytes:
            raise FetchError(f"body of {int(declared)} bytes exceeds the {cfg.max_bytes}-byte cap", resp.status_code)
        chunks, size = [], 0
        if not resp.is_redirect:
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > cfg.max_bytes:
                    raise FetchError(f"body exceeds the {cfg.max_bytes}-byte cap", resp.status_code)
                chunks.append(chunk)
        return resp.status_code, ctype, b"".join(chunks), resp.headers.get("location"), resp.headers


async def request(client: httpx.AsyncClient, limiter: Limiter, method: str, url: str, cfg: NetConfig, *,
                  guarded: bool = True, **kw: Any) -> Response:
    """One request with redirects, guard, size cap, timeout and bounded retries."""
    t0, hops, attempt = time.perf_counter(), [], 0
    while True:
        host = urlsplit(url).netloc
        try:
            async with limiter.slot(host):
                async with asyncio.timeout(cfg.timeout):  # no extra task per request, unlike wait_for
                    status, ctype, body, location, headers = await _once(client, method, url, cfg, guarded, **kw)
        except BlockedAddress as e:
            raise FetchError(f"blocked: {e}") from None
        except (asyncio.TimeoutError, httpx.TimeoutException):
            if attempt < cfg.retries:
                attempt += 1
                continue
            raise FetchError(f"timed out after {cfg.timeout:g} s ({attempt + 1} attempts)") from None
        except httpx.HTTPError as e:
            raise FetchError(f"connection failed: {type(e).__name__}") from None
        if status in (301, 302, 303, 307, 308) and location:
            if len(hops) >= cfg.max_redirects:
                raise FetchError(f"more than {cfg.max_redirects} redirects", status)
            hops.append(url)
            url = urljoin(url, location)
            if status == 303:
                method, kw = "GET", {k: v for k, v in kw.items() if k not in ("json", "content", "data")}
            continue
        if status == 429 or status >= 500:
            wait = retry_after_seconds(headers.get("retry-after"), default=0.5 * 2 ** attempt)
            if attempt < cfg.retries and wait <= MAX_RETRY_AFTER:
                attempt += 1
                if status == 429:
                    limiter.pause(host, wait)
                else:
                    await asyncio.sleep(wait)
                continue
            raise FetchError(f"HTTP {status} after {attempt + 1} attempts"
                             + (" (rate limited)" if status == 429 else ""), status)
        return Response(url, status, ctype, body, time.perf_counter() - t0, hops)
