"""``openai:<model>``: any OpenAI-compatible chat endpoint (vLLM, SGLang, llama.cpp, Ollama, OpenAI) through
the SDK, with its own timeout, retries and typed errors; the key lives only inside the SDK's clients. deepr
keeps its policy (docs/models.md): the server is asked once about its context and slots; a refused connection,
or a 404 on a chat call, stops the run; a format field the server refuses or ignores moves the call down its
format ladder from the step the run reached; a prompt is fitted to the context.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import logging
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx2
import openai
from pydantic import SecretStr

from deepr.llm.base import LLM, LLMError, Message, OutputFormat, Reply
from deepr.llm.cache import LLMCache
from deepr.llm.context import prompt_tokens
from deepr.llm.gbnf import LLAMACPP_EXTRA, regex_to_gbnf, schema_to_gbnf
from deepr.llm.openai_config import _NO_KEY, OpenAIConfig, resolve_endpoint, safe_url
from deepr.llm.openai_reply import (_REGEX_STYLES, _STYLES, attempts, caused_by, check_response,
                                    read_completion, reason_of, refuses_format)

__all__ = ["LLMStatusError", "OpenAIBackend", "OpenAIConfig", "resolve_endpoint", "safe_url"]

log = logging.getLogger("deepr.llm")
_PROBE_TIMEOUT = 10.0  # seconds for each question to the server about itself
_LADDERS = {"json": _STYLES, "regex": _REGEX_STYLES}
_PARSED = "(replies are parsed and re-asked)"
_REFUSED = "connection refused: nothing is listening at {} (is the server running, and is --base-url right?)"


class LLMStatusError(LLMError):
    """The endpoint refused a request; ``status`` is the HTTP status (None: no response)."""

    def __init__(self, message: str, status: int | None = None, *, attempts: int = 1, unreachable: bool = False):
        super().__init__(message)
        self.status, self.attempts, self.unreachable = status, attempts, unreachable


class OpenAIBackend(LLM):
    name = "openai"

    def __init__(self, config: OpenAIConfig, *, api_key: str | None = None, cache: LLMCache | None = None):
        super().__init__(max_concurrency=config.max_concurrency)
        base_url, key = resolve_endpoint(config.base_url, api_key)
        self.config, self.cache, self.url = config.model_copy(update={"base_url": base_url}), cache, safe_url(base_url)
        self._key = SecretStr(key)  # only to build clients and to scrub messages
        # One client per event loop (each run_sync starts one): its connection pool belongs to that loop.
        self._clients: dict[Any, tuple[openai.AsyncOpenAI, Any]] = {}
        # How far down each format ladder the run has moved: only ever grows.
        self._step = {k: 0 if config.structured_outputs else len(v) for k, v in _LADDERS.items()}
        self._warned: set[str] = set()
        self._probe_lock, self._probed = threading.Lock(), base_url is None  # api.openai.com is not asked
        self._context, self._down = config.context_length, None

    # -- the server, asked once --------------------------------------------------------
    @property
    def context_length(self) -> int | None:
        """The served model's context in tokens: the smaller of what the server says and ``context_length``."""
        self._probe()
        return self._context

    def _sem(self) -> asyncio.Semaphore:
        self._probe()  # before this loop's semaphore is made, so the server's slots bound it
        return super()._sem()

    def _probe(self) -> None:
        """Ask the server its context and slots, once; synchronously, as prompts are fitted to the context
        in sync code (:func:`deepr.roles.fit_context`). A server without these routes says nothing."""
        with self._probe_lock:
            if self._probed:
                return
            url = self.config.base_url
            with openai.OpenAI(api_key=self._key.get_secret_value(), base_url=url, max_retries=0,
                               timeout=min(self.config.timeout, _PROBE_TIMEOUT)) as client:
                models = self._ask(client.models.list)
                props = self._ask(lambda: client.get(re.sub(r"/v1/?$", "", url) + "/props", cast_to=object))
            entries = [m.to_dict() for m in getattr(models, "data", None) or []]
            mine = ([m for m in entries if m.get("id") == self.config.model] or entries[:1] or [{}])[0]
            props = props if isinstance(props, dict) else {}
            gen = props.get("default_generation_settings")
            said = _count(mine.get("max_model_len"), gen.get("n_ctx") if isinstance(gen, dict) else None,
                          props.get("n_ctx"))
            self._context = min(filter(None, (self._context, said)), default=None)
            if (slots := _count(props.get("total_slots"))) and slots < self.max_concurrency:
                log.warning("%s: the server has %d slot(s): at most %d call(s) in flight (--concurrency %d would "
                            "queue calls inside it until they time out)", self._where(), slots, slots,
                            self.max_concurrency)
                self.max_concurrency = slots
            self._probed = True

    def _ask(self, question: Any) -> Any:
        try:
            return question()
        except openai.APIConnectionError as e:
            if caused_by(e, ConnectionRefusedError):
                self._down = _REFUSED.format(self.url)
        except (openai.APIError, ValueError):  # no such route here: the server says nothing
            pass
        return None

    # -- one call ----------------------------------------------------------------------
    async def _client(self) -> openai.AsyncOpenAI:
        loop = asyncio.get_running_loop()
        if loop not in self._clients:
            http = openai.DefaultAsyncHttpxClient(verify=_tls(), event_hooks={"response": [check_response]})
            client = openai.AsyncOpenAI(api_key=self._key.get_secret_value(), base_url=self.config.base_url,
                                        timeout=self.config.timeout, max_retries=self.config.max_retries,
                                        http_client=http)
            self._clients[loop] = (client, closer := _closes_with_its_loop(client, self._clients, loop))
            await closer.asend(None)
        return self._clients[loop][0]

    def _request(self, messages: list[Message], temperature: float | None, max_tokens: int | None,
                 stop: Sequence[str] | None, top_p: float | None = None, seed: int | None = None,
                 fmt: OutputFormat | None = None) -> dict[str, Any]:
        """Everything that shapes the reply: the body we send and the cache key."""
        if temperature is None and self.config.base_url:
            # Unset means greedy, as on the hf backend: self-hosted servers would sample at their own default
            # (llama-cpp-python: 0.8, which turned SmolLM2's plans into babble). api.openai.com keeps its own
            # (some of its models take no other temperature).
            temperature = 0.0
        shape = fmt and {"name": fmt.name, **({"json_schema": fmt.json_schema} if fmt.json_schema is not None
                                             else {"regex": fmt.regex})}
        return {"backend": self.name, "model": self.config.model, "base_url": self.url, "messages": messages,
                "temperature": temperature, "max_tokens": max_tokens or self.config.default_max_tokens,
                "stop": list(stop) if stop else None, "top_p": top_p,
                "seed": seed if seed is not None else self.config.seed, "fmt": shape,
                "extra_body": self.config.extra_body}

    def _fit(self, request: dict[str, Any]) -> None:
        """Lower a max_tokens that would run past the context; fail a prompt that leaves under an eighth of it
        before it is sent. The prompt is estimated as :mod:`deepr.roles` fits it."""
        limit, est, want = self.context_length, prompt_tokens(self, request["messages"]), request["max_tokens"]
        if limit is None or est + want <= limit:
            return
        if limit - est < limit // 8:
            raise self._error(f"{self._where()}: prompt of about {est} tokens + max_tokens {want} "
                              f"exceeds the context of {limit} tokens; shorten the prompt or max_tokens")
        self._warn_once("max-tokens", f"max_tokens {want} lowered to {limit - est} where a prompt "
                        f"of about {est} tokens leaves no more of the context of {limit} tokens")
        request["max_tokens"] = limit - est

    async def _achat(self, messages: list[Message], *, role: str | None, temperature: float | None,
                     max_tokens: int | None, stop: Sequence[str] | None, **extra: Any) -> Reply:
        request = self._request(messages, temperature, max_tokens, stop, extra.get("top_p"), extra.get("seed"),
                                extra.get("fmt"))
        self._fit(request)
        if self.cache is not None and (hit := self.cache.get(request)) is not None:
            self.usage.add(role=role, cached=True)
            flags = hit.get("flags") or {}
            return Reply(hit["reply"], constrained=bool(flags.get("constrained")),
                         truncated=bool(flags.get("truncated")))
        if self._down:
            raise self._error(f"{self.config.model}: {self._down}", unreachable=True)
        t0 = time.perf_counter()
        text, finish, (prompt, completion), sent = await self._laddered(request)
        self.usage.add(role=role, prompt_tokens=prompt, completion_tokens=completion, seconds=time.perf_counter() - t0)
        reply = Reply(text, constrained=self._honoured(text, finish, request["fmt"], sent),
                      truncated=finish == "length", tokens=(prompt, completion) if prompt or completion else None)
        if self.cache is not None:
            self.cache.put(request, text, prompt_tokens=prompt, completion_tokens=completion,
                           flags={"constrained": reply.constrained, "truncated": reply.truncated})
        return reply

    async def _laddered(self, request: dict[str, Any]) -> tuple[str, str | None, Any, tuple[str, int] | None]:
        """Send the request, moving down this call's own format ladder while the server refuses a format;
        returns the reply and the (ladder, step) it was sent with (None: no format)."""
        fmt = request["fmt"]
        kind = "regex" if fmt and fmt.get("regex") else "json"
        step = self._step[kind]  # read once: calls beside this one may move the run's step meanwhile
        while True:
            style = _LADDERS[kind][step] if fmt and step < len(_LADDERS[kind]) else None
            try:
                raw, sent = await self._once(request, style)
                break
            except openai.APIError as e:
                if style is None or not refuses_format(e):
                    raise self._failed(e) from None
                step = self._next(kind, step, reason_of(e, self.config.timeout)[0])
        self.usage.retries += raw.retries_taken
        text, finish, tokens = read_completion(raw.http_response.text, raw.headers.get("content-type", ""))  # checked
        return text, finish, tokens, (kind, step) if sent else None

    async def _once(self, request: dict[str, Any], style: str | None) -> tuple[Any, bool]:
        kw: dict[str, Any] = {"model": self.config.model, "messages": request["messages"],
                              self.config.max_tokens_field: request["max_tokens"]}
        kw.update({k: request[k] for k in ("temperature", "top_p", "seed", "stop") if request[k] is not None})
        extra, fmt, sent = dict(self.config.extra_body), request["fmt"], style is not None
        if style == "json_schema":
            kw["response_format"] = {"type": "json_schema", "json_schema": {
                "name": re.sub(r"[^A-Za-z0-9_-]", "_", fmt["name"])[:64] or "reply",
                "schema": fmt["json_schema"], "strict": self.config.strict_schema}}
        elif style == "json_object":  # Anyscale-style APIs take the schema this way
            kw["response_format"] = {"type": "json_object", "schema": fmt["json_schema"]}
        elif style == "vllm":
            extra["structured_outputs"] = {"regex": fmt["regex"]}
        elif style == "gbnf":  # llama.cpp's servers; a schema is converted here (llama-cpp-python's server)
            try:
                extra["grammar"] = regex_to_gbnf(fmt["regex"]) if "regex" in fmt else schema_to_gbnf(fmt["json_schema"])
            except ValueError as e:  # this format only: the call goes unconstrained and says why
                self._warn_once(f"gbnf-{e}", f"format {fmt['name']!r} has no GBNF form ({e}); such calls are "
                                "unconstrained")
                sent = False
        client = await self._client()
        return await client.chat.completions.with_raw_response.create(**kw, extra_body=extra or None), sent

    def _next(self, kind: str, step: int, reason: str) -> int:
        """The step after a refused one, with its one warning; the run learns it too."""
        step += 1
        if kind == "json" and step == 1:  # GBNF grammars need llama-cpp-python's converter on this side
            if has_schema_converter():
                self._warn_once("schema-as-gbnf", "the server refused json_schema response formats; JSON schemas go "
                                "out as GBNF grammars converted here by llama-cpp-python's converter")
            else:
                self._warn_once("refused-no-converter", f"the server refused json_schema response formats ({reason});"
                                " to send JSON schemas as grammars instead, install the llamacpp extra "
                                f"({LLAMACPP_EXTRA}). Until then this run sends no JSON formats {_PARSED}")
                step = len(_STYLES)
        if step >= len(_LADDERS[kind]):
            what = "structured outputs" if kind == "json" else "regex formats"
            self._warn_once(f"refused-{kind}", f"the server refused {what} ({reason}); this run sends them no more "
                            + _PARSED)
        self._step[kind] = max(self._step[kind], step)  # steps only move down: concurrent calls commute
        return step

    def _honoured(self, text: str, finish: str | None, fmt: dict[str, Any], sent: tuple[str, int] | None) -> bool:
        """Was the reply really constrained? A server may accept a format field and ignore it."""
        if sent is None or not text:  # no text (tool_calls only) says nothing of the format
            return False
        kind, step = sent
        if finish == "length" or (re.fullmatch(fmt["regex"], text.strip()) if kind == "regex" else _is_json(text)):
            return True  # (cut mid-JSON by the budget: the flag 'truncated' tells the caller)
        ladder = _LADDERS[kind]
        if kind == "regex" or ladder[step] == "gbnf":  # a field the server ignored: later calls try the next
            then = f"it as {ladder[step + 1]}" if step + 1 < len(ladder) else f"none {_PARSED}"
            what = "a regex format" if kind == "regex" else "a JSON schema"
            self._warn_once(f"ignored-{kind}-{step}", f"the server accepted {what} as {ladder[step]} but its reply "
                            f"{'does not match it' if kind == 'regex' else 'is not JSON'}; later calls send {then}")
            self._step[kind] = max(self._step[kind], step + 1)
        else:
            self._warn_once("ignored", "the server accepted response_format but replied with text that is not "
                            "JSON; such replies are marked unconstrained")
        return False

    def _failed(self, e: openai.APIError) -> LLMStatusError:
        """deepr's error for a request the SDK gave up on; a refused connection or a 404 stops the run."""
        reason, status, n = *reason_of(e, self.config.timeout), attempts(e)
        self.usage.retries += n - 1
        if caused_by(e, ConnectionRefusedError) or status == 404:
            v1 = re.search(r"/v1/?$", self.config.base_url or "/v1")
            hint = "; is `/v1` missing?" if status == 404 and not v1 else ""
            answered = f"{self.url} answered a chat call with {reason}{hint}"
            self._down = _REFUSED.format(self.url) if status is None else answered
            return self._error(f"{self.config.model}: {self._down}", status, unreachable=True)
        if n > 1:
            return self._error(f"{self._where()} failed after {n} attempts: {reason}", status, attempts=n)
        what = {200: "sent an unusable reply", None: "failed"}.get(status, "refused the request")
        return self._error(f"{self._where()} {what} ({reason})", status)

    def _error(self, message: str, status: int | None = None, **kw: Any) -> LLMStatusError:
        """A failed call: counted, its message scrubbed of the key."""
        self.usage.failures += 1
        return LLMStatusError(self._scrub(message), status, **kw)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s: %s", self._where(), self._scrub(message))

    def _scrub(self, text: str) -> str:
        key = self._key.get_secret_value()
        return text.replace(key, "***") if key != _NO_KEY else text

    def _where(self) -> str:
        return f"{self.config.model} at {self.url or 'api.openai.com'}"

    # -- reporting ---------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"backend": self.name, "model": c.model, "base_url": self.url, "timeout": c.timeout,
                "max_retries": c.max_retries, "max_concurrency": self.max_concurrency, "seed": c.seed,
                "cache": str(self.cache.path) if self.cache is not None else None}

    def __repr__(self) -> str:
        return f"OpenAIBackend(model={self.config.model!r}, base_url={self.url!r})"

    def close(self) -> None:
        self._clients.clear()  # each client is closed as its loop shuts down
        if self.cache is not None:
            self.cache.close()


async def _closes_with_its_loop(client: Any, clients: dict[Any, Any], loop: Any) -> Any:
    """Suspended until ``loop`` shuts down its async generators (``asyncio.run`` does, after the last task),
    then closes ``client`` on that loop, which its connections belong to."""
    try:
        yield
    finally:
        clients.pop(loop, None)
        await client.close()


@functools.cache
def _tls() -> Any:
    """One TLS context for every client: loading the CA store took 100-500 ms a client on a busy 2-core
    machine, paid once per event loop (each ``llm.chat``) otherwise."""
    return httpx2.create_ssl_context()


def _count(*values: Any) -> int | None:
    """The first positive integer among ``values`` (what a server said), else None."""
    return next((v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)


def _is_json(text: str) -> bool:
    try:
        json.loads(text, strict=False)  # a raw control character inside a string is still JSON
    except ValueError:
        return False
    return True


def has_schema_converter() -> bool:
    """Is llama-cpp-python's JSON-schema→GBNF converter importable here (the llamacpp extra)?"""
    return importlib.util.find_spec("llama_cpp") is not None
