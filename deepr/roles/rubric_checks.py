"""Every constraint of a query–rubric pair (DeepRubric §3.2), checked in code.

Shared by ``synthesize-rubrics`` (a reply that breaks one is re-asked with the list, then
rejected) and ``verify`` (a revision that breaks one is not accepted). Each function
returns a list of problems in words a model (or a person) can act on; empty means fine.

Grounding is lexical on purpose: a factual criterion's evidence must be a verbatim or
close paraphrase of one statement of its source leaves, i.e. at least
``evidence_support`` of its content words occur in a single such statement.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deepr.records import RubricItem, Tree
from deepr.text import coverage, tok, word_count

_RUBRIC_ID = re.compile(r"^R(\d+)$")
_LISTS_RUBRICS = re.compile(r"\b(R\d+|(?i:rubrics?))\b")


class RubricLimits(BaseModel):
    """Bounds every pair must respect; part of the synthesize and verify configs."""

    model_config = ConfigDict(extra="forbid")

    min_rubrics: int = Field(5, ge=1, description="Fewest rubric criteria per pair (DeepRubric: at least 5).")
    max_rubrics: int = Field(12, ge=1, description="Most rubric criteria per synthesised pair.")
    min_selected: int = Field(3, ge=1, description="Fewest selected leaves (the paper averages 5).")
    max_selected: int = Field(8, ge=1, description="Most selected leaves.")
    max_rubric_words: int = Field(50, ge=5, description="Longest criterion description, in words (atomic, checkable).")
    min_question_words: int = Field(6, ge=1, description="Shortest final question, in words.")
    max_question_words: int = Field(80, ge=5, description="Longest final question, in words (brief).")
    evidence_support: float = Field(0.6, ge=0, le=1, description=(
        "Least share of an evidence string's content words found in one statement of its source leaves."))
    duplicate_overlap: float = Field(0.8, gt=0, le=1, description=(
        "Word-set overlap (Jaccard) at or above which two criteria count as the same check."))


def leaf_statements(tree: Tree) -> dict[str, list[str]]:
    """Leaf id → statements, for leaves that carry any (the only ones a pair may select)."""
    return {n.id: list(n.statements) for n in tree.nodes if not n.children and n.statements}


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name)


def _dump(x: Any) -> dict[str, Any]:
    return x.model_dump() if isinstance(x, BaseModel) else dict(x)


def evidence_supported(evidence: str, statements: Sequence[str], threshold: float) -> bool:
    """True when one statement contains at least ``threshold`` of the evidence's content words."""
    words = tok(evidence)
    if not words:
        return False
    return any((coverage(evidence, tok(s)) or 0.0) >= threshold for s in statements)


def selection_problems(selected: Sequence[str], leaves: Mapping[str, list[str]],
                       limits: RubricLimits) -> list[str]:
    errs = []
    if not limits.min_selected <= len(selected) <= limits.max_selected:
        errs.append(f"select {limits.min_selected} to {limits.max_selected} leaves; got {len(selected)}")
    unknown = [s for s in selected if s not in leaves]
    if unknown:
        errs.append(f"selected_leaf_ids {unknown} are not leaves with statements in this tree")
    if len(set(selected)) != len(selected):
        errs.append("selected_leaf_ids lists a leaf twice")
    return errs


def rubric_problems(rubrics: Sequence[RubricItem], selected: Sequence[str],
                    leaves: Mapping[str, list[str]], limits: RubricLimits, *,
                    min_n: int | None = None, max_n: int | None = None) -> list[str]:
    """Count, ids R1..Rn, types, weights, source leaves ⊆ selection, grounded evidence, duplicates."""
    lo, hi = min_n or limits.min_rubrics, max_n or limits.max_rubrics
    errs = []
    if not lo <= len(rubrics) <= hi:
        errs.append(f"write {lo} to {hi} rubric criteria; got {len(rubrics)}")
    chosen = set(selected)
    for k, r in enumerate(rubrics, start=1):
        errs += [f"{r.id}: {e}" for e in _one_rubric(r, k, chosen, leaves, limits)]
    if rubrics and not any(r.type == "factual" for r in rubrics):
        errs.append("no factual criterion: at least one must check a fact from the selected leaves")
    return errs + duplicate_problems(rubrics, limits.duplicate_overlap)


def duplicate_pairs(rubrics: Sequence[RubricItem], threshold: float) -> list[tuple[int, int]]:
    """Index pairs of criteria whose distinctive words overlap (Jaccard) at or above ``threshold``.

    Words found in most criteria of the set ("answer", "states", the topic) say nothing
    about what a criterion checks, so they are left out of the comparison.
    """
    bags = [tok(r.description) for r in rubrics]
    df: dict[str, int] = {}
    for bag in bags:
        for w in bag:
            df[w] = df.get(w, 0) + 1
    common = {w for w, c in df.items() if len(bags) >= 3 and c * 2 > len(bags)}
    out = []
    for i in range(len(bags)):
        for j in range(i + 1, len(bags)):
            x, y = bags[i] - common, bags[j] - common
            if (x and y and len(x & y) / len(x | y) >= threshold) or bags[i] == bags[j]:
                out.append((i, j))
    return out


def duplicate_problems(rubrics: Sequence[RubricItem], threshold: float) -> list[str]:
    return [f"{rubrics[i].id} and {rubrics[j].id} check the same thing; merge or replace one"
            for i, j in duplicate_pairs(rubrics, threshold)]


def _one_rubric(r: RubricItem, k: int, chosen: set[str], leaves: Mapping[str, list[str]],
                limits: RubricLimits) -> list[str]:
    errs = []
    m = _RUBRIC_ID.match(r.id)
    if not m or int(m.group(1)) != k:
        errs.append(f"ids must run R1, R2, ... in order; this one should be R{k}")
    n_words = word_count(r.description)  # a Chinese sentence is one space-separated "word"
    if n_words > limits.max_rubric_words:
        errs.append(f"description has {n_words} words; keep it atomic, at most {limits.max_rubric_words}")
    penalty = bool((r.model_extra or {}).get("penalty"))
    if r.weight < 0 and not penalty:
        errs.append("negative weight is only for a penalty criterion on a misleading leaf (set \"penalty\": true)")
    if r.weight == 0:
        errs.append("weight 0 makes the criterion count for nothing; use a weight in (0, 1]")
    if penalty and r.weight >= 0:
        errs.append("a penalty criterion needs a negative weight")
    if not r.source_leaf_ids:
        errs.append("source_leaf_ids is empty; name the selected leaves it rests on")
    outside = [s for s in r.source_leaf_ids if s not in chosen]
    if outside:
        errs.append(f"source_leaf_ids {outside} are not in selected_leaf_ids")
    if r.type == "factual":
        if not r.evidence:
            errs.append("a factual criterion needs evidence copied from its source leaves' statements")
        pool = [s for lid in r.source_leaf_ids if lid in chosen for s in leaves.get(lid, [])]
        for i, ev in enumerate(r.evidence, start=1):
            if not evidence_supported(ev, pool, limits.evidence_support):
                errs.append(f"evidence {i} is not supported by the statements of its source leaves; "
                            "quote one of them (verbatim or nearly)")
    return errs


def question_problems(question: str, rubrics: Sequence[RubricItem], leaf_ids: Sequence[str],
                      limits: RubricLimits) -> list[str]:
    errs = []
    n = word_count(question)  # words as its language has them, or every Chinese question is "1 word"
    if not limits.min_question_words <= n <= limits.max_question_words:
        errs.append(f"the question has {n} words; use {limits.min_question_words} to "
                    f"{limits.max_question_words}")
    if _LISTS_RUBRICS.search(question) or any(lid in question for lid in leaf_ids):
        errs.append("the question must not mention rubric ids, rubrics or leaf ids")
    echoed = [r.id for r in rubrics if (coverage(r.description, question) or 0) >= 0.9]
    if len(echoed) >= 2:
        errs.append(f"the question spells out the criteria {echoed}; ask the question, do not list the checks")
    return errs


def trace_problems(question: str, selected: Sequence[str], selection_trace: Sequence[Any],
                   merge_trace: Sequence[Any]) -> list[str]:
    """Selection notes cover the selection; merge steps form one bottom-up tree ending in the question."""
    errs = []
    noted = {str(_dump(s).get("leaf_id")) for s in selection_trace}
    missing = [s for s in selected if s not in noted]
    if missing:
        errs.append(f"selection_trace gives no reason for leaves {missing}")
    steps = [_dump(s) for s in merge_trace]
    if not steps:
        return errs + ["merge_trace is empty; show how the leaves merge into the question"]
    ids = [str(s.get("id") or f"M{i}") for i, s in enumerate(steps, start=1)]
    earlier: set[str] = set()
    used: set[str] = set()
    for sid, s in zip(ids, steps):
        bad = [x for x in s.get("inputs", []) if x not in earlier and x not in selected]
        if bad:
            errs.append(f"merge step {sid}: inputs {bad} are neither selected leaves nor earlier steps")
        used.update(s.get("inputs", []))
        earlier.add(sid)
    unmerged = [s for s in selected if s not in used]
    if unmerged:
        errs.append(f"selected leaves {unmerged} are never merged")
    dangling = [sid for sid in ids[:-1] if sid not in used]
    if dangling:
        errs.append(f"merge steps {dangling} feed no later step; every step but the last must")
    if " ".join(str(steps[-1].get("output", "")).split()) != " ".join(question.split()):
        errs.append("the last merge step's output must be the final question, word for word")
    return errs


def pair_problems(pair: Any, leaves: Mapping[str, list[str]], limits: RubricLimits) -> list[str]:
    """All the constraints of a synthesised pair (a reply or a QRPair)."""
    selected = list(_get(pair, "selected_leaf_ids"))
    rubrics = list(_get(pair, "rubrics"))
    question = _get(pair, "question")
    return (selection_problems(selected, leaves, limits)
            + rubric_problems(rubrics, selected, leaves, limits)
            + question_problems(question, rubrics, list(leaves), limits)
            + trace_problems(question, selected, _get(pair, "selection_trace"), _get(pair, "merge_trace")))
