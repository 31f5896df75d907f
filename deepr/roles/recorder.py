"""What a unit of work (a run, a tree, a pair) records: every model call, turn, decision and
failure (:class:`Recorder`), through a wrapper that times and counts each call of a backend."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from deepr.llm.base import LLM, LLMError, Message, Reply
from deepr.records import ModelCall, Turn


_HASH_JSON = json.JSONEncoder(sort_keys=True, ensure_ascii=False)  # json.dumps would build one a call


def prompt_hash(messages: Sequence[Message]) -> str:
    blob = _HASH_JSON.encode(list(messages))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _estimate_tokens(text: str) -> int:
    return max(1, len(text) // 4) if text else 0


class _RecordedLLM(LLM):
    """Delegates to the real backend and appends a ModelCall per call to the recorder."""

    counted = False  # the real backend counts the call

    def __init__(self, inner: LLM, rec: Recorder, role: str, action: str):
        super().__init__(max_concurrency=1 << 16)  # the inner backend bounds concurrency
        self.inner, self.rec, self.role, self.action = inner, rec, role, action
        self.name, self.usage = inner.name, inner.usage

    def label(self) -> str:
        return self.inner.label()

    async def _achat(self, messages: list[Message], *, role: str | None, temperature: float | None,
                     max_tokens: int | None, stop: Sequence[str] | None, **extra: Any) -> Reply:
        rec = self.rec
        before = (self.inner.usage.prompt_tokens, self.inner.usage.completion_tokens)
        rec._in_flight += 1
        alone = rec._in_flight == 1
        t0 = time.perf_counter()
        try:
            reply = await self.inner.achat(messages, role=role or self.role, temperature=temperature,
                                           max_tokens=max_tokens, stop=stop, **extra)
        except LLMError as e:
            rec.calls.append(ModelCall(role=self.role, action=self.action, prompt_hash=prompt_hash(messages),
                                       reply="", latency_s=round(time.perf_counter() - t0, 4), ok=False,
                                       error=str(e)))
            raise
        finally:
            rec._in_flight -= 1
        after = (self.inner.usage.prompt_tokens, self.inner.usage.completion_tokens)
        own = getattr(reply, "tokens", None)
        # The backend's totals also move with calls of other runs beside this one (deepr run --parallel).
        counted = own is not None or (alone and after != before)
        if own is not None:
            p_tok, c_tok = own
        else:
            p_tok = after[0] - before[0] if counted else _estimate_tokens(json.dumps(messages, ensure_ascii=False))
            c_tok = after[1] - before[1] if counted else _estimate_tokens(reply)
        rec.calls.append(ModelCall(role=self.role, action=self.action, prompt_hash=prompt_hash(messages),
                                   reply=reply, latency_s=round(time.perf_counter() - t0, 4),
                                   prompt_tokens=p_tok, completion_tokens=c_tok, tokens_estimated=not counted,
                                   constrained=reply.constrained, truncated=reply.truncated))
        return reply

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


class Recorder:
    """Model calls, turns, decisions and failures of one unit of work (a run, a tree, a pair).

    ``engines`` counts who produced each performed role's value (llm / extractive /
    fallback / failed), the basis of the "written by" notes and stage tables.
    """

    def __init__(self) -> None:
        self.calls: list[ModelCall] = []
        self.turns: list[Turn] = []
        self.decisions: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.engines: Counter = Counter()
        self.rejected = 0  # replies that came back but failed their format or acceptance checks
        self._in_flight = 0

    def llm(self, llm: LLM, role: str, action: str) -> LLM:
        return _RecordedLLM(llm, self, role, action)

    def decide(self, what: str, **details: Any) -> None:
        self.decisions.append({"step": len(self.decisions) + 1, "what": what, **details})

    def fail(self, where: str, reason: str, **details: Any) -> None:
        """A recorded failure: the work goes on, the reason stays in the record."""
        self.failures.append({"where": where, "reason": reason, **details})
        self.decide(f"failure at {where}", reason=reason, **details)

    def turn(self, role: str, action: str, messages: Sequence[Message], completion: str, *,
             ok: bool = True, **extra: Any) -> Turn:
        t = Turn(role=role, action=action, messages=[dict(m) for m in messages], completion=completion,
                 ok=ok, **extra)
        self.turns.append(t)
        return t


NO_MODEL = "extractive"  # how records name the engine without a model (``llm=None``)
NO_MODEL_NOTE = "no language model is used: every role runs a deterministic extractive algorithm"


def engine_label(llm: LLM | None) -> str:
    """How records name who answered: "extractive" for the non-LLM engine, else "llm:<backend>[:model]"."""
    return NO_MODEL if llm is None else llm.label()


def engine_info(llm: LLM | None) -> dict[str, Any]:
    """The engine as a stage's provenance sidecar and a run's trace describe it."""
    return {"backend": NO_MODEL, "model": None, "note": NO_MODEL_NOTE} if llm is None else llm.describe()
