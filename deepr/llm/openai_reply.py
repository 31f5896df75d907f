"""Reading an OpenAI-compatible reply, and deepr's policy on the ways a request fails.

Used by openai_backend.py. A 200 reply can still be unusable (HTML from a proxy, JSON that is not a
completion, no choices, no text); each case is a :class:`_BadReply` with its reason. Two of them
may pass on a retry (a body cut short, an upstream error passed on with status 200): the response
hook :func:`check_response` raises those as a broken protocol, so the SDK's own retries resend them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx2
import openai

# JSON-schema styles, tried in order: OpenAI's response_format (vLLM, SGLang, llama-server,
# Ollama), a GBNF "grammar" converted on the client (llama-cpp-python's server), then
# response_format {"type": "json_object", "schema": ...} (Anyscale-style APIs).
_STYLES = ("json_schema", "gbnf", "json_object")
# Regex formats: a GBNF "grammar" field (llama-server, llama-cpp-python), then vLLM's
# structured_outputs {"regex": ...}. OpenAI's own API has neither and refuses both with a 400.
_REGEX_STYLES = ("gbnf", "vllm")

# Words in a 400/422 body that mean "this server does not do structured outputs".
_FORMAT_REFUSAL = re.compile(r"response_format|json_schema|structured|grammar|not supported|unsupported",
                             re.IGNORECASE)
# llama-cpp-python's server answers an unknown response_format type with a 500 naming it.
_FORMAT_500 = re.compile(r"response_format|json_schema")


class _BadReply(Exception):
    """A 200 reply that is not a usable chat completion; ``retryable`` per case."""

    def __init__(self, reason: str, retryable: bool = False):
        super().__init__(reason)
        self.retryable = retryable


class _Unusable(httpx2.RemoteProtocolError):
    """A 200 whose body a retry may fix: raised from the response hook, so the SDK retries it."""


def read_completion(text: str, content_type: str = "application/json") -> tuple[str, str | None, Any]:
    """(text, finish_reason, decoded body) of a chat completion, or :class:`_BadReply` saying what is
    wrong. A body that is not JSON is not a completion, unless a JSON body was promised (then it
    was cut short: retryable). Control characters inside strings are read, not refused."""
    try:
        body = json.loads(text, strict=False)
    except ValueError as e:
        if "json" in content_type:
            raise _BadReply(f"the reply body is not complete JSON ({e})", retryable=True) from None
        head = " ".join(text[:80].split())
        raise _BadReply(f"HTTP 200 with a body that is not JSON ({head!r}); is --base-url the API root "
                        "(ending in /v1)?") from None
    body = body if isinstance(body, dict) else {}
    choices = body.get("choices")
    if choices is None:
        err = body.get("error")
        if isinstance(err, (dict, str)):  # an upstream failure passed on with status 200
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise _BadReply(f"HTTP 200 carrying an error: {str(msg)[:200]}", retryable=True)
        raise _BadReply("HTTP 200 with JSON that is not a chat completion (no 'choices')")
    if not isinstance(choices, list) or not choices:
        raise _BadReply("the endpoint returned no choices")
    choice = choices[0] if isinstance(choices[0], dict) else {}
    finish = choice.get("finish_reason")
    message = choice.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(message, dict) and content is None and (message.get("tool_calls") or finish == "tool_calls"):
        # Tool calls instead of text (deepr's protocols are text): an empty reply, which the
        # role's parse rejects and the executor re-asks within --max-reasks, not a failed turn.
        return "", finish, body
    if not isinstance(content, str):
        why = "no message" if message is None else "no message text"
        raise _BadReply(f"the endpoint returned {why} (finish_reason={finish})")
    return content, finish, body


def usage_of(body: Any) -> tuple[int, int]:
    """(prompt, completion) tokens a completion reports (0 where it reports none or no number)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    return tuple(n if isinstance(n := usage.get(k), int) else 0 for k in ("prompt_tokens", "completion_tokens"))


async def check_response(response: Any) -> None:
    """httpx response hook on every chat call. A 200 a retry may fix is raised as a broken
    protocol (the SDK retries those); a 500 that names response_format is a server refusing the
    field, which no retry changes: marked ``x-should-retry: false``, the header the SDK obeys."""
    if response.status_code == 200:
        await response.aread()
        try:
            read_completion(response.text, response.headers.get("content-type", ""))
        except _BadReply as e:
            if e.retryable:
                raise _Unusable(str(e), request=response.request) from None
    elif response.status_code >= 500:
        await response.aread()
        if _FORMAT_500.search(response.text):
            response.headers["x-should-retry"] = "false"


def refuses_format(e: openai.APIStatusError) -> bool:
    """Does this error say the server will not take a structured-output field?"""
    text = f"{e.message} {json.dumps(e.body, default=str)}"
    return (e.status_code in (400, 422) and bool(_FORMAT_REFUSAL.search(text))) or (
        e.status_code >= 500 and bool(_FORMAT_500.search(text)))


def reason_of(e: BaseException, timeout: float) -> tuple[str, int | None]:
    """One line on why a request failed, and the HTTP status (None: no response)."""
    if isinstance(e, openai.APIConnectionError) and hung_up(e):
        # the SDK's aiohttp transport reports a dropped connection as a connect *timeout*: name it
        return "connection error: the server closed the connection without a reply (did it crash or restart?)", None
    if isinstance(e, openai.APITimeoutError):
        return f"timed out after {timeout:g}s", None
    if isinstance(e, openai.APIConnectionError):
        cause = e.__cause__
        if isinstance(cause, _Unusable):
            return str(cause), 200
        return f"connection error ({type(e).__name__}: {e}{f'; {cause}' if cause else ''})", None
    if isinstance(e, openai.APIStatusError):
        message = str(e.message)
        if e.body is not None and str(e.body) not in message:  # e.g. FastAPI's 422 {"detail": [...]}
            message = f"{message} {json.dumps(e.body, default=str)[:300]}"
        return f"HTTP {e.status_code}: {message}", e.status_code
    return f"unreadable reply ({type(e).__name__}: {e})", None


def sdk_retried(e: BaseException) -> bool:
    """Whether the SDK spent its retries on this error before raising it (its own rule)."""
    if isinstance(e, openai.APIConnectionError):
        return True
    return isinstance(e, openai.APIStatusError) and (e.status_code in (408, 409, 429) or e.status_code >= 500) \
        and e.response.headers.get("x-should-retry") != "false"


def refused_connection(e: BaseException) -> bool:
    """Whether a connection error was a refused connection (somewhere down its cause chain)."""
    return any(isinstance(x, ConnectionRefusedError) for x in _causes(e))


# what each transport raises when the server closes the connection before its reply is whole
_HUNG_UP = ("ServerDisconnectedError", "RemoteProtocolError", "ClientPayloadError")


def hung_up(e: BaseException) -> bool:
    """Whether the server closed the connection before replying (somewhere down the cause chain)."""
    return any(isinstance(x, (ConnectionResetError, BrokenPipeError)) or type(x).__name__ in _HUNG_UP
               for x in _causes(e))


def _causes(e: BaseException) -> Iterator[BaseException]:
    """The exception and its causes, each once."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        yield x
        seen.add(id(x))
        x = x.__cause__ or x.__context__
