"""DeepRubric composite reward (002 Eq. 5, App. A.1–A.4) and its parts.

    R = 0.5 R_rubric + 0.2 R_format + 0.2 R_cite + 0.1 R_search

Input: the agent's completion (``<think>``, ``<tool_call>``, ``<answer>`` with
``<cite id="...">claim</cite>`` spans) or a plain markdown report with bracketed
markers ``[N1-R3]``, the question, rubric items, and the citation store {id: snippet
text}. Output: dicts with every component. R_format, R_search and R_fmt are pure; R_rubric
and the per-claim F1 use a :class:`~deepr.rewards.judges.Judge`.

    deepr eval trace.json --metric rubric,citation,composite --rubrics verified.jsonl --out s.jsonl

Definitions fixed here: claims are cite spans, sentences carrying bracketed markers, and
the remaining sentences (connective fragments under 3 words around a span are not claims).
A cited claim none of whose ids is in the store gets recall 0 and precision 0 without a
judge call. With no citation at all, v = m = 0 so R_fmt = 0. Citation distribution
uses the first position of each distinct valid id; uniformity is 1 − mean |gap − ḡ| / ḡ
(1 for two citations, 0 for one). An empty report scores 0 everywhere, with a note.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, field_validator

from deepr.extractive.support import invented
from deepr.rewards.judges import Judge, Verdict, coerce_rubrics
from deepr.text import find_markers, split_sentences, strip_citations, tok, word_count

W_RUBRIC, W_FORMAT, W_CITE, W_SEARCH = 0.5, 0.2, 0.2, 0.1
TOOL_NAMES = ("search", "browse", "scholar")
SEARCH_CAP = 6

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_THINK = re.compile(r"<think>(.*?)</think>", re.S | re.I)
_TOOL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S | re.I)
_CITE_SPAN = re.compile(r"<cite\s+ids?\s*=\s*[\"']([^\"']*)[\"']\s*>(.*?)</cite>", re.S | re.I)
_NON_ANSWER = re.compile(r"<(think|tool_call|tool_response)>.*?</\1>", re.S | re.I)


@dataclass
class Claim:
    text: str
    ids: list[str]
    start: int  # character offset in the answer text, for the distribution score

    @property
    def cited(self) -> bool:
        return bool(self.ids)


def answer_text(completion: str) -> str:
    """The report: the last <answer> block if there is one, else the text minus tool/think blocks."""
    blocks = _ANSWER.findall(completion or "")
    if blocks:
        return blocks[-1].strip()
    return _NON_ANSWER.sub("", completion or "").strip()


def _sentence_claims(segment: str, offset: int, known: Collection[str]) -> list[Claim]:
    out, pos = [], 0
    for sent in split_sentences(segment):
        at = segment.find(sent[:20], pos)
        at = pos if at < 0 else at
        pos = at + len(sent)
        marks = find_markers(sent, known)
        ids = [i for _, _, found in marks for i in found]
        for start, end, _ in reversed(marks):
            sent = sent[:start] + sent[end:]
        text = strip_citations(sent)
        if ids or (word_count(text) >= 3 and tok(text)):
            out.append(Claim(text, list(dict.fromkeys(ids)), offset + at))
    return out


def extract_claims(answer: str, known: Collection[str] = ()) -> list[Claim]:
    """Cited claims (cite spans, sentences with markers) and uncited sentences, in order.

    ``known`` ids (the citation store) let markers without digits, like [a], count."""
    claims: list[Claim] = []
    last = 0
    for m in _CITE_SPAN.finditer(answer):
        claims.extend(_sentence_claims(answer[last:m.start()], last, known))
        ids = [i.strip() for i in re.split(r"[,\s;]+", m.group(1)) if i.strip()]
        claims.append(Claim(strip_citations(m.group(2)), list(dict.fromkeys(ids)), m.start()))
        last = m.end()
    claims.extend(_sentence_claims(answer[last:], last, known))
    return claims


# --- pure parts --------------------------------------------------------------------------


def tool_calls(completion: str, names: Sequence[str] = TOOL_NAMES) -> tuple[int, int]:
    """(valid, invalid) <tool_call> blocks: valid = JSON with a known name and dict arguments."""
    valid = invalid = 0
    for body in _TOOL.findall(completion or ""):
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError:
            invalid += 1
            continue
        ok = isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments", {}), dict)
        valid, invalid = valid + ok, invalid + (not ok)
    return valid, invalid


def r_search(n_valid_calls: int) -> float:
    return min(n_valid_calls / SEARCH_CAP, 1.0)


def r_format(completion: str) -> dict[str, float]:
    """0.5 I_answer + 0.2 I_cite + 0.1 I_tool + 0.2 I_think (002 Eq. 7)."""
    text = completion or ""
    opens, closes = len(re.findall(r"<answer>", text, re.I)), len(re.findall(r"</answer>", text, re.I))
    blocks = _ANSWER.findall(text)
    i_answer = float(opens == closes == len(blocks) >= 1 and bool(blocks[-1].strip()))
    i_cite = float(bool(_CITE_SPAN.search(answer_text(text))))
    i_tool = float(tool_calls(text)[0] >= 1)
    i_think = float(any(t.strip() for t in _THINK.findall(text)))
    total = 0.5 * i_answer + 0.2 * i_cite + 0.1 * i_tool + 0.2 * i_think
    return {"R_format": total, "I_answer": i_answer, "I_cite": i_cite, "I_tool": i_tool, "I_think": i_think}


def _distribution(positions: Sequence[float]) -> dict[str, float]:
    p = sorted(positions)
    k = len(p)
    if k == 0:
        return {"d": 0.0, "span": 0.0, "uniformity": 0.0, "center": 0.0}
    span = min((p[-1] - p[0]) / 0.6, 1.0)
    if k == 1:
        uni = 0.0
    else:
        gaps = [b - a for a, b in zip(p, p[1:])]
        mean_gap = sum(gaps) / len(gaps)
        uni = 0.0 if mean_gap <= 0 else 1.0 - min(1.0, sum(abs(g - mean_gap) for g in gaps) / len(gaps) / mean_gap)
    center = 1.0 - 2.0 * abs(sum(p) / k - 0.5)
    return {"d": 0.4 * span + 0.4 * uni + 0.2 * center, "span": span, "uniformity": uni, "center": center}


def citation_format(answer: str, claims: Sequence[Claim], store_ids: Sequence[str] | set[str]) -> dict[str, float]:
    """R_fmt = Q (0.7 + 0.1 d + 0.2 n), Q = v·m (002 App. A.4.3)."""
    known = set(store_ids)
    cited = [c for c in claims if c.cited]
    all_ids = {i for c in cited for i in c.ids}
    valid = all_ids & known
    v = len(valid) / len(all_ids) if all_ids else 0.0
    m = sum(len(c.text.split()) >= 4 and len(c.text) >= 18 for c in cited) / len(cited) if cited else 0.0
    first: dict[str, int] = {}
    for c in cited:
        for i in c.ids:
            if i in valid:
                first.setdefault(i, c.start)
    length = max(len(answer), 1)
    dist = _distribution([pos / length for pos in first.values()])
    n = min(len(valid) / 6, 1.0)
    q = v * m
    return {"R_fmt": q * (0.7 + 0.1 * dist["d"] + 0.2 * n), "v": v, "m": m, "n": n, "Q": q, **dist,
            "cited_ids": len(all_ids), "unknown_ids": len(all_ids - known)}


def claim_f1(recall: float, precision: float) -> float:
    return 0.0 if recall + precision == 0 else 2 * recall * precision / (recall + precision)


# --- citation judges (002 App. A.4.2) ------------------------------------------------------


class _ClaimSupport(BaseModel):
    support: Literal["full", "partial", "none"]
    relevant: bool

    @field_validator("support", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v


class _NeedsCitation(BaseModel):
    needs_citation: list[bool]


CLAIM_PROMPT = """Check one statement of a report against the sources it cites.

support: "full" when nearly all of the statement is stated in or directly drawn from the
sources; "partial" when more than half is supported but some part is missing or conflicts;
"none" when the sources do not back its main points.
relevant: true when the sources contain at least some key information of the statement,
false when they are essentially about something else.

Question: {question}
Statement: {statement}
Sources:
<<<
{sources}
>>>

Return {{"support": "full"|"partial"|"none", "relevant": true|false}}."""

NEEDS_CITE_PROMPT = """Below are sentences from a report that carry no citation. For each, decide
whether it makes a concrete factual claim (a fact, number, date, result, comparison or
attribution) that ought to be backed by a source. Introductions, transitions, restatements
of the question and summaries of points already cited do not need one.

Question: {question}
Sentences:
{numbered}

Return {{"needs_citation": [true|false, ...]}} with exactly {n} booleans, in order."""


async def judge_claim(judge: Judge, question: str, statement: str, sources: str) -> Verdict:
    """[recall ∈ {1, .5, 0}, precision ∈ {1, 0}] of a cited claim against its sources."""
    def local() -> list[float]:
        s = judge.support(statement, sources)
        # A date or name the sources never mention is invented, however close the embedding is.
        backed = 0.0 if invented(statement, sources) else 1.0 if s >= 0.7 else 0.5 if s >= 0.45 else 0.0
        return [backed, 1.0 if s >= 0.3 else 0.0]

    return await judge.run(
        "claim", [question, statement, sources], local=local,
        prompt=CLAIM_PROMPT.format(question=question, statement=statement, sources=sources),
        schema=_ClaimSupport,
        convert=lambda v: [{"full": 1.0, "partial": 0.5, "none": 0.0}[v.support], 1.0 if v.relevant else 0.0])


def factual_sentence(sentence: str) -> bool:
    """Extractive "needs a citation": a number, a capitalised name, or ≥ 8 content tokens."""
    if any(ch.isdigit() for ch in sentence):
        return True
    return any(w[:1].isupper() for w in sentence.split()[1:]) or len(tok(sentence)) >= 8


async def judge_needs_citation(judge: Judge, question: str, sentences: Sequence[str]) -> Verdict:
    """One bool per uncited sentence (one call for all of them)."""
    if not sentences:
        return Verdict(True, [], judge=judge.name)
    n = len(sentences)
    numbered = "\n".join(f"{i}. {s}" for i, s in enumerate(sentences, start=1))
    return await judge.run(
        "needs_cite", [question, list(sentences)], local=lambda: [factual_sentence(s) for s in sentences],
        prompt=NEEDS_CITE_PROMPT.format(question=question, numbered=numbered, n=n),
        schema=_NeedsCitation, convert=lambda v: list(v.needs_citation),
        check=lambda v: [] if len(v.needs_citation) == n else
        [f"needs_citation has {len(v.needs_citation)} entries, expected {n}"])


# --- judged parts ------------------------------------------------------------------------


@dataclass
class CitationReward:
    R_cite: float | None
    F1_mean: float | None
    fmt: dict[str, float]
    claims: list[dict[str, Any]] = field(default_factory=list)
    judge: str = ""
    failure: str | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def citation_reward(question: str, answer: str, store: Mapping[str, str], judge: Judge) -> CitationReward:
    """R_cite = 0.6 F̄1 + 0.4 R_fmt with per-claim recall/precision from ``judge``."""
    claims = extract_claims(answer, store.keys())
    fmt = citation_format(answer, claims, store.keys())
    if not claims:
        return CitationReward(0.0, 0.0, fmt, judge=judge.name, notes=["empty report: no claims to score"])
    cited = [c for c in claims if c.cited and any(i in store for i in c.ids)]
    uncited = [c for c in claims if not c.cited]
    verdicts = await asyncio.gather(
        *(judge_claim(judge, question, c.text, "\n\n".join(store[i] for i in c.ids if i in store)) for c in cited),
        judge_needs_citation(judge, question, [c.text for c in uncited]))
    bad = [v.reason for v in verdicts if not v.ok]
    if bad:
        return CitationReward(None, None, fmt, judge=judge.name, failure="; ".join(bad))
    by_claim = {id(c): v.value for c, v in zip(cited, verdicts)}
    needs = dict(zip((id(c) for c in uncited), verdicts[-1].value))
    rows = []
    for c in claims:
        if not c.cited:
            rec, prec = (0.0 if needs[id(c)] else 1.0), 1.0
        else:
            rec, prec = by_claim.get(id(c), (0.0, 0.0))  # no known id: nothing supports it
        rows.append({"text": c.text, "ids": c.ids, "recall": rec, "precision": prec, "f1": claim_f1(rec, prec)})
    f1 = sum(r["f1"] for r in rows) / len(rows)
    return CitationReward(0.6 * f1 + 0.4 * fmt["R_fmt"], f1, fmt, rows, judge=judge.name)


async def rubric_score(question: str, report: str, rubrics: Any, judge: Judge) -> dict[str, Any]:
    """R_rubric = Σ|w| credit / Σ|w| over the 0–4 judge scores / 4 (see judges module)."""
    items = coerce_rubrics(rubrics, where="rubric")
    if not report.strip():
        return {"R_rubric": 0.0, "judge": judge.name, "note": "empty report: every criterion unmet"}
    verdict = await judge.rubrics(question, report, items)
    if not verdict.ok:
        return {"R_rubric": None, "judge": judge.name, "failure": verdict.reason}
    return {"R_rubric": verdict.value["score"], "items": verdict.value["items"], "judge": judge.name}


async def rubric_composite(question: str, completion: str, rubrics: Any, store: Mapping[str, str],
                           judge: Judge, *, n_tool_calls: int | None = None) -> dict[str, Any]:
    """The full composite of 002 Eq. 5; ``n_tool_calls`` overrides counting <tool_call> blocks
    (e.g. the ok entries of a run trace's ``tools``)."""
    report = answer_text(completion)
    fmt = r_format(completion)
    n_calls = tool_calls(completion)[0] if n_tool_calls is None else n_tool_calls
    rub, cite = await asyncio.gather(rubric_score(question, report, rubrics, judge),
                                     citation_reward(question, report, store, judge))
    out: dict[str, Any] = {**fmt, "R_search": r_search(n_calls), "tool_calls": n_calls,
                           "R_rubric": rub["R_rubric"], "R_cite": cite.R_cite, "F1_mean": cite.F1_mean,
                           "R_fmt": cite.fmt["R_fmt"], "judge": judge.name}
    failures = [f for f in (rub.get("failure"), cite.failure) if f]
    if failures:
        out["R"], out["failure"] = None, "; ".join(failures)
        return out
    out["R"] = (W_RUBRIC * rub["R_rubric"] + W_FORMAT * fmt["R_format"] + W_CITE * cite.R_cite
                + W_SEARCH * out["R_search"])
    return out


def report_structure(report: str, sources: Mapping[str, str]) -> dict[str, Any]:
    """Report statistics: sections, citations, distinct / valid cited ids, unique sources.

    ``sources`` maps each known citation id to its document id."""
    claims = extract_claims(report, sources.keys())
    ids = [i for c in claims for i in c.ids]
    distinct = set(ids)
    valid = distinct & set(sources)
    return {"sections": sum(1 for line in report.splitlines() if re.match(r"^\s{0,3}#{1,6}\s", line)),
            "words": len(report.split()), "citations": len(ids), "cited_ids": len(distinct),
            "unknown_cited_ids": sorted(distinct - valid),
            "cited_id_validity": len(valid) / len(distinct) if distinct else None,
            "unique_sources": len({sources[i] for i in valid})}
