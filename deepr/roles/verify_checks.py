"""The code half of the audit (DeepRubric App. C.3–C.4): findings any pair can be checked for without a model,
and the deterministic repairs the extractive auditor applies.

Each finding has a tag (the error-tag vocabulary of the histogram), a detail, and a
kind: ``fatal`` (the pair cannot be kept), ``fixable`` (a repair exists: drop or reweight
the offending criteria) or ``note`` (recorded only). The LLM auditor sees the findings
in its prompt; the extractive auditor decides from them alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from deepr.records import QRPair, RubricItem
from deepr.roles.rubric_checks import (RubricLimits, duplicate_pairs, evidence_supported, question_problems,
                                 selection_problems, trace_problems)

Embed = Callable[[list[str]], np.ndarray]


@dataclass
class Finding:
    tag: str
    detail: str
    kind: Literal["fatal", "fixable", "note"]
    rubric_ids: tuple[str, ...] = ()


def _lighter(a: RubricItem, b: RubricItem) -> str:
    """Of two redundant criteria, the one to drop: the lower weight, else the later one."""
    return a.id if a.weight < b.weight else b.id


def _text(r: RubricItem) -> str:
    return " ".join([r.description, *r.evidence])


def findings(pair: QRPair, leaves: Mapping[str, list[str]], embed: Embed, *, limits: RubricLimits,
             redundancy: float, min_alignment: float, max_rubrics: int) -> list[Finding]:
    """Every problem the code can see in ``pair`` (leaves: selected leaf id → statements)."""
    out: list[Finding] = []
    sel = list(pair.selected_leaf_ids)
    for p in selection_problems(sel, leaves, limits) + trace_problems(
            pair.question, sel, pair.selection_trace, pair.merge_trace):
        out.append(Finding("structure", p, "fatal"))
    for p in question_problems(pair.question, pair.rubrics, list(leaves), limits):
        out.append(Finding("question_form", p, "fatal"))
    out += _rubric_findings(pair.rubrics, sel, leaves, limits)
    out += _embedding_findings(pair, leaves, embed, redundancy, min_alignment)
    if len(pair.rubrics) > max_rubrics:
        out.append(Finding("too_many_rubrics", f"{len(pair.rubrics)} criteria; keep at most {max_rubrics}",
                           "fixable"))
    return out


def _rubric_findings(rubrics: Sequence[RubricItem], selected: Sequence[str],
                     leaves: Mapping[str, list[str]], limits: RubricLimits) -> list[Finding]:
    out: list[Finding] = []
    chosen = set(selected)
    for r in rubrics:
        outside = [s for s in r.source_leaf_ids if s not in chosen]
        if outside or not r.source_leaf_ids:
            out.append(Finding("source_outside_selection", f"{r.id} rests on {outside or 'no leaf'}",
                               "fixable", (r.id,)))
        pool = [s for lid in r.source_leaf_ids if lid in chosen for s in leaves.get(lid, [])]
        if r.type == "factual" and (not r.evidence or not all(
                evidence_supported(e, pool, limits.evidence_support) for e in r.evidence)):
            out.append(Finding("evidence_unsupported", f"{r.id}: evidence missing or not in its leaves' statements",
                               "fixable", (r.id,)))
        if r.weight < 0:
            out.append(Finding("negative_weight", f"{r.id} has weight {r.weight}", "fixable", (r.id,)))
    for i, j in duplicate_pairs(rubrics, limits.duplicate_overlap):
        out.append(Finding("rubric_redundant", f"{rubrics[i].id} and {rubrics[j].id} check the same thing",
                           "fixable", (_lighter(rubrics[i], rubrics[j]),)))
    factual = sum(r.weight for r in rubrics if r.type == "factual" and r.weight > 0)
    logical = sum(r.weight for r in rubrics if r.type == "logical" and r.weight > 0)
    if logical > factual:
        out.append(Finding("logical_dominates", f"logical weight {logical:.2f} > factual {factual:.2f}",
                           "fixable", tuple(r.id for r in rubrics if r.type == "logical")))
    if not any(r.type == "logical" for r in rubrics):
        out.append(Finding("not_deep", "no logical criterion asks for comparison or synthesis", "note"))
    if len({lid for r in rubrics for lid in r.source_leaf_ids}) < 2:
        out.append(Finding("not_deep", "all criteria rest on a single leaf", "fatal"))
    return out


def embedding_texts(pair: QRPair, leaves: Mapping[str, list[str]]) -> list[str]:
    """The texts the embedding checks of ``pair`` embed, in order: the question, each criterion
    with its evidence, each selected leaf's first statements."""
    leaf_texts = [" ".join(leaves.get(lid, [])[:3]) or lid for lid in pair.selected_leaf_ids]
    return [pair.question, *(_text(r) for r in pair.rubrics), *leaf_texts]


class Prefetched:
    """An :data:`Embed` answering from vectors computed ahead, in one batch (:meth:`fill`), for a
    group of pairs. Embedding pair by pair on the event loop kept one audit call in flight at a
    time: each pair's encode outlasted the previous pair's round-trip. A text not filled is
    embedded on demand. One lock: the embedder's tokenizer is not safe to share across threads."""

    def __init__(self, embed: Embed) -> None:
        import threading

        self.embed, self.vectors, self._lock = embed, {}, threading.Lock()

    def fill(self, texts: Sequence[str]) -> None:
        new = [t for t in dict.fromkeys(texts) if t not in self.vectors]
        if new:
            with self._lock:
                vecs = self.embed(new)
            self.vectors.update(zip(new, vecs))

    def __call__(self, texts: list[str]) -> np.ndarray:
        self.fill(texts)
        return np.stack([self.vectors[t] for t in texts])


def _embedding_findings(pair: QRPair, leaves: Mapping[str, list[str]], embed: Embed,
                        redundancy: float, min_alignment: float) -> list[Finding]:
    out: list[Finding] = []
    rubrics = pair.rubrics
    vecs = embed(embedding_texts(pair, leaves))
    q, rv, lv = vecs[0], vecs[1:1 + len(rubrics)], vecs[1 + len(rubrics):]
    sims = rv @ rv.T
    for i in range(len(rubrics)):
        for j in range(i + 1, len(rubrics)):
            if rubrics[i].type == rubrics[j].type and sims[i, j] >= redundancy:
                out.append(Finding("rubric_redundant", f"{rubrics[i].id} and {rubrics[j].id}: cosine "
                                   f"{sims[i, j]:.2f}", "fixable", (_lighter(rubrics[i], rubrics[j]),)))
    for r, v in zip(rubrics, rv):  # dimension 1: every criterion serves the main question
        cos = float(q @ v)
        if cos < min_alignment:
            out.append(Finding("rubric_misaligned", f"{r.id} is far from the question (cosine {cos:.2f})",
                               "fixable", (r.id,)))
    for lid, v in zip(pair.selected_leaf_ids, lv):
        if float(q @ v) < min_alignment and not any(lid in r.source_leaf_ids for r in rubrics):
            out.append(Finding("merge_unfaithful", f"leaf {lid} is selected but neither the question nor "
                               "any criterion reflects it", "note"))
    return out


def repair(rubrics: Sequence[RubricItem], found: Sequence[Finding], max_rubrics: int) -> list[RubricItem]:
    """Drop the criteria the fixable findings name, damp logical weights, trim, renumber."""
    drop = {rid for f in found if f.kind == "fixable" and f.tag not in ("logical_dominates", "too_many_rubrics")
            for rid in f.rubric_ids}
    kept = [r.model_copy(deep=True) for r in rubrics if r.id not in drop]
    factual = sum(r.weight for r in kept if r.type == "factual")
    logical = sum(r.weight for r in kept if r.type == "logical")
    if logical > factual > 0:
        scale = factual / logical
        for r in kept:
            if r.type == "logical":
                r.weight = round(r.weight * scale, 3)
    if len(kept) > max_rubrics:
        keep_ids = {r.id for r in sorted(kept, key=lambda r: -r.weight)[:max_rubrics]}
        kept = [r for r in kept if r.id in keep_ids]
    for k, r in enumerate(kept, start=1):
        r.id = f"R{k}"
    return kept


def leaves_of(pair: QRPair, trees: Mapping[str, Any] | None = None) -> dict[str, list[str]] | None:
    """Selected leaf id → statements: from the pair itself, else from its tree."""
    stored = (pair.model_extra or {}).get("selected_leaves")
    if stored:
        return {str(leaf["id"]): list(leaf.get("statements", [])) for leaf in stored}
    tree = (trees or {}).get(pair.tree_id)
    if tree is None:
        return None
    wanted = set(pair.selected_leaf_ids)
    return {n.id: list(n.statements) for n in tree.nodes if n.id in wanted and not n.children}
