"""dag planner (DecomposeR §3.2–3.3): initial plan G0 from the query, revised plan G1 after search.

Two roles (:mod:`deepr.roles`): ``INITIAL`` and ``REVISE``, each checked by the plan
validator, so an invalid plan is re-asked with the validator's exact messages (bounded); a plan
that never validates is recorded as a failure and the fallback stands in (extractive G0, or
the previous plan for a revision). The non-LLM implementation is :mod:`deepr.extractive.planner`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deepr.roles.acceptance import FREE_TEXT, query_words
from deepr.evidence.plan import validate_plan
from deepr.text.lang import ask_in_language
from deepr.records import Plan
from deepr.roles import JSONReply, Role

from deepr.evidence.env import Ctx
from deepr.extractive import planner as ex

PLANNER_SYSTEM = """You are the planner of a research agent. You break a research question into a typed \
graph of small steps (a directed acyclic graph) that other components execute.

Node types:
- search: {"id": "N1", "type": "search", "query": "<a focused search query>", "key_points": ["<what its \
results should establish>", ...]}
- aggregate: {"id": "N5", "type": "aggregate", "need": "<the conclusion this synthesis step must reach>", \
"key_points": ["<point its write-up must cover>", ...], "inputs": ["N1", "N2"]}
- answer: exactly one, {"id": "N8", "type": "answer", "need": "<the final deliverable>", "inputs": ["N5", "N6"]}

An edge is an entry of "inputs": the node reads the output of the listed node.
Rules:
1. Ids are short and unique (N1, N2, ...). Search nodes have no inputs.
2. The answer node reads aggregate nodes and nothing reads the answer node.
3. No cycles; every aggregate node must lead to the answer node.
4. Write 3 to 6 search nodes on distinct facets (background, mechanisms, comparisons and alternatives, \
quantitative evidence, risks and failures, open questions). One search node may feed several aggregates, \
and an aggregate may read other aggregates.
5. Reply with the JSON object only, no prose."""

INITIAL_USER = "Research question:\n{query}\n\nWrite the initial plan as {{\"nodes\": [...]}}."

REVISION_USER = """Research question:
{query}

Current plan:
{plan}

Search results of each search node (cite or fetch them by the id in brackets):
{results}
{gaps}
Revise the plan in the light of these results:
- keep a search node unchanged (same id and query) when its results are useful: they are reused;
- rewrite or drop search nodes whose results are off-topic or empty; add search nodes for what is missing;
- adjust the aggregate nodes so each one can be written from its inputs.
Also choose at most {fetch_limit} results whose full page would help most, by id.
Reply with the JSON object only: {{"nodes": [...], "fetch": ["N1-R2", ...]}}."""


def plan_json(plan: Plan) -> str:
    return json.dumps({"nodes": [n.model_dump(exclude_none=True) for n in plan.nodes]}, ensure_ascii=False)


def initial_messages(query: str) -> list[dict[str, str]]:
    return ask_in_language([{"role": "system", "content": PLANNER_SYSTEM},
                            {"role": "user", "content": INITIAL_USER.format(query=query)}], query)


def criteria_lines(items: Sequence[dict[str, Any]]) -> str:
    return "\n".join(f"- {g.get('name', '')}: {g.get('guidance') or g.get('description', '')}" for g in items)


def revision_messages(ctx: Ctx, query: str, plan: Plan, results: dict[str, list[str]],
                      gaps: Sequence[dict[str, Any]] = (),
                      rubric: Sequence[dict[str, Any]] = ()) -> list[dict[str, str]]:
    blocks = []
    for n in plan.nodes:
        if n.type == "search":
            ids = results.get(n.id, [])
            body = ctx.catalog.evidence(ids, max_chars=300) if ids else "(no results)"
            blocks.append(f"### {n.id}: {n.query}\n{body}")
    gap_text = ""
    if rubric:  # DuMate §2.2.3: the persistent rubric stays in view while the ephemeral one names gaps
        gap_text += ("\nPersistent criteria the final report must meet; keep a search node for each:\n"
                     + criteria_lines(rubric) + "\n")
    if gaps:
        gap_text += ("\nEvidence gaps found after the last cycle; close them with new or rewritten search "
                     "nodes:\n" + criteria_lines(gaps) + "\n")
    user = REVISION_USER.format(query=query, plan=plan_json(plan), results="\n\n".join(blocks), gaps=gap_text,
                                fetch_limit=ctx.config.fetch_limit)
    return ask_in_language([{"role": "system", "content": PLANNER_SYSTEM}, {"role": "user", "content": user}], query)


def _plan_check(value: Any) -> list[str]:
    return validate_plan(value)[1]


def _fetch_check(ctx: Ctx, value: Any) -> list[str]:
    fetch = value.get("fetch", []) if isinstance(value, dict) else []
    if not isinstance(fetch, list) or not all(isinstance(f, str) for f in fetch):
        return ["'fetch' must be a list of result ids (strings) taken from the brackets of the results"]
    errors = []
    if len(fetch) > ctx.config.fetch_limit:
        errors.append(f"'fetch' lists {len(fetch)} items; choose at most {ctx.config.fetch_limit}")
    unknown = [f for f in fetch if ctx.catalog.resolve(f) is None]
    if unknown:
        errors.append(f"'fetch' names {', '.join(unknown)}, which no search returned; use result ids shown "
                      "in brackets")
    return errors


class PlanNodeShape(BaseModel):
    """A node as the prompt describes it: its type and the fields of every type (null where the
    type has none). Which fields each type needs, and the wiring, are the validator's checks."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["search", "aggregate", "answer"]
    query: str | None  # search nodes
    need: str | None  # aggregate and answer nodes
    key_points: list[str]
    inputs: list[str]  # readers: the ids they read; search nodes: empty


class PlanShape(BaseModel):
    """The planner's reply (``JSONReply(shape=PlanShape)``): typed nodes, no encoded wiring."""

    model_config = ConfigDict(extra="forbid")
    nodes: list[PlanNodeShape] = Field(min_length=2)


class RevisionShape(PlanShape):
    fetch: list[str]


@dataclass
class PlanAsk:
    ctx: Ctx
    query: str
    plan: Plan | None = None
    results: dict[str, list[str]] = field(default_factory=dict)
    gaps: Sequence[dict[str, Any]] = ()
    rubric: Sequence[dict[str, Any]] = ()


def _revised(a: PlanAsk, value: dict[str, Any]) -> tuple[Plan, list[str]]:
    return validate_plan(value)[0], list(value.get("fetch", []))


def _search_queries(value: Any) -> list[str]:
    nodes = value.get("nodes") if isinstance(value, dict) else None
    return [str(n.get("query") or "") for n in nodes or [] if isinstance(n, dict) and n.get("type") == "search"]


STRICT = (*FREE_TEXT, query_words(_search_queries))


INITIAL = Role(
    name="planner", action="plan", messages=lambda a: initial_messages(a.query),
    output=JSONReply(shape=PlanShape), check=lambda a, v: _plan_check(v),
    extractive=ex.initial_reply,
    result=lambda a, v: validate_plan(v)[0], max_tokens=1536, accept=STRICT,
    on_fail="initial plan written by the extractive planner because the model's plan never validated")

REVISE = Role(
    name="planner", action="revise",
    messages=lambda a: revision_messages(a.ctx, a.query, a.plan, a.results, a.gaps, a.rubric),
    output=JSONReply(shape=RevisionShape), check=lambda a, v: _plan_check(v) or _fetch_check(a.ctx, v),
    extractive=ex.revise_reply,
    fallback=lambda a: ex.plan_value(a.plan, []), result=_revised, max_tokens=2048, accept=STRICT,
    on_fail="kept the previous plan because the revision never validated")

_BY = {"llm": "llm", "extractive": "extractive", "fallback": "extractive-fallback"}


async def initial_plan(ctx: Ctx, query: str, *, cycle: int = 1) -> Plan:
    """Planner turn 1: G0 from the query alone."""
    out = await ctx.perform(INITIAL, PlanAsk(ctx, query))
    ctx.tracer.plan(out.value, cycle=cycle, turn="initial", by=_BY[out.by],
                    **({"attempts": out.attempts} if out.by == "llm" else {}))
    return out.value


async def revise_plan(ctx: Ctx, query: str, plan: Plan, results: dict[str, list[str]], *,
                      gaps: Sequence[dict[str, Any]] = (), rubric: Sequence[dict[str, Any]] = (),
                      cycle: int = 1) -> tuple[Plan, list[str]]:
    """Planner turn 2 (and gap-driven re-planning): revised plan plus the fetch list; a re-planning
    cycle sees both the persistent ``rubric`` and the ephemeral ``gaps``."""
    out = await ctx.perform(REVISE, PlanAsk(ctx, query, plan, results, gaps, rubric))
    revised, fetch = out.value
    by = {"fallback": "previous-plan"}.get(out.by, out.by)
    ctx.tracer.plan(revised, cycle=cycle, turn="revised", fetch=fetch, by=by,
                    **({"attempts": out.attempts} if out.by == "llm" else {}))
    return revised, fetch
