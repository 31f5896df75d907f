"""The short-answer ending of a run (``deepr run --answer short``): a fact-seeking question's
response in the form BrowseComp and BrowseComp-Plus grade, ``Explanation`` (citing evidence),
``Exact Answer`` and ``Confidence`` (0–100).

Input: the question, the answer the mode wrote (dag's final answer, decor's answerer, the tools
agent's cited answer) and the evidence it rests on. One role turns them into the three fields;
the explanation may cite only catalogued ids (code checks them, as for every other text), the
exact answer holds no brackets, and the confidence is an integer in [0, 100]. The value and who
produced it (model, extractive engine, fallback) go into report.json under ``short_answer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from deepr.extractive import short_answer as ex
from deepr.roles import JSONReply, Role
from deepr.roles.acceptance import FREE_TEXT

from deepr.evidence.citations import cited_ids, normalize
from deepr.evidence.env import Ctx

SYSTEM = """You give the final response to a fact-seeking question from the evidence shown. Reply with \
a JSON object of three fields. explanation: two to four sentences on how the evidence leads to the \
answer; after each sentence put, in brackets, the ids of the evidence items it rests on. exact_answer: \
the succinct final answer alone (a name, date, number or short phrase), without brackets. confidence: \
how sure you are that the exact answer is correct, an integer from 0 to 100."""

MAX_EVIDENCE = 10  # evidence items shown: the draft's own sources first


class ShortReply(BaseModel):
    explanation: str = Field(min_length=1)
    exact_answer: str = Field(min_length=1, max_length=300)
    confidence: int = Field(ge=0, le=100)


@dataclass
class ShortAsk:
    ctx: Ctx
    query: str
    draft: str
    ids: list[str]


def evidence_ids(ctx: Ctx, draft: str) -> list[str]:
    """Every id the draft cites, then other catalogued sources up to MAX_EVIDENCE in all."""
    cited = list(dict.fromkeys(c for c in cited_ids(draft) if c in ctx.catalog))
    rest = [c for c in ctx.catalog.entries if c not in cited]
    return cited + rest[:max(0, MAX_EVIDENCE - len(cited))]


def _messages(a: ShortAsk) -> list[dict[str, str]]:
    user = (f"Question: {a.query}\nDraft answer: {a.draft or '(none)'}\nEvidence:\n"
            f"{a.ctx.catalog.evidence(a.ids) or '(none)'}")
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _check(a: ShortAsk, v: dict[str, Any]) -> list[str]:
    problems = a.ctx.catalog.check(normalize(v["explanation"]), a.ids, require=bool(a.ids))
    if "[" in v["exact_answer"] or "]" in v["exact_answer"]:
        problems.append("the exact answer holds brackets: cite evidence ids in the explanation only")
    if " ".join(v["exact_answer"].split()).casefold() == " ".join(a.query.split()).casefold():
        problems.append("the exact answer repeats the question: give the answer itself")
    return problems


def _result(a: ShortAsk, v: dict[str, Any]) -> dict[str, Any]:
    return {"explanation": normalize(v["explanation"]).strip(), "exact_answer": " ".join(v["exact_answer"].split()),
            "confidence": int(v["confidence"])}


SHORT = Role(
    name="short_answer", action="answer", messages=_messages, output=JSONReply(ShortReply),
    accept=FREE_TEXT, check=_check, extractive=ex.short_reply, result=_result, max_tokens=768,
    on_fail="short answer extracted from the draft after the model failed")


async def short_answer(ctx: Ctx, query: str, draft: str) -> dict[str, Any]:
    """{explanation, exact_answer, confidence}; recorded in the trace with ``by``."""
    out = await ctx.perform(SHORT, ShortAsk(ctx, query, draft, evidence_ids(ctx, draft)))
    value = out.value or {"explanation": "", "exact_answer": "", "confidence": 0}
    ctx.tracer.extra["short_answer"] = {**value, "by": out.by, **({"error": out.error} if out.error else {})}
    return value


def short_text(v: dict[str, Any], sep: str = "\n\n") -> str:
    """The response as the benchmark reads it (BrowseComp's three labelled fields)."""
    return sep.join([f"Explanation: {v['explanation']}", f"Exact Answer: {v['exact_answer']}",
                     f"Confidence: {v['confidence']}%"])
