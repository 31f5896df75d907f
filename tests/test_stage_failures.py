"""Data stages under a model that always fails: counts, top reasons, non-zero exit, and the
opt-in per-record ``--fallback extractive`` recorded in each record and in the sidecar."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from deepr.cli import app
from deepr.data.outcomes import StageTally, reason_key
from deepr.data.rubrics import SynthConfig, synthesize_rubrics
from deepr.data.topics import SeedTopic, tree_id
from deepr.data.trees import TreeConfig, build_trees
from deepr.data.verify import VerifyConfig, verify
from deepr.io import read_jsonl
from deepr.llm.base import LLM
from deepr.llm.replay import ReplayLLM
from deepr.records import QRPair, Reject, Tree
from tree_helpers import LexicalRetriever, good_synthesis, small_tree, volcano_docs

TOPICS = [SeedTopic(id=tree_id(t), title=t) for t in ("Volcano", "Mount Vesuvius")]


class Failing(LLM):
    """A model whose every reply is unusable (no JSON, no tags), as a tiny model often is."""

    name = "failing"

    def __init__(self):
        super().__init__()
        self.calls = 0

    async def _achat(self, messages, **kw):
        self.calls += 1
        return "Sure! Here is what you asked for."


def tally(results) -> StageTally:
    t = StageTally("stage")
    for r in results:
        t.add(r)
    return t


@pytest.fixture(scope="module")
def volc():
    return LexicalRetriever(volcano_docs())


def test_reasons_of_different_records_group_into_one():
    assert reason_key("root query failed: 'Volcano' after 3 attempts") == reason_key(
        "root query failed: 'Mount Vesuvius' after 2 attempts")


def test_build_trees_with_a_failing_model_rejects_every_tree_and_says_why(volc, embedder):
    llm = Failing()
    results = build_trees(TOPICS, volc, llm, TreeConfig(max_depth=1, min_leaves=1), embed=embedder.encode)
    assert all(isinstance(r, Reject) for r in results) and llm.calls > 0
    t = tally(results)
    assert (t.ok, t.fallback, t.failed) == (0, 0, 2) and t.every_failed
    top, n = t.top(1)[0]
    assert n == 2 and top.startswith("record: root query failed: gave up after N attempts: no JSON object")
    assert ("root_query/write: gave up after N attempts: no JSON object found in the reply; it starts with '…'"
            in dict(t.top(3)))  # the turn-level reason, from each tree's Recorder failures
    assert "all 2 record(s) failed" in t.verdict() and "--fallback extractive" in t.verdict()
    # the turns' own failures travel with the reject
    assert all(f["where"].startswith("root_query") for f in results[0].record["failures"])


def test_build_trees_fallback_extractive_rebuilds_each_failed_tree_and_records_it(volc, embedder):
    cfg = TreeConfig(max_depth=1, min_leaves=1, fallback="extractive")
    results = build_trees(TOPICS, volc, Failing(), cfg, embed=embedder.encode)
    assert all(isinstance(r, Tree) for r in results)
    for tree in results:
        fb = tree.model_dump()["fallback"]
        assert tree.backend == "extractive" and fb["engine"] == "extractive"
        assert "root query failed" in fb["reason"] and fb["model_failures"]
    t = tally(results)
    assert (t.ok, t.fallback, t.failed) == (0, 2, 0) and not t.every_failed and t.top(1)


def test_synthesis_and_verify_with_a_failing_model_and_with_the_fallback(embedder):
    tree = small_tree()
    [rej] = synthesize_rubrics([tree], Failing(), SynthConfig(max_reasks=1))
    assert isinstance(rej, Reject) and tally([rej]).every_failed
    [pair] = synthesize_rubrics([tree], Failing(), SynthConfig(max_reasks=1, fallback="extractive"),
                                embed=embedder.encode)
    assert isinstance(pair, QRPair) and pair.backend == "extractive"
    assert "model path" in pair.model_dump()["fallback"]["reason"]
    [v] = verify([pair], Failing(), VerifyConfig(max_reasks=0), embed=embedder.encode)
    assert v.kind == "reject" and tally([v]).every_failed and "audit failed" in tally([v]).top(1)[0][0]
    [v] = verify([pair], Failing(), VerifyConfig(max_reasks=0, fallback="extractive"), embed=embedder.encode)
    assert v.kind in ("verified", "dropped") and v.record.model_dump()["fallback"]["engine"] == "extractive"
    assert tally([v]).fallback == 1


def test_cli_exits_non_zero_when_every_record_failed_and_the_fallback_is_counted(tmp_path):
    trees = tmp_path / "trees.jsonl"
    trees.write_text(small_tree("tree-a").model_dump_json() + "\n" + small_tree("tree-b").model_dump_json() + "\n")
    replies = tmp_path / "replies.jsonl"  # unusable replies, then the replay runs dry: every call fails
    replies.write_text("".join(json.dumps({"role": "synthesize", "reply": "Sure!"}) + "\n" for _ in range(2)))
    out = tmp_path / "pairs.jsonl"
    args = ["synthesize-rubrics", str(trees), "--out", str(out), "--llm", f"replay:{replies}", "--concurrency", "1"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 4, r.output  # nothing succeeded (deepr/cli/exit_codes.py)
    assert "all 2 record(s) failed" in r.output and "top failure 1" in r.output
    meta = json.loads((tmp_path / "pairs.jsonl.meta.json").read_text())
    assert meta["counts"]["failed"] == 2 and meta["counts"]["top_failure_reasons"]
    r = CliRunner().invoke(app, [*args, "--retry-rejects", "--fallback", "extractive"])
    assert r.exit_code == 0, r.output
    pairs = list(read_jsonl(out, QRPair))
    assert len(pairs) == 2 and all(p.model_dump()["fallback"]["engine"] == "extractive" for p in pairs)
    meta = json.loads((tmp_path / "pairs.jsonl.meta.json").read_text())
    assert meta["counts"]["fallback"] == 2 and meta["counts"]["ok"] == 0
    r = CliRunner().invoke(app, [*args, "--fallback", "sometimes"])
    assert r.exit_code != 0 and "fallback" in r.output and "Traceback" not in r.output


def test_verify_cli_exits_non_zero_when_every_audit_failed(tmp_path, embedder):
    pairs = tmp_path / "pairs.jsonl"
    [pair] = synthesize_rubrics([small_tree()], ReplayLLM([json.dumps(good_synthesis())]), SynthConfig())
    pairs.write_text(pair.model_dump_json() + "\n")
    replies = tmp_path / "judge.jsonl"
    replies.write_text(json.dumps({"reply": "I think it is fine."}) + "\n")
    out = tmp_path / "verified.jsonl"
    args = ["verify", str(pairs), "--out", str(out), "--llm", f"replay:{replies}"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 4, r.output  # nothing succeeded (deepr/cli/exit_codes.py)
    assert "verify: all 1 record(s) failed" in r.output and "audit failed" in r.output
    r = CliRunner().invoke(app, [*args, "--retry-rejects", "--fallback", "extractive"])
    assert r.exit_code == 0, r.output
    [kept] = read_jsonl(out, QRPair)
    assert kept.model_dump()["fallback"]["engine"] == "extractive"
    assert json.loads((tmp_path / "verified.jsonl.meta.json").read_text())["counts"]["fallback"] == 1
