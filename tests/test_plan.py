"""The plan validator names exactly what is wrong; waves follow the dependency order."""

from __future__ import annotations

import json

import pytest

from deepr.evidence.plan import answer_node, children_map, is_valid, validate_plan, waves


def S(nid, q="q"):
    return {"id": nid, "type": "search", "query": f"{q} {nid}", "key_points": ["kp"]}


def A(nid, inputs, t="aggregate"):
    return {"id": nid, "type": t, "need": f"need {nid}", "key_points": ["kp"], "inputs": inputs}


def good():
    # The DecomposeR case study shape: N9 feeds N10, N5 fans out to three aggregates.
    return {"nodes": [S("N1"), S("N2"), S("N3"), S("N4"), S("N5"), S("N6"),
                      A("N7", ["N1", "N4"]), A("N8", ["N2", "N5"]), A("N9", ["N5", "N6"]),
                      A("N10", ["N3", "N5", "N9"]), A("N11", ["N7", "N8", "N10"], "answer")]}


def errors_of(obj):
    plan, errors = validate_plan(obj)
    assert plan is None, "expected the plan to be rejected"
    return " | ".join(errors)


def test_valid_plan_passes_and_waves_follow_dependencies():
    plan, errors = validate_plan(good())
    assert errors == [] and plan is not None
    assert waves(plan) == [["N7", "N8", "N9"], ["N10"]]
    assert answer_node(plan).id == "N11"
    assert children_map(plan)["N5"] == ["N8", "N9", "N10"]


def test_json_text_and_bare_node_list_are_accepted():
    assert is_valid(json.dumps(good()))
    assert is_valid(good()["nodes"])


def test_cycle_is_named_with_its_path():
    p = good()
    p["nodes"][6]["inputs"] = ["N1", "N10"]  # N7 <- N10 <- ... N11 <- N7: make N10 read N7 too
    p["nodes"][9]["inputs"] = ["N3", "N7"]
    msg = errors_of(p)
    assert "cycle" in msg and "N7 -> N10 -> N7" in msg


def test_two_answer_nodes():
    p = good()
    p["nodes"].append(A("N12", ["N7"], "answer"))
    assert "exactly one answer node, found 2 (N11, N12)" in errors_of(p)


def test_no_answer_node():
    p = good()
    p["nodes"][-1]["type"] = "aggregate"
    assert "exactly one answer node, found 0" in errors_of(p)


def test_dangling_input_id():
    p = good()
    p["nodes"][7]["inputs"] = ["N2", "N99"]
    assert "node N8 lists input 'N99', which is not a node id" in errors_of(p)


def test_unreachable_aggregate():
    p = good()
    p["nodes"].insert(10, A("N12", ["N1", "N2"]))  # reads searches, feeds nothing
    assert "aggregate node N12 does not lead to the answer node N11" in errors_of(p)


def test_disconnected_search_node():
    p = good()
    p["nodes"].insert(0, S("N0"))
    assert "not connected: N0" in errors_of(p)


def test_wrong_node_type():
    p = good()
    p["nodes"][7]["type"] = "summary"
    msg = errors_of(p)
    assert "node N8: type 'summary' is not allowed; use one of search, aggregate, answer" in msg


def test_wrong_field_type_names_the_field():
    p = good()
    p["nodes"][7]["inputs"] = "N2"
    assert "field nodes.7.inputs" in errors_of(p)


def test_bad_json_text():
    msg = errors_of('{"nodes": [{"id": "N1", "type": "search",}]}')
    assert msg.startswith("plan is not valid JSON")


@pytest.mark.parametrize("obj, expected", [
    ({"nodes": []}, "non-empty 'nodes' list"),
    ("[1, 2", "not valid JSON"),
    (42, "must be a JSON object with a 'nodes' list, got int"),
])
def test_not_a_plan(obj, expected):
    assert expected in errors_of(obj)


def test_answer_node_must_not_feed_others():
    p = good()
    p["nodes"].append(A("N12", ["N11"]))
    assert "answer node N11 must not feed other nodes (used by N12)" in errors_of(p)


def test_search_node_rules():
    p = good()
    p["nodes"][0]["query"] = " "
    p["nodes"][1]["inputs"] = ["N3"]
    msg = errors_of(p)
    assert "search node N1 needs a non-empty 'query'" in msg
    assert "search node N2 must not have inputs" in msg


def test_duplicate_and_malformed_ids():
    p = good()
    p["nodes"][1]["id"] = "N1"
    p["nodes"][2]["id"] = "3 bad"
    msg = errors_of(p)
    assert "node id 'N1' is used more than once" in msg
    assert "node id '3 bad' is not valid" in msg


def test_aggregate_without_inputs_or_need():
    p = good()
    p["nodes"][6]["inputs"] = []
    p["nodes"][7]["need"] = ""
    msg = errors_of(p)
    assert "aggregate node N7 has no inputs" in msg
    assert "aggregate node N8 needs a non-empty 'need'" in msg


def test_every_error_is_reported_at_once():
    p = good()
    p["nodes"][7]["type"] = "summary"
    p["nodes"][8]["inputs"] = ["N5", "N77"]
    assert len(validate_plan(p)[1]) >= 2


def test_waves_chain_of_aggregates():
    plan, _ = validate_plan({"nodes": [S("N1"), A("N2", ["N1"]), A("N3", ["N2"]), A("N4", ["N3", "N1"]),
                                       A("N5", ["N4"], "answer")]})
    assert waves(plan) == [["N2"], ["N3"], ["N4"]]


def test_repeated_input_is_rejected_with_the_node_and_id_named():
    # Issue 15.1: ["S1", "S1"] used to pass and count as two edges in R_plan's graph terms.
    bad = good()
    bad["nodes"][6]["inputs"] = ["N1", "N1", "N4"]
    msg = errors_of(bad)
    assert "node N7 lists input 'N1' more than once" in msg


def test_children_map_counts_a_repeated_input_once():
    from deepr.records import Plan

    # built without the validator, as a reward might receive it
    plan = Plan.model_validate({"nodes": [S("N1"), A("N2", ["N1", "N1"]), A("N3", ["N2"], "answer")]})
    assert children_map(plan)["N1"] == ["N2"]


def _shape_objects(node):
    if isinstance(node, dict):
        if node.get("type") == "object":
            yield node
        for v in node.values():
            yield from _shape_objects(v)
    elif isinstance(node, list):
        for v in node:
            yield from _shape_objects(v)


def test_planner_decoding_schema_bounds_what_a_plan_may_hold():
    """The schema a constrained backend decodes with must end a plan inside its token budget, even
    for a model that copies the whole question into every query (SmolLM2 did, and ran out at 400
    tokens on every plan). Replies are still checked in code, so this bounds decoding only."""
    from pydantic import ValidationError

    from deepr.profiles.small.planner import _PlanShape, graph_format

    for revision in (False, True):  # the small profile's plan format when its strict formats are off
        schema = graph_format(revision).json_schema
        assert max(size["maxItems"] for size in schema["properties"]["nodes"]["anyOf"]) == 10
        objects = list(_shape_objects(schema))
        assert len(objects) >= 4 and all(o.get("additionalProperties") is False for o in objects)  # no keys to ramble in
    question = ("What roles do Soul Train and Funk, African-American and R B play in Hip-hop, and how should "
                "their causes, consequences and relative significance be weighed?")
    answer = {"id": "N11", "type": "answer", "need": "the answer", "inputs": ["N1"]}
    with pytest.raises(ValidationError, match="pattern"):  # 2 to 10 words, the bound xgrammar keeps
        _PlanShape.model_validate({"nodes": [{"id": "N1", "type": "search", "query": question}, answer]})
    ten = [{"id": f"N{i}", "type": "search", "query": "soul train and funk"} for i in range(1, 11)]
    _PlanShape.model_validate({"nodes": ten})
    with pytest.raises(ValidationError, match="at most 10 items"):
        _PlanShape.model_validate({"nodes": [*ten, answer]})
    with pytest.raises(ValidationError, match="at most 4 items"):
        _PlanShape.model_validate({"nodes": [{"id": "N1", "type": "search", "query": "funk music",
                                              "key_points": ["a", "b", "c", "d", "e"]}, answer]})


def test_planner_decoding_schema_gives_each_node_type_its_own_fields():
    """What a small model got wrong after SFT and the schema can rule out: one-word queries, search
    nodes with inputs, readers without inputs, ids in another style. The wiring between ids is
    added by plan_guard.graph_schema and the guard (tests/test_plan_guard.py)."""
    from pydantic import ValidationError

    from deepr.profiles.small.planner import _PlanShape

    ok = {"nodes": [{"id": "N1", "type": "search", "query": "plate tectonics causes", "key_points": ["why"]},
                    {"id": "N2", "type": "search", "query": "volcano eruption triggers"},
                    {"id": "N3", "type": "aggregate", "need": "how both combine", "inputs": ["N1", "N2"]},
                    {"id": "N4", "type": "answer", "need": "the report", "inputs": ["N3"]}]}
    _PlanShape.model_validate(ok)
    bad = [({"id": "N1", "type": "search", "query": "volcanoes"}, "pattern"),
           ({"id": "N1", "type": "search", "query": "volcano causes", "inputs": ["N2"]}, "Extra inputs"),
           ({"id": "N3", "type": "aggregate", "need": "combine"}, "inputs"),
           ({"id": "node-1", "type": "search", "query": "volcano causes"}, "pattern"),
           ({"id": "N5", "type": "summary", "need": "x", "inputs": ["N1"]}, "type")]
    for node, why in bad:
        with pytest.raises(ValidationError, match=why):
            _PlanShape.model_validate({"nodes": [node, ok["nodes"][-1]]})


def test_planner_decoding_schema_compiles_for_xgrammar(tok):
    """The hf backend compiles each role's schema with xgrammar; a keyword it cannot compile (a
    regex feature, a union form) would fail every planner call at run time."""
    xgr = pytest.importorskip("xgrammar")
    from deepr.profiles.small.planner import graph_format

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok))
    for revision in (False, True):
        compiled = compiler.compile_json_schema(json.dumps(graph_format(revision).json_schema))
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string('{"nodes": [{"id": "N1", "type": "search", "query": "plate')
        assert not matcher.accept_string('"], "inputs"')  # a search node has no inputs
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string('{"nodes": [{"id": "N1", "type": "search", "query": "' + "R B " * 4 + "R B")
        assert not matcher.accept_string(" and")  # an 11th word: the query's length is bounded in decoding


def test_answerer_wave_schema_format_wants_non_empty_texts_under_both_local_backends(tok):
    """`--formats schema` decodes a wave under the role's static schema: an object of texts of 20+
    characters, at least one. It must mean the same under xgrammar (hf) and llama-cpp-python's
    converter: a key pattern (patternProperties) turned into "{}" only under the latter."""
    from deepr.agent.answerer import WAVE
    from deepr.profiles.small.agent import SCHEMA

    schema = SCHEMA[WAVE]().json_schema
    good, empty, short = '{"N5": "Ash clouds ground flights for days [S1-R1]."}', "{}", '{"N5": "ok"}'
    listed = '{"N5": ["Ash clouds ground flights for days"]}'
    xgr = pytest.importorskip("xgrammar")
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok)).compile_json_schema(json.dumps(schema))
    assert xgr.GrammarMatcher(compiled).accept_string(good)
    assert not any(xgr.GrammarMatcher(compiled).accept_string(t) for t in (empty, short, listed))
    pytest.importorskip("llama_cpp")
    from deepr.llm.gbnf import schema_to_gbnf

    grammar = schema_to_gbnf(schema)
    assert "additional-kv" in grammar and 'char char char char char char char char char char' in grammar
