"""The dag answerer without a model: each node's text and the final answer picked from the cited
evidence by :mod:`deepr.evidence.writer` (its key points and the rubric criteria aimed at it as targets)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepr.evidence import writer
from deepr.evidence.env import Ctx
from deepr.evidence.extract import sub_questions
from deepr.records import PlanNode


def _extractive_node(ctx: Ctx, node: PlanNode, ids: list[str], inherited: list[str], outputs: dict[str, str],
                     rubric: Sequence[dict[str, Any]]) -> str:
    targets = [node.need or "", *node.key_points,
               *(r.get("description", "") for r in rubric if r.get("node") == node.id)]
    parents = [outputs[s] for s in node.inputs if s in outputs]
    return writer.write(ctx, targets, ids, ctx.config.section_sentences, cited_texts=parents)


def wave_reply(a: Any) -> dict[str, str]:
    by_id = {n.id: n for n in a.plan.nodes}
    return {nid: _extractive_node(a.ctx, by_id[nid], a.shown[nid], a.allowed[nid], a.outputs, a.rubric)
            for nid in a.wave}


def final_reply(a: Any) -> str:
    return writer.write_by_parts(a.ctx, a.query, sub_questions(a.query), a.ids, a.ctx.config.answer_sentences,
                                 cited_texts=[a.outputs.get(s, "") for s in a.node.inputs])
