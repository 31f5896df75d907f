"""Citation support: is each cited claim of a report backed by the snippets it cites?

A valid id proves only that the evidence exists, not that it says what the sentence claims:
a weak model writes "In 1507, Johannes Gutenberg invented …" behind a real id whose
snippet says nothing of the kind. Every sentence carrying a citation marker is checked
against the text of the ids it cites:

- by a judge model when one is given (the role ``judge/support``: entailment, JSON verdict);
- otherwise by overlap: the claim's content words must mostly occur in the cited text,
  and every number and name in it must occur there (an invented date or person is the
  commonest fabrication, and plain overlap alone lets it through).

Inputs: the report text and ``{id: source text}``. Output: a :class:`SupportReport` whose
``as_dict()`` goes into the run trace (``report.json`` → ``support``) and ``deepr eval
--metric support``.

    deepr eval runs/ --metric support --judge-llm openai:gpt-4o-mini
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from deepr.evidence.citations import normalize
from deepr.llm.base import LLM
from deepr.extractive import support as ex
from deepr.extractive.support import overlap_verdict
from deepr.roles import JSONReply, Recorder, Role, perform
from deepr.text import find_markers, report_prose, split_sentences, strip_citations, tok

_REFERENCE = re.compile(r"^\s*[-*]\s*\[[^\]]+\]\s")  # "- [N1-R3] Title (snippet of `doc`)"

Verdict = dict[str, Any]  # {"verdict": "supported" | "partial" | "unsupported", "reason": str}
JudgeFn = Callable[[str, str, str], Awaitable[tuple[Verdict | None, str | None]]]


@dataclass
class Claim:
    text: str
    ids: list[str]


def _leading(sent: str, known: Sequence[str]) -> tuple[list[str], str]:
    """Markers that open a sentence ("… Parthenon. [N1-R1] They …" splits after the full stop,
    so the marker lands on the next sentence although it cites the one before) and the rest."""
    ids: list[str] = []
    rest = sent.strip()
    while (marks := find_markers(rest, known)) and marks[0][0] == 0:
        ids += marks[0][2]
        rest = rest[marks[0][1]:].lstrip()
    return ids, rest


def cited_claims(report: str, known: Sequence[str] = ()) -> list[Claim]:
    """Sentences that carry citation markers (reference-list entries excluded), markers removed."""
    out: list[Claim] = []
    for line in normalize(report or "").splitlines():
        if _REFERENCE.match(line):
            continue
        line_claims: list[Claim] = []
        for sent in split_sentences(line):
            lead, rest = _leading(sent, known)
            if lead and line_claims:
                line_claims[-1].ids = list(dict.fromkeys([*line_claims[-1].ids, *lead]))
            elif lead:
                rest = sent  # a line that opens with a marker: it belongs to this sentence
            marks = find_markers(rest, known)
            text = strip_citations(rest).strip()
            if tok(text):
                line_claims.append(Claim(text, list(dict.fromkeys(i for _, _, found in marks for i in found))))
        out += [c for c in line_claims if c.ids]
    return out


# --- the judge role -------------------------------------------------------------------------


class SupportReply(BaseModel):
    verdict: Literal["supported", "partial", "unsupported"]
    unsupported_part: str = Field("", description="what the sources do not back, if anything")

    @field_validator("verdict", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v


SYSTEM = "You check statements against their sources. Reply with JSON only."
PROMPT = """Does the source text back the statement?

supported: everything the statement asserts (names, dates, numbers, events) is stated in or
directly follows from the sources. partial: its main point is backed but some detail is not.
unsupported: its main point, or a name, date or number in it, is not in the sources.
Judge only from the sources, not from what you know.

Question of the report: {question}
Statement: {claim}
Sources:
<<<
{sources}
>>>

Give the verdict, and in unsupported_part the words of the statement the sources do not back."""


@dataclass
class SupportAsk:
    question: str
    claim: str
    sources: str


def _verdict(a: SupportAsk, v: dict[str, Any]) -> Verdict:
    return {"verdict": v["verdict"], "reason": v.get("unsupported_part", "") or ""}


SUPPORT = Role(
    name="judge", action="support", output=JSONReply(SupportReply), max_tokens=160, temperature=0.0,
    messages=lambda a: [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": PROMPT.format(question=a.question or "(not given)",
                                                                  claim=a.claim, sources=a.sources)}],
    extractive=ex.support_reply,
    result=_verdict, fallback=None)


def role_judge(llm: LLM | None, rec: Recorder | None = None, *, max_reasks: int = 2) -> JudgeFn:
    """A judge that performs :data:`SUPPORT` with ``llm`` (a failed judgement is None + reason)."""

    async def judge(question: str, claim: str, sources: str) -> tuple[Verdict | None, str | None]:
        out = await perform(SUPPORT, SupportAsk(question, claim, sources), llm=llm,
                            rec=rec if rec is not None else Recorder(), max_reasks=max_reasks)
        return (out.value, None) if out.ok else (None, out.error or "no verdict")

    return judge


# --- the check -----------------------------------------------------------------------------


@dataclass
class SupportReport:
    checked_by: str
    rows: list[dict[str, Any]] = field(default_factory=list)

    def count(self, verdict: str) -> int:
        return sum(r["verdict"] == verdict for r in self.rows)

    @property
    def support(self) -> float | None:
        """Share of the judged cited claims that are supported (None: nothing was judged)."""
        judged = [r for r in self.rows if r["verdict"] != "unchecked"]
        return (sum(r["verdict"] == "supported" for r in judged) / len(judged)) if judged else None

    def as_dict(self) -> dict[str, Any]:
        return {"checked_by": self.checked_by, "claims": len(self.rows), "support": self.support,
                **{k: self.count(k) for k in ("supported", "partial", "unsupported", "unchecked")},
                "unsupported_claims": [r for r in self.rows if r["verdict"] == "unsupported"],
                "rows": self.rows}


async def check_support(report: str, sources: Mapping[str, str], *, question: str = "",
                        judge: JudgeFn | None = None, judge_name: str = "") -> SupportReport:
    """Every cited claim of ``report`` against the text of the ids it cites (see module doc)."""
    claims = cited_claims(report_prose(report), list(sources))

    async def one(c: Claim) -> dict[str, Any]:
        missing = [i for i in c.ids if not (sources.get(i) or "").strip()]
        text = "\n\n".join(f"[{i}] {sources[i]}" for i in c.ids if i not in missing)
        row: dict[str, Any] = {"text": c.text, "ids": c.ids}
        if not text:
            return {**row, "verdict": "unsupported", "reason": f"cites ids with no source text: {', '.join(missing)}"}
        if judge is None:
            return {**row, **overlap_verdict(c.text, text)}
        verdict, error = await judge(question, c.text, text)
        if verdict is None:  # a failed judgement is not a verdict: it is excluded from the share
            return {**row, "verdict": "unchecked", "reason": error}
        return {**row, **verdict}

    rows = list(await asyncio.gather(*(one(c) for c in claims)))
    return SupportReport("overlap" if judge is None else (judge_name or "judge"), rows)
