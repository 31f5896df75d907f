"""``extractive``: the backend with NO language model.

Roles run their own deterministic algorithms over retrieval and embeddings instead of
prompting (:func:`deepr.roles.perform` runs ``role.extractive``, from :mod:`deepr.extractive`). For a generic prompt this backend still
answers something real and repeatable: the few sentences of the prompt's material
(system and user messages) that share the most informative words with the last user
message, in their original order. When the whole prompt is one user message, its last
sentence is taken as the question and the sentences before it as the material.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from deepr.text.lang import HAS_UNSPACED
from deepr.llm.base import LLM, Message
from deepr.text import split_sentences, words

NOTE = "no language model is used: every role runs a deterministic extractive algorithm"

_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset("""a an and are as at be been but by can could did do does for from had has have
how i if in into is it its may me more most my no not of on or our should so such than that the
their them then there these they this those to was we were what when where which who whom why
will with would you your about also any each other only own same some very just over under
between after before during through""".split())


def sentences(text: str) -> list[str]:
    """Split prose into sentences (deepr.text's splitter: a line break or a sentence end, in any
    language; headings and list items count as sentences here)."""
    return split_sentences(text, drop_headings=False)


def _stem(word: str) -> str:
    # Folding a plural / third-person "s" is enough to match "flows" with "flow".
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def content_words(text: str) -> set[str]:
    if HAS_UNSPACED.search(text):  # Chinese, Japanese, Thai: segmented words (deepr.text.lang)
        return {w for w in words(text) if len(w) > 1 and w not in _STOP}
    return {_stem(w) for w in _WORD.findall(text.lower()) if len(w) > 1 and w not in _STOP}


def _split_prompt(messages: Sequence[Message]) -> tuple[list[str], str]:
    """(candidate sentences, query) from a chat prompt."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    last = users[-1] if users else len(messages) - 1
    query = str(messages[last].get("content", "")) if messages else ""
    material = [str(m.get("content", "")) for i, m in enumerate(messages)
                if i != last and m.get("role") in ("system", "user")]
    cands = [s for text in material for s in sentences(text)]
    if not cands:
        own = sentences(query)
        if len(own) > 1:
            return own[:-1], own[-1]
    return cands, query


def select_sentences(candidates: Sequence[str], query: str, k: int = 3) -> list[str]:
    """The ``k`` candidates sharing the most idf-weighted words with ``query``, in original order.

    With no overlap at all, the first ``k`` sentences (a lead summary) are returned.
    """
    seen: set[str] = set()
    unique = [s for s in candidates if not (s in seen or seen.add(s))]
    bags = [content_words(s) for s in unique]
    df = Counter(w for bag in bags for w in bag)
    n = len(unique)
    q = content_words(query)
    scores = [sum(math.log(1 + n / df[w]) for w in bag & q) for bag in bags]
    ranked = sorted((i for i in range(n) if scores[i] > 0), key=lambda i: (-scores[i], i))[:k]
    chosen = sorted(ranked) if ranked else list(range(min(k, n)))
    return [unique[i] for i in chosen]


def _truncate(text: str, max_tokens: int | None, stop: Sequence[str] | None) -> str:
    for s in stop or ():
        if s and s in text:
            text = text[: text.index(s)]
    if max_tokens is not None:
        words = text.split(" ")
        text = " ".join(words[:max_tokens])
    return text


class ExtractiveLLM(LLM):
    name = "extractive"
    is_extractive = True

    def __init__(self, *, k: int = 3, max_concurrency: int = 8):
        super().__init__(max_concurrency=max_concurrency)
        self.k = k

    async def _achat(self, messages: list[Message], *, role: str | None, temperature: float | None,
                     max_tokens: int | None, stop: Sequence[str] | None, **extra: Any) -> str:
        cands, query = _split_prompt(messages)
        picked = select_sentences(cands, query, self.k) if cands else sentences(query)[: self.k]
        text = _truncate(" ".join(picked), max_tokens, stop)
        prompt_words = sum(len(str(m.get("content", "")).split()) for m in messages)
        self.usage.add(role=role, prompt_tokens=prompt_words, completion_tokens=len(text.split()))
        return text

    def label(self) -> str:
        return "extractive"

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model": None, "note": NOTE}
