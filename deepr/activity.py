"""What the library is doing right now, as counters a front end can show while it works.

The model-call layer, the roles' executor and the retrievers add to one process-wide
:data:`ACTIVITY` (calls sent and returned, calls that worked or failed, re-asks, fallbacks,
searches); they print nothing. A front end (the CLI's live view, :mod:`deepr.cli.live`)
takes a :meth:`Activity.snapshot` when it starts and shows what changed since.

    before = ACTIVITY.snapshot()
    ...                                   # model calls, searches
    ACTIVITY.since(before)["call ok"]     # calls that worked meanwhile
"""

from __future__ import annotations

import threading
from collections import Counter

# The kinds counted: a call is "sent" when it leaves for the backend and "returned" when the
# backend answers or gives up (their difference is the calls in flight); every call a caller
# made ends as "call ok" or "call failed" (those refused before sending too: --deadline passed).
KINDS = ("sent", "returned", "call ok", "call failed", "reask", "fallback", "search")


class Activity:
    """Thread-safe counters (backends answer on worker threads and event loops alike)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter = Counter()

    def add(self, kind: str, n: int = 1) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown activity {kind!r}; expected one of {', '.join(KINDS)}")
        with self._lock:
            self._counts[kind] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {k: self._counts[k] for k in KINDS}

    def since(self, before: dict[str, int]) -> dict[str, int]:
        """What was counted after ``before`` (a snapshot), per kind."""
        now = self.snapshot()
        return {k: now[k] - before.get(k, 0) for k in KINDS}


ACTIVITY = Activity()


def note(kind: str, n: int = 1) -> None:
    """Count ``n`` of ``kind`` (one of :data:`KINDS`)."""
    ACTIVITY.add(kind, n)
