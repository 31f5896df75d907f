"""Rubric scaffold for dag mode (DuMate §2.2.3): persistent and ephemeral rubrics.

The persistent rubric is written once from the query and the plan and conditions the
writer; after each planning cycle an ephemeral rubric names the evidence gaps that remain.
Gaps drive another planning cycle; none left (or ``--max-cycles``) stops planning.

Extractive path: persistent criteria = one per aggregate / answer node (its need and key
points) and one per sub-question; gaps = sub-questions and key points whose best evidence
sentence stays below ``gap_threshold`` cosine similarity, each with a search query.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from deepr.records import Plan

from deepr.agent.ask import ask_structured, record_extractive
from deepr.agent.env import Ctx
from deepr.agent.extract import focus_query, shorten, sub_questions

RUBRIC_SYSTEM = """You write quality rubrics that steer a research agent while it works. Each criterion \
has a short name, a description of what a good result has, and guidance: an instruction the agent can act \
on (what to check, look up or compare), never a score. Reply with the JSON object only."""

PERSISTENT_USER = """Research question:
{query}

Research plan:
{plan}

Write 4 to 6 persistent criteria for the final report (coverage of every part of the question, consistency \
across sources, depth balanced across sections, conclusions backed by cited evidence, explicit requirements \
of the question). Reply as {{"criteria": [{{"name": "...", "description": "...", "guidance": "..."}}]}}."""

EPHEMERAL_USER = """Research question:
{query}

Persistent criteria:
{criteria}

Evidence gathered so far, per search node:
{evidence}

Name the most decision-relevant evidence gaps (at most 4): parts of the question with no evidence, parts \
covered only shallowly, or sources that conflict. Give each gap a search query that would close it. If the \
evidence is enough to write the report, say so and list no gaps.
Reply as {{"sufficient": false, "gaps": [{{"name": "...", "description": "...", "guidance": "...", \
"query": "..."}}]}}."""


class Criterion(BaseModel):
    name: str = Field(min_length=1)
    description: str = Field(min_length=1)
    guidance: str = ""


class Persistent(BaseModel):
    criteria: list[Criterion] = Field(min_length=1, max_length=10)


class Gap(BaseModel):
    name: str = Field(min_length=1)
    description: str = ""
    guidance: str = ""
    query: str = Field(min_length=2)


class Ephemeral(BaseModel):
    sufficient: bool = False
    gaps: list[Gap] = Field(default_factory=list, max_length=4)


def _plan_lines(plan: Plan) -> str:
    return "\n".join(f"- {n.id} ({n.type}): {n.query or n.need}" for n in plan.nodes)


def _extractive_persistent(query: str, plan: Plan) -> list[dict[str, Any]]:
    out = [{"name": f"{n.id} coverage", "description": " ".join([n.need or "", *n.key_points]).strip(),
            "guidance": "Cite evidence for: " + "; ".join(n.key_points or [n.need or ""]), "node": n.id}
           for n in plan.nodes if n.type in ("aggregate", "answer")]
    parts = sub_questions(query)
    if len(parts) > 1:
        out += [{"name": f"part {i}", "description": p, "guidance": f"Answer this part with evidence: {p}",
                 "node": next(n.id for n in plan.nodes if n.type == "answer")} for i, p in enumerate(parts, 1)]
    out.append({"name": "grounding", "description": "Every claim cites an evidence id.",
                "guidance": "Drop any claim no snippet supports."})
    return out


async def persistent_rubric(ctx: Ctx, query: str, plan: Plan) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": RUBRIC_SYSTEM},
                {"role": "user", "content": PERSISTENT_USER.format(query=query, plan=_plan_lines(plan))}]
    if not ctx.extractive:
        parsed = await ask_structured(ctx.tracer, ctx.llm, messages, role="rubric", action="persistent",
                                      schema=Persistent, max_reasks=ctx.config.max_reasks, **ctx.config.chat_kw())
        if parsed.ok:
            rubric = [c.model_dump() for c in parsed.value.criteria]
            ctx.tracer.extra.setdefault("rubrics", []).append({"kind": "persistent", "criteria": rubric})
            return rubric
        ctx.tracer.decide("persistent rubric built extractively after the model failed", reason=parsed.error)
    rubric = _extractive_persistent(query, plan)
    if ctx.extractive:
        record_extractive(ctx.tracer, "rubric", "persistent", messages, {"criteria": rubric})
    ctx.tracer.extra.setdefault("rubrics", []).append({"kind": "persistent", "criteria": rubric})
    return rubric


def _evidence_ids(ctx: Ctx, plan: Plan, results: dict[str, list[str]]) -> list[str]:
    search = [n.id for n in plan.nodes if n.type == "search"]
    ids = [c for nid in search for c in results.get(nid, [])]
    ids += [e.id for e in ctx.catalog.entries.values() if e.kind == "fetch" and e.node in search]
    return ids


def extractive_gaps(ctx: Ctx, query: str, plan: Plan, results: dict[str, list[str]]) -> list[dict[str, Any]]:
    parts = sub_questions(query)
    targets = (parts if len(parts) > 1 else []) + [p for n in plan.nodes if n.type != "answer" for p in n.key_points]
    targets = list(dict.fromkeys(t for t in targets if t.strip()))
    sents = [s for cid in _evidence_ids(ctx, plan, results) for s in ctx.sentences(cid)]
    if not targets:
        return []
    best = (ctx.encode(targets) @ ctx.encode(sents).T).max(axis=1) if sents else np.zeros(len(targets))
    searched = {" ".join(t.get("query", "").lower().split()) for t in ctx.tracer.tools if t["tool"] == "search"}
    gaps = []
    for i in np.argsort(best, kind="stable"):
        q = focus_query(targets[i], 16)
        if best[i] >= ctx.config.gap_threshold or " ".join(q.lower().split()) in searched:
            continue
        gaps.append({"name": f"gap: {shorten(targets[i], 8)}", "description": targets[i],
                     "guidance": f"Find evidence on: {targets[i]}", "query": q, "coverage": round(float(best[i]), 3)})
    return gaps[:3]


async def ephemeral_rubric(ctx: Ctx, query: str, plan: Plan, results: dict[str, list[str]],
                           persistent: Sequence[dict[str, Any]], cycle: int) -> list[dict[str, Any]]:
    """Evidence gaps after a planning cycle; an empty list means planning can stop."""
    blocks = [f"### {n.id}: {n.query}\n" + (ctx.catalog.evidence(results.get(n.id, []), max_chars=200) or "(none)")
              for n in plan.nodes if n.type == "search"]
    criteria = "\n".join(f"- {c['name']}: {c.get('guidance') or c['description']}" for c in persistent)
    messages = [{"role": "system", "content": RUBRIC_SYSTEM},
                {"role": "user", "content": EPHEMERAL_USER.format(query=query, criteria=criteria,
                                                                  evidence="\n\n".join(blocks))}]
    gaps: list[dict[str, Any]]
    if not ctx.extractive:
        parsed = await ask_structured(ctx.tracer, ctx.llm, messages, role="rubric", action="ephemeral",
                                      schema=Ephemeral, max_reasks=ctx.config.max_reasks,
                                      turn_extra={"cycle": cycle}, **ctx.config.chat_kw())
        if parsed.ok:
            gaps = [] if parsed.value.sufficient else [g.model_dump() for g in parsed.value.gaps]
        else:
            gaps = []
            ctx.tracer.decide("stopped re-planning: the gap rubric could not be read", reason=parsed.error)
    else:
        gaps = extractive_gaps(ctx, query, plan, results)
        record_extractive(ctx.tracer, "rubric", "ephemeral", messages,
                          {"sufficient": not gaps, "gaps": gaps}, cycle=cycle)
    ctx.tracer.extra.setdefault("rubrics", []).append({"kind": "ephemeral", "cycle": cycle, "gaps": gaps})
    return gaps

