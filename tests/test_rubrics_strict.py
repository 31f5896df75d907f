"""synthesize-rubrics under --formats strict (issue 14): the selection, ids and evidence slots are
fixed by code, the format admits only the tree's own statements as evidence and words (no ids) in
the prose, and a reply that fills the format passes every pair check."""

from __future__ import annotations

import json
import re

import pytest

from deepr.roles.rubric_checks import RubricLimits, duplicate_pairs, leaf_statements, pair_problems
from deepr.data.rubrics import SynthConfig, SynthReply, serialize_tree, synthesize_rubrics
from deepr.profiles.rubric_words import overlap_bound
from deepr.profiles import SMALL, get_profile
from deepr.profiles.rubrics_strict import pick_leaves, plan_slots, strict_format, strict_plan
from deepr.llm.base import LLM
from deepr.records import QRPair, Reject
from tree_helpers import LEAF_STATEMENTS, small_tree

LIMITS = RubricLimits()


_DESC = re.compile(r"^\^(?P<open>.*?)\(\?:,\? \(\?:\(\?:(?P<links>[^()]*)\) \)\{0,2\}\(\?:(?P<words>[^()]*)\)\)"
                   r"\{(?P<lo>\d+),(?P<hi>\d+)\}\\\.\?\$$")


def description_parts(pattern: str) -> tuple[str, list[str], list[str], int, int]:
    """A strict description pattern's opening (the first option, for the logical one), its link
    and content words, and the bounds on how many (link +) content steps follow the opening."""
    m = _DESC.match(pattern)
    assert m, pattern
    opening = m["open"][3:-1].split("|")[0] if m["open"].startswith("(?:") else m["open"]
    return opening, m["links"].split("|"), m["words"].split("|"), int(m["lo"]), int(m["hi"])


def _description(pattern: str, evidence: str) -> str:
    """What a careful model writes: the forced opening, then content words that follow it in the
    evidence (for the logical criterion: reasoning words)."""
    opening, _links, words, lo, hi = description_parts(pattern)
    ev = evidence.rstrip(".").split()
    start = next((i for i in range(len(ev)) if " ".join(ev[i:]).startswith(opening)), None)
    if start is None:  # the logical criterion
        rest = [w for w in ("both", "differ", "together") if w in words]
    else:
        rest = [w for w in (x.strip(",;:") for x in ev[start + len(opening.split()):]) if w in words]
    rest = rest[:hi]
    return " ".join([opening, *rest, *words[:max(0, lo - len(rest))]])


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
            if key == "description":
                out[key] = _description(sub["pattern"], (out.get("evidence") or [""])[0])
            else:
                out[key] = fill(sub, key)
        return out
    if schema.get("type") == "array" and schema.get("maxItems") == 0:
        return []
    if schema.get("type") == "array":
        return [fill(s, hint) for s in schema.get("prefixItems", [])] or [fill(schema["items"], hint)]
    pattern = schema["pattern"]
    if pattern.endswith(r"\?$"):
        return "How do Lava temperatures and the eruption of Mount Vesuvius shape the Volcanic Explosivity Index?"
    return f"Notes what the {hint} evidence says about volcanic hazards"


def _format(limits: RubricLimits = LIMITS, n_select: int = 5, per_leaf: int = 6):
    return strict_format(serialize_tree(small_tree(), per_leaf), n_select, limits)


_COMPILED: dict[str, object] = {}


def _accepts(schema: dict, reply: str) -> bool:
    """Whether xgrammar (the hf backend's decoder) admits ``reply`` under ``schema`` to the end.
    Each schema is compiled once: a strict pair schema takes seconds to compile."""
    xgr = pytest.importorskip("xgrammar")
    key = json.dumps(schema)
    if key not in _COMPILED:
        info = xgr.TokenizerInfo(["a", "</s>"], stop_token_ids=[1])
        _COMPILED[key] = xgr.GrammarCompiler(info).compile_json_schema(key, any_whitespace=False)
    m = xgr.GrammarMatcher(_COMPILED[key])
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
    [pair] = synthesize_rubrics([small_tree()], llm, SynthConfig(), profile=SMALL)
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
    synthesize_rubrics([small_tree()], llm, SynthConfig(max_reasks=0), profile=get_profile('small', formats='schema'))
    fmt = llm.seen[0][1].json_schema
    assert "prefixItems" not in fmt["properties"]["rubrics"] and "nodes" in json.loads(llm.seen[0][0][1]["content"])


def test_a_tree_with_too_few_leaves_is_rejected_before_any_call():
    tree = small_tree()
    keep = {"n0.1.1", "n0.1.2"}
    for n in tree.nodes:
        if not n.children and n.id not in keep:
            n.statements = []
    llm = _FillingLLM(strict=True)
    [rej] = synthesize_rubrics([tree], llm, SynthConfig(), profile=SMALL)
    assert isinstance(rej, Reject) and not llm.seen
    assert "2 leaf/leaves with statements; a pair selects at least 3" in rej.reason


# The tree on which SmolLM2's three strict replies all failed the duplicate check (issue 14): the
# Chronology leaf has two statements, so it gets two criteria, and the second statement opens with
# stop words only ("It is also the"), which left nothing distinct in R4's forced opening.
CHRONO = {
    "n0.1": ["Run-DMC was an American hip-hop group formed in Hollis, Queens, New York City in 1983."],
    "n0.2": ["Statistics is the discipline that concerns the collection, organization, analysis, "
             "interpretation, and presentation of data."],
    "n0.3": ["Chronology is the science of arranging events in their order of occurrence in time, such as "
             "in a timeline or other sequence of events.",
             "It is also \"the determination of the actual temporal sequence of past events\"."],
}


def _tree(leaves: dict[str, list[str]], topic: str = "Hip-hop"):
    from deepr.records import SupportingDoc, Tree, TreeNode, TreeStats

    def node(nid, parent, query, children=(), statements=()):
        docs = [SupportingDoc(doc_id=f"D{nid}", snippet_id=f"D{nid}#0", statements=list(statements))]
        return TreeNode(id=nid, parent=parent, depth=nid.count("."), query=query, children=list(children),
                        supporting_docs=docs, statements=list(statements),
                        stop_reason=None if children else "max_depth")

    nodes = [node("n0", None, f"{topic} history", list(leaves), ["A root statement."])]
    nodes += [node(lid, "n0", f"query {lid}", statements=st) for lid, st in leaves.items()]
    return Tree(id="tree-t", topic=topic, root_id="n0", nodes=nodes,
                stats=TreeStats(nodes=len(nodes), leaves=len(leaves), depth=1))


def _most_alike(schema: dict) -> dict:
    """A reply that fills every description with as many words the other criteria can also write
    as its format allows (each step: a shared link word, then a shared content word first): the
    closest to a duplicate a model can get."""
    value = fill(schema)
    rubrics = schema["properties"]["rubrics"]["prefixItems"]
    parts = [description_parts((r.get("anyOf") or [r])[0]["properties"]["description"]["pattern"]) for r in rubrics]
    for k, (opening, links, words, _lo, hi) in enumerate(parts):
        others = {w for j, p in enumerate(parts) if j != k for w in p[2]}
        shared = [w for w in words if w in others] + [w for w in words if w not in others]
        said = ["answer", "states", "mentions", "notes"]
        steps = [f"{said[i % 4]} {w}" for i, w in enumerate(shared[:hi])]
        value["rubrics"][k]["description"] = " ".join([opening, *steps])
    return value


@pytest.mark.parametrize("leaves,question", [
    (CHRONO, "How do Run-DMC and Statistics relate to Chronology and the science of arranging events?"),
    (LEAF_STATEMENTS, None)], ids=["chronology", "volcano"])
def test_no_reply_the_format_admits_has_two_criteria_alike(leaves, question):
    tree = _tree(leaves, "Hip-hop" if leaves is CHRONO else "Volcano")
    compact = serialize_tree(tree, 6)
    schema = strict_format(compact, 5, LIMITS).json_schema
    worst = _most_alike(schema)
    if question:  # the question is drawn from the tree's own words too
        worst["question"] = question
    assert _accepts(schema, json.dumps(worst))
    rubrics = SynthReply.model_validate(worst).rubrics
    assert duplicate_pairs(rubrics, LIMITS.duplicate_overlap) == []
    assert pair_problems(SynthReply.model_validate(worst), leaf_statements(tree), LIMITS) == []
    selected, slots = strict_plan(compact, 5, LIMITS)
    context = f"{compact['topic']} {compact['nodes'][0]['query']}"
    assert overlap_bound([s.pool for s in slots if s.leaf], context, 24) < LIMITS.duplicate_overlap
    # the reply SmolLM2 kept writing: one criterion's description copied into the next
    r3, r4 = worst["rubrics"][2], worst["rubrics"][3]
    copied = worst | {"rubrics": [*worst["rubrics"][:3], r4 | {"description": r3["description"]},
                                  *worst["rubrics"][4:]]}
    assert not _accepts(schema, json.dumps(copied))


def test_a_statement_two_leaves_show_is_evidence_for_the_first_only():
    shared = "Hip-hop emerged in the Bronx in the early 1970s."
    leaves = {"n0.1": [shared, "DJ Kool Herc hosted block parties in the Bronx."],
              "n0.2": [shared, "Breakdancing grew up beside the music at those parties."],
              "n0.3": ["Sampling reuses parts of earlier recordings."]}
    _selected, slots = strict_plan(serialize_tree(_tree(leaves), 6), 5, LIMITS)
    assert sorted(st for s in slots if s.leaf == "n0.1" for st in s.pool) == sorted(leaves["n0.1"])
    assert [s.pool for s in slots if s.leaf == "n0.2"] == [(leaves["n0.2"][1],)]


def test_a_tree_whose_leaves_repeat_one_statement_is_rejected_before_any_call():
    shared = "Hip-hop is a genre of popular music that emerged in the early 1970s."
    tree = _tree({"n0.1": [shared], "n0.2": [shared], "n0.3": [shared, "Run-DMC formed in Queens in 1983."]})
    assert strict_plan(serialize_tree(tree, 6), 5, LIMITS) is None
    llm = _FillingLLM(strict=True)
    [rej] = synthesize_rubrics([tree], llm, SynthConfig(), profile=SMALL)
    assert isinstance(rej, Reject) and not llm.seen
    assert "2 leaf/leaves with statements of their own" in rej.reason


def test_descriptions_cannot_loop_on_link_words_and_the_question_uses_real_words():
    schema = _format().json_schema
    value = fill(schema)
    assert _accepts(schema, json.dumps(value))
    r1 = value["rubrics"][0]
    looping = r1 | {"description": r1["description"] + " the the the the the"}  # seen from SmolLM2
    assert not _accepts(schema, json.dumps(value | {"rubrics": [looping, *value["rubrics"][1:]]}))
    for q in ("How do lava flows relate to thes-saysitagfthn?",  # an invented word (seen from SmolLM2)
              "Lava temperatures and Mount Vesuvius?"):  # no question word
        assert not _accepts(schema, json.dumps(value | {"question": q, "merge_trace": value["merge_trace"]})), q
