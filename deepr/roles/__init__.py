"""The role seam: a model role is one declaration, and one executor performs any role (the
shared acceptance checks roles opt into are in :mod:`deepr.roles.acceptance`).

A :class:`Role` says everything about one model turn: its name and action, the messages it
sends (``messages(inp)``), the shape of its reply (:class:`JSONReply` from a pydantic schema,
or :class:`TaggedReply` for ``<tag>text</tag>`` replies; both give the backend an
:class:`~deepr.llm.base.OutputFormat` for constrained decoding and parse the reply), its code
checks, its default generation limits, and its non-LLM implementation (``extractive(inp)``,
which returns the reply a model should have given, already parsed).

:func:`perform` runs a role. With no model (``llm=None``: the stage was configured with
``--llm extractive``) it records the role's own ``extractive(inp)`` as the turn; otherwise model call → parse → checks → bounded
re-asks (sampled, so a greedy model does not repeat itself) → recorded fallback. A :class:`CallPolicy` (a profile, :mod:`deepr.profiles`) may
replace a call's decoding format or prompt and chooses how a refused reply is asked again; it
travels with the call, so role modules never see it. Every outcome is written to a :class:`Recorder` as one
:class:`~deepr.records.Turn` (prompt + accepted completion), and every model call as a
:class:`~deepr.records.ModelCall`, so every stage yields trajectories the same way.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from pydantic import BaseModel, TypeAdapter

from deepr import activity
from deepr.llm.base import LLM, LLMError, Message, OutputFormat
from deepr.llm.context import CHARS_PER_TOKEN, context_length, prompt_tokens, trim_evidence  # noqa: F401
from deepr.llm.parse import parse_reply, strip_thinking
from deepr.llm.schema import strict_schema
from deepr.roles.recorder import NO_MODEL, Recorder, engine_info, engine_label, prompt_hash  # noqa: F401 - the seam's names

I = TypeVar("I")  # noqa: E741 - the role's input
T = TypeVar("T")

REASK_TEMPERATURE = 0.7  # re-asks sample: a greedy model would return the same reply again
_THOUGHT = re.compile(r"<thought>.*?</thought>", re.S | re.I)
JSON_REASK = ("Your previous reply could not be used: {error}\n"
              "Reply again with only the corrected JSON, no other text.")
TEXT_REASK = "Your previous reply could not be used: {error}\nReply again with the corrected text{where}."


# --- reply shapes -------------------------------------------------------------------------


def body_of(reply: str, tag: str | None) -> str:
    """The usable part of a prose reply: thinking removed, the ``<tag>`` body if present."""
    text = _THOUGHT.sub("", strip_thinking(reply)).strip()
    if tag:
        m = re.search(rf"<{tag}>(.*?)(?:</{tag}>|$)", text, re.S | re.I)
        if m:
            text = m.group(1).strip()
    return text


@functools.cache
def _json_schema(model: type[BaseModel]) -> str:
    """pydantic rebuilds a schema on every call (~6 ms): once per model class instead, since one
    evidence tree makes ~370 calls on the event loop thread (docs/experiments.md)."""
    return json.dumps(strict_schema(model.model_json_schema()))


@dataclass(frozen=True)
class JSONReply:
    """A JSON reply validated by ``schema`` (a pydantic model, a TypeAdapter, or None: any JSON).

    The decoding format is the schema's strict form (:func:`deepr.llm.schema.strict_schema`):
    every property required, optional ones nullable, no other keys, so OpenAI's strict structured
    outputs and every grammar engine take it. ``shape`` gives the format instead when ``schema``
    cannot (a pydantic model, or a function of the call's input returning a JSON schema).
    """

    schema: type[BaseModel] | TypeAdapter | None = None
    want: str | None = "object"
    shape: type[BaseModel] | Callable[[Any], dict[str, Any]] | None = None

    def fmt(self, name: str, inp: Any = None) -> OutputFormat:
        model = self.schema if isinstance(self.schema, type) else self.shape
        if isinstance(model, type):
            js = json.loads(_json_schema(model))  # a fresh dict: backends may adapt it
        elif model is not None:
            js = strict_schema(model(inp))
        elif isinstance(self.schema, TypeAdapter):
            js = strict_schema(self.schema.json_schema())
        else:
            js = {"type": "array" if self.want == "array" else "object"}
        return OutputFormat(name, json_schema=js)

    def parse(self, reply: str) -> tuple[Any, str | None]:
        value, error = parse_reply(reply, self.schema, want=self.want, nulls_absent=True)
        return (value.model_dump() if isinstance(value, BaseModel) else value), error

    def render(self, value: Any) -> str:
        return json.dumps(value.model_dump() if isinstance(value, BaseModel) else value, ensure_ascii=False)

    def reask(self, error: str) -> str:
        return JSON_REASK.format(error=error)


@dataclass(frozen=True)
class TaggedReply:
    """Prose inside ``<tag>…</tag>`` (optionally after a ``<think>`` block).

    ``regex`` overrides the decoding constraint (e.g. a reply that may be one of two tags);
    ``required`` rejects a reply without the tag instead of using the whole reply.
    """

    tag: str
    regex: str | None = None
    required: bool = False

    def fmt(self, name: str, inp: Any = None) -> OutputFormat:
        t = self.tag
        return OutputFormat(name, regex=self.regex or rf"(<think>[^<]*</think>[ \n]*)?<{t}>[^<]+</{t}>")

    def parse(self, reply: str) -> tuple[Any, str | None]:
        if self.required and not re.search(rf"<{self.tag}>", reply, re.I):
            return None, f"the reply has no {self.tag} tag around its text"
        body = body_of(reply, self.tag)
        if not body:
            return None, f"the reply is empty (expected the text inside the {self.tag} tags)"
        return body, None

    def render(self, value: Any) -> str:
        return value if self.regex else f"<{self.tag}>{value}</{self.tag}>"

    def reask(self, error: str) -> str:
        return TEXT_REASK.format(error=error, where=f", between an opening and a closing {self.tag} tag")


Output = JSONReply | TaggedReply


class CallPolicy(Protocol):
    """What a profile may change about one call (see :class:`deepr.profiles.Profile`)."""

    reask: str  # "correct": show the refused reply and why; "resample": same prompt, new seed

    def format(self, role: Any, inp: Any, messages: Sequence[Message]) -> OutputFormat | None: ...

    def messages(self, role: Any, inp: Any) -> list[Message] | None: ...

    def precheck(self, role: Any, inp: Any) -> str | None: ...


class RoleFailed(Exception):
    """Raised by a non-LLM implementation (or fallback) that cannot produce a value; the
    executor records it as the role's failure with this reason."""


# --- the declaration ----------------------------------------------------------------------


def _same(inp: Any, value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Role(Generic[I, T]):
    """One model role; see the module docstring.

    ``extractive(inp)`` and ``fallback(inp)`` return a reply value of the same shape as a
    parsed model reply (a dict for JSON roles, text for tagged ones); ``result(inp, value)``
    turns any accepted value into what the caller uses. ``fallback`` defaults to the
    extractive implementation; ``fallback=None`` means a failed turn has no value.
    ``on_fail`` is the decision recorded when the fallback stands in (``{field}`` names are
    filled from the turn's extra fields); ``parts`` names the report parts it wrote.
    """

    name: str
    action: str
    messages: Callable[[I], list[Message]]
    output: Output
    extractive: Callable[[I], Any]
    check: Callable[[I, Any], Sequence[str]] | None = None
    result: Callable[[I, Any], T] = _same
    fallback: Callable[[I], Any] | None | str = "extractive"
    on_fail: str = "{role}/{action} done by the extractive implementation after the model failed"
    parts: Callable[[I], list[str]] | None = None
    max_tokens: int = 1024
    temperature: float | None = None
    turn_action: Callable[[Any], str] | None = None
    direct: bool = False  # extractive() returns the result itself (a judge's local score), not a reply
    accept: tuple[Callable[[Any, Sequence[Message], Sequence[str]], list[str]], ...] = ()  # deepr.roles.acceptance
    # A smaller input for a prompt over the model's context (step 1, 2, …; None: nothing left to
    # cut). It should drop evidence first; the executor then trims evidence lines itself.
    shrink: Callable[[I, int], I | None] | None = None


@dataclass
class Outcome(Generic[T]):
    """What performing a role gave: ``by`` is "llm", "extractive", "fallback" or "failed"."""

    value: T | None
    by: str
    error: str | None = None
    attempts: int = 0
    reply: str | None = None  # the last raw reply (a multi-turn loop continues from it)

    @property
    def ok(self) -> bool:
        return self.by in ("llm", "extractive")


# --- recording ----------------------------------------------------------------------------


# --- the context budget -------------------------------------------------------------------

# context_length, prompt_tokens and trim_evidence live in deepr.llm.context (no role needed).


@dataclass
class _Fit:
    messages: list[Message]
    inp: Any
    error: str | None = None


def fit_context(role: Role, inp: Any, llm: LLM, max_tokens: int, rec: Recorder,
                policy: CallPolicy | None = None) -> _Fit:
    """The role's messages made to fit the model's context with room for ``max_tokens``: the
    role's ``shrink`` first, then evidence lines trimmed; else a clear error, before any call."""
    def make(x: Any) -> list[Message]:
        return (policy.messages(role, x) if policy is not None else None) or role.messages(x)

    messages = make(inp)
    limit = context_length(llm)
    if limit is None:
        return _Fit(messages, inp)
    if llm.gen.max_tokens is not None:
        max_tokens = min(max_tokens, llm.gen.max_tokens)
    budget = limit - max_tokens
    first = need = prompt_tokens(llm, messages)
    step = 0
    while need > budget and role.shrink is not None:
        step += 1
        smaller = role.shrink(inp, step)
        if smaller is None:
            break
        inp, messages = smaller, make(smaller)
        need = prompt_tokens(llm, messages)
    while need > budget:
        trimmed = trim_evidence(messages, (need - budget) * CHARS_PER_TOKEN)
        if trimmed is None:
            break
        messages, need = trimmed, prompt_tokens(llm, trimmed)
    if need > budget:
        return _Fit(messages, inp, f"{role.name}/{role.action}: the prompt needs about {need} tokens "
                    f"(from {first} before trimming evidence) plus max_tokens {max_tokens}, more than the "
                    f"model's context of {limit} tokens; lower --max-tokens, give less evidence or use a "
                    "model with a longer context")
    if need != first:
        rec.decide(f"{role.name}/{role.action}: prompt trimmed to fit the model's context",
                   tokens_before=first, tokens_after=need, context=limit, max_tokens=max_tokens)
    return _Fit(messages, inp)


# --- the executor -------------------------------------------------------------------------


@dataclass
class _Attempts:
    ok: bool = False
    value: Any = None
    error: str | None = None
    attempts: int = 0
    replies: list[str] = field(default_factory=list)


def _problems(role: Role, inp: Any, value: Any, messages: list[Message], convo: list[Message]) -> str | None:
    """Strict acceptance and the role's own checks, all reported at once for the re-ask."""
    sent = [m["content"] for m in convo[len(messages):] if m["role"] == "user"]
    rejected = [p for accept in role.accept for p in accept(value, messages, sent)]
    violated = list(role.check(inp, value)) if role.check is not None else []
    parts = ([f"not accepted: {'; '.join(rejected)}"] if rejected else []) + (
        [f"constraint violations: {'; '.join(violated)}"] if violated else [])
    return "; ".join(parts) or None


def judge_reply(role: Role, inp: Any, reply: str, messages: list[Message],
                convo: list[Message] | None = None) -> tuple[Any, str | None]:
    """What the executor makes of one reply to ``messages`` (``convo``: the conversation it
    answered, re-asks included): ``(value, None)`` when accepted, else ``(None, reason)``. GRPO's
    rollouts judge sampled turns with it, so training rewards what ``deepr run`` accepts."""
    value, error = role.output.parse(reply)
    if error is None:
        error = _problems(role, inp, value, messages, list(convo or messages))
    return (value, None) if error is None else (None, error)


def _format(role: Role, inp: Any, policy: CallPolicy | None, messages: list[Message]) -> OutputFormat:
    built = policy.format(role, inp, messages) if policy is not None else None
    return built or role.output.fmt(f"{role.name}.{role.action}", inp)


async def _ask(role: Role, inp: Any, messages: list[Message], llm: LLM, rec: Recorder, max_reasks: int,
               temperature: float | None, max_tokens: int, earlier: int = 0,
               policy: CallPolicy | None = None) -> _Attempts:
    out = _Attempts()
    convo, fmt = list(messages), _format(role, inp, policy, messages)
    resample = policy is not None and policy.reask == "resample"
    wrapped = rec.llm(llm, role.name, role.action)
    limit = context_length(llm)
    for n in range(max_reasks + 1):
        room = min(max_tokens, llm.gen.max_tokens) if llm.gen.max_tokens is not None else max_tokens
        if n and limit is not None and prompt_tokens(llm, convo) + room > limit:
            # The re-ask repeats the whole exchange; past the context the backend would refuse it.
            out.error = f"{out.error}; a re-ask would not fit the model's context of {limit} tokens"
            break
        out.attempts += 1
        if n:
            activity.note("reask")
        temp = temperature if n == 0 else max(temperature or 0.0, REASK_TEMPERATURE)
        # a resampled re-ask sends the same prompt: only a new seed makes its sample differ
        seed = (llm.gen.seed or 0) + earlier + n if (n or earlier) and resample else None
        try:
            reply = await wrapped.achat(convo, role=role.name, temperature=temp, max_tokens=max_tokens, fmt=fmt,
                                        seed=seed)
        except LLMError as e:
            out.attempts += e.attempts - 1  # the backend's own retries were requests too
            out.error = f"model call failed: {e}"
            return out
        out.replies.append(reply)
        if getattr(reply, "truncated", False):
            value, error = None, f"the reply was cut at max_tokens ({room}); write a shorter reply"
        else:
            value, error = judge_reply(role, inp, reply, messages, convo)
        if error is None:
            out.ok, out.value, out.error = True, value, None
            return out
        out.error = error
        rec.rejected += 1
        llm.usage.rejected += 1  # the backend's accounting, which stage sidecars and demo summaries report
        if not resample:
            convo = convo + [{"role": "assistant", "content": reply},
                             {"role": "user", "content": role.output.reask(error)}]
    if out.attempts > 1:
        out.error = f"gave up after {out.attempts} attempts: {out.error}"
    return out


async def perform(role: Role[I, T], inp: I, *, llm: LLM | None, rec: Recorder, max_reasks: int = 2,
                  temperature: float | None = None, max_tokens: int | None = None, earlier: int = 0,
                  profile: CallPolicy | None = None, **extra: Any) -> Outcome[T]:
    """Perform ``role`` on ``inp``; see the module docstring. ``extra`` goes into the turn record.

    ``temperature`` / ``max_tokens`` override the role's defaults (the user's settings).
    ``earlier``: attempts the caller's own loop already made at this turn (tools mode re-asks in
    its conversation), so a resampled attempt draws a seed none of them used. ``profile``: the
    model's profile (None: the role's own formats, refused replies corrected). ``llm=None``: the
    extractive engine, chosen where the stage is configured and passed down to here.
    """
    if llm is None:  # no model: the role's own implementation
        return _perform_extractive(role, inp, rec, extra)
    fit = fit_context(role, inp, llm, max_tokens or role.max_tokens, rec, profile)
    messages = fit.messages
    skip = fit.error or (profile.precheck(role, fit.inp) if profile is not None else None)
    if skip is not None:
        got = _Attempts(error=skip)  # nothing is sent: no reply could pass, or the backend would refuse it
    else:
        got = await _ask(role, fit.inp, messages, llm, rec, max_reasks,
                         role.temperature if temperature is None else temperature, max_tokens or role.max_tokens,
                         earlier, profile)
    last = got.replies[-1] if got.replies else None
    action = role.turn_action(got.value) if (role.turn_action and got.ok) else role.action
    rec.turn(role.name, action, messages, last or "", ok=got.ok, attempts=got.attempts,
             **({} if got.ok else {"error": got.error}), **extra)
    if got.ok:
        rec.engines["llm"] += 1
        return Outcome(role.result(inp, got.value), "llm", attempts=got.attempts, reply=last)
    error = got.error or "no usable reply"
    backup = role.extractive if role.fallback == "extractive" else role.fallback
    if backup is None:
        return failed(role, rec, error, got.attempts, last, extra)
    rec.fail(f"{role.name}/{role.action}", error, role=role.name, attempts=got.attempts, **extra)
    try:
        value = backup(inp)
    except RoleFailed as e:
        return failed(role, rec, f"{error}; the fallback failed too: {e}", got.attempts, last, {}, record=False)
    note = role.on_fail.format(role=role.name, action=role.action, **extra)
    rec.decide(note, reason=error, **({"fallback": role.parts(inp)} if role.parts else {}))
    rec.engines["fallback"] += 1
    activity.note("fallback")
    return Outcome(role.result(inp, value), "fallback", error, got.attempts, last)


def _perform_extractive(role: Role, inp: Any, rec: Recorder, extra: dict[str, Any]) -> Outcome:
    """``role.extractive(inp)`` recorded as the role's turn: the messages a model would have been
    sent and the reply it should have given, so every stage yields trajectories the same way."""
    messages = role.messages(inp)
    try:
        value = role.extractive(inp)
    except RoleFailed as e:
        rec.turn(role.name, role.action, messages, "", ok=False, attempts=0, extractive=True, error=str(e), **extra)
        return failed(role, rec, str(e), 0, None, extra)
    action = role.turn_action(value) if role.turn_action else role.action
    shown = json.dumps(value, default=str) if role.direct else role.output.render(value)
    rec.turn(role.name, action, messages, shown, ok=True, attempts=1, extractive=True, **extra)
    rec.engines["extractive"] += 1
    return Outcome(value if role.direct else role.result(inp, value), "extractive", attempts=0)


def failed(role: Role, rec: Recorder, error: str, attempts: int, reply: str | None, extra: dict[str, Any],
           *, record: bool = True) -> Outcome:
    """The outcome of a role that has no value, recorded as a failure (``record``) and counted."""
    if record:
        rec.fail(f"{role.name}/{role.action}", error, role=role.name, attempts=attempts, **extra)
    rec.engines["failed"] += 1
    return Outcome(None, "failed", error, attempts, reply)
