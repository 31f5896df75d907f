"""synthesize-rubrics: compact serialisation, every pair constraint in code, the LLM path
with recorded replies (re-asks, rejections) and the extractive synthesiser."""

from __future__ import annotations

import copy
import json

import pytest

from deepr.llm.replay import ReplayLLM
from deepr.records import QRPair, Reject, Tree
from deepr.roles.rubric_checks import RubricLimits, evidence_supported, leaf_statements, pair_problems
from deepr.data.rubrics import SynthConfig, SynthReply, serialize_tree, synthesize_rubrics
from deepr.data.trees import TreeConfig, build_trees
from deepr.data.topics import SeedTopic, tree_id
from tree_helpers import LEAF_STATEMENTS, LexicalRetriever, good_synthesis, small_tree, volcano_docs

LIMITS = RubricLimits()


def _problems(reply: dict) -> list[str]:
    return pair_problems(SynthReply.model_validate(reply), leaf_statements(small_tree()), LIMITS)


def test_serialisation_is_compact_with_paths_and_statements():
    compact = serialize_tree(small_tree(), statements_per_leaf=1)
    assert compact["nodes"][0] == {"id": "n0", "parent": None, "depth": 0, "query": "Volcanoes and their hazards",
                                   "children": ["n0.1", "n0.2", "n0.3"]}
    leaf = next(x for x in compact["leaves"] if x["id"] == "n0.1.1")
    assert leaf["path"] == ["Volcanoes and their hazards", "Lava behaviour", "Lava flow speed and temperature"]
    assert leaf["statements"] == LEAF_STATEMENTS["n0.1.1"][:1]
    assert {x["id"] for x in compact["leaves"]} == set(LEAF_STATEMENTS)


def test_a_good_synthesis_passes_every_check():
    assert _problems(good_synthesis()) == []


def _mutate(path: str, value) -> dict:
    reply = copy.deepcopy(good_synthesis())
    target = reply
    *keys, last = path.split(".")
    for k in keys:
        target = target[int(k)] if k.isdigit() else target[k]
    if value is _DEL:
        del target[int(last)]
    else:
        target[int(last) if last.isdigit() else last] = value
    return reply


_DEL = object()


@pytest.mark.parametrize("path,value,expected", [
    ("rubrics.0.source_leaf_ids", ["n0.1"], "not in selected_leaf_ids"),
    ("rubrics.0.evidence", [], "needs evidence"),
    ("rubrics.0.evidence", ["Lava is cold and slow everywhere on Mars."], "not supported by the statements"),
    ("rubrics", good_synthesis()["rubrics"][:4], "write 5 to 12 rubric criteria; got 4"),
    ("rubrics.1.weight", -0.5, "negative weight is only for a penalty"),
    ("rubrics.1.weight", 0.0, "weight 0"),
    ("rubrics.2.id", "R7", "should be R3"),
    ("rubrics.3.description", "Mentions that Vesuvius buried Pompeii in 79 AD.", "check the same thing"),
    ("question", "R1 and R2: " + "why " * 3, "must not mention rubric ids"),
    ("question", "word " * 90, "the question has 90 words"),
    ("selected_leaf_ids", ["n0.1.1", "n0.1"], "not leaves with statements"),
    ("merge_trace.2.inputs", ["M1", "M9", "n0.3"], "neither selected leaves nor earlier steps"),
    ("merge_trace.2.output", "Something else entirely?", "must be the final question"),
    ("merge_trace.1", _DEL, "never merged"),
    ("selection_trace.4", _DEL, "gives no reason for leaves ['n0.3']"),
    ("rubrics.0.description", " ".join(["word"] * 60), "keep it atomic"),
])
def test_each_constraint_violation_is_named(path, value, expected):
    problems = _problems(_mutate(path, value))
    assert any(expected in p for p in problems), problems


def test_a_penalty_criterion_may_have_negative_weight():
    reply = _mutate("rubrics.1.weight", -0.5)
    reply["rubrics"][1]["penalty"] = True
    assert _problems(reply) == []


def test_evidence_support_is_against_one_statement():
    st = LEAF_STATEMENTS["n0.1.1"]
    assert evidence_supported("basaltic lava flows travel up to 10 kilometres per hour", st, 0.6)
    assert not evidence_supported("lava flows at 10 kilometres per hour reach 1,200 degrees in Iceland", st, 0.9)


# --- LLM path with recorded replies ------------------------------------------------------


def _run(replies: list[str], **cfg) -> tuple[QRPair | Reject, ReplayLLM]:
    llm = ReplayLLM({"synthesize": replies})
    [out] = synthesize_rubrics([small_tree()], llm, SynthConfig(**cfg))
    return out, llm


def test_well_formed_reply_becomes_a_pair():
    out, llm = _run([json.dumps(good_synthesis())])
    assert isinstance(out, QRPair) and out.id == "tree-volcano-test-qr" and out.tree_id == "tree-volcano-test"
    assert out.question == good_synthesis()["question"] and len(out.rubrics) == 6
    assert [x["id"] for x in out.selected_leaves] == out.selected_leaf_ids  # verify needs no tree file
    assert out.backend == "replay" and out.attempts == 1
    sent = json.loads(llm.calls[0][1][1]["content"])
    assert {"nodes", "leaves", "topic"} <= set(sent)


def test_fenced_reply_with_thinking_is_parsed():
    out, _ = _run([f"<think>Let me pick leaves.</think>\nSure:\n```json\n{json.dumps(good_synthesis())}\n```"])
    assert isinstance(out, QRPair)


def test_bad_json_is_reasked_then_accepted():
    out, llm = _run(['{"question": "How', json.dumps(good_synthesis())])
    assert isinstance(out, QRPair) and out.attempts == 2
    assert "Your previous reply could not be used" in llm.calls[1][1][-1]["content"]


def test_constraint_violations_are_listed_in_the_reask():
    bad = _mutate("rubrics.0.source_leaf_ids", ["n0.2"])
    out, llm = _run([json.dumps(bad), json.dumps(good_synthesis())])
    assert isinstance(out, QRPair)
    assert "R1: source_leaf_ids ['n0.2'] are not in selected_leaf_ids" in llm.calls[1][1][-1]["content"]


def test_persistent_violations_are_rejected_with_reason():
    bad = json.dumps(_mutate("rubrics.0.evidence", []))
    out, llm = _run([bad, bad, bad], max_reasks=2)
    assert isinstance(out, Reject) and out.id == "tree-volcano-test-qr"
    assert "gave up after 3 attempts" in out.reason and "needs evidence" in out.reason
    assert llm.remaining("synthesize") == 0


# --- extractive path -----------------------------------------------------------------------


def test_extractive_pairs_pass_every_check(embedder):
    topics = [SeedTopic(id=tree_id(t), title=t) for t in ("Volcano", "Plate tectonics", "Mount Vesuvius")]
    results = build_trees(topics, LexicalRetriever(volcano_docs()), None, TreeConfig(max_depth=2),
                          embed=embedder.encode)
    trees = [t for t in results if isinstance(t, Tree)] + [small_tree()]
    out = synthesize_rubrics(trees, None, SynthConfig(), embed=embedder.encode)
    pairs = [p for p in out if isinstance(p, QRPair)]
    assert len(pairs) >= 2, [getattr(p, "reason", "") for p in out]
    by_tree = {t.id: t for t in trees}
    for p in pairs:
        assert pair_problems(p, leaf_statements(by_tree[p.tree_id]), LIMITS) == []
        assert p.backend == "extractive" and len(p.rubrics) >= 5
        assert {r.type for r in p.rubrics} == {"factual", "logical"}
        assert set(r for x in p.rubrics for r in x.source_leaf_ids) <= set(p.selected_leaf_ids)
    for r in out:
        if isinstance(r, Reject):
            assert r.reason  # a tree that cannot make a pair says why


def test_cli_with_recorded_replies_writes_pairs_rejects_and_resumes(tmp_path):
    from typer.testing import CliRunner

    from deepr.cli import app
    from deepr.io import read_jsonl

    trees = tmp_path / "trees.jsonl"
    trees.write_text(small_tree("tree-a").model_dump_json() + "\n" + small_tree("tree-b").model_dump_json() + "\n")
    replies = tmp_path / "replies.jsonl"
    bad = json.dumps(_mutate("rubrics.0.evidence", []))
    lines = [json.dumps(good_synthesis())] + [bad] * 3  # tree-a succeeds, tree-b never does
    replies.write_text("".join(json.dumps({"role": "synthesize", "reply": r}) + "\n" for r in lines))
    out = tmp_path / "pairs.jsonl"
    args = ["synthesize-rubrics", str(trees), "--out", str(out), "--llm", f"replay:{replies}", "--concurrency", "1"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 3, r.output  # one of two trees rejected: exit 3 (issue 18)
    assert [p.id for p in read_jsonl(out, QRPair)] == ["tree-a-qr"]
    [rej] = read_jsonl(tmp_path / "pairs.rejects.jsonl", Reject)
    assert rej.id == "tree-b-qr" and "needs evidence" in rej.reason
    meta = json.loads((tmp_path / "pairs.jsonl.meta.json").read_text())
    assert meta["summary"]["mean rubrics/pair"] == 6 and meta["counts"]["rejected"] == 1
    r = CliRunner().invoke(app, args)  # everything is done: no model call, nothing appended
    assert r.exit_code == 0 and len(out.read_text().splitlines()) == 1
    assert len((tmp_path / "pairs.rejects.jsonl").read_text().splitlines()) == 1


def test_a_tree_over_the_models_context_is_sent_with_fewer_statements_per_leaf():
    from deepr.roles import prompt_tokens

    full = ReplayLLM({"synthesize": [json.dumps(good_synthesis())]})
    synthesize_rubrics([small_tree()], full, SynthConfig(max_tokens=200))
    whole = prompt_tokens(full, full.calls[0][1])
    llm = ReplayLLM({"synthesize": [json.dumps(good_synthesis())]})
    llm.context_length = whole + 200 - 1  # one token too small for every statement
    [out] = synthesize_rubrics([small_tree()], llm, SynthConfig(max_tokens=200))
    sent = json.loads(llm.calls[0][1][1]["content"])
    assert isinstance(out, QRPair)
    assert max(len(leaf["statements"]) for leaf in sent["leaves"]) < max(
        len(leaf["statements"]) for leaf in json.loads(full.calls[0][1][1]["content"])["leaves"])
    # every statement travels with the pair even though the prompt showed fewer
    assert all(leaf["statements"] == LEAF_STATEMENTS[leaf["id"]] for leaf in out.selected_leaves)
