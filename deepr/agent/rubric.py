"""Rubric scaffold for dag mode (DuMate §2.2.3): persistent and ephemeral rubrics.

The persistent rubric is written once from the query and the plan and conditions the
writer; after each planning cycle an ephemeral rubric names the evidence gaps that remain.
Gaps drive another planning cycle; none left (or ``--max-cycles``) stops planning.

Without a model: :mod:`deepr.extractive.rubric`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from deepr.text.lang import ask_in_language
from deepr.records import Plan

from deepr.roles.acceptance import FREE_TEXT, query_words
from deepr.extractive import rubric as ex
from deepr.roles import JSONReply, Role
from deepr.evidence.env import Ctx

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


@dataclass
class RubricAsk:
    ctx: Ctx
    query: str
    plan: Plan
    results: dict[str, list[str]] = field(default_factory=dict)
    persistent: Sequence[dict[str, Any]] = ()


def _persistent_messages(a: RubricAsk) -> list[dict[str, str]]:
    user = PERSISTENT_USER.format(query=a.query, plan=_plan_lines(a.plan))
    return ask_in_language([{"role": "system", "content": RUBRIC_SYSTEM}, {"role": "user", "content": user}], a.query)


def _ephemeral_messages(a: RubricAsk) -> list[dict[str, str]]:
    ctx = a.ctx
    blocks = [f"### {n.id}: {n.query}\n" + (ctx.catalog.evidence(a.results.get(n.id, []), max_chars=200) or "(none)")
              for n in a.plan.nodes if n.type == "search"]
    criteria = "\n".join(f"- {c['name']}: {c.get('guidance') or c['description']}" for c in a.persistent)
    return ask_in_language([{"role": "system", "content": RUBRIC_SYSTEM},
                            {"role": "user", "content": EPHEMERAL_USER.format(query=a.query, criteria=criteria,
                                                                              evidence="\n\n".join(blocks))}], a.query)


PERSISTENT = Role(
    name="rubric", action="persistent", messages=_persistent_messages, output=JSONReply(Persistent),
    extractive=ex.persistent_reply,
    result=lambda a, v: list(v["criteria"]), max_tokens=1024, accept=FREE_TEXT,
    on_fail="persistent rubric built extractively after the model failed")

EPHEMERAL = Role(
    name="rubric", action="ephemeral", messages=_ephemeral_messages, output=JSONReply(Ephemeral),
    extractive=ex.gaps_reply, result=lambda a, v: [] if v["sufficient"] else list(v["gaps"]),
    fallback=lambda a: {"sufficient": True, "gaps": []}, max_tokens=1024,
    accept=(*FREE_TEXT, query_words(lambda v: [g.get("query", "") for g in v.get("gaps") or []])),
    on_fail="stopped re-planning: the gap rubric could not be read")


async def persistent_rubric(ctx: Ctx, query: str, plan: Plan) -> list[dict[str, Any]]:
    rubric = (await ctx.perform(PERSISTENT, RubricAsk(ctx, query, plan))).value
    ctx.tracer.extra.setdefault("rubrics", []).append({"kind": "persistent", "criteria": rubric})
    return rubric


async def ephemeral_rubric(ctx: Ctx, query: str, plan: Plan, results: dict[str, list[str]],
                           persistent: Sequence[dict[str, Any]], cycle: int) -> list[dict[str, Any]]:
    """Evidence gaps after a planning cycle; an empty list means planning can stop."""
    gaps = (await ctx.perform(EPHEMERAL, RubricAsk(ctx, query, plan, results, persistent), cycle=cycle)).value
    ctx.tracer.extra.setdefault("rubrics", []).append({"kind": "ephemeral", "cycle": cycle, "gaps": gaps})
    return gaps
