"""Stage ``verify``: audit query–rubric pairs and KEEP / REVISE / DROP them (DeepRubric
§3.2, App. C.3–C.4).

Input: ``pairs.jsonl`` (:class:`deepr.records.QRPair`, as written by synthesize-rubrics).
Outputs: ``verified.jsonl`` (KEEP as is, REVISE with the repair applied and the original
kept under ``original``), ``verified.dropped.jsonl`` (DROP, with ``drop_reason``), and rejects
for pairs whose audit itself failed (e.g. the judge never replied with valid JSON).

    deepr verify pairs.jsonl --out verified.jsonl --judge-llm openai:gpt-4.1

The code checks of :mod:`deepr.roles.verify_checks` run on every pair. The LLM auditor sees
their findings and judges the six dimensions; a revision it proposes must pass the same
constraints as synthesis (5–8 criteria, source leaves inside the selection, factual
evidence found in those leaves' statements) or it is re-asked, then not accepted. The audit is
one role (``AUDIT``); its non-LLM implementation decides from the findings: none → KEEP, only
fixable ones → REVISE by dropping or reweighting the criteria they name, any fatal one → DROP.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deepr.llm.base import LLM, run_sync
from deepr.llm.parse import parse_reply
from deepr.records import QRPair, Reject, RubricItem
from deepr.roles.acceptance import FREE_TEXT
from deepr.roles import NO_MODEL, JSONReply, Recorder, Role, perform
from deepr.text.lang import ask_in_language, corpus_language
from deepr.data.outcomes import Fallback, mark_fallback
from deepr.roles.rubric_checks import RubricLimits, question_problems, rubric_problems
from deepr.roles.verify_checks import Embed, Finding, Prefetched, embedding_texts, findings, leaves_of
from deepr.extractive.verify import audit_reply

SYSTEM = (
    "You audit one training sample for deep-research agents: a research question, the evidence leaves it "
    "was built from (each with statements extracted from documents), the merge trace from leaves to "
    "question, and the rubric criteria that will score answers. Decide KEEP (usable as it is), REVISE "
    "(worth keeping after a targeted repair) or DROP (broken beyond repair). Prefer REVISE to DROP while "
    "the topic is still worth asking about.\n\n"
    "Check all six dimensions:\n"
    "1. Alignment: every criterion serves the main question at its level of detail; a side detail is not "
    "made mandatory unless it is central.\n"
    "2. Deep-research suitability: the criteria reward synthesis, comparison, causal explanation, "
    "qualified evidence and a reasoned conclusion, not a checklist of isolated facts.\n"
    "3. Rubric quality: each criterion is atomic, specific, judgeable on its own and not a repeat of "
    "another.\n"
    "4. Evidence sufficiency: the source leaves of each criterion really support it; flag claims stronger"
    " than their evidence.\n"
    "5. Merge faithfulness: the question reflects what the selected leaves and merge steps cover "
    "together, without unjustified broadening, narrowing or strengthening.\n"
    "6. Scoring validity: weights are sensible, vague logical criteria do not outweigh the core factual "
    "ones, and negative weights are a problem unless clearly justified.\n\n"
    "For REVISE give revised_question (same topic, faithful to the selected leaves and merge trace, still"
    " a deep-research question) and {lo} to {hi} revised_rubrics, each {{\"id\": \"R1\", \"type\": \"factual\" or"
    " \"logical\", \"description\": \"...\", \"weight\": 0.0-1.0, \"source_leaf_ids\": [...], \"evidence\": [...]}}. "
    "source_leaf_ids come only from the selected leaves; factual criteria quote their evidence (verbatim "
    "or nearly) from those leaves' statements; logical criteria have an empty evidence list. Bring in no "
    "facts from outside the leaves.\n\n"
    "Reply with JSON only: {{\"decision\": \"KEEP\" or \"REVISE\" or \"DROP\", \"error_tags\": [short snake_case "
    "tags], \"major_issues\": [\"...\"], \"justification\": \"...\", \"fix_plan\": \"...\", "
    "\"revised_question\": \"...\""
    " or null, \"revised_rubrics\": [...] or null}}"
)


class VerifyConfig(BaseModel):
    """Settings of ``verify``; validated on construction."""

    model_config = ConfigDict(extra="forbid")

    limits: RubricLimits = Field(default_factory=RubricLimits, description="Constraints a pair must meet.")
    revise_min: int = Field(5, ge=1, description="Fewest criteria in a revision.")
    revise_max: int = Field(8, ge=1, description="Most criteria in a revision (and in a kept pair).")
    redundancy_threshold: float = Field(0.9, gt=0, le=1, description=(
        "Embedding cosine at or above which two criteria of one type are redundant."))
    min_alignment: float = Field(0.15, ge=-1, le=1, description=(
        "Least embedding cosine between a criterion (with its evidence) and the question; below it the "
        "criterion is misaligned."))
    max_reasks: int = Field(2, ge=0, le=5, description="Re-asks after an unusable audit reply.")
    concurrency: int = Field(8, ge=1, le=512, description="Pairs audited at the same time.")
    max_tokens: int | None = Field(None, ge=64, description=(
        "Reply length limit sent to the judge (None: backend default)."))
    fallback: Fallback = Field("none", description=(
        "extractive: a pair whose model audit fails is audited by the extractive engine (recorded in "
        "the record's 'fallback' field); none: it is rejected."))


class AuditReply(BaseModel):
    """The JSON an audit reply must hold."""

    model_config = ConfigDict(extra="ignore")
    decision: Literal["KEEP", "REVISE", "DROP"]
    error_tags: list[str] = Field(default_factory=list)
    major_issues: list[str] = Field(default_factory=list)
    justification: str = ""
    fix_plan: str | list[str] = ""
    revised_question: str | None = None
    revised_rubrics: list[RubricItem] | None = None

    @field_validator("decision", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.strip().upper() if isinstance(v, str) else v


@dataclass
class Verdict:
    """One audited pair: ``kind`` says which file its record goes to."""

    kind: Literal["verified", "dropped", "reject"]
    record: QRPair | Reject


def _revision_problems(reply: AuditReply, pair: QRPair, leaves: Mapping[str, list[str]],
                       cfg: VerifyConfig) -> list[str]:
    if reply.decision != "REVISE":
        return []
    if not reply.revised_rubrics:
        return ["REVISE needs revised_rubrics"]
    question = reply.revised_question or pair.question
    return (rubric_problems(reply.revised_rubrics, pair.selected_leaf_ids, leaves, cfg.limits,
                            min_n=cfg.revise_min, max_n=cfg.revise_max)
            + question_problems(question, reply.revised_rubrics, list(leaves), cfg.limits))


def _tags(found: Sequence[Finding], extra: Sequence[str] = ()) -> list[str]:
    return list(dict.fromkeys([*extra, *(f.tag for f in found)]))


def _verified(pair: QRPair, decision: str, tags: list[str], audit: dict[str, Any],
              question: str | None = None, rubrics: list[RubricItem] | None = None) -> QRPair:
    data = pair.model_dump()
    if decision == "REVISE":
        data["original"] = {"question": pair.question, "rubrics": data["rubrics"]}
        data["question"] = question or pair.question
        data["rubrics"] = [r.model_dump() for r in rubrics or []]
    data.update(decision=decision, error_tags=tags, audit=audit)
    return QRPair.model_validate(data)


def _dropped(pair: QRPair, tags: list[str], reason: str, audit: dict[str, Any]) -> Verdict:
    data = pair.model_dump()
    data.update(decision="DROP", error_tags=tags, drop_reason=reason, audit=audit)
    return Verdict("dropped", QRPair.model_validate(data))


@dataclass
class AuditAsk:
    pair: QRPair
    leaves: Mapping[str, list[str]]
    found: list[Finding]
    cfg: VerifyConfig

    @functools.cached_property  # read by every attempt's prompt and the extractive engine
    def language(self) -> str:
        """The pair's language: the one most of its question and evidence are written in."""
        return corpus_language([self.pair.question, *(s for st in self.leaves.values() for s in st)])


def _audit_messages(a: AuditAsk) -> list[dict[str, str]]:
    pair, leaves = a.pair, a.leaves
    sample = {"question": pair.question,
              "selected_leaves": (pair.model_extra or {}).get("selected_leaves")
              or [{"id": k, "statements": v} for k, v in leaves.items()],
              "merge_trace": [m.model_dump() for m in pair.merge_trace],
              "rubrics": [r.model_dump() for r in pair.rubrics]}
    notes = "\n".join(f"- {f.tag}: {f.detail}" for f in a.found) or "- none"
    # a revised question and criteria are written in the pair's language (English prompts unchanged)
    return ask_in_language([{"role": "system", "content": SYSTEM.format(lo=a.cfg.revise_min, hi=a.cfg.revise_max)},
                            {"role": "user", "content": json.dumps(sample, ensure_ascii=False)
                             + f"\n\nAutomatic checks found:\n{notes}"}], language=a.language)


# The tags the code checks give (deepr.roles.verify_checks); a strict audit picks among them.
AUDIT_TAGS = ("structure", "question_form", "too_many_rubrics", "source_outside_selection", "evidence_unsupported",
              "negative_weight", "rubric_redundant", "logical_dominates", "not_deep", "rubric_misaligned",
              "merge_unfaithful")


AUDIT = Role(
    name="verify", action="audit", messages=_audit_messages, output=JSONReply(AuditReply),
    check=lambda a, v: _revision_problems(AuditReply.model_validate(v), a.pair, a.leaves, a.cfg),
    extractive=audit_reply, result=lambda a, v: AuditReply.model_validate(v), fallback=None,
    max_tokens=3072, accept=FREE_TEXT)


def _decide(pair: QRPair, found: list[Finding], r: AuditReply, audit: dict[str, Any]) -> Verdict:
    audit.update(major_issues=r.major_issues, justification=r.justification, fix_plan=r.fix_plan)
    tags = _tags(found, r.error_tags)
    if r.decision == "DROP":
        return _dropped(pair, tags, r.justification or "the auditor dropped it", audit)
    if r.decision == "KEEP":
        fatal = [f.detail for f in found if f.kind == "fatal" or f.tag == "evidence_unsupported"]
        if fatal:
            return _dropped(pair, tags, "kept by the auditor but fails the checks: " + "; ".join(fatal), audit)
        return Verdict("verified", _verified(pair, "KEEP", tags, audit))
    return Verdict("verified", _verified(pair, "REVISE", tags, audit, r.revised_question, r.revised_rubrics))


async def verify_one(pair: QRPair, judge: LLM | None, cfg: VerifyConfig, embed: Embed,
                     trees: Mapping[str, Any] | None = None, profile: Any = None) -> Verdict:
    leaves = leaves_of(pair, trees)
    if leaves is None:
        return Verdict("reject", Reject(id=pair.id, stage="verify", reason=(
            f"pair has no selected_leaves and tree {pair.tree_id!r} was not given; pass --trees trees.jsonl")))
    # One small embedding call per pair: cheap next to a judge round-trip, so it stays inline.
    found = findings(pair, leaves, embed, limits=cfg.limits, redundancy=cfg.redundancy_threshold,
                     min_alignment=cfg.min_alignment, max_rubrics=cfg.revise_max)
    out = await perform(AUDIT, AuditAsk(pair, leaves, found, cfg), llm=judge, rec=Recorder(),
                        max_reasks=cfg.max_reasks, max_tokens=cfg.max_tokens, profile=profile)
    audit: dict[str, Any] = {"backend": NO_MODEL if judge is None else judge.name, "attempts": out.attempts,
                             "findings": [f"{f.tag}: {f.detail}" for f in found]}
    if out.value is not None:
        return _decide(pair, found, out.value, audit)
    last, _ = parse_reply(out.reply, AuditReply) if out.reply else (None, None)
    if last is not None and last.decision == "REVISE":
        return _dropped(pair, _tags(found, last.error_tags), f"revision not accepted: {out.error}", audit)
    return Verdict("reject", Reject(id=pair.id, stage="verify", reason=f"audit failed: {out.error}"))


async def averify(pairs: Sequence[QRPair], judge: LLM | None, config: VerifyConfig, *, embed: Embed,
                  trees: Mapping[str, Any] | None = None,
                  on_result: Callable[[Verdict], None] | None = None, profile: Any = None) -> list[Verdict]:
    """Audit all pairs, ``config.concurrency`` at once; ``on_result`` sees each verdict as it ends.
    ``profile``: the judge's profile (:mod:`deepr.profiles`). ``judge=None``: the extractive audit."""
    sem = asyncio.Semaphore(config.concurrency)
    out: list[Verdict] = []

    rescue = judge is not None and config.fallback == "extractive"  # what the engine failed, it would fail again

    async def one(pair: QRPair, vectors: Embed) -> None:
        async with sem:
            v = await verify_one(pair, judge, config, vectors, trees, profile)
            if v.kind == "reject" and rescue:
                v = await _rescue(pair, v, config, vectors, trees)
        out.append(v)
        if on_result is not None:
            on_result(v)

    # Each group's embeddings in one batch, in a worker thread, while the audits of the groups
    # before it are in flight; memory holds one group's vectors (plus the groups still auditing).
    tasks: list[asyncio.Task[None]] = []
    size = max(1, config.concurrency)
    try:
        for start in range(0, len(pairs), size):
            group, vectors = pairs[start:start + size], Prefetched(embed)
            texts = [t for p in group if (lv := leaves_of(p, trees)) is not None for t in embedding_texts(p, lv)]
            await asyncio.to_thread(vectors.fill, texts)
            tasks += [asyncio.create_task(one(p, vectors)) for p in group]
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:  # cancelled or failed part-way: no audit is left running unawaited
            t.cancel()
    return out


async def _rescue(pair: QRPair, failed: Verdict, cfg: VerifyConfig, embed: Embed,
                  trees: Mapping[str, Any] | None) -> Verdict:
    """``--fallback extractive``: the extractive audit decides a pair whose model audit failed."""
    again = await verify_one(pair, None, cfg, embed, trees)
    if again.kind == "reject":
        return Verdict("reject", failed.record.model_copy(update={
            "reason": f"{failed.record.reason}; the extractive fallback failed too: {again.record.reason}"}))
    return Verdict(again.kind, mark_fallback(again.record, f"model path: {failed.record.reason}"))


def verify(pairs: Sequence[QRPair], judge: LLM | None, config: VerifyConfig, **kw: Any) -> list[Verdict]:
    """Sync wrapper of :func:`averify` (records in, verdicts out)."""
    return run_sync(averify(pairs, judge, config, **kw))


def verify_summary(verdicts: Sequence[Verdict]) -> tuple[dict[str, Any], dict[str, int]]:
    """Decision counts and rates over audited pairs, and the error-tag histogram."""
    decisions = Counter(getattr(v.record, "decision", None) for v in verdicts if v.kind != "reject")
    audited = sum(decisions.values()) or 1
    tags = Counter(t for v in verdicts if v.kind != "reject" for t in v.record.error_tags)
    rows = {"audited": sum(decisions.values()), "audit failures": sum(v.kind == "reject" for v in verdicts)}
    for d in ("KEEP", "REVISE", "DROP"):
        rows[f"{d.lower()} rate"] = round(decisions.get(d, 0) / audited, 3)
    return rows, dict(tags.most_common())
