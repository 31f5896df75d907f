"""AgentCPM-Report atomic-skill rewards (003 App. A.6.1; SPEC §6) for WARP actions.

- outline (initialize / expand): 2–7 subsections per section, and language consistency
  with the query measured by character statistics (share of letters in the query's script);
- paragraph (write): 100–2000 tokens, 0–12 citations, language consistency, and citation
  F1 against the teacher's citations; any cited id outside the retrieved set → 0;
- terminate: 1 if the decision matches the pruned label, else 0.

Input: the action's text plus the references named above; output: dicts with every part.

    deepr grpo --stage warp-atomic ...   (these are its reward functions)

Combinations fixed here (the paper's LLM-judged holistic-quality and faithfulness terms are
left to the report-level judge): outline = count_ok · language; paragraph = 0.5 basic +
0.5 citation F1 with basic = length_ok · count_ok · language; two empty citation sets
have F1 = 1. Tokens are words, and each CJK character counts as one token.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from deepr.text import find_markers

MIN_SUB, MAX_SUB = 2, 7
MIN_TOKENS, MAX_TOKENS = 100, 2000
MAX_CITES = 12

_TOKEN = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]|[^\W_]+", re.UNICODE)
_CITE_ID = re.compile(r"<cite\s+ids?\s*=\s*[\"']([^\"']*)[\"']", re.I)
_HEADING = re.compile(r"^\s*(#{1,6})\s+(.+?)\s*$")
_NUMBERED = re.compile(r"^\s*(?:\d+(?:\.\d+)*[.)]?|[-*+])\s+(.+?)\s*$")


def script_of(ch: str) -> str:
    """Coarse script of one letter: the first word of its Unicode name (LATIN, CJK, ...)."""
    try:
        name = unicodedata.name(ch)
    except ValueError:
        return "OTHER"
    first = name.split()[0]
    return "CJK" if first in ("CJK", "HIRAGANA", "KATAKANA", "HANGUL") else first


def dominant_script(text: str) -> str | None:
    counts = Counter(script_of(ch) for ch in text if ch.isalpha())
    return counts.most_common(1)[0][0] if counts else None


def language_consistency(text: str, reference: str) -> float:
    """Share of ``text``'s letters written in the dominant script of ``reference`` (1 if either has none)."""
    target = dominant_script(reference)
    letters = [ch for ch in text if ch.isalpha()]
    if target is None or not letters:
        return 1.0
    return sum(script_of(ch) == target for ch in letters) / len(letters)


def count_tokens(text: str) -> int:
    return len(_TOKEN.findall(text or ""))


def outline_sections(outline: str | Sequence[Any]) -> list[str]:
    """Section titles of a one-level outline: list items/dicts, or markdown headings / list lines."""
    if not isinstance(outline, str):
        out = []
        for s in outline:
            out.append(str(s.get("title") or s.get("name") or "") if isinstance(s, dict) else str(s))
        return [s for s in out if s.strip()]
    lines = outline.splitlines()
    heads = [(len(m.group(1)), m.group(2)) for m in map(_HEADING.match, lines) if m]
    if heads:
        top = min(level for level, _ in heads)
        return [t for level, t in heads if level == top]
    return [m.group(1) for m in map(_NUMBERED.match, lines) if m]


def outline_reward(outline: str | Sequence[Any], query: str) -> dict[str, float]:
    """Atomic reward of an initialize / expand action's one-level outline."""
    sections = outline_sections(outline)
    k = len(sections)
    count_ok = float(MIN_SUB <= k <= MAX_SUB)
    text = outline if isinstance(outline, str) else "\n".join(sections)
    lang = language_consistency(text, query)
    return {"outline_reward": count_ok * lang, "sections": float(k), "count_ok": count_ok, "language": lang}


def cited_ids(paragraph: str, known: Iterable[str] = ()) -> list[str]:
    """Citation ids of a paragraph in order of first use (<cite id> spans and [id] markers)."""
    ids = [i.strip() for m in _CITE_ID.finditer(paragraph) for i in re.split(r"[,\s;]+", m.group(1)) if i.strip()]
    ids += [i for _, _, found in find_markers(paragraph, known) for i in found]
    return list(dict.fromkeys(ids))


def set_f1(pred: Iterable[str], gold: Iterable[str]) -> float:
    p, g = set(pred), set(gold)
    if not p and not g:
        return 1.0
    hit = len(p & g)
    return 0.0 if hit == 0 else 2 * hit / (len(p) + len(g))


def paragraph_reward(paragraph: str, query: str, retrieved_ids: Iterable[str],
                     teacher_ids: Iterable[str]) -> dict[str, float]:
    """Atomic reward of a write action's paragraph (see the module docstring)."""
    retrieved = set(retrieved_ids)
    ids = cited_ids(paragraph, retrieved)
    unknown = [i for i in ids if i not in retrieved]
    n_tok = count_tokens(paragraph)
    length_ok = float(MIN_TOKENS <= n_tok <= MAX_TOKENS)
    count_ok = float(len(ids) <= MAX_CITES)
    lang = language_consistency(paragraph, query)
    f1 = set_f1(ids, teacher_ids)
    basic = length_ok * count_ok * lang
    total = 0.0 if unknown else 0.5 * basic + 0.5 * f1
    return {"paragraph_reward": total, "tokens": float(n_tok), "length_ok": length_ok,
            "citations": float(len(ids)), "count_ok": count_ok, "language": lang,
            "citation_f1": f1, "hallucinated_ids": float(len(unknown))}


_DECISIONS = {"terminate": "terminate", "stop": "terminate", "end": "terminate",
              "expand": "expand", "continue": "expand", "deepen": "expand"}


def normalise_decision(decision: str) -> str:
    """Map a decision string ("TERMINATE", "<terminate/>", "Expand section 2") to terminate/expand."""
    words = re.findall(r"[a-z]+", (decision or "").lower())
    for w in words:
        if w in _DECISIONS:
            return _DECISIONS[w]
    raise ValueError(f"cannot read a decision from {decision[:60]!r}; expected TERMINATE or EXPAND")


def terminate_reward(decision: str, label: str) -> float:
    """1.0 when the decision matches the pruned label; an unreadable decision scores 0
    (the model's fault), an unreadable label raises ValueError (the caller's)."""
    want = normalise_decision(label)
    try:
        got = normalise_decision(decision)
    except ValueError:
        return 0.0
    return float(got == want)
