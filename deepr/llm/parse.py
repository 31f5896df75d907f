"""One robust parser for model replies that should carry JSON.

Open models leak ``<think>…</think>`` blocks and wrap JSON in prose or code fences.
:func:`ask_json` strips thinking, finds the first JSON value of the wanted kind, validates
it against a pydantic schema and optional code checks, and re-asks the model with the exact
error (bounded). It never raises on a bad reply: the result says ok or why not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from deepr.llm.base import LLM, LLMError, Message
from deepr.llm.schema import drop_nulls

_THINK_BLOCK = re.compile(r"<think(?:ing)?>.*?</think(?:ing)?>", re.S | re.I)
_THINK_OPEN = re.compile(r"<think(?:ing)?>", re.I)
_THINK_CLOSE = re.compile(r"</think(?:ing)?>", re.I)
_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.S)


class JSONExtractError(ValueError):
    """No usable JSON value in a reply; the message says what was found instead."""


def strip_thinking(text: str) -> str:
    """Remove reasoning blocks, including an unclosed one and a bare leading ``</think>``."""
    text = _THINK_BLOCK.sub("", text)
    close = list(_THINK_CLOSE.finditer(text))
    if close:  # some chat templates emit only the closing tag
        text = text[close[-1].end():]
    m = _THINK_OPEN.search(text)
    if m:  # a block that never closed: everything after it is reasoning
        text = text[: m.start()]
    return text.strip()


def _decode_from(text: str, kinds: tuple[type, ...]) -> Any:
    decoder = json.JSONDecoder(strict=False)  # a raw newline or tab inside a string is still the model's JSON
    for i, ch in enumerate(text):
        if ch not in "{[":
            continue
        try:
            value, _ = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            continue
        if isinstance(value, kinds):
            return value
    raise JSONExtractError


def extract_json(text: str, want: str | None = None) -> Any:
    """First JSON object/array in ``text`` (fenced blocks first), after stripping thinking.

    ``want`` is "object", "array" or None (either).
    """
    kinds: tuple[type, ...] = {"object": (dict,), "array": (list,)}.get(want or "", (dict, list))
    body = strip_thinking(text)
    if not body:
        raise JSONExtractError("the reply is empty (after removing any <think> block)")
    for block in _FENCE.findall(body):
        try:
            return _decode_from(block, kinds)
        except JSONExtractError:
            continue
    try:
        return _decode_from(body, kinds)
    except JSONExtractError:
        pass
    what = want or "object or array"
    if "{" in body or "[" in body:
        raise JSONExtractError(f"no valid JSON {what} found; the braces present do not parse as JSON "
                               "(check quotes, trailing commas and unclosed brackets)")
    raise JSONExtractError(f"no JSON {what} found in the reply; it starts with {body[:60]!r}")


@dataclass
class Parsed:
    """Outcome of :func:`ask_json`: the validated value, or the reason it failed."""

    ok: bool
    value: Any = None
    error: str | None = None
    attempts: int = 0
    replies: list[str] = field(default_factory=list)


def _validate(data: Any, schema: type[BaseModel] | TypeAdapter | None) -> Any:
    if schema is None:
        return data
    if isinstance(schema, TypeAdapter):
        return schema.validate_python(data)
    return schema.model_validate(data)


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:8]:
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        parts.append(f"{loc}: {e['msg']}")
    more = len(err.errors()) - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def parse_reply(reply: str, schema: type[BaseModel] | TypeAdapter | None = None, *,
                want: str | None = None,
                check: Callable[[Any], Sequence[str]] | None = None,
                nulls_absent: bool = False) -> tuple[Any, str | None]:
    """Parse one reply: (value, None) or (None, reason). No model call. ``nulls_absent``: a null
    field counts as left out (a strict schema sends optional fields as required nullable ones)."""
    if want is None and isinstance(schema, type) and issubclass(schema, BaseModel):
        want = "object"
    try:
        data = extract_json(reply, want)
        value = _validate(drop_nulls(data) if nulls_absent else data, schema)
    except JSONExtractError as e:
        return None, str(e)
    except ValidationError as e:
        return None, f"the JSON does not match the expected shape: {_describe(e)}"
    if check is not None:
        problems = list(check(value))
        if problems:
            return None, "constraint violations: " + "; ".join(problems)
    return value, None


REASK = ("Your previous reply could not be used: {error}\n"
         "Reply again with only the corrected JSON, no other text.")


async def ask_json(llm: LLM, messages: Sequence[Message],
                   schema: type[BaseModel] | TypeAdapter | None = None, *,
                   role: str | None = None, want: str | None = None,
                   check: Callable[[Any], Sequence[str]] | None = None,
                   max_reasks: int = 2, **chat_kw: Any) -> Parsed:
    """Ask for JSON; on a parse, schema or ``check`` failure re-ask with the error, at most
    ``max_reasks`` times; a failed call (after the backend's own retries) ends it at once."""
    convo = list(messages)
    result = Parsed(ok=False)
    for _ in range(max_reasks + 1):
        result.attempts += 1
        try:
            reply = await llm.achat(convo, role=role, **chat_kw)
        except LLMError as e:
            result.error = f"model call failed: {e}"
            return result
        result.replies.append(reply)
        value, error = parse_reply(reply, schema, want=want, check=check)
        if error is None:
            result.ok, result.value, result.error = True, value, None
            return result
        result.error = error
        convo = convo + [{"role": "assistant", "content": reply},
                         {"role": "user", "content": REASK.format(error=error)}]
    result.error = f"gave up after {result.attempts} attempts: {result.error}"
    return result
