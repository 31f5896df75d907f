"""The search agent without a model: the key points of a plan node whose best snippet sentence
stays below ``gap_threshold`` become the next queries; all covered means done."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepr.evidence.env import Ctx
from deepr.evidence.extract import focus_query, split_sentences
from deepr.records import Hit, PlanNode


def _norm(q: str) -> str:
    return " ".join(q.lower().split())


def _uncovered(ctx: Ctx, node: PlanNode, hits: Sequence[Hit]) -> list[str]:
    if not node.key_points or not hits:
        return []
    sents = [s for h in hits for s in (split_sentences(h.text) or [h.text])]
    best = (ctx.encode(list(node.key_points)) @ ctx.encode(sents).T).max(axis=1)
    return [p for p, b in zip(node.key_points, best) if b < ctx.config.gap_threshold]


def reformulate_reply(a: Any) -> dict[str, Any]:
    seen = {_norm(q) for q in a.asked}
    queries = [q for q in (focus_query(p, 16) for p in _uncovered(a.ctx, a.node, a.hits)) if _norm(q) not in seen][:3]
    return {"done": not queries, "queries": queries}
