"""The agent's rubric roles without a model (DuMate §2.2.3): persistent criteria = one per
aggregate / answer node (its need and key points) and one per sub-question; gaps = sub-questions
and key points whose best evidence sentence stays below ``gap_threshold`` cosine similarity, each
with a search query."""

from __future__ import annotations

from typing import Any

import numpy as np

from deepr.evidence.env import Ctx
from deepr.evidence.extract import focus_query, shorten, sub_questions
from deepr.records import Plan


def persistent_criteria(query: str, plan: Plan) -> list[dict[str, Any]]:
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


def _evidence_ids(ctx: Ctx, plan: Plan, results: dict[str, list[str]]) -> list[str]:
    search = [n.id for n in plan.nodes if n.type == "search"]
    ids = [c for nid in search for c in results.get(nid, [])]
    ids += [e.id for e in ctx.catalog.entries.values() if e.kind == "fetch" and e.node in search]
    return ids


def gaps(ctx: Ctx, query: str, plan: Plan, results: dict[str, list[str]]) -> list[dict[str, Any]]:
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




def persistent_reply(a: Any) -> dict[str, Any]:
    return {"criteria": persistent_criteria(a.query, a.plan)}


def gaps_reply(a: Any) -> dict[str, Any]:
    found = gaps(a.ctx, a.query, a.plan, a.results)
    return {"sufficient": not found, "gaps": found}
