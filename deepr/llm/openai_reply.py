"""Reading an OpenAI-compatible reply: what counts as a usable chat completion, and why not.

Used by openai_backend.py. A 200 reply can still be unusable (HTML from a proxy, JSON that is
not a completion, no choices, no text); each case becomes a :class:`_BadReply` with its reason
and whether a retry can help. :func:`failure_of` says the same of every error a request can
end in (timeouts, refused connections, HTTP statuses, a format the server refused).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from deepr.llm.base import OutputFormat


@dataclass
class _Result:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    format_sent: bool
    style: str | None = None  # the format style the request went out with


class _BadReply(Exception):
    """A 200 reply that is not a usable chat completion; ``retryable`` per case."""

    def __init__(self, reason: str, retryable: bool = False):
        super().__init__(reason)
        self.retryable = retryable


@dataclass
class _Failure:
    reason: str
    status: int | None
    retryable: bool
    retry_after: float | None = None
    format_refused: bool = False
    unreachable: bool = False
    style: str | None = None  # the format style this request went out with


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


def _fmt_dict(fmt: OutputFormat | None) -> dict[str, Any] | None:
    if fmt is None:
        return None
    return {"name": fmt.name, "json_schema": fmt.json_schema} if fmt.json_schema is not None else {
        "name": fmt.name, "regex": fmt.regex}


def _read_completion(resp: Any) -> tuple[str, str | None]:
    """(text, finish_reason) of a chat completion as decoded JSON, or :class:`_BadReply` saying
    what is wrong. The SDK hands back bodies it did not read as JSON (a JSON content type) as
    text: a JSON object there is still read, anything else is not a completion."""
    if isinstance(resp, (str, bytes)):
        try:
            resp = json.loads(resp)
        except ValueError:
            head = " ".join(str(resp)[:80].split())
            raise _BadReply(f"HTTP 200 with a body that is not JSON ({head!r}); is --base-url the API root "
                            "(ending in /v1)?") from None
    body = resp if isinstance(resp, dict) else {}
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
        return "", finish
    if not isinstance(content, str):
        why = "no message" if message is None else "no message text"
        raise _BadReply(f"the endpoint returned {why} (finish_reason={finish})")
    return content, finish


def _usage(resp: Any) -> tuple[int, int]:
    """(prompt, completion) tokens a completion reports (0 where it reports none or no number)."""
    usage = resp.get("usage") if isinstance(resp, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    return tuple(n if isinstance(n := usage.get(k), int) else 0 for k in ("prompt_tokens", "completion_tokens"))


def failure_of(e: BaseException, fmt: dict[str, Any] | None, styles: tuple[str | None, str | None], *,
               timeout: float, where: str | None) -> _Failure | None:
    """Why a request failed, as a value (None: an error this module does not know; the caller
    re-raises it). Turning errors into values keeps no exception holding the HTTP request (and
    its Authorization header) alive past the attempt."""
    import openai

    refused_msg = (f"connection refused: nothing is listening at {where} "
                   "(is the server running, and is --base-url right?)")
    if isinstance(e, openai.APIConnectionError):  # timeouts too; a body cut short: the server may recover
        if _refused(e):  # the SDK may call it a timeout; retrying an empty port only wastes time
            return _Failure(refused_msg, None, False, unreachable=True)
        if isinstance(e, openai.APITimeoutError):
            return _Failure(f"timed out after {timeout:g}s", None, True)
        return _Failure(f"connection error ({type(e).__name__}: {e})", None, True)
    if isinstance(e, TimeoutError):
        return _Failure(f"timed out after {timeout:g}s", None, True)
    if isinstance(e, openai.APIStatusError):
        return _status_failure(e, fmt, styles)
    if isinstance(e, openai.APIError):  # a reply the client cannot read: retrying will not fix it
        return _Failure(f"unreadable reply ({type(e).__name__}: {e})", None, False)
    if isinstance(e, ValueError):  # JSON cut short with a correct length: a server that died mid-reply
        return _Failure(f"the reply body is not complete JSON ({e})", 200, True)
    if isinstance(e, _BadReply):
        return _Failure(str(e), 200, e.retryable)
    return None


def _status_failure(e: Any, fmt: dict[str, Any] | None, styles: tuple[str | None, str | None]) -> _Failure:
    retryable = e.status_code == 429 or e.status_code >= 500
    message = str(e.message)
    if e.body is not None and str(e.body) not in message:  # e.g. FastAPI's 422 {"detail": [...]}
        message = f"{message} {json.dumps(e.body, default=str)[:300]}"
    style = styles[1] if (fmt or {}).get("regex") else styles[0]
    # llama-cpp-python's server answers an unknown response_format type with a 500.
    refused = fmt is not None and style is not None and (
        (e.status_code in (400, 422) and bool(_FORMAT_REFUSAL.search(message)))
        or (e.status_code >= 500 and bool(re.search(r"response_format|json_schema", message))))
    return _Failure(f"HTTP {e.status_code}: {message}", e.status_code, retryable, _retry_after(e),
                    format_refused=refused, style=style)


def _refused(e: BaseException) -> bool:
    """Whether a connection error was a refused connection (somewhere down its cause chain)."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        if isinstance(x, ConnectionRefusedError):
            return True
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    return False


def _retry_after(e: Any) -> float | None:
    try:
        value = e.response.headers.get("retry-after")
        return float(value) if value is not None else None
    except (AttributeError, TypeError, ValueError):
        return None
