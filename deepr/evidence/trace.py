"""The audit trace of one ``deepr run``: every plan, tool call, model call and decision.

:class:`Tracer` collects the record while the agent works and turns it into

- a :class:`~deepr.records.RunTrace` (the ``report.json`` sidecar: query, mode,
  plans, calls, tools, citations, report, plus decisions, waves, timings, failures), and
- a :class:`~deepr.records.Trajectory` for ``--record``: one :class:`~deepr.records.Turn`
  per model turn, tagged role/action, holding the exact prompt messages and the accepted
  completion, so ``prune-trajectories`` can make SFT examples of it.

It is a :class:`deepr.roles.Recorder` (model calls, turns, decisions, failures, written by
:func:`deepr.roles.perform` for every role) plus what only a run has: plans, tool calls,
phases and timings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from deepr.records import Citation, Plan, RubricItem, RunTrace, Trajectory
from deepr.roles import Recorder


class Tracer(Recorder):
    """Collects the audit record of one run (see the module docstring)."""

    def __init__(self, query: str, mode: str, *, on_phase: Callable[[str], None] | None = None):
        super().__init__()
        self.query, self.mode = query, mode
        self.on_phase = on_phase
        self.plans: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] = []
        self.drafts: list[str] = []
        self.timings: dict[str, float] = {}
        self.extra: dict[str, Any] = {}
        self._t0 = time.perf_counter()

    # --- recording -------------------------------------------------------------------

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase (timings add up when a phase repeats) and report it for progress."""
        if self.on_phase:
            self.on_phase(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = round(self.timings.get(name, 0.0) + time.perf_counter() - t0, 4)

    def tool(self, tool: str, **entry: Any) -> None:
        self.tools.append({"tool": tool, **entry})

    def plan(self, plan: Plan | dict, *, cycle: int, turn: str, **extra: Any) -> None:
        data = plan.model_dump(exclude_none=True) if isinstance(plan, BaseModel) else dict(plan)
        self.plans.append({"cycle": cycle, "turn": turn, "plan": data, **extra})

    # --- outputs ---------------------------------------------------------------------

    def seconds(self) -> float:
        return round(time.perf_counter() - self._t0, 4)

    def run_trace(self, report: str, citations: dict[str, Citation], **extra: Any) -> RunTrace:
        return RunTrace(query=self.query, mode=self.mode, plans=self.plans, calls=self.calls, tools=self.tools,
                        citations=citations, report=report, decisions=self.decisions, failures=self.failures,
                        timings={**self.timings, "total": self.seconds()}, **self.extra, **extra)

    def trajectory(self, traj_id: str, report: str, rubrics: Sequence[RubricItem] = (),
                   **extra: Any) -> Trajectory:
        return Trajectory(id=traj_id, query=self.query, mode=self.mode, turns=self.turns,
                          rubrics=list(rubrics), report=report, drafts=self.drafts, **extra)


def load_trace(path: str | Path) -> RunTrace:
    """Read a ``report.json`` sidecar; errors name the file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such trace (it is written next to the report by deepr run)")
    try:
        return RunTrace.model_validate_json(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not a deepr run trace: {str(e).splitlines()[0]}") from None


def replay_waves(trace: RunTrace) -> list[list[str]]:
    """Recompute the answerer's waves from the final plan stored in the trace."""
    from deepr.evidence.plan import validate_plan, waves

    if not trace.plans:
        raise ValueError("the trace holds no plan (only dag runs record plan graphs)")
    plan, errors = validate_plan(trace.plans[-1]["plan"])
    if plan is None:
        raise ValueError(f"the last plan in the trace is invalid: {'; '.join(errors)}")
    return waves(plan)
