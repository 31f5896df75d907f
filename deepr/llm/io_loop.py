"""An event loop in a daemon thread that owns one async HTTP client (used by openai_backend.py).

The client's connection pool is bound to the loop it was created on, while deepr's callers come
from many loops (each ``run_sync`` starts a new one): every request runs on this one loop.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class IOLoop:
    """An event loop in a daemon thread that owns one async HTTP client."""

    def __init__(self, make_client: Any):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="deepr-llm-io")
        self.thread.start()
        self.client = asyncio.run_coroutine_threadsafe(self._make(make_client), self.loop).result()

    @staticmethod
    async def _make(make_client: Any) -> Any:
        return make_client()  # created on the loop that will use it

    async def run(self, coro: Any) -> Any:
        """Await ``coro`` on this loop from any other loop; cancelling the caller cancels it."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.client.close(), self.loop).result(timeout=5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
            if not self.thread.is_alive():
                self.loop.close()
