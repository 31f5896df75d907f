"""The one LLM interface every role talks to: chat messages in, text out.

Roles never import an SDK. They receive an :class:`LLM` and call ``await llm.achat(...)``
(or ``abatch`` for many independent prompts); backends bound concurrency themselves, so
gathering hundreds of calls is safe. The engine without a model is no backend at all: a stage
configured with ``--llm extractive`` passes ``llm=None``, and the role executor
(:func:`deepr.roles.perform`) then runs each role's own implementation.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from deepr.activity import note

Message = dict[str, str]  # {"role": "system"|"user"|"assistant", "content": str}
T = TypeVar("T")


class LLMError(RuntimeError):
    """A call that failed for good (after the bounded retries), with the reason. ``attempts`` is
    how many requests the backend sent for it (its retries included)."""

    attempts: int = 1


AUTH_STATUSES = (401, 403)


@dataclass(frozen=True)
class OutputFormat:
    """The shape a role's reply must take, for backends that can constrain decoding to it.

    Exactly one of ``json_schema`` (a JSON Schema dict, built from the role's pydantic model)
    or ``regex`` (for tagged-text replies such as ``<search>...</search>``) is set. Backends
    that cannot constrain a format ignore it; the caller still parses and checks the reply.
    ``distinct_words``, ``guard`` and ``decoding`` are honoured by the hf backend only (the acceptance checks
    and the role's own check still refuse what they would have prevented, from any backend).
    """

    name: str
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    # No content word twice inside one JSON string (a search query of "Han emperor emperor" or
    # "art movement art style art"): the hf backend bans the tokens that would start it again.
    distinct_words: bool = False
    # A rule across the parts of a reply that a schema cannot state (a plan's inputs naming each id
    # once; its answer reading every node nothing else reads): an object with ``watching(text)``
    # (can the next token break it here?) and ``viable(text)`` (can a reply starting with this
    # still pass?), e.g. :class:`deepr.profiles.plan_guard.PlanGuard`. The hf backend bans the
    # candidate tokens that make the reply so far not viable.
    guard: Any = field(default=None, compare=False)
    # Repetition settings (the hf backend's repetition_penalty, repetition_window, no_repeat_ngram,
    # no_repeat_word) for the calls decoded under this format, where the model spec sets none of its
    # own: the small profile's strict formats bring its rules to one role under another profile
    # (``--formats answerer=strict``) without imposing them on the other roles' JSON.
    decoding: Mapping[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if (self.json_schema is None) == (self.regex is None):
            raise ValueError(f"OutputFormat {self.name!r}: set exactly one of json_schema or regex")


class Reply(str):
    """A model reply: the text, plus what the backend knows about how it was produced.

    ``constrained``: decoding was constrained to the requested :class:`OutputFormat`;
    ``truncated``: generation stopped at ``max_tokens`` (a cut JSON reply is a failure, not a
    reply to repair). A plain ``str`` where a Reply is expected means neither. ``tokens``:
    (prompt, completion) tokens of this call when the backend counted them; a trace reads them
    instead of differencing the backend's totals, which calls running beside it also move.
    """

    constrained: bool
    truncated: bool
    tokens: tuple[int, int] | None

    def __new__(cls, text: str, *, constrained: bool = False, truncated: bool = False,
                tokens: tuple[int, int] | None = None) -> Reply:
        obj = super().__new__(cls, text)
        obj.constrained, obj.truncated, obj.tokens = constrained, truncated, tokens
        return obj


@dataclass
class GenDefaults:
    """Generation settings a user set on the command line (``--max-tokens``, ``--temperature``,
    ``--top-p``, ``--seed``); a field left None keeps what the role asks for."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None


@dataclass
class Usage:
    """Token and call accounting for one run; ``by_role`` splits calls per role."""

    calls: int = 0
    cache_hits: int = 0
    failures: int = 0
    retries: int = 0
    rejected: int = 0  # replies that came back but failed their format or acceptance checks (deepr.roles)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    by_role: dict[str, int] = field(default_factory=dict)

    def add(self, *, role: str | None, prompt_tokens: int = 0, completion_tokens: int = 0,
            seconds: float = 0.0, cached: bool = False) -> None:
        self.calls += 1
        self.cache_hits += int(cached)
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.seconds += seconds
        key = role or "default"
        self.by_role[key] = self.by_role.get(key, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class LLM(ABC):
    """Base class of every backend. Subclasses implement :meth:`_achat`."""

    name: str = "llm"
    # Set once, then every later call fails at once: the --deadline passed, or the endpoint
    # refused the credentials (retrying with the same key cannot help).
    stopped: str | None = None
    auth_failed: bool = False
    unreachable: str | None = None  # why the endpoint could not be reached (a refused connection)
    _deadline: tuple[float, float] | None = None  # (monotonic end, the budget in seconds)
    # Calls count in deepr.activity (the live view); a wrapper that hands each call to another
    # backend says False, so the inner one counts it once.
    counted: bool = True

    def __init__(self, max_concurrency: int = 8, gen: GenDefaults | None = None):
        self.max_concurrency = max_concurrency
        self.gen = gen or GenDefaults()
        self.usage = Usage()
        self._sems: dict[int, asyncio.Semaphore] = {}

    def _sem(self) -> asyncio.Semaphore:
        # One semaphore per event loop: asyncio primitives are bound to the loop they first ran on.
        loop = asyncio.get_running_loop()
        key = id(loop)
        if key not in self._sems:
            self._sems[key] = asyncio.Semaphore(self.max_concurrency)
        return self._sems[key]

    async def achat(self, messages: Sequence[Message], *, role: str | None = None,
                    temperature: float | None = None, max_tokens: int | None = None,
                    stop: Sequence[str] | None = None, top_p: float | None = None,
                    seed: int | None = None, fmt: OutputFormat | None = None) -> Reply:
        """One chat call. ``max_tokens`` / ``temperature`` are the role's; the user's
        :class:`GenDefaults` override them (``--max-tokens`` caps every role)."""
        g = self.gen
        if g.max_tokens is not None:
            max_tokens = g.max_tokens if max_tokens is None else min(max_tokens, g.max_tokens)
        temperature = g.temperature if g.temperature is not None and temperature is None else temperature
        top_p = g.top_p if top_p is None else top_p
        seed = g.seed if seed is None else seed
        try:
            out = await self._call(list(messages), role=role, temperature=temperature, max_tokens=max_tokens,
                                   stop=stop, top_p=top_p, seed=seed, fmt=fmt)
        except BaseException:
            if self.counted:
                note("call failed")
            raise
        if self.counted:
            note("call ok")
        return out if isinstance(out, Reply) else Reply(out)

    async def _call(self, messages: list[Message], **kw: Any) -> str | Reply:
        if self.stopped:
            raise LLMError(self.stopped)
        left = self._left()
        call = self._bounded(messages, **kw)
        try:
            return await (call if self._deadline is None else asyncio.wait_for(call, left))
        except TimeoutError:
            if self._deadline is None or time.monotonic() < self._deadline[0]:
                raise
            raise LLMError(self._deadline_reached()) from None
        except LLMError as e:
            if getattr(e, "status", None) in AUTH_STATUSES:
                self.auth_failed = True
                self.stopped = f"stopped: the endpoint refused the credentials earlier ({e})"
            if getattr(e, "unreachable", False):  # nothing listens there: later calls cannot do better
                self.unreachable = str(e)
                self.stopped = f"stopped: {e}"
            raise

    async def _bounded(self, messages: list[Message], **kw: Any) -> str | Reply:
        async with self._sem():
            if not self.counted:
                return await self._achat(messages, **kw)
            note("sent")
            try:
                return await self._achat(messages, **kw)
            finally:
                note("returned")

    def set_deadline(self, seconds: float | None) -> None:
        """Give every later call a shared wall-clock budget (``--deadline``); None: no budget."""
        self._deadline = None if seconds is None else (time.monotonic() + seconds, seconds)

    def _left(self) -> float:
        left = self._deadline[0] - time.monotonic() if self._deadline else float("inf")
        if left <= 0:
            raise LLMError(self._deadline_reached())
        return left

    def _deadline_reached(self) -> str:
        self.stopped = f"deadline of {self._deadline[1]:g} s reached"
        return self.stopped

    @abstractmethod
    async def _achat(self, messages: list[Message], *, role: str | None, temperature: float | None,
                     max_tokens: int | None, stop: Sequence[str] | None, **extra: Any) -> str | Reply:
        """Send one chat request; raise :class:`LLMError` with the reason on final failure.

        ``extra`` holds ``top_p``, ``seed`` and ``fmt`` (an :class:`OutputFormat` or None);
        a backend uses what it supports and ignores the rest.
        """

    async def abatch(self, batch: Sequence[Sequence[Message]], *, role: str | None = None,
                     **kw: Any) -> list[Reply]:
        """Run independent prompts concurrently (bounded by ``max_concurrency``), in order."""
        return list(await asyncio.gather(*(self.achat(m, role=role, **kw) for m in batch)))

    def chat(self, messages: Sequence[Message], **kw: Any) -> Reply:
        return run_sync(self.achat(messages, **kw))

    def describe(self) -> dict[str, Any]:
        """What goes into sidecars: backend and model, never credentials."""
        return {"backend": self.name}

    def label(self) -> str:
        """How records name who answered: "llm:<backend>[:model]"."""
        try:
            info = self.describe()
        except Exception:  # a backend's describe() must never break scoring
            info = {}
        return ":".join(["llm", str(info.get("backend", self.name)),
                         *([str(info["model"])] if info.get("model") else [])])

    def close(self) -> None:
        """Release resources (HTTP clients, model weights). Safe to call twice."""


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine from sync code, also when an event loop already runs (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["v"] = asyncio.run(coro)
        except BaseException as e:  # re-raised in the caller's thread
            box["e"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]
