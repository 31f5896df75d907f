"""Strict synthesis for small models: code fixes the structure, the model writes the words.

``synthesize-rubrics`` asks for one JSON reply that must meet every constraint of
:mod:`deepr.roles.rubric_checks` at once. A 135M model given only the pair's schema wrote to its
4,096-token limit without closing the JSON (issue 14). Under ``--formats strict`` (the default for
``--llm smollm2``) the reply is decoded against a format built from the tree instead:

- the selection is made here (the tree's leaves with statements, evenly spread when there are
  more than ``n_select``) and is a constant of the format, so are the selection trace's leaf ids,
  the single merge step (all selected leaves → the question) and the criteria ids R1..Rn;
- each factual criterion has a slot: its source leaf is a constant and its evidence is one
  statement chosen from an enum of that leaf's statements (shown in the prompt), so no evidence
  is invented; a leaf with several statements may get two slots over alternate statements;
- the model writes the reasons, the question (6–30 real words, ending in "?") and the merge
  rationale, and picks weights from a short list; each criterion's description is words of its
  own statement (the logical one: reasoning words and the topic's), opening with words no other
  criterion can write, so two criteria cannot read the same (:mod:`deepr.profiles.rubric_words`);
  one logical criterion cites one or two of the selected leaves.

Every reply is still checked by :func:`deepr.roles.rubric_checks.pair_problems` (the question's
wording is not expressible in a format).

    deepr synthesize-rubrics trees.jsonl --llm smollm2 --out pairs.jsonl   (strict by default)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deepr.profiles.formats import PHRASE, text
from deepr.roles.rubric_checks import RubricLimits
from deepr.profiles.rubric_words import exclusive_tokens, factual_pattern, logical_pattern, question_pattern
from deepr.llm.base import OutputFormat

SYSTEM_STRICT = (
    "You design one deep-research task from the evidence leaves below, chosen for you from an evidence "
    "tree. Each leaf has an id, the research queries that led to it and statements taken from documents.\n"
    "Write, in order:\n"
    "1. selection_trace: for each leaf, one short sentence on what it adds to the topic.\n"
    "2. question: one self-contained research question of {q_lo} to {q_hi} words about the topic that "
    "needs the evidence of all the leaves together. Do not list the answers in it.\n"
    "3. merge_trace: one sentence on what the leaves cover together.\n"
    "4. rubrics, the criteria that grade a long answer to the question. For a factual criterion, choose "
    "the statement that is its evidence, then describe in at most {max_words} words, in the words of that "
    "statement, the fact an answer must state. The logical criterion describes how the answer must "
    "reason, compare or qualify. Each criterion checks something different.\n"
    "Reply with JSON only, in this shape (ids and leaves are fixed for you): {{\"selected_leaf_ids\": [leaf ids], "
    "\"selection_trace\": [{{\"leaf_id\": id, \"reason\": sentence}}], \"question\": question, \"merge_trace\": "
    "[{{\"id\": \"M1\", \"inputs\": [leaf ids], \"rationale\": sentence}}], \"rubrics\": [{{\"id\": \"R1\", "
    "\"type\": \"factual\", \"source_leaf_ids\": [leaf id], \"evidence\": [a statement of that leaf], "
    "\"description\": sentence, \"weight\": number}}]}}")
FACT_WEIGHTS = [1, 0.8, 0.6, 0.4]  # 1, not 1.0: xgrammar writes an enum number in its shortest form
LOGIC_WEIGHTS = [0.5, 0.3]


@dataclass(frozen=True)
class Slot:
    """One criterion to write: factual over ``leaf`` with evidence from ``pool``, or logical (leaf None)."""

    leaf: str | None
    pool: tuple[str, ...] = ()


def pick_leaves(leaves: Mapping[str, Sequence[str]], n_select: int, limits: RubricLimits) -> list[str]:
    """``n_select`` (within the limits) of the leaves, evenly spread over the tree's order; [] when
    the tree has fewer leaves with statements than a pair must select."""
    ids = [lid for lid, st in leaves.items() if st]
    k = min(max(n_select, limits.min_selected), limits.max_selected)
    if len(ids) < limits.min_selected:
        return []
    if len(ids) <= k:
        return ids
    return [ids[round(i * (len(ids) - 1) / (k - 1))] for i in range(k)] if k > 1 else ids[:1]


def plan_slots(selected: Sequence[str], shown: Mapping[str, Sequence[str]], limits: RubricLimits) -> list[Slot]:
    """One factual slot per selected leaf, more over alternate statements of a leaf while fewer than
    ``min_rubrics - 1`` exist, and one logical slot (more only if the leaves run out of statements)."""
    slots = [Slot(lid, tuple(shown[lid])) for lid in selected if shown.get(lid)]
    want = min(max(limits.min_rubrics, len(slots) + 1), limits.max_rubrics)
    i = 0
    while len(slots) < want - 1 and i < len(slots):
        s = slots[i]
        if s.leaf is not None and len(s.pool) >= 2:
            slots[i:i + 1] = [Slot(s.leaf, s.pool[0::2]), Slot(s.leaf, s.pool[1::2])]
            i += 2
        else:
            i += 1
    slots = slots[: want - 1]
    return slots + [Slot(None)] * (want - len(slots))


def _obj(**props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _fixed(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "array", "prefixItems": items, "items": False, "minItems": len(items), "maxItems": len(items)}


def _consts(values: Sequence[str]) -> dict[str, Any]:
    # Not {"const": [...]}: xgrammar writes a constant array without the spaces it puts after
    # commas elsewhere; item by item the reply keeps one style.
    return _fixed([{"const": v} for v in values])


def _criteria(slots: Sequence[Slot], selected: Sequence[str], max_words: int, context: str) -> list[dict[str, Any]]:
    """One schema per slot. Descriptions come from closed vocabularies, each forced to hold words
    no other criterion can write (:mod:`deepr.profiles.rubric_words`): SmolLM2 wrote one description for
    two slots, and every re-ask failed the duplicate check."""
    hi = min(max_words, 24)
    pools = [s.pool for s in slots if s.leaf is not None]
    excl = iter(exclusive_tokens(pools, context))
    out = []
    for k, slot in enumerate(slots, start=1):
        if slot.leaf is None:
            out.append(_obj(id={"const": f"R{k}"}, type={"const": "logical"},
                            source_leaf_ids={"type": "array", "minItems": 1, "maxItems": 2,
                                             "items": {"enum": list(selected)}},
                            evidence={"type": "array", "maxItems": 0},
                            description=text(logical_pattern(pools, context, hi)), weight={"enum": LOGIC_WEIGHTS}))
            continue
        out.append({"anyOf": [_obj(id={"const": f"R{k}"}, type={"const": "factual"},
                                   source_leaf_ids=_consts([slot.leaf]), evidence=_fixed([{"const": st}]),
                                   description=text(factual_pattern(st, e, hi)), weight={"enum": FACT_WEIGHTS})
                              for st, e in zip(slot.pool, next(excl))]})
    return out


def pair_schema(selected: Sequence[str], slots: Sequence[Slot], limits: RubricLimits,
                context: str = "") -> dict[str, Any]:
    """The pair's JSON schema with the selection, ids and evidence pools fixed (see the module doc).
    The merge step has no ``output``: the parser fills in the question (see ``SynthReply``)."""
    q_lo, q_hi = limits.min_question_words, min(limits.max_question_words, 30)
    return _obj(
        selected_leaf_ids=_consts(selected),
        selection_trace=_fixed([_obj(leaf_id={"const": lid}, reason=text(PHRASE)) for lid in selected]),
        question=text(question_pattern([st for s in slots for st in s.pool], context, q_lo, q_hi)),
        merge_trace=_fixed([_obj(id={"const": "M1"}, inputs=_consts(selected), rationale=text(PHRASE))]),
        rubrics=_fixed(_criteria(slots, selected, limits.max_rubric_words, context)))


def distinct_statements(compact: Mapping[str, Any]) -> dict[str, list[str]]:
    """Leaf id → its shown statements that no earlier leaf shows. One document often grounds
    several leaves (four of the demo's five Hip-hop leaves opened with one sentence), and criteria
    over one statement could only read the same: such a leaf brings nothing to a pair."""
    seen: set[str] = set()
    out = {}
    for leaf in compact["leaves"]:
        st = list(dict.fromkeys(leaf["statements"]))
        out[leaf["id"]] = [s for s in st if s not in seen]
        seen.update(st)
    return out


def strict_plan(compact: Mapping[str, Any], n_select: int, limits: RubricLimits
                ) -> tuple[list[str], list[Slot]] | None:
    """The selection and criteria slots for a serialised tree (its leaves' own statements); None
    when too few leaves have statements of their own for a pair."""
    shown = distinct_statements(compact)
    selected = pick_leaves(shown, n_select, limits)
    return (selected, plan_slots(selected, shown, limits)) if selected else None


def _root_query(compact: Mapping[str, Any]) -> str:
    return next((n["query"] for n in compact["nodes"] if n["parent"] is None), compact.get("topic", ""))


def strict_format(compact: Mapping[str, Any], n_select: int, limits: RubricLimits) -> OutputFormat | None:
    plan = strict_plan(compact, n_select, limits)
    context = f"{compact.get('topic') or ''} {_root_query(compact)}"
    return OutputFormat("synthesize.pair.strict", json_schema=pair_schema(*plan, limits, context)) if plan else None


def strict_messages(compact: Mapping[str, Any], n_select: int, limits: RubricLimits) -> list[dict[str, str]]:
    """The short prompt of strict mode: the topic, the root query and only the selected leaves."""
    plan = strict_plan(compact, n_select, limits)
    chosen = set(plan[0]) if plan else set()
    root = _root_query(compact)
    user = {"topic": compact.get("topic", ""), "root_query": root,
            "leaves": [leaf for leaf in compact["leaves"] if leaf["id"] in chosen]}
    system = SYSTEM_STRICT.format(q_lo=limits.min_question_words, q_hi=min(limits.max_question_words, 30),
                                  max_words=min(limits.max_rubric_words, 24))
    return [{"role": "system", "content": system},
            {"role": "user", "content": json.dumps(user, ensure_ascii=False, indent=1)}]
