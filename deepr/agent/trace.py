"""The audit trace of one ``deepr run``: every plan, tool call, model call and decision.

:class:`Tracer` collects the record while the agent works and turns it into

- a :class:`~deepr.records.RunTrace` (the ``report.json`` sidecar, SPEC §10: query, mode,
  plans, calls, tools, citations, report, plus decisions, waves, timings, failures), and
- a :class:`~deepr.records.Trajectory` for ``--record``: one :class:`~deepr.records.Turn`
  per model turn, tagged role/action, holding the exact prompt messages and the accepted
  completion, so ``prune-trajectories`` can make SFT examples of it.

Model calls are captured by wrapping the LLM (:meth:`Tracer.llm`), so re-asks made inside
:func:`deepr.llm.parse.ask_json` are audited one by one.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from deepr.llm.base import LLM, LLMError, Message, Reply
from deepr.records import Citation, ModelCall, Plan, RubricItem, RunTrace, Trajectory, Turn


def prompt_hash(messages: Sequence[Message]) -> str:
    blob = json.dumps(list(messages), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4) if text else 0


class _RecordedLLM(LLM):
    """Delegates to the real backend and appends a ModelCall per call to the tracer."""

    def __init__(self, inner: LLM, tracer: Tracer, role: str, action: str):
        super().__init__(max_concurrency=1 << 16)  # the inner backend bounds concurrency
        self.inner, self.tracer, self.role, self.action = inner, tracer, role, action
        self.name = inner.name
        self.is_extractive = inner.is_extractive
        self.usage = inner.usage

    async def _achat(self, messages: list[Message], *, role: str | None, temperature: float | None,
                     max_tokens: int | None, stop: Sequence[str] | None, **extra: Any) -> Reply:
        tr = self.tracer
        before = (self.inner.usage.prompt_tokens, self.inner.usage.completion_tokens)
        tr._in_flight += 1
        alone = tr._in_flight == 1
        t0 = time.perf_counter()
        try:
            reply = await self.inner.achat(messages, role=role or self.role, temperature=temperature,
                                           max_tokens=max_tokens, stop=stop, **extra)
        except LLMError as e:
            tr.calls.append(ModelCall(role=self.role, action=self.action, prompt_hash=prompt_hash(messages),
                                      reply="", latency_s=round(time.perf_counter() - t0, 4), ok=False,
                                      error=str(e)))
            raise
        finally:
            tr._in_flight -= 1
        after = (self.inner.usage.prompt_tokens, self.inner.usage.completion_tokens)
        counted = alone and after != before
        p_tok = after[0] - before[0] if counted else _estimate_tokens(json.dumps(messages, ensure_ascii=False))
        c_tok = after[1] - before[1] if counted else _estimate_tokens(reply)
        tr.calls.append(ModelCall(role=self.role, action=self.action, prompt_hash=prompt_hash(messages),
                                  reply=reply, latency_s=round(time.perf_counter() - t0, 4),
                                  prompt_tokens=p_tok, completion_tokens=c_tok,
                                  tokens_estimated=not counted, constrained=reply.constrained,
                                  truncated=reply.truncated))
        return reply

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


class Tracer:
    """Collects the audit record of one run (see the module docstring)."""

    def __init__(self, query: str, mode: str, *, on_phase: Callable[[str], None] | None = None):
        self.query, self.mode = query, mode
        self.on_phase = on_phase
        self.plans: list[dict[str, Any]] = []
        self.calls: list[ModelCall] = []
        self.tools: list[dict[str, Any]] = []
        self.decisions: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.turns: list[Turn] = []
        self.drafts: list[str] = []
        self.timings: dict[str, float] = {}
        self.extra: dict[str, Any] = {}
        self._in_flight = 0
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

    def llm(self, llm: LLM, role: str, action: str) -> LLM:
        return _RecordedLLM(llm, self, role, action)

    def decide(self, what: str, **details: Any) -> None:
        self.decisions.append({"step": len(self.decisions) + 1, "what": what, **details})

    def fail(self, where: str, reason: str, **details: Any) -> None:
        """A recorded failure: the run goes on, the reason stays in the trace."""
        self.failures.append({"where": where, "reason": reason, **details})
        self.decide(f"failure at {where}", reason=reason, **details)

    def tool(self, tool: str, **entry: Any) -> None:
        self.tools.append({"tool": tool, **entry})

    def plan(self, plan: Plan | dict, *, cycle: int, turn: str, **extra: Any) -> None:
        data = plan.model_dump(exclude_none=True) if isinstance(plan, BaseModel) else dict(plan)
        self.plans.append({"cycle": cycle, "turn": turn, "plan": data, **extra})

    def turn(self, role: str, action: str, messages: Sequence[Message], completion: str, *,
             ok: bool = True, **extra: Any) -> Turn:
        t = Turn(role=role, action=action, messages=[dict(m) for m in messages], completion=completion,
                 ok=ok, **extra)
        self.turns.append(t)
        return t

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
    from deepr.agent.plan import validate_plan, waves

    if not trace.plans:
        raise ValueError("the trace holds no plan (only dag runs record plan graphs)")
    plan, errors = validate_plan(trace.plans[-1]["plan"])
    if plan is None:
        raise ValueError(f"the last plan in the trace is invalid: {'; '.join(errors)}")
    return waves(plan)
