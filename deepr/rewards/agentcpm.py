"""AgentCPM-Report atomic-skill rewards (003 App. A.6.1) for WARP actions.

- outline (initialize / expand): 2–7 subsections per section, and language consistency
  with the query measured by character statistics (share of letters in the query's script);
- paragraph (write): 100–2000 tokens, 0–12 citations, language consistency, and citation
  F1 against the teacher's citations; any cited id outside the retrieved set → 0;
- terminate: 1 if the decision matches the pruned label, else 0.

Input: the action's text plus the references named above; output: dicts with every part.

    deepr grpo --stage warp-atomic ...   (these are its reward functions)

Combinations fixed here (003 lists the terms in Table 1 but gives no weights, so the terms
present are averaged with equal weight): without a judge, outline = basic and paragraph =
0.5 basic + 0.5 citation precision; with an LLM judge (``grpo --judge-llm``) the judged
holistic-quality and faithfulness terms join them: outline = mean(basic, quality,
faithfulness), paragraph = mean(basic, quality, faithfulness, citation precision).
basic = length_ok · count_ok · language (paragraph) or count_ok · language (outline);
citation precision = citation F1, or 0 when a cited id is outside the retrieved set (that
hallucination zeroes this term only); two empty citation sets have F1 = 1. Quality is the
judge's 1–5 rating per aspect (outline: guidance, hierarchy, coherence — OmniThink; paragraph:
relevance, coverage, depth, novelty — STORM) mapped to (s − 1) / 4 and averaged, with the
teacher's reply shown as the score-5 reference; faithfulness is the share of the reply's
factual claims the judge finds supported by the material the action saw (FActScore-style).
Tokens are words, and each CJK character counts as one token.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel

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
    precision = 0.0 if unknown else f1  # a hallucinated id zeroes citation precision, not the paragraph
    return {"paragraph_reward": 0.5 * basic + 0.5 * precision, "basic": basic, "tokens": float(n_tok),
            "length_ok": length_ok, "citations": float(len(ids)), "count_ok": count_ok, "language": lang,
            "citation_f1": f1, "citation_precision": precision, "hallucinated_ids": float(len(unknown))}


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


# --- LLM-judged terms (003 App. A.6.1: holistic quality, faithfulness) --------------------------

OUTLINE_ASPECTS = {
    "guidance": "Does the outline steer the writing so that every important part of the topic gets covered?",
    "hierarchy": "Are topics and subtopics clearly separated into levels, distinct and sensibly nested?",
    "coherence": "Do the sections follow a logical order with natural transitions between ideas?"}
PARAGRAPH_ASPECTS = {
    "relevance": "Does the text stay focused on the question and the section's purpose?",
    "coverage": "Does it cover the main aspects of its subject without padding?",
    "depth": "Does it explore its subject in detail rather than give a surface overview?",
    "novelty": "Does it bring in pertinent aspects beyond the literal wording of the request?"}

QUALITY_PROMPT = """You grade one step of a report-writing agent on a 1-5 scale per aspect (1 = very poor, 3 = \
acceptable with clear gaps, 5 = excellent, nothing to improve). A reference reply that deserves 5 is \
shown for calibration; the reply may differ from it and still score well. List the major and minor \
problems to yourself first, then score strictly; low scores are fine.

Request the agent received:
<<<
{instruction}
>>>

Reply to grade:
<<<
{response}
>>>

Reference reply (score 5):
<<<
{reference}
>>>

Aspects:
{aspects}

Return {{"scores": {{{keys}}}}} with an integer 1-5 for each aspect."""

FAITH_PROMPT = """Check whether a reply states only things its source material backs up. List each factual claim the \
reply makes (skip headings, plans and opinions) and say whether the source material supports it. A \
claim that cites an id must be supported by that id's text.

Source material:
<<<
{sources}
>>>

Reply:
<<<
{response}
>>>

Return {{"claims": [{{"claim": "...", "supported": true}}]}} (an empty list when there is no factual claim)."""


class _Scores(BaseModel):
    scores: dict[str, int]


class _Claim(BaseModel):
    claim: str
    supported: bool


class _Claims(BaseModel):
    claims: list[_Claim]


def _clip(text: str, n: int = 12000) -> str:
    return text if len(text) <= n else text[:n] + " …"


async def judged_quality(judge: Any, instruction: str, response: str, reference: str,
                         aspects: dict[str, str]) -> Any:
    """Verdict whose value is {"quality": mean (s − 1)/4, "quality_<aspect>": s} (LLM judge only)."""

    def check(v: _Scores) -> list[str]:
        bad = [k for k in aspects if not 1 <= int(v.scores.get(k, 0)) <= 5]
        return [f"give an integer 1-5 for each of {', '.join(aspects)} (missing or out of range: "
                f"{', '.join(bad)})"] if bad else []

    def convert(v: _Scores) -> dict[str, float]:
        out = {f"quality_{k}": float(v.scores[k]) for k in aspects}
        out["quality"] = sum((v.scores[k] - 1) / 4 for k in aspects) / len(aspects)
        return out

    return await judge.run(
        "agentcpm_quality", [instruction, response, reference, sorted(aspects)],
        prompt=QUALITY_PROMPT.format(instruction=_clip(instruction), response=_clip(response),
                                     reference=_clip(reference), keys=", ".join(f'"{k}": 0' for k in aspects),
                                     aspects="\n".join(f"- {k}: {d}" for k, d in aspects.items())),
        schema=_Scores, check=check, convert=convert, max_tokens=1024)


async def judged_faithfulness(judge: Any, response: str, sources: str) -> Any:
    """Verdict whose value is {"faithfulness": supported / claims (1 with no claim), "claims": n}."""

    def convert(v: _Claims) -> dict[str, float]:
        n = len(v.claims)
        return {"faithfulness": sum(c.supported for c in v.claims) / n if n else 1.0, "claims": float(n)}

    return await judge.run("agentcpm_faithfulness", [response, sources],
                           prompt=FAITH_PROMPT.format(sources=_clip(sources), response=_clip(response)),
                           schema=_Claims, convert=convert, max_tokens=2048)


async def judged_terms(judge: Any, kind: str, instruction: str, response: str, reference: str) -> dict[str, Any]:
    """Quality and faithfulness of an outline (``kind="outline"``) or paragraph; the request's own
    text is the source material. {"failure": reason} when a judgement failed (never a silent 0)."""
    import asyncio

    aspects = OUTLINE_ASPECTS if kind == "outline" else PARAGRAPH_ASPECTS
    q, f = await asyncio.gather(judged_quality(judge, instruction, response, reference, aspects),
                                judged_faithfulness(judge, response, instruction))
    bad = [v.reason for v in (q, f) if not v.ok]
    return {"failure": "; ".join(bad)} if bad else {**q.value, **f.value}


def with_judged(basic_terms: Sequence[float], judged: dict[str, Any]) -> float:
    """Equal-weight mean of the unjudged terms and the judged quality and faithfulness."""
    terms = [*basic_terms, judged["quality"], judged["faithfulness"]]
    return sum(terms) / len(terms)
