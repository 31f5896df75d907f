"""The context budget of a chat prompt: how long the model's context is, how many tokens a
prompt takes (the backend's own count, else an estimate that errs high), and trimming the
evidence lines of a prompt that does not fit. :func:`deepr.roles.fit_context` uses these before
any call is sent, so a prompt over the context fails clearly instead of being cut by the server.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from deepr.llm.base import LLM, Message

CHARS_PER_TOKEN = 3  # an estimate that errs high for English and code, so a trimmed prompt fits
_PER_MESSAGE = 8  # chat-template tokens around each message
# An evidence item as the prompts show it: "[N1-R3] title: text" or "[2] title — text".
_EVIDENCE_LINE = re.compile(r"^\[[^\]\n]{1,40}\] \S.*$", re.M)
_MIN_EVIDENCE_CHARS = 80


def context_length(llm: LLM) -> int | None:
    """The model's context in tokens when the backend reports it (``llm.context_length``), else None."""
    for obj in (llm, getattr(llm, "inner", None)):
        n = getattr(obj, "context_length", None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def prompt_tokens(llm: LLM, messages: Sequence[Message]) -> int:
    """Tokens of ``messages``: the backend's own count (``llm.count_tokens``) when it has one,
    else a character estimate."""
    count = getattr(llm, "count_tokens", None)
    if callable(count):
        try:
            return int(count(list(messages)))
        except Exception:  # a tokenizer that cannot count this prompt: estimate instead
            pass
    return sum(len(str(m.get("content", ""))) // CHARS_PER_TOKEN + _PER_MESSAGE for m in messages)


def trim_evidence(messages: list[Message], over_chars: int) -> list[Message] | None:
    """Messages with about ``over_chars`` fewer characters of evidence: long evidence lines are
    shortened first (every item keeps its id), then the last items are dropped. None when the
    prompt has no evidence left to cut."""
    lines = [(i, m.start(), m.end()) for i, msg in enumerate(messages) if msg.get("role") != "system"
             for m in _EVIDENCE_LINE.finditer(str(msg.get("content", "")))]
    texts = [messages[i]["content"][a:b] for i, a, b in lines]
    if not lines:
        return None
    new = list(texts)
    longest = max(len(t) for t in texts)
    cap, cut = longest, 0
    while cut < over_chars and cap > _MIN_EVIDENCE_CHARS:
        cap = max(_MIN_EVIDENCE_CHARS, cap * 3 // 4)
        new = [t if len(t) <= cap else t[:cap].rsplit(" ", 1)[0] + " …" for t in texts]
        cut = sum(len(a) - len(b) for a, b in zip(texts, new))
    k = len(new)
    while cut < over_chars and k > 0:  # the lowest-ranked items go last in every prompt
        k -= 1
        cut += len(new[k]) + 1
        new[k] = None  # type: ignore[call-overload]
    if cut == 0:
        return None
    out = [dict(m) for m in messages]
    for (i, a, b), t in reversed(list(zip(lines, new))):
        body = out[i]["content"]
        out[i]["content"] = body[:a] + t + body[b:] if t is not None else body[:a] + body[b + 1:]
    return out
