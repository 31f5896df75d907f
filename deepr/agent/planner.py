"""dag planner (DecomposeR §3.2–3.3): initial plan G0 from the query, revised plan G1 after search.

Two roles (:mod:`deepr.roles`): ``INITIAL`` and ``REVISE``, each checked by the plan
validator, so an invalid plan is re-asked with the validator's exact messages (bounded); a plan
that never validates is recorded as a failure and the fallback stands in (extractive G0, or
the previous plan for a revision). Non-LLM implementation (SPEC §9): search nodes from
clusters of the query's retrieval results, aggregates over related clusters
(at the end of this module).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from deepr.acceptance import FREE_TEXT, query_words
from deepr.agent.plan import validate_plan
from deepr.records import Hit, Plan, PlanNode
from deepr.roles import JSONReply, Role

from deepr.agent.env import Ctx
from deepr.agent.extract import (FRAMING, anchored_query, cluster, content_terms, distinctive_terms,
                                 focus_query, shorten, split_sentences, sub_questions)
from deepr.agent.rubric import extractive_gaps

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
    return [{"role": "system", "content": PLANNER_SYSTEM},
            {"role": "user", "content": INITIAL_USER.format(query=query)}]


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
    return [{"role": "system", "content": PLANNER_SYSTEM}, {"role": "user", "content": user}]


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


def _as_value(plan: Plan, fetch: list[str] | None = None) -> dict[str, Any]:
    value: dict[str, Any] = {"nodes": json.loads(plan_json(plan))["nodes"]}
    return value if fetch is None else {**value, "fetch": fetch}


def _revised(a: PlanAsk, value: dict[str, Any]) -> tuple[Plan, list[str]]:
    return validate_plan(value)[0], list(value.get("fetch", []))


def _search_queries(value: Any) -> list[str]:
    nodes = value.get("nodes") if isinstance(value, dict) else None
    return [str(n.get("query") or "") for n in nodes or [] if isinstance(n, dict) and n.get("type") == "search"]


STRICT = (*FREE_TEXT, query_words(_search_queries))


INITIAL = Role(
    name="planner", action="plan", messages=lambda a: initial_messages(a.query),
    output=JSONReply(shape=PlanShape), check=lambda a, v: _plan_check(v),
    extractive=lambda a: _as_value(extractive_plan(a.ctx, a.query)),
    result=lambda a, v: validate_plan(v)[0], max_tokens=1536, accept=STRICT,
    on_fail="initial plan written by the extractive planner because the model's plan never validated")

REVISE = Role(
    name="planner", action="revise",
    messages=lambda a: revision_messages(a.ctx, a.query, a.plan, a.results, a.gaps, a.rubric),
    output=JSONReply(shape=RevisionShape), check=lambda a, v: _plan_check(v) or _fetch_check(a.ctx, v),
    extractive=lambda a: _as_value(*extractive_revision(a.ctx, a.query, a.plan, a.results, a.gaps)),
    fallback=lambda a: _as_value(a.plan, []), result=_revised, max_tokens=2048, accept=STRICT,
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

# --- the non-LLM implementation of these roles (SPEC §9) --------------------
#
# The extractive dag planner (SPEC §9): plans from retrieval, no language model.
#
# Turn 1: retrieve for the query (and each sub-question of a multi-part request), cluster
# the results by embedding; each sub-question and each cluster becomes a search node
# (cluster query = its central title plus its distinctive terms), aggregates join the most
# related search nodes pairwise (an odd one out fans in to a second aggregate), and with
# three or more aggregates a second-wave aggregate joins the two closest ones.
#
# Turn 2 / gap cycles: drop search nodes that found nothing; add search nodes for reported
# evidence gaps, else for parts of the question no evidence sentence covers, else for
# question terms no result mentions; fetch the most relevant top result of up to
# ``fetch_limit`` nodes.


MAX_SEARCH_NODES = 6


def _explore(ctx: Ctx, query: str) -> tuple[list[Hit], list[str]]:
    parts = sub_questions(query)
    queries = [focus_query(query)] + (parts if len(parts) > 1 else [])
    pool: dict[str, Hit] = {}
    for i, q in enumerate(queries):
        k = ctx.config.explore_k if i == 0 else max(ctx.config.k, ctx.config.explore_k // 2)
        hits, _ = ctx.raw_search(focus_query(q, 32), k, node="planner", purpose="explore")
        for h in ctx.relevant(hits, q, floor=0.35, keep=1, rel=0.55):  # looser: clusters need breadth
            pool.setdefault(h.id, h)
    return list(pool.values()), parts


def _best_sentences(ctx: Ctx, hits: Sequence[Hit], target: np.ndarray, n: int = 2) -> list[str]:
    out = []
    for h in hits[:n]:
        sents = split_sentences(h.text) or [h.text]
        best = int(np.argmax(ctx.encode(sents) @ target))
        out.append(shorten(sents[best], 25))
    return out


def _search_specs(ctx: Ctx, query: str) -> list[dict[str, Any]]:
    hits, parts = _explore(ctx, query)
    qvec = ctx.encode([focus_query(query)])[0]
    specs: list[dict[str, Any]] = []
    if len(parts) > 1:
        hvecs = ctx.encode([h.text for h in hits])
        for p in parts[:4]:
            pvec = ctx.encode([p])[0]
            near = [hits[int(np.argmax(hvecs @ pvec))]] if hits else []
            specs.append({"query": focus_query(p, 24), "label": shorten(p, 8),
                          "key_points": [shorten(p, 25)] + _best_sentences(ctx, near, pvec, 1)})
    else:
        specs.append({"query": focus_query(query, 24), "label": "the question",
                      "key_points": _best_sentences(ctx, hits, qvec, 2)})
    if not hits:  # nothing retrieved: plan from the question alone (still needs vectors for pairing)
        return _dedupe(ctx, specs)
    texts = [h.text for h in hits]
    groups = cluster(ctx.encode(texts), min(4, max(2, -(-len(hits) // 3))), order=range(len(hits)))
    for g in groups:
        members = [hits[i] for i in g]
        title = members[0].title or members[0].doc_id
        terms = distinctive_terms([texts[i] for i in g], texts, 3, exclude=content_terms(title))
        specs.append({"query": " ".join([title, *terms]), "label": title,
                      "key_points": _best_sentences(ctx, members, qvec, 2)})
    return _dedupe(ctx, specs)[:MAX_SEARCH_NODES]


def _dedupe(ctx: Ctx, specs: list[dict[str, Any]], max_sim: float = 0.85) -> list[dict[str, Any]]:
    vecs = ctx.encode([s["query"] for s in specs])
    keep: list[int] = []
    for i in range(len(specs)):
        if all(float(vecs[i] @ vecs[j]) <= max_sim for j in keep):
            keep.append(i)
    for i in keep:
        specs[i]["vec"] = vecs[i]
    return [specs[i] for i in keep]


def _pairs(vecs: np.ndarray) -> list[list[int]]:
    """Group search nodes two by two, most similar first; an odd one joins its nearest node."""
    m = len(vecs)
    if m == 1:
        return [[0]]
    sim = vecs @ vecs.T
    order = sorted(((float(sim[i, j]), i, j) for i in range(m) for j in range(i + 1, m)), reverse=True)
    free, groups = set(range(m)), []
    for _, i, j in order:
        if i in free and j in free:
            groups.append([i, j])
            free -= {i, j}
    for i in sorted(free):
        nearest = max((j for j in range(m) if j != i), key=lambda j: sim[i, j])
        groups.append(sorted([i, nearest]))
    return groups


def extractive_plan(ctx: Ctx, query: str) -> Plan:
    """Plan G0 from clusters of the query's retrieval results."""
    specs = _search_specs(ctx, query)
    nodes = [PlanNode(id=f"N{i}", type="search", query=s["query"], key_points=s["key_points"])
             for i, s in enumerate(specs, start=1)]
    vecs = np.stack([s["vec"] for s in specs])
    aggs: list[PlanNode] = []
    for g in _pairs(vecs):
        labels = " and ".join(specs[i]["label"] for i in g)
        aggs.append(PlanNode(id=f"N{len(nodes) + len(aggs) + 1}", type="aggregate",
                             need=f"What the evidence on {labels} establishes for the question",
                             key_points=[specs[i]["key_points"][0] for i in g if specs[i]["key_points"]],
                             inputs=[nodes[i].id for i in g]))
    top = [a.id for a in aggs]
    if len(aggs) >= 3:
        avec = ctx.encode([a.need for a in aggs])
        a, b = _pairs(avec)[0]
        aggs.append(PlanNode(id=f"N{len(nodes) + len(aggs) + 1}", type="aggregate",
                             need=f"How the findings of {aggs[a].id} and {aggs[b].id} connect",
                             key_points=[shorten(aggs[a].need, 20), shorten(aggs[b].need, 20)],
                             inputs=[aggs[a].id, aggs[b].id]))
        top = [x for x in top if x not in (aggs[a].id, aggs[b].id)] + [aggs[-1].id]
    answer = PlanNode(id=f"N{len(nodes) + len(aggs) + 1}", type="answer", need=shorten(query, 60),
                      key_points=[shorten(p, 25) for p in sub_questions(query)], inputs=top)
    plan, errors = validate_plan(Plan(nodes=nodes + aggs + [answer]))
    if plan is None:  # a bug here, not bad input: the construction above is valid by design
        raise RuntimeError(f"extractive planner built an invalid plan: {errors}")
    return plan


def _next_id(nodes: Sequence[PlanNode]) -> str:
    nums = [int(m.group(1)) for n in nodes if (m := re.fullmatch(r"N(\d+)", n.id))]
    return f"N{max(nums, default=0) + 1}"


def _norm(q: str) -> str:
    return " ".join(q.lower().split())


def _new_queries(ctx: Ctx, query: str, plan: Plan, results: dict[str, list[str]],
                 gaps: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """Queries for new search nodes: reported gaps, else parts of the question no evidence
    covers, else two or more substantive question terms no result mentions."""
    gaps = list(gaps) or extractive_gaps(ctx, query, plan, results)
    if gaps:
        return [(str(g.get("query") or g.get("name")), str(g.get("description") or g.get("name")))
                for g in gaps if g.get("query") or g.get("name")]
    seen = {w for ids in results.values() for cid in ids for w in content_terms(ctx.catalog[cid].text)}
    terms = content_terms(focus_query(query))[:12]
    uncovered = [t for t in terms if t not in seen and t not in FRAMING and len(t) >= 4 and not t.isdigit()]
    if len(uncovered) < 2:
        return []
    return [(anchored_query(query, uncovered[:4]), f"evidence on {', '.join(uncovered[:4])}")]


def extractive_revision(ctx: Ctx, query: str, plan: Plan, results: dict[str, list[str]],
                        gaps: Sequence[dict[str, Any]] = ()) -> tuple[Plan, list[str]]:
    """Revised plan (empty nodes dropped, new nodes for gaps) and the fetch list."""
    nodes = [n.model_copy(deep=True) for n in plan.nodes]
    for n in [n for n in nodes if n.type == "search" and not results.get(n.id)]:
        trial = [m.model_copy(update={"inputs": [i for i in m.inputs if i != n.id]}) for m in nodes if m is not n]
        if validate_plan(Plan(nodes=trial))[0] is not None:
            nodes = trial
            ctx.tracer.decide(f"dropped search node {n.id}: its search returned nothing", query=n.query)
    searched = {_norm(t.get("query", "")) for t in ctx.tracer.tools if t["tool"] == "search"}
    aggs = [n for n in nodes if n.type == "aggregate"]
    for q, point in _new_queries(ctx, query, plan, results, gaps)[:3]:
        if not q.strip() or _norm(q) in searched or not aggs:
            continue
        new = PlanNode(id=_next_id(nodes), type="search", query=q, key_points=[shorten(point, 25)])
        target = aggs[int(np.argmax(ctx.encode([a.need or "" for a in aggs]) @ ctx.encode([q])[0]))]
        target.inputs.append(new.id)
        nodes.insert(sum(1 for n in nodes if n.type == "search"), new)
        searched.add(_norm(q))
    revised, errors = validate_plan(Plan(nodes=nodes))
    if revised is None:
        raise RuntimeError(f"extractive revision built an invalid plan: {errors}")
    return revised, _fetch_choice(ctx, query, revised, results)


def _fetch_choice(ctx: Ctx, query: str, plan: Plan, results: dict[str, list[str]]) -> list[str]:
    if ctx.config.fetch_limit == 0:
        return []
    fetched = {e.doc_id for e in ctx.catalog.entries.values() if e.kind == "fetch"}
    tops = [results[n.id][0] for n in plan.nodes if n.type == "search" and results.get(n.id)]
    if not tops:
        return []
    scores = ctx.encode([ctx.catalog[c].text for c in tops]) @ ctx.encode([focus_query(query)])[0]
    out, docs = [], set(fetched)
    for i in np.argsort(-scores, kind="stable"):
        doc = ctx.catalog[tops[i]].doc_id
        if doc not in docs:
            out.append(tops[i])
            docs.add(doc)
        if len(out) == ctx.config.fetch_limit:
            break
    return out
