"""Request pacing: a global rate limit, per-host concurrency and 429 / Retry-After back-off.

One :class:`Limiter` is shared by every request of a run (searches and fetches). ``slot``
waits for (1) the global minimum interval between request starts, (2) any pause a host
asked for with 429 + Retry-After, (3) a free per-host and global concurrency slot.

Example::

    python -c "import asyncio; from deepr.search.ratelimit import Limiter; \
l = Limiter(rate=10); asyncio.run(l.wait_turn('h'))"
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import time
from collections import defaultdict
from collections.abc import AsyncIterator

MAX_RETRY_AFTER = 60.0  # a server asking for a longer pause is treated as a failure instead


def retry_after_seconds(value: str | None, default: float = 1.0) -> float:
    """Seconds from a Retry-After header (delta seconds or an HTTP date)."""
    if not value:
        return default
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return default
    return max(0.0, when.timestamp() - time.time())


class Limiter:
    """Global start rate (requests/s, None = unlimited) + concurrency per host and overall."""

    def __init__(self, rate: float | None = None, per_host: int = 4, total: int = 16):
        self.interval = 1.0 / rate if rate else 0.0
        self.per_host, self.total = per_host, total
        self._next_start = 0.0
        self._paused_until: dict[str, float] = defaultdict(float)
        self._host_sems: dict[str, asyncio.Semaphore] = {}
        self._all: asyncio.Semaphore | None = None
        self._lock: asyncio.Lock | None = None

    def pause(self, host: str, seconds: float) -> None:
        """Honour a 429: no request to ``host`` starts before ``seconds`` from now."""
        self._paused_until[host] = max(self._paused_until[host], time.monotonic() + seconds)

    async def wait_turn(self, host: str) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        while (delay := self._paused_until[host] - time.monotonic()) > 0:
            await asyncio.sleep(delay)
        if self.interval:
            async with self._lock:
                now = time.monotonic()
                start = max(now, self._next_start)
                self._next_start = start + self.interval
            if start > now:
                await asyncio.sleep(start - now)

    @contextlib.asynccontextmanager
    async def slot(self, host: str) -> AsyncIterator[None]:
        if self._all is None:
            self._all = asyncio.Semaphore(self.total)
        sem = self._host_sems.setdefault(host, asyncio.Semaphore(self.per_host))
        async with self._all, sem:
            await self.wait_turn(host)
            yield
