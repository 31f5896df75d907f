"""The live view of every model-calling command: what is happening while it works.

It reads the library's counters (:mod:`deepr.activity`: calls sent, returned, worked, failed,
re-asks, fallbacks, searches) and the command's own units (trees, pairs, questions) and shows
them with the elapsed time against ``--deadline``. On a terminal it is a rich live display; on
anything else (CI, a log file) it prints a plain line when a unit finishes, when the phase
changes and every ``every`` seconds, and a last line at the end.

    with LiveView("build-trees", total=20, unit="trees", deadline=240) as view:
        ...                 # model calls, searches: counted by the library
        view.advance()      # one tree finished
        view.phase("plan")  # what a single run is doing now
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from deepr.activity import ACTIVITY


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class LiveView:
    """Counters since the view opened, on ``console`` (the CLI's stderr console by default)."""

    def __init__(self, label: str, *, total: int | None = None, unit: str = "", deadline: float | None = None,
                 console: Console | None = None, every: float = 10.0) -> None:
        if console is None:
            from deepr.cli.app import console as cli_console

            console = cli_console
        self.label, self.total, self.unit, self.deadline = label, total, unit, deadline
        self.console, self.every = console, every
        self.done, self.now = 0, ""
        self._before = ACTIVITY.snapshot()
        self._t0 = time.monotonic()
        self._live: Any = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._printed, self._last = "", 0.0

    # -- what the command tells it -------------------------------------------------------------

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._plain(force=True)

    def phase(self, text: str) -> None:
        if text != self.now:
            self.now = text
            self._plain()

    # -- what it shows -------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Since the view opened: calls done, in flight and failed, re-asks, fallbacks, searches."""
        c = ACTIVITY.since(self._before)
        return {"calls done": c["call ok"], "in flight": max(c["sent"] - c["returned"], 0),
                "failed": c["call failed"], "re-asks": c["reask"], "fallbacks": c["fallback"],
                "searches": c["search"]}

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def clock(self) -> str:
        """Elapsed time, and the deadline with what is left of it (or that it was reached)."""
        spent = self.elapsed()
        if self.deadline is None:
            return f"{_clock(spent)} elapsed, no deadline"
        left = self.deadline - spent
        state = f"{_clock(left)} left" if left > 0 else "reached"
        return f"{_clock(spent)} elapsed of --deadline {self.deadline:g} s ({state})"

    def units(self) -> str:
        if self.total is None:
            return ""
        return f"{self.done}/{self.total} {self.unit}".strip()

    def line(self) -> str:
        """The whole state on one line (what a log gets)."""
        c = self.counts()
        parts = [self.units(), self.now,
                 f"calls {c['calls done']} done, {c['in flight']} in flight, {c['failed']} failed",
                 f"re-asks {c['re-asks']}", f"fallbacks {c['fallbacks']}", f"searches {c['searches']}", self.clock()]
        return f"{self.label}: " + " · ".join(p for p in parts if p)

    def __rich__(self) -> Table:
        c = self.counts()
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        grid.add_row(Text(self.label, style="bold cyan"), Text(self.clock()))
        if self.now:
            grid.add_row("now", Text(self.now, style="cyan"))
        if self.total is not None:
            width = 30
            filled = int(width * self.done / self.total) if self.total else width
            grid.add_row(self.unit or "done", Text("━" * filled, style="green") + Text("━" * (width - filled),
                                                                                       style="grey37")
                         + Text(f" {self.done}/{self.total}"))
        grid.add_row("model calls", Text(f"{c['calls done']} done · {c['in flight']} in flight · ")
                     + Text(f"{c['failed']} failed", style="red" if c["failed"] else ""))
        grid.add_row("re-asks", str(c["re-asks"]))
        grid.add_row("fallbacks", Text(str(c["fallbacks"]), style="yellow" if c["fallbacks"] else ""))
        grid.add_row("searches", str(c["searches"]))
        return grid

    # -- showing it ----------------------------------------------------------------------------

    def __enter__(self) -> LiveView:
        if self.console.is_terminal:
            from rich.live import Live

            # a recording console keeps every redraw: a recorded run (docs/img) shows the last state
            self._live = Live(self, console=self.console, refresh_per_second=4, transient=False,
                              auto_refresh=not self.console.record)
            self._live.start()
        else:
            self._plain(force=True)
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if exc[0] is None:
            self.now = "done"
        elif issubclass(exc[0], KeyboardInterrupt):
            self.now = "interrupted"
        if self._live is not None:
            self._live.stop()  # leaves the last state on screen above the summary
        else:
            if self._ticker is not None:
                self._ticker.join()
            self._plain(force=True)

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            self._plain(force=True)

    def _plain(self, force: bool = False) -> None:
        """One line on a console that is not a terminal (nothing on a terminal: Live redraws)."""
        if self._live is not None or self.console.is_terminal:
            return
        # a new phase prints at most every 2 s: a batch of many-phase runs must not flood a log
        now = time.monotonic()
        if force or (self.now != self._printed and now - self._last >= 2.0):
            self._printed, self._last = self.now, now
            self.console.print(self.line(), markup=False, highlight=False, soft_wrap=True)
