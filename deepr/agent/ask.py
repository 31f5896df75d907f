"""How agent roles talk to a model: one call helper that parses, checks, re-asks and records.

- :func:`ask_structured` sends a prompt expecting JSON through
  :func:`deepr.llm.parse.ask_json` (schema + code checks, bounded re-asks);
- :func:`ask_text` does the same for prose replies (a report section, an answer), with an
  optional ``<tag>`` that holds the reply body;
- :func:`record_extractive` records what a deterministic role produced in the same shape
  an LLM would have replied, so extractive runs also yield training trajectories.

Every outcome lands in the trace as a :class:`~deepr.records.Turn` tagged with the role
and action: the original prompt messages and the accepted completion (the reply a model
should learn to give at once), with the number of attempts and the failure reason if any.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, TypeAdapter

from deepr.llm.base import LLM, LLMError, Message
from deepr.llm.parse import Parsed, ask_json, strip_thinking

from deepr.agent.trace import Tracer

_THOUGHT = re.compile(r"<thought>.*?</thought>", re.S | re.I)
TEXT_REASK = "Your previous reply could not be used: {error}\nReply again with the corrected text{where}."


async def ask_structured(tracer: Tracer, llm: LLM, messages: Sequence[Message], *, role: str, action: str,
                         schema: type[BaseModel] | TypeAdapter | None = None,
                         check: Callable[[Any], Sequence[str]] | None = None, want: str | None = "object",
                         max_reasks: int = 2, turn_action: Callable[[Any], str] | None = None,
                         turn_extra: dict[str, Any] | None = None, **chat_kw: Any) -> Parsed:
    """Ask for JSON (validated and checked in code), record the turn, return the outcome."""
    result = await ask_json(tracer.llm(llm, role, action), messages, schema, role=role, want=want,
                            check=check, max_reasks=max_reasks, **chat_kw)
    act = turn_action(result.value) if (turn_action and result.ok) else action
    _record(tracer, role, act, messages, result, turn_extra)
    return result


def body_of(reply: str, tag: str | None) -> str:
    """The usable part of a prose reply: thinking removed, the ``<tag>`` body if present."""
    text = _THOUGHT.sub("", strip_thinking(reply)).strip()
    if tag:
        m = re.search(rf"<{tag}>(.*?)(?:</{tag}>|$)", text, re.S | re.I)
        if m:
            text = m.group(1).strip()
    return text


async def ask_text(tracer: Tracer, llm: LLM, messages: Sequence[Message], *, role: str, action: str,
                   check: Callable[[str], Sequence[str]] | None = None, tag: str | None = None,
                   max_reasks: int = 2, turn_extra: dict[str, Any] | None = None, **chat_kw: Any) -> Parsed:
    """Ask for prose; an empty body or a failed ``check`` is re-asked with the problems."""
    convo = list(messages)
    result = Parsed(ok=False)
    wrapped = tracer.llm(llm, role, action)
    for _ in range(max_reasks + 1):
        result.attempts += 1
        try:
            reply = await wrapped.achat(convo, role=role, **chat_kw)
        except LLMError as e:
            result.error = f"model call failed: {e}"
            break
        result.replies.append(reply)
        body = body_of(reply, tag)
        problems = ["the reply is empty" + (f" (expected the text inside <{tag}>…</{tag}>)" if tag else "")]
        if body:
            problems = list(check(body)) if check else []
        if not problems:
            result.ok, result.value, result.error = True, body, None
            break
        result.error = "; ".join(problems)
        where = f" inside <{tag}>...</{tag}>" if tag else ""
        convo = convo + [{"role": "assistant", "content": reply},
                         {"role": "user", "content": TEXT_REASK.format(error=result.error, where=where)}]
    if not result.ok and result.attempts > max_reasks and not result.error.startswith("model call"):
        result.error = f"gave up after {result.attempts} attempts: {result.error}"
    _record(tracer, role, action, messages, result, turn_extra)
    return result


_TRIES = re.compile(r"failed after (\d+) attempts")


def _requests(result: Parsed) -> int:
    """Requests sent for one turn: each ask, plus the backend's own tries of a call that failed
    for good, so a failure entry agrees with its reason ('failed after 4 attempts')."""
    err = result.error or ""
    m = _TRIES.search(err) if err.startswith("model call failed") else None
    return result.attempts - 1 + int(m.group(1)) if m else result.attempts


def _record(tracer: Tracer, role: str, action: str, messages: Sequence[Message], result: Parsed,
            extra: dict[str, Any] | None = None) -> None:
    completion = result.replies[-1] if result.replies else ""
    attempts = result.attempts if result.ok else _requests(result)
    tracer.turn(role, action, messages, completion, ok=result.ok, attempts=attempts,
                **({} if result.ok else {"error": result.error}), **(extra or {}))
    if not result.ok:
        tracer.fail(f"{role}/{action}", result.error or "no usable reply", attempts=attempts)


def record_extractive(tracer: Tracer, role: str, action: str, messages: Sequence[Message],
                      value: Any, **extra: Any) -> str:
    """Record a deterministic role's output as the completion a model would have given."""
    completion = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    tracer.turn(role, action, messages, completion, ok=True, attempts=1, extractive=True, **extra)
    return completion
