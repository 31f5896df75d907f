"""Reading an OpenAI-compatible reply, and deepr's policy on the ways a request fails.

A 200 reply can still be unusable (HTML from a proxy, JSON that is not a completion, no text): the response
hook :func:`check_response` raises it with its reason, as a broken protocol the SDK retries where a retry may
fix it (a body cut short, an upstream error passed on with status 200), else as an error the SDK passes on.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx2
import openai

# The format ladders, tried in order. JSON schemas: OpenAI's response_format (vLLM, SGLang, llama-server,
# Ollama), a GBNF "grammar" converted here (llama-cpp-python's server), then response_format json_object
# with the schema (Anyscale-style APIs). Regexes: a GBNF "grammar" (llama.cpp's servers), then vLLM's
# structured_outputs. OpenAI's own API has neither and refuses both with a 400.
_STYLES = ("json_schema", "gbnf", "json_object")
_REGEX_STYLES = ("gbnf", "vllm")
# Words in a 400/422 body that mean "this server does not do structured outputs"; llama-cpp-python's
# server answers an unknown response_format type with a 500 naming it.
_FORMAT_REFUSAL = re.compile(r"response_format|json_schema|structured|grammar|not supported|unsupported", re.I)
_FORMAT_500 = re.compile(r"response_format|json_schema")


class _BadReply(httpx2.RemoteProtocolError):
    """A 200 reply that is not a usable chat completion, and whether a retry may fix it."""

    def __init__(self, reason: str, retryable: bool = False):
        super().__init__(reason)
        self.retryable = retryable


def read_completion(text: str, content_type: str = "application/json") -> tuple[str, str | None, tuple[int, int]]:
    """(text, finish_reason, (prompt, completion) tokens) of a chat completion, or :class:`_BadReply` saying what
    is wrong. Tokens a completion does not report as numbers count 0."""
    try:
        body = json.loads(text, strict=False)  # a raw control character inside a string is still read
    except ValueError as e:
        if "json" in content_type:  # JSON was promised: the body was cut short
            raise _BadReply(f"the reply body is not complete JSON ({e})", retryable=True) from None
        raise _BadReply(f"HTTP 200 with a body that is not JSON ({' '.join(text[:80].split())!r}); is --base-url "
                        "the API root (ending in /v1)?") from None
    body = body if isinstance(body, dict) else {}
    if (choices := body.get("choices")) is None:
        if isinstance(err := body.get("error"), (dict, str)):  # an upstream failure passed on with status 200
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise _BadReply(f"HTTP 200 carrying an error: {str(msg)[:200]}", retryable=True)
        raise _BadReply("HTTP 200 with JSON that is not a chat completion (no 'choices')")
    if not isinstance(choices, list) or not choices:
        raise _BadReply("the endpoint returned no choices")
    choice = choices[0] if isinstance(choices[0], dict) else {}
    finish, message = choice.get("finish_reason"), choice.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(message, dict) and content is None and (message.get("tool_calls") or finish == "tool_calls"):
        # Tool calls instead of text (deepr's protocols are text): an empty reply, which the role's
        # parse rejects and the executor re-asks within --max-reasks, not a failed turn.
        content = ""
    elif not isinstance(content, str):
        why = "no message" if message is None else "no message text"
        raise _BadReply(f"the endpoint returned {why} (finish_reason={finish})")
    usage = body["usage"] if isinstance(body.get("usage"), dict) else {}
    tokens = tuple(n if isinstance(n := usage.get(k), int) else 0 for k in ("prompt_tokens", "completion_tokens"))
    return content, finish, tokens


async def check_response(response: Any) -> None:
    """Response hook on every chat call: an unusable 200 is raised (see above); a 500 that names
    response_format is a refused field, which no retry changes: marked so the SDK does not retry."""
    if response.status_code == 200:
        await response.aread()
        try:
            read_completion(response.text, response.headers.get("content-type", ""))
        except _BadReply as e:
            e.request = response.request
            if e.retryable:
                raise
            raise openai.APIError(str(e), response.request, body=None) from e  # the SDK's own: not retried
    elif response.status_code >= 500:
        await response.aread()
        if _FORMAT_500.search(response.text):
            response.headers["x-should-retry"] = "false"


def refuses_format(e: openai.APIError) -> bool:
    """Does this error say the server will not take a structured-output field?"""
    if not isinstance(e, openai.APIStatusError):
        return False
    text = f"{e.message} {json.dumps(e.body, default=str)}"
    return bool(e.status_code in (400, 422) and _FORMAT_REFUSAL.search(text)
                or e.status_code >= 500 and _FORMAT_500.search(text))


def reason_of(e: openai.APIError, timeout: float) -> tuple[str, int | None]:
    """One line on why a request failed, and the HTTP status (None: no response)."""
    if isinstance(e, openai.APIStatusError):
        message = str(e.message)
        if e.body is not None and str(e.body) not in message:  # e.g. FastAPI's 422 {"detail": [...]}
            message = f"{message} {json.dumps(e.body, default=str)[:300]}"
        return f"HTTP {e.status_code}: {message}", e.status_code
    if isinstance(e, openai.APITimeoutError):
        return f"timed out after {timeout:g}s", None
    if isinstance(cause := e.__cause__, _BadReply):
        return str(cause), 200
    if caused_by(e, ConnectionResetError, BrokenPipeError, httpx2.RemoteProtocolError):
        return "connection error: the server closed the connection without a reply (did it crash or restart?)", None
    return f"connection error ({type(e).__name__}: {e}{f'; {cause}' if cause else ''})", None


def attempts(e: openai.APIError) -> int:
    """The requests the SDK sent before raising ``e``: it numbers its retries in a header of each request."""
    return 1 + int(e.request.headers.get("x-stainless-retry-count", 0))


def caused_by(e: BaseException | None, *types: type[BaseException]) -> bool:
    """Whether ``e`` or an exception down its chain of causes is one of ``types``."""
    for _ in range(32):  # a chain may loop back through __context__
        if e is None or isinstance(e, types):
            return e is not None
        e = e.__cause__ or e.__context__
    return False
