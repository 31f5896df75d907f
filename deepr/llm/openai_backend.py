"""``openai:<model>``: any OpenAI-compatible chat endpoint through the official client.

Works with vLLM, SGLang, llama.cpp server, Ollama and OpenAI itself. The base URL and
key come from arguments, else ``DEEPR_LLM_BASE_URL`` / ``DEEPR_LLM_API_KEY``, else
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``; a local endpoint needs no key.

Every call has a timeout. Rate limits (429), server errors (5xx), timeouts and
connection errors are retried a bounded number of times with exponential backoff and
jitter; any other error fails at once with :class:`LLMStatusError`. A refused connection
(nothing listens at the base URL) is not retried: it fails at once, says so, and the backend
answers every later call with the same error (``unreachable``), so a run writes no report. The client's own
retries are off so ours are the only ones, and they are counted in ``usage.retries``.

Every request carries ``max_tokens`` (the role's, else ``default_max_tokens``) and the
call's temperature / top_p / seed; an unset temperature is sent as 0 (greedy, as on the hf
backend) to a self-hosted endpoint (``base_url`` set), whose own default would apply otherwise. A timed-out request is cancelled, which closes its
connection, before any retry, so a server that stops on disconnect stops generating.
A reply cut at ``max_tokens`` (``finish_reason == "length"``) comes back flagged
``truncated``. With ``context_length`` set, a prompt that cannot fit (estimated at 4
characters a token) fails before it is sent.

Structured outputs: a call with a JSON-schema :class:`OutputFormat` sends
``response_format={"type": "json_schema", ...}`` (vLLM, SGLang, llama.cpp's llama-server,
Ollama and OpenAI accept it). A server that refuses it (HTTP 400/422 naming response_format
or an unsupported feature, as llama-cpp-python's server does) is asked again with the schema
as a GBNF ``grammar``, converted on this side by llama-cpp-python's own converter
(:func:`deepr.llm.gbnf.schema_to_gbnf`; that server's ``json_object`` + schema silently degrades
to "any JSON" for schemas its converter cannot read, so it is not relied on); without that
package (the ``llamacpp`` extra) the run says which extra to install and sends no JSON formats.
A server that refuses or ignores the grammar too is asked with ``{"type": "json_object",
"schema": ...}`` (Anyscale-style APIs), and after that without any: every later call of the run
then goes unconstrained, with one warning. Regex formats (tagged replies) have no common
field: they go out as a GBNF ``grammar`` (llama.cpp's servers; see :mod:`deepr.llm.gbnf`), else as
vLLM's ``structured_outputs={"regex": ...}``; a server that refuses a style, or answers with text
the regex does not match (it ignored the field), moves the run to the next style, then to
unconstrained regex calls, with one warning each. ``Reply.constrained`` says what happened per call: it is
False when the format was not sent, or when a "constrained" reply is not JSON (a server
that silently ignores the field).

Malformed replies (a 200 that is HTML or not a chat completion, no ``choices``, empty
``choices``, no message text, a body cut short) become :class:`LLMStatusError` with the
reason; only a cut body or a passed-through upstream error is retried.

The API key lives only inside the HTTP client: it is never logged, cached, described,
put in an exception message or shown by ``repr``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import random
import re
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from deepr.llm.base import LLM, LLMError, Message, OutputFormat, Reply
from deepr.llm.cache import LLMCache
from deepr.llm.gbnf import LLAMACPP_EXTRA, regex_to_gbnf, schema_to_gbnf
from deepr.llm.io_loop import IOLoop
from deepr.llm.openai_config import _NO_KEY, OpenAIConfig, _Secret, resolve_endpoint, safe_url
from deepr.llm.openai_reply import (_REGEX_STYLES, _STYLES, _Failure, _fmt_dict, _read_completion, _Result, _usage,
                                    failure_of)

__all__ = ["LLMStatusError", "OpenAIBackend", "OpenAIConfig", "has_aiohttp", "resolve_endpoint", "safe_url"]

log = logging.getLogger("deepr.llm")


class LLMStatusError(LLMError):
    """The endpoint refused a request; ``status`` is the HTTP status (None: no response)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class OpenAIBackend(LLM):
    name = "openai"

    def __init__(self, config: OpenAIConfig, *, api_key: str | None = None,
                 cache: LLMCache | None = None):
        super().__init__(max_concurrency=config.max_concurrency)
        base_url, key = resolve_endpoint(config.base_url, api_key)
        self.config = config.model_copy(update={"base_url": base_url})
        self.cache = cache
        self._key = _Secret(key)  # used only to build clients and to scrub messages
        self._io: IOLoop | None = None
        self._io_lock = threading.Lock()
        # How JSON schemas are sent; the next style once a server refuses one, None at the end.
        self._style: str | None = _STYLES[0] if config.structured_outputs else None
        # How regex formats are sent (llama.cpp's GBNF grammar field, then vLLM's structured
        # outputs); the next one once a server refuses or ignores one, None at the end.
        self._rstyle: str | None = _REGEX_STYLES[0] if config.structured_outputs else None
        self._warned: set[str] = set()
        self.transport = _transport(config.http_client)  # checked now: a missing package fails before any call

    # -- plumbing ----------------------------------------------------------------------
    def _loop(self) -> IOLoop:
        # One private event loop owns the HTTP client: its connection pool is bound to a loop,
        # while callers may come from many (each run_sync starts a new one).
        with self._io_lock:
            if self._io is None:
                import openai

                extra = {}
                if self.transport == "aiohttp":
                    extra["http_client"] = openai.DefaultAioHttpClient(timeout=self.config.timeout)
                self._io = IOLoop(lambda: openai.AsyncOpenAI(
                    api_key=self._key.reveal(), base_url=self.config.base_url,
                    timeout=self.config.timeout, max_retries=0, **extra))
                # A backend dropped unclosed (a command's end, the process's exit) still closes its
                # client: aiohttp reports "Unclosed client session / connector" otherwise.
                self._closer = weakref.finalize(self, self._io.stop)
            return self._io

    def _scrub(self, text: str) -> str:
        key = self._key.reveal()
        return text.replace(key, "***") if key != _NO_KEY else text

    def _request(self, messages: list[Message], temperature: float | None, max_tokens: int | None,
                 stop: Sequence[str] | None, top_p: float | None = None, seed: int | None = None,
                 fmt: OutputFormat | None = None) -> dict[str, Any]:
        """Everything that shapes the reply: the body we send and the cache key."""
        if temperature is None and self.config.base_url:
            # Unset means greedy, as on the hf backend. Self-hosted servers would otherwise sample at
            # their own default (llama-cpp-python: 0.8, which turned SmolLM2's plans into babble);
            # api.openai.com keeps its default (some of its models take no other temperature).
            temperature = 0.0
        return {"backend": self.name, "model": self.config.model, "base_url": safe_url(self.config.base_url),
                "messages": messages, "temperature": temperature,
                "max_tokens": max_tokens or self.config.default_max_tokens,
                "stop": list(stop) if stop else None, "top_p": top_p,
                "seed": seed if seed is not None else self.config.seed,
                "fmt": _fmt_dict(fmt), "extra_body": self.config.extra_body}

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s: %s", self._where(), self._scrub(message))

    def _check_context(self, request: dict[str, Any]) -> None:
        limit = self.config.context_length
        if limit is None:
            return
        chars = sum(len(str(m.get("content") or "")) for m in request["messages"])
        est = chars // 4 + 4 * len(request["messages"])
        if est + request["max_tokens"] > limit:
            self.usage.failures += 1
            raise LLMStatusError(f"{self._where()}: prompt of about {est} tokens + max_tokens "
                                 f"{request['max_tokens']} exceeds the context of {limit} tokens "
                                 "(context_length); shorten the prompt or max_tokens")

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        cap = min(self.config.backoff_max, self.config.backoff_base * (2 ** attempt))
        delay = random.uniform(0, cap)  # full jitter spreads a burst of 429s apart
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.config.backoff_max))
        return delay

    # -- one call ----------------------------------------------------------------------
    async def _once(self, request: dict[str, Any], styles: tuple[str | None, str | None]) -> _Result:
        kw: dict[str, Any] = {"model": self.config.model, "messages": request["messages"],
                              self.config.max_tokens_field: request["max_tokens"]}
        for field in ("temperature", "top_p", "seed", "stop"):
            if request[field] is not None:
                kw[field] = request[field]
        fmt = request["fmt"]
        style, rstyle = styles  # read once by the caller: other calls in flight may move them meanwhile
        sent = bool(fmt and "json_schema" in fmt and style)
        if self.config.extra_body:
            kw["extra_body"] = dict(self.config.extra_body)
        if sent and style == "json_schema":
            kw["response_format"] = {"type": "json_schema", "json_schema": {
                "name": re.sub(r"[^A-Za-z0-9_-]", "_", fmt["name"])[:64] or "reply",
                "schema": fmt["json_schema"], "strict": self.config.strict_schema}}
        elif sent and style == "gbnf":  # llama-cpp-python's server: the schema as a grammar
            sent = self._send_schema_grammar(kw, fmt)
        elif sent:  # Anyscale-style APIs take the schema this way
            kw["response_format"] = {"type": "json_object", "schema": fmt["json_schema"]}
        if fmt and fmt.get("regex") and rstyle:
            sent = self._send_regex(kw, fmt["regex"], rstyle)
        # client.post, not chat.completions.create: create() walks every request through the
        # SDK's type-driven transform, a no-op for plain JSON chat bodies that cost ~1 ms of a
        # ~4 ms call on the client's one thread (docs/experiments.md); and the
        # reply comes back as decoded JSON (cast_to=object), not built into the SDK's pydantic
        # ChatCompletion, of which deepr reads three fields (~9 % of build-trees' client CPU
        # under py-spy, docs/experiments.md)
        body = {k: v for k, v in kw.items() if k != "extra_body"} | dict(kw.get("extra_body") or {})
        resp = await self._loop().client.post("/chat/completions", body=body, cast_to=object)
        text, finish = _read_completion(resp)
        return _Result(text, *_usage(resp), finish, sent, rstyle if fmt and fmt.get("regex") else style)

    def _send_schema_grammar(self, kw: dict[str, Any], fmt: dict[str, Any]) -> bool:
        try:
            grammar = schema_to_gbnf(fmt["json_schema"])
        except ValueError as e:  # this schema only: the call goes unconstrained and says why
            self._warn_once(f"schema-gbnf-{e}", f"format {fmt['name']!r}: {e}; such calls are unconstrained")
            return False
        kw["extra_body"] = {**kw.get("extra_body", {}), "grammar": grammar}
        return True

    def _next_style(self, style: str, reason: str) -> str | None:
        """The JSON style after ``style`` was refused. A server that refuses json_schema gets the
        schema as a GBNF grammar (llama-cpp-python's server takes no other form it honours), which
        needs llama-cpp-python's converter on this side."""
        nxt = _next(_STYLES, style)
        if nxt != "gbnf":
            return nxt
        if not has_schema_converter():
            self._warn_once("refused-no-converter", f"the server refused json_schema response formats ({reason}); "
                            f"to send JSON schemas as grammars instead, install the llamacpp extra ({LLAMACPP_EXTRA}). "
                            "Until then this run sends no JSON formats (replies are parsed and re-asked)")
            return None
        self._warn_once("schema-as-gbnf", "the server refused json_schema response formats; JSON schemas go out as "
                        "GBNF grammars converted here by llama-cpp-python's converter")
        return nxt

    def _send_regex(self, kw: dict[str, Any], regex: str, rstyle: str) -> bool:
        body = dict(kw.get("extra_body") or {})
        if rstyle == "gbnf":
            try:
                body["grammar"] = regex_to_gbnf(regex)
            except ValueError as e:  # a construct the translation lacks: this call goes unconstrained
                self._warn_once("gbnf", f"a regex format has no GBNF translation ({e}); such calls are unconstrained")
                return False
        else:
            body["structured_outputs"] = {"regex": regex}
        kw["extra_body"] = body
        return True

    async def _achat(self, messages: list[Message], *, role: str | None, temperature: float | None,
                     max_tokens: int | None, stop: Sequence[str] | None, **extra: Any) -> Reply:
        request = self._request(messages, temperature, max_tokens, stop, extra.get("top_p"), extra.get("seed"),
                                extra.get("fmt"))
        if self.cache is not None:
            hit = self.cache.get(request)
            if hit is not None:
                self.usage.add(role=role, cached=True)
                flags = hit.get("flags") or {}
                return Reply(hit["reply"], constrained=bool(flags.get("constrained")),
                             truncated=bool(flags.get("truncated")))
        self._check_context(request)
        t0 = time.perf_counter()
        res = await self._loop().run(self._with_retries(request))
        self.usage.add(role=role, prompt_tokens=res.prompt_tokens, completion_tokens=res.completion_tokens,
                       seconds=time.perf_counter() - t0)
        reply = Reply(res.text, constrained=self._honoured(res, request["fmt"]), truncated=res.finish_reason == "length",
                      tokens=(res.prompt_tokens, res.completion_tokens) if res.prompt_tokens or res.completion_tokens else None)
        if self.cache is not None:
            self.cache.put(request, res.text, prompt_tokens=res.prompt_tokens, completion_tokens=res.completion_tokens,
                           flags={"constrained": reply.constrained, "truncated": reply.truncated})
        return reply

    def _honoured(self, res: _Result, fmt: dict[str, Any] | None = None) -> bool:
        """Was the reply really constrained? A server may accept response_format and ignore it."""
        if not res.format_sent or not res.text:  # no text (tool_calls only) says nothing of the format
            return False
        if res.finish_reason == "length":
            return True  # cut mid-JSON by the budget; the flag 'truncated' tells the caller
        if fmt and fmt.get("regex"):
            if re.fullmatch(fmt["regex"], res.text.strip()):
                return True
            # A server that ignores the field: try the next way of sending regexes from now on.
            was = res.style
            if was != self._rstyle:  # another call in flight already moved on from this style
                return False
            self._rstyle = _next(_REGEX_STYLES, was)
            self._warn_once(f"ignored-{was}", f"the server accepted a regex format as {was} but its reply does not "
                            "match it; " + (f"trying {self._rstyle} next" if self._rstyle else
                                            "regex formats are no longer sent (replies are parsed and re-asked)"))
            return False
        try:
            json.loads(res.text)
        except ValueError:
            if self._style == "gbnf" and res.style == "gbnf":  # the grammar field was ignored: try the next style from now on
                self._style = _next(_STYLES, "gbnf")
                self._warn_once("ignored-gbnf", "the server accepted a JSON schema as a GBNF grammar but its reply "
                                "is not JSON; trying response_format json_object next")
                return False
            self._warn_once("ignored", "the server accepted response_format but replied with text that is not "
                            "JSON; such replies are marked unconstrained")
            return False
        return True

    async def _with_retries(self, request: dict[str, Any]) -> _Result:
        attempts = self.config.max_retries + 1
        attempt = 0
        while attempt < attempts:
            outcome = await self._attempt(request)
            if not isinstance(outcome, _Failure):
                return outcome
            reason, status = outcome.reason, outcome.status
            fmt = request["fmt"] or {}
            if outcome.format_refused and fmt.get("regex") and self._rstyle:
                if outcome.style != self._rstyle:  # a call beside this one moved on already: resend as is
                    continue
                self._rstyle = _next(_REGEX_STYLES, self._rstyle)  # the same request in the next style
                if self._rstyle is None:
                    self._warn_once("refused-regex", f"the server refused regex formats ({reason}); this run sends "
                                    "them no more (replies are parsed and re-asked)")
                continue
            if outcome.format_refused and self._style:
                if outcome.style != self._style:
                    continue
                # The same request again, in the next style or without response_format.
                self._style = self._next_style(self._style, reason)
                if self._style is None:
                    self._warn_once("refused", f"the server refused structured outputs ({reason}); this run "
                                    "continues without constrained decoding (replies are parsed and re-asked)")
                continue
            if outcome.unreachable:
                self.usage.failures += 1
                err = LLMStatusError(self._scrub(f"{self.config.model}: {reason}"), None)
                err.unreachable = True
                raise err
            if not outcome.retryable:
                self.usage.failures += 1
                what = "sent an unusable reply" if status == 200 else "refused the request"
                raise LLMStatusError(self._scrub(f"{self._where()} {what} ({reason})"), status)
            if attempt + 1 < attempts:
                self.usage.retries += 1
                delay = self._delay(attempt, outcome.retry_after)
                log.warning("%s: %s; retry %d/%d in %.2fs", self.config.model, self._scrub(reason),
                            attempt + 1, self.config.max_retries, delay)
                await asyncio.sleep(delay)
            attempt += 1
        self.usage.failures += 1
        err = LLMStatusError(self._scrub(f"{self._where()} failed after {attempts} attempts: {reason}"), status)
        err.attempts = attempts  # requests sent, so the failure record counts what the message says
        raise err

    async def _attempt(self, request: dict[str, Any]) -> _Result | _Failure:
        """One try: the reply, or why it failed (:func:`failure_of`: as a value, so no exception
        holding the request and its Authorization header outlives this frame). ``wait_for``
        cancels a request that runs past the timeout, which closes its connection."""
        styles = (self._style, self._rstyle)
        try:
            return await asyncio.wait_for(self._once(request, styles), self.config.timeout)
        except Exception as e:  # what went wrong, as a value; anything unforeseen propagates
            failure = failure_of(e, request["fmt"], styles, timeout=self.config.timeout,
                                 where=safe_url(self.config.base_url))
            if failure is None:
                raise
            return failure

    def _where(self) -> str:
        return f"{self.config.model} at {safe_url(self.config.base_url) or 'api.openai.com'}"

    # -- reporting ---------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"backend": self.name, "model": c.model, "base_url": safe_url(c.base_url),
                "timeout": c.timeout, "max_retries": c.max_retries, "max_concurrency": c.max_concurrency,
                "seed": c.seed, "http_client": self.transport,
                "cache": str(self.cache.path) if self.cache is not None else None}

    def __repr__(self) -> str:
        return f"OpenAIBackend(model={self.config.model!r}, base_url={safe_url(self.config.base_url)!r})"

    def close(self) -> None:
        with self._io_lock:
            io, self._io = self._io, None
            closer, self._closer = getattr(self, "_closer", None), None
        if closer is not None:
            closer.detach()
        if io is not None:
            io.stop()
        if self.cache is not None:
            self.cache.close()


def _transport(choice: str) -> str:
    """'aiohttp' or 'httpx': what ``OpenAIConfig.http_client`` resolves to here."""
    if choice == "httpx" or (choice == "auto" and not has_aiohttp()):
        return "httpx"
    if not has_aiohttp():
        raise LLMError("http_client='aiohttp' needs the aiohttp package: pip install 'openai[aiohttp]'")
    return "aiohttp"


def has_aiohttp() -> bool:
    """Whether the SDK's aiohttp transport can be used (the ``aiohttp`` extra of openai)."""
    import openai

    return importlib.util.find_spec("aiohttp") is not None and hasattr(openai, "DefaultAioHttpClient")


def has_schema_converter() -> bool:
    """Is llama-cpp-python's JSON-schema→GBNF converter importable here (the llamacpp extra)?"""
    return importlib.util.find_spec("llama_cpp") is not None


def _next(styles: tuple[str, ...], style: str | None) -> str | None:
    return styles[styles.index(style) + 1] if style in styles[:-1] else None
