"""Strict acceptance: shared checks that a role declaration opts into (``Role(accept=...)``).

A weak model's most common "valid" replies are not answers at all: the prompt's template
copied back (``...``, ``…``, ``the query``), the prompt or the re-ask text echoed, a search
query of one stop word. Each check here takes ``(value, prompt messages, re-asks sent)`` and
returns the problems as re-ask reasons, so :func:`deepr.roles.perform` rejects such a reply,
re-asks, and records the failure with its reason when the re-asks run out.

    accept=(no_placeholder, no_echo, query_words(lambda v: [v]))
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from deepr.llm.base import Message
from deepr.text import STOP_WORDS, tok, words as text_words

Accept = Callable[[Any, Sequence[Message], Sequence[str]], list[str]]

_ELLIPSIS = re.compile(r"^[\s.…·_\-\"'\[\](){}<>,:;]*$")
_TAG_BODY = re.compile(r"<([a-z_]+)>([^<]{1,80})</\1>", re.I)
_QUOTED = re.compile(r'"([^"{}\[\]]{1,80})"')
_ANGLE = re.compile(r"<([a-z][^<>]{2,80})>", re.I)
_CITES = re.compile(r"\[[^\[\]]*\]|</?cite[^>]*>", re.I)
_ECHO_MIN = 24  # shorter texts (a name, a date) may legitimately occur in a prompt


def strings(value: Any) -> Iterator[str]:
    """Every string leaf of a reply value (text, or a parsed JSON dict/list)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from strings(v)


def _uncite(text: str) -> str:
    # Most texts have no bracket at all; scanning for one is much cheaper than running the pattern.
    return _CITES.sub(" ", text) if "[" in text or "<" in text else text


def _norm(text: str) -> str:
    # str.split() splits on exactly the characters \s matches, and is several times faster than
    # the regex on the long prompts every reply is compared with.
    return " ".join(_uncite(text).split()).strip(".").strip().lower()


# A run's prompts repeat: one system prompt per role, and a request is checked against every reply
# and re-ask it gets. Normalising them once per text, not once per check, was a tenth of deepr's
# CPU per model call at --parallel 32 (the throughput benchmark, --profile).
_norm_prompt = functools.lru_cache(maxsize=512)(_norm)


@functools.lru_cache(maxsize=512)
def _message_templates(text: str, system: bool) -> frozenset[str]:
    patterns = ((_TAG_BODY, 2), (_QUOTED, 1), (_ANGLE, 1)) if system else ((_ANGLE, 1),)
    return frozenset(_norm(x.group(group)) for pattern, group in patterns for x in pattern.finditer(text))


def template_texts(messages: Sequence[Message]) -> set[str]:
    """Texts the prompt shows as a format to fill: ``<tag>the query</tag>`` bodies and quoted
    strings of JSON examples in the instructions, and ``<a placeholder>`` descriptions."""
    out: set[str] = set()
    for m in messages:
        # Quoted strings and tag bodies count only in the instructions: a user message carries
        # evidence whose quoted statements a reply may rightly repeat.
        out.update(_message_templates(str(m.get("content", "")), m.get("role") == "system"))
    # One-word values ("search", "factual", "STOP") are legitimate choices, not templates.
    return {t for t in out if len(t.split()) >= 2}


# A field that only names its slot: SmolLM2 filled a plan's answer need with "The answer to the
# question", which no prompt showed as a template.
_SLOT_NAME = re.compile(r"(?:(?:the|your|an?|my) )?(?:final )?(?:answer|query|question|paragraph|text|content|"
                        r"summary|need|key point|result)s?(?: (?:to|for|of) (?:the|this|your) (?:question|query|"
                        r"request|task))?(?: here| goes here)?")


def no_placeholder(value: Any, messages: Sequence[Message], reasks: Sequence[str] = ()) -> list[str]:
    """A reply (or a JSON field) that is only dots, only the name of its slot ("the answer to the
    question"), or the prompt's template text copied back."""
    templates = template_texts(messages)
    problems = []
    for s in strings(value):
        if not (text := s.strip()):
            continue
        if _ELLIPSIS.match(_CITES.sub("", s)):  # dots, maybe behind a real id
            problems.append(f"{text!r} is a placeholder, not content; write the actual text")
        elif (body := _norm(s)) in templates:
            problems.append(f"{text!r} is the prompt's template text; replace it with real content")
        elif len(body.split()) >= 2 and _SLOT_NAME.fullmatch(body):  # "Summary" may be a title
            problems.append(f"{text!r} only names what belongs there; write the actual text")
    return problems[:3]


_QUOTE = re.compile(r"'[^']*'|\"[^\"]*\"")
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")


def _sentences(text: str) -> list[tuple[str, str]]:
    """Each sentence of ``text`` with its normalised body, if 24+ characters long."""
    pairs = ((x, _norm(x)) for x in _SENTENCE.split(text))
    return [(x, body) for x, body in pairs if len(body) >= _ECHO_MIN]


def _copied_sentence(sentences: list[tuple[str, str]], sources: Sequence[str]) -> str | None:
    """The first of ``sentences`` found verbatim in one of ``sources``."""
    for sentence, body in sentences:
        if any(body in t for t in sources):
            return sentence.strip()
    return None


def no_echo(value: Any, messages: Sequence[Message], reasks: Sequence[str] = ()) -> list[str]:
    """A reply that repeats the instructions (system prompt), a re-ask, or the whole request;
    in a longer text, one sentence copied from the instructions or a re-ask is enough."""
    instructions = [_norm_prompt(str(m.get("content", ""))) for m in messages if m.get("role") == "system"]
    requests = [_norm_prompt(str(m.get("content", ""))) for m in messages if m.get("role") == "user"]
    again = [_norm(r) for r in reasks]
    # A re-ask may quote the rejected reply ('...'); a corrected reply may rightly keep that text.
    own_words = [_norm(_QUOTE.sub(" ", r)) for r in reasks]
    for s in strings(value):
        body = _norm(s)
        if len(body) < _ECHO_MIN:
            continue
        if any(body in t for t in instructions):
            return ["the reply repeats the instructions instead of carrying out the task"]
        if any(body in t or t in body for t in again if t):
            return ["the reply repeats the correction request instead of a corrected reply"]
        if any(body == t for t in requests):
            return ["the reply repeats the request instead of answering it"]
        sentences = _sentences(s) if instructions or own_words else []
        if copied := _copied_sentence(sentences, instructions):
            return [f"the sentence {copied[:60]!r} is copied from the instructions, not written from the evidence"]
        if copied := _copied_sentence(sentences, own_words):
            return [f"the sentence {copied[:60]!r} is copied from the correction request, not an answer"]
    return []


_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")


def _content_words(query: str) -> int:
    # Scripts written without spaces form one "word" per run; two characters make about one word.
    # Distinct words: "vaccine vaccine" names one thing, however often it repeats it.
    return max(len(set(tok(query))), len(set(_CJK.findall(query))) // 2)


def query_words(queries: Callable[[Any], Sequence[str]], least: int = 2) -> Accept:
    """Search queries (picked out of the value) need ``least`` content words: a stop word or
    a lone generic term retrieves noise."""

    def check(value: Any, messages: Sequence[Message], reasks: Sequence[str] = ()) -> list[str]:
        short = [q for q in queries(value) if _content_words(q) < least]
        looped = [(q, w) for q in queries(value) if q not in short and (w := _looped_word(q))]
        return ([f"the search query {q!r} has fewer than {least} content words; name what to find"
                 for q in short[:3]]
                + [f"the search query {q!r} repeats {w!r}; name each thing once" for q, w in looped[:3]])

    return check


def _looped_word(query: str) -> str | None:
    """A word that makes up more than half of a query of 4+ words ("seasons seasons seasons seasons
    Earth", seen from SmolLM2 in tools mode), or None."""
    words = [w for w in text_words(query) if w not in STOP_WORDS]
    top = max(set(words), key=words.count, default=None)
    return top if len(words) >= 4 and 2 * words.count(top) > len(words) else None


_WORD = re.compile(r"[^\W_][\w'\-]*")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_COMMON = frozenset("the a an of in on and or to for is are was were be by with as at from that this it its "
                    "which who their they has have not".split())
_REPEAT_MIN, _REPEAT_SHARE = 8, 0.4  # one word as 40 % of a sentence of 8+ words: a loop, not prose
_DIGIT_MIN, _DIGIT_SHARE = 3, 0.6  # most "words" carry digits: ids and counters, not text
# 40 % of the 4-word phrases of a 20+ word text repeat earlier ones: a loop that varies a word or a
# number per sentence ("The volcano is a seamount which is a volcanic island ... 2.222, and the
# volcano is a seamount ..."), which the sentence and word checks miss. The 10,033 offline
# Wikipedia summaries reach at most 14 % (Economic inequality).
_LOOP_MIN, _LOOP_N, _LOOP_SHARE = 20, 4, 0.4


def phrase_loop(text: str) -> float:
    """The share of the word ``_LOOP_N``-grams of ``text`` that repeat an earlier one (0 below
    ``_LOOP_MIN`` words)."""
    return _loop_share([w.lower() for w in _WORD.findall(_uncite(text))])


def _loop_share(words: list[str]) -> float:
    if len(words) < _LOOP_MIN:
        return 0.0
    seen: set[tuple[str, ...]] = set()
    repeats = 0
    for i in range(len(words) - _LOOP_N + 1):
        gram = tuple(words[i:i + _LOOP_N])
        repeats += gram in seen
        seen.add(gram)
    return repeats / (len(words) - _LOOP_N + 1)


def babble(text: str) -> str | None:
    """Why a text is degenerate (None: it is not): half or more of its sentences are copies of the
    others, a sentence loops on one word ("SECTION 1 SECTION 2 SECTION 3 …"), or its words are
    mostly digit strings and ids ("S1-R1234 1 2 3")."""
    # The text is cleaned and split once; the sentences' words, joined, are the whole text's words
    # (sentences split on whitespace only), which the phrase-loop share reads.
    parts = _SENTENCE_END.split(_uncite(text))
    lowered = [_WORD.findall(x.lower()) for x in parts]
    sentences = [" ".join(w) for w in lowered if len(w) >= 4]
    if len(sentences) >= 3 and 2 * len(set(sentences)) <= len(sentences):
        return f"{len(sentences) - len(set(sentences))} of its {len(sentences)} sentences repeat others"
    # Lower-casing before or after finding the words differs only outside ASCII ("İ" lower-cases
    # to two characters), so an ASCII text reuses the words found above.
    ascii_text = text.isascii()
    every: list[str] = []
    for sentence, low in zip(parts, lowered):
        words = low if ascii_text else [w.lower() for w in _WORD.findall(sentence)]
        every += words
        # counted by whitespace: one id ("n0.1.2", "2023-05-01") is a legitimate field value
        toks = sentence.split()
        if (len(toks) >= _DIGIT_MIN and any(map(str.isdigit, sentence))
                and sum(any(map(str.isdigit, t)) for t in toks) >= _DIGIT_SHARE * len(toks)):
            return f"{sentence.strip()[:60]!r} is mostly numbers and ids, not words"
        if len(words) < _REPEAT_MIN:
            continue
        top = max(((n, w) for w, n in Counter(words).items() if w not in _COMMON), default=None)
        if top and top[0] >= _REPEAT_SHARE * len(words):
            return f"{sentence.strip()[:60]!r} repeats {top[1]!r} over and over"
    if (share := _loop_share(every)) >= _LOOP_SHARE:
        return f"{round(100 * share)} % of its 4-word phrases repeat earlier ones (a loop)"
    return None


def no_babble(value: Any, messages: Sequence[Message], reasks: Sequence[str] = ()) -> list[str]:
    """Degenerate text in any string of the reply (see :func:`babble`): a small model under a
    format can fill it with a counter or one word repeated, which no other check catches."""
    found = [why for s in strings(value) if (why := babble(s))]
    return [f"{why}; write real sentences about the question" for why in found[:2]]


# What every reply of free text is checked for (queries add query_words, citations their own check).
FREE_TEXT: tuple[Accept, ...] = (no_placeholder, no_echo, no_babble)
