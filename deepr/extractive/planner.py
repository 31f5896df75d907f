"""The dag planner without a model (DecomposeR §3.2–3.3 roles): plans from retrieval.

Turn 1: retrieve for the query (and each sub-question of a multi-part request), cluster
the results by embedding; each sub-question and each cluster becomes a search node
(cluster query = its central title plus its distinctive terms), aggregates join the most
related search nodes pairwise (an odd one out fans in to a second aggregate), and with
three or more aggregates a second-wave aggregate joins the two closest ones.

Turn 2 / gap cycles: drop search nodes that found nothing; add search nodes for reported
evidence gaps, else for parts of the question no evidence sentence covers, else for
question terms no result mentions; fetch the most relevant top result of up to
``fetch_limit`` nodes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from deepr.evidence.env import Ctx
from deepr.evidence.extract import (FRAMING, anchored_query, cluster, content_terms, distinctive_terms,
                                 focus_query, shorten, split_sentences, sub_questions)
from deepr.evidence.phrases import phrases
from deepr.evidence.plan import validate_plan
from deepr.extractive import rubric
from deepr.records import Hit, Plan, PlanNode


def plan_value(plan: Plan, fetch: list[str] | None = None) -> dict[str, Any]:
    """A plan as the planner's reply: its nodes (and the fetch list of a revision)."""
    value: dict[str, Any] = {"nodes": [n.model_dump(exclude_none=True) for n in plan.nodes]}
    return value if fetch is None else {**value, "fetch": fetch}


def initial_reply(a: Any) -> dict[str, Any]:
    return plan_value(extractive_plan(a.ctx, a.query))


def revise_reply(a: Any) -> dict[str, Any]:
    return plan_value(*extractive_revision(a.ctx, a.query, a.plan, a.results, a.gaps))


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
        specs.append({"query": focus_query(query, 24), "label": phrases(query)["question_label"],
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
    words = phrases(query)  # the plan's own words, in the question's language
    aggs: list[PlanNode] = []
    for g in _pairs(vecs):
        labels = words["label_join"].join(specs[i]["label"] for i in g)
        aggs.append(PlanNode(id=f"N{len(nodes) + len(aggs) + 1}", type="aggregate",
                             need=words["need"].format(labels=labels),
                             key_points=[specs[i]["key_points"][0] for i in g if specs[i]["key_points"]],
                             inputs=[nodes[i].id for i in g]))
    top = [a.id for a in aggs]
    if len(aggs) >= 3:
        avec = ctx.encode([a.need for a in aggs])
        a, b = _pairs(avec)[0]
        aggs.append(PlanNode(id=f"N{len(nodes) + len(aggs) + 1}", type="aggregate",
                             need=words["connect"].format(a=aggs[a].id, b=aggs[b].id),
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
    gaps = list(gaps) or rubric.gaps(ctx, query, plan, results)
    if gaps:
        return [(str(g.get("query") or g.get("name")), str(g.get("description") or g.get("name")))
                for g in gaps if g.get("query") or g.get("name")]
    seen = {w for ids in results.values() for cid in ids for w in content_terms(ctx.catalog[cid].text)}
    terms = content_terms(focus_query(query))[:12]
    uncovered = [t for t in terms if t not in seen and t not in FRAMING and not t.isdigit()
                 and (len(t) >= 4 or (len(t) >= 2 and not t.isascii()))]  # a Chinese word: 2+ characters
    if len(uncovered) < 2:
        return []
    words = phrases(query)
    return [(anchored_query(query, uncovered[:4]),
             words["evidence_on"].format(terms=words["term_join"].join(uncovered[:4])))]


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
