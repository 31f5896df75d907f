"""synthesize-rubrics under --formats strict (issue 14): the selection, ids and evidence slots are
fixed by code, the format admits only the tree's own statements as evidence and words (no ids) in
the prose, and a reply that fills the format passes every SPEC §2 check."""

from __future__ import annotations

import json
import re

import pytest

from deepr.data.rubric_checks import RubricLimits, leaf_statements, pair_problems
from deepr.data.rubrics import SynthConfig, SynthReply, serialize_tree, synthesize_rubrics
from deepr.data.rubrics_strict import pick_leaves, plan_slots, strict_format
from deepr.llm.base import LLM
from deepr.records import QRPair, Reject
from tree_helpers import LEAF_STATEMENTS, small_tree

LIMITS = RubricLimits()


def _sentence(evidence: str, end: str) -> str:
    """Prose a careful model would write: the evidence's own words (the format makes a description
    open with its evidence's first four), the final full stop dropped."""
    return " ".join(evidence.rstrip(".").split()[:16]) + end


def fill(schema: dict, hint: str = "") -> object:
    """An instance of a strict format, chosen the way a well-behaved model would fill it."""
    if "anyOf" in schema:
        return fill(schema["anyOf"][0], hint)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    if schema.get("type") == "object":
        out: dict = {}
        for key, sub in schema["properties"].items():
            basis = (out.get("evidence") or [""])[0] if key == "description" else ""
            out[key] = fill(sub, basis or key)
        return out
    if schema.get("type") == "array" and schema.get("maxItems") == 0:
        return []
    if schema.get("type") == "array":
        return [fill(s, hint) for s in schema.get("prefixItems", [])] or [fill(schema["items"], hint)]
    pattern = schema["pattern"]
    if pattern.endswith(r"\?$"):
        return "How do lava behaviour and the size of historic eruptions shape the hazards volcanoes pose?"
    if hint.startswith("States") or " " in hint:
        return _sentence(hint, "")
    return f"Compares what the {hint} evidence says about volcanic hazards"


def _format(limits: RubricLimits = LIMITS, n_select: int = 5, per_leaf: int = 6):
    return strict_format(serialize_tree(small_tree(), per_leaf), n_select, limits)


def _accepts(schema: dict, reply: str) -> bool:
    """Whether xgrammar (the hf backend's decoder) admits ``reply`` under ``schema`` to the end."""
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo(["a", "</s>"], stop_token_ids=[1])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(reply, debug_print=False) and m.accept_token(1) and m.is_terminated()


def test_leaves_are_spread_over_the_tree_and_too_few_leaves_give_no_plan():
    leaves = {f"L{i}": ["a statement."] for i in range(9)}
    assert pick_leaves(leaves, 5, LIMITS) == ["L0", "L2", "L4", "L6", "L8"]
    assert pick_leaves(dict(list(leaves.items())[:4]), 5, LIMITS) == ["L0", "L1", "L2", "L3"]
    assert pick_leaves({"L0": ["s."], "L1": ["s."], "L2": []}, 5, LIMITS) == []  # 2 with statements < 3


def test_slots_cover_every_selected_leaf_and_split_statements_when_short():
    shown = {"A": ["a1", "a2", "a3"], "B": ["b1"], "C": ["c1", "c2"]}
    slots = plan_slots(["A", "B", "C"], shown, LIMITS)  # 5 criteria: 4 factual + 1 logical
    assert [(s.leaf, s.pool) for s in slots] == [("A", ("a1", "a3")), ("A", ("a2",)), ("B", ("b1",)),
                                                  ("C", ("c1", "c2")), (None, ())]
    five = {k: [f"{k}{i}" for i in range(3)] for k in "ABCDE"}
    slots = plan_slots(list(five), five, LIMITS)
    assert [s.leaf for s in slots] == ["A", "B", "C", "D", "E", None]  # one per leaf, then logical


def test_strict_format_fixes_structure_and_admits_only_the_trees_statements():
    fmt = _format()
    schema = fmt.json_schema
    props = schema["properties"]
    selected = [x["const"] for x in props["selected_leaf_ids"]["prefixItems"]]
    assert selected == ["n0.3", "n0.1.1", "n0.1.2", "n0.2.1", "n0.2.2"]  # the tree's 5 leaves
    rubrics = props["rubrics"]["prefixItems"]
    assert [(r.get("anyOf") or [r])[0]["properties"]["id"]["const"] for r in rubrics] == [f"R{k}" for k in range(1, 7)]
    for r in rubrics[:-1]:
        alts = r["anyOf"]
        leaf = alts[0]["properties"]["source_leaf_ids"]["prefixItems"][0]["const"]
        assert [a["properties"]["evidence"]["prefixItems"][0]["const"] for a in alts] == LEAF_STATEMENTS[leaf]
    assert rubrics[-1]["properties"]["type"]["const"] == "logical"
    reply = json.dumps(fill(schema))
    assert _accepts(schema, reply)
    value = json.loads(reply)
    assert pair_problems(SynthReply.model_validate(value), leaf_statements(small_tree()), LIMITS) == []
    invented = value | {"rubrics": [value["rubrics"][0] | {"evidence": ["Lava is cold on Mars."]},
                                    *value["rubrics"][1:]]}
    assert not _accepts(schema, json.dumps(invented))
    opening = " ".join(value["rubrics"][0]["evidence"][0].split()[:4])
    for words in (f"{opening} N4-N4 lava flows fast", f"{opening} lava from n0.1.1 flows fast",
                  f"{opening} lava flows fast [S1-R2]", "...", "States that the index rates eruptions"):
        r1 = value["rubrics"][0] | {"description": words}
        assert not _accepts(schema, json.dumps(value | {"rubrics": [r1, *value["rubrics"][1:]]})), words
    other_leaf = value["rubrics"][0] | {"source_leaf_ids": ["n0.2.1"]}
    assert not _accepts(schema, json.dumps(value | {"rubrics": [other_leaf, *value["rubrics"][1:]]}))


class _FillingLLM(LLM):
    """A model that fills whatever format it is given, and records each call's format and prompt."""

    name = "filler"

    def __init__(self, strict: bool):
        super().__init__()
        self.strict_formats = strict
        self.seen: list[tuple[list, object]] = []

    async def _achat(self, messages, *, role, temperature, max_tokens, stop, **extra) -> str:
        self.seen.append((messages, extra.get("fmt")))
        return json.dumps(fill(extra["fmt"].json_schema)) if self.strict_formats else "{}"


def test_strict_synthesis_writes_a_pair_in_one_call_from_a_short_prompt():
    llm = _FillingLLM(strict=True)
    [pair] = synthesize_rubrics([small_tree()], llm, SynthConfig())
    assert isinstance(pair, QRPair), pair
    assert len(llm.seen) == 1 and "prefixItems" in llm.seen[0][1].json_schema["properties"]["rubrics"]
    assert pair.merge_trace[-1].output == pair.question and pair.question.endswith("?")
    assert len(pair.rubrics) == 6 and sum(r.type == "factual" for r in pair.rubrics) == 5
    for r in pair.rubrics:
        assert all(e in LEAF_STATEMENTS[r.source_leaf_ids[0]] for e in r.evidence)
        assert not re.search(r"[A-Za-z]+[0-9]|[0-9][A-Za-z]", r.description)  # no id-like words
    sent = json.loads(llm.seen[0][0][1]["content"])
    assert [leaf["id"] for leaf in sent["leaves"]] == pair.selected_leaf_ids and "nodes" not in sent


def test_schema_mode_keeps_the_pairs_own_schema():
    llm = _FillingLLM(strict=False)
    synthesize_rubrics([small_tree()], llm, SynthConfig(max_reasks=0))
    fmt = llm.seen[0][1].json_schema
    assert "prefixItems" not in fmt["properties"]["rubrics"] and "nodes" in json.loads(llm.seen[0][0][1]["content"])


def test_a_tree_with_too_few_leaves_is_rejected_before_any_call():
    tree = small_tree()
    keep = {"n0.1.1", "n0.1.2"}
    for n in tree.nodes:
        if not n.children and n.id not in keep:
            n.statements = []
    llm = _FillingLLM(strict=True)
    [rej] = synthesize_rubrics([tree], llm, SynthConfig())
    assert isinstance(rej, Reject) and not llm.seen
    assert "2 leaf/leaves with statements; a pair selects at least 3" in rej.reason
