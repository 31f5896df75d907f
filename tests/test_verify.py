"""verify: the code audit and extractive decisions, the LLM auditor with recorded replies
(KEEP / REVISE / DROP, revisions checked for grounding), summaries, and the CLI files."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.cli import app
from deepr.io import read_jsonl
from deepr.llm.replay import ReplayLLM
from deepr.records import QRPair
from deepr.roles.rubric_checks import RubricLimits, rubric_problems
from deepr.data.rubrics import SynthConfig, synthesize_rubrics
from deepr.data.verify import VerifyConfig, verify, verify_summary
from tree_helpers import LEAF_STATEMENTS, good_synthesis, small_tree

EXTRA = [{"id": "R7", "type": "factual", "description": "Gives the 700 to 1,200 degree Celsius range of lava.",
          "weight": 0.5, "source_leaf_ids": ["n0.1.1"], "evidence": [LEAF_STATEMENTS["n0.1.1"][1]]},
         {"id": "R8", "type": "logical", "description": "Explains why surface texture changes how lava advances.",
          "weight": 0.4, "source_leaf_ids": ["n0.1.2"], "evidence": []}]


def _pair(mutate=None, extra: bool = False) -> QRPair:
    reply = copy.deepcopy(good_synthesis())
    if extra:
        reply["rubrics"] += copy.deepcopy(EXTRA)
    [pair] = synthesize_rubrics([small_tree()], ReplayLLM([json.dumps(reply)]), SynthConfig())
    assert isinstance(pair, QRPair), pair
    if mutate:
        data = pair.model_dump()
        mutate(data)
        pair = QRPair.model_validate(data)
    return pair


def _one(pair: QRPair, judge, cfg: VerifyConfig | None = None):
    from deepr.profiles import SMALL

    # a judge scripted as a small model audits under the small profile
    profile = SMALL if getattr(judge, "strict_formats", False) else None
    [v] = verify([pair], judge, cfg or VerifyConfig(), embed=_embed, profile=profile)
    return v


@pytest.fixture(autouse=True)
def _use_embedder(embedder):
    global _embed
    _embed = embedder.encode


# --- extractive audit ----------------------------------------------------------------------


def test_clean_pair_is_kept():
    v = _one(_pair(), None)
    assert v.kind == "verified" and v.record.decision == "KEEP" and v.record.error_tags == []


def test_fixable_problems_are_revised_and_revision_stays_grounded():
    def break_two(d):
        d["rubrics"][1]["weight"] = -0.4  # negative without justification
        d["rubrics"][3]["evidence"] = ["Pinatubo erupted on the Moon in 1850."]  # not in its leaf

    v = _one(_pair(break_two, extra=True), None)
    assert v.kind == "verified" and v.record.decision == "REVISE"
    assert {"negative_weight", "evidence_unsupported"} <= set(v.record.error_tags)
    assert [r.id for r in v.record.rubrics] == [f"R{i}" for i in range(1, 7)]
    assert all(r.weight > 0 for r in v.record.rubrics)
    leaves = {x["id"]: x["statements"] for x in v.record.selected_leaves}
    assert rubric_problems(v.record.rubrics, v.record.selected_leaf_ids, leaves, RubricLimits(), max_n=8) == []
    assert len(v.record.original["rubrics"]) == 8


def test_logical_weights_that_dominate_are_damped():
    def heavy_logic(d):
        for r in d["rubrics"]:
            r["weight"] = 1.0 if r["type"] == "logical" else 0.2

    v = _one(_pair(heavy_logic), None)
    assert v.record.decision == "REVISE" and "logical_dominates" in v.record.error_tags
    f = sum(r.weight for r in v.record.rubrics if r.type == "factual")
    assert sum(r.weight for r in v.record.rubrics if r.type == "logical") <= f + 1e-6


def test_structural_failures_are_dropped_with_reason():
    def bad_merge(d):
        d["merge_trace"][-1]["output"] = "A different question about volcanoes and people?"

    v = _one(_pair(bad_merge), None)
    assert v.kind == "dropped" and v.record.decision == "DROP" and "structure" in v.record.error_tags
    assert "word for word" in v.record.drop_reason


def test_repair_that_leaves_too_few_criteria_is_dropped():
    def break_two(d):
        d["rubrics"][0]["evidence"] = ["Made up claim about glaciers."]
        d["rubrics"][1]["source_leaf_ids"] = ["n0.1"]

    v = _one(_pair(break_two), None)  # 6 criteria - 2 = 4 < 5
    assert v.kind == "dropped" and v.record.drop_reason.startswith("repair not possible")


# --- LLM audit ----------------------------------------------------------------------------


def _audit(decision: str, **kw) -> str:
    return json.dumps({"decision": decision, "error_tags": kw.pop("tags", []), "major_issues": [],
                       "justification": kw.pop("why", "ok"), "fix_plan": "", **kw})


REVISED = [dict(r) for r in good_synthesis()["rubrics"][:5]]


def test_judge_keep_and_drop():
    v = _one(_pair(), ReplayLLM({"verify": [_audit("keep", why="solid sample")]}))
    assert v.record.decision == "KEEP" and v.record.audit["justification"] == "solid sample"
    v = _one(_pair(), ReplayLLM({"verify": [_audit("DROP", tags=["shallow"], why="fact lookup only")]}))
    assert v.kind == "dropped" and v.record.drop_reason == "fact lookup only" and "shallow" in v.record.error_tags


def test_judge_revision_is_applied_and_original_kept():
    new_q = "Which volcanic hazards, from lava flows to climate cooling, matter most and why?"
    llm = ReplayLLM({"verify": [_audit("REVISE", tags=["question_rubric_mismatch"], revised_question=new_q,
                                       revised_rubrics=REVISED)]})
    v = _one(_pair(), llm)
    assert v.record.decision == "REVISE" and v.record.question == new_q and len(v.record.rubrics) == 5
    assert v.record.original["question"] == good_synthesis()["question"]
    assert "question_rubric_mismatch" in v.record.error_tags


def test_ungrounded_revision_is_reasked_then_accepted():
    outside = copy.deepcopy(REVISED)
    outside[0]["source_leaf_ids"] = ["n0.2"]  # an inner node, not a selected leaf
    llm = ReplayLLM({"verify": [_audit("REVISE", revised_rubrics=outside), _audit("REVISE", revised_rubrics=REVISED)]})
    v = _one(_pair(), llm)
    assert v.record.decision == "REVISE" and v.record.audit["attempts"] == 2
    assert "not in selected_leaf_ids" in llm.calls[1][1][-1]["content"]


def test_revision_with_outside_evidence_is_not_accepted():
    invented = copy.deepcopy(REVISED)
    invented[2]["evidence"] = ["Vesuvius erupted 400 times in the 20th century alone."]
    bad = _audit("REVISE", revised_rubrics=invented)
    v = _one(_pair(), ReplayLLM({"verify": [bad, bad, bad]}))
    assert v.kind == "dropped" and v.record.drop_reason.startswith("revision not accepted")
    assert "not supported by the statements" in v.record.drop_reason


def test_unparseable_audit_is_a_recorded_failure():
    v = _one(_pair(), ReplayLLM({"verify": ["Looks fine to me!"] * 3}))
    assert v.kind == "reject" and v.record.reason.startswith("audit failed") and "gave up" in v.record.reason


def test_judge_keep_does_not_override_failed_checks():
    pair = _pair(lambda d: d["rubrics"][0].update(evidence=["Lava is cold."]))
    v = _one(pair, ReplayLLM({"verify": [_audit("KEEP")]}))
    assert v.kind == "dropped" and "kept by the auditor but fails the checks" in v.record.drop_reason


def test_summary_rates_and_tag_histogram():
    verdicts = verify([_pair(), _pair(lambda d: d["merge_trace"][-1].update(output="Other question here?"))],
                      None, VerifyConfig(), embed=_embed)
    rates, tags = verify_summary(verdicts)
    assert rates["audited"] == 2 and rates["keep rate"] == 0.5 and rates["drop rate"] == 0.5
    assert tags == {"structure": 1}


# --- CLI ----------------------------------------------------------------------------------


def test_cli_writes_verified_dropped_sidecar_and_resumes(tmp_path: Path):
    pairs = tmp_path / "pairs.jsonl"
    good, bad = _pair(), _pair(lambda d: d["merge_trace"][-1].update(output="Other question here?"))
    bad = bad.model_copy(update={"id": "other-qr", "tree_id": "other"})
    pairs.write_text(good.model_dump_json() + "\n" + bad.model_dump_json() + "\n")
    out = tmp_path / "verified.jsonl"
    r = CliRunner().invoke(app, ["verify", str(pairs), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert [p.id for p in read_jsonl(out, QRPair)] == [good.id]
    assert [p.id for p in read_jsonl(tmp_path / "verified.dropped.jsonl", QRPair)] == ["other-qr"]
    meta = json.loads((tmp_path / "verified.jsonl.meta.json").read_text())
    assert meta["error_tags"] == {"structure": 1} and meta["counts"]["drop rate"] == 0.5
    r = CliRunner().invoke(app, ["verify", str(pairs), "--out", str(out)])
    assert r.exit_code == 0 and len(out.read_text().splitlines()) == 1  # nothing redone or duplicated
    assert len((tmp_path / "verified.dropped.jsonl").read_text().splitlines()) == 1


def test_cli_names_file_and_line_of_a_bad_record(tmp_path: Path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(_pair().model_dump_json() + "\n" + '{"id": "x", "tree_id": "t"}\n')
    r = CliRunner().invoke(app, ["verify", str(pairs), "--out", str(tmp_path / "v.jsonl")])
    assert r.exit_code == 2 and "pairs.jsonl:2" in r.output and "Traceback" not in r.output


# --- strict audit (--formats strict) --------------------------------------------------------


class _StrictJudge(ReplayLLM):
    """A judge that decodes under strict formats and records the format of each call."""

    strict_formats = True

    def __init__(self, replies):
        super().__init__(replies)
        self.formats = []

    async def _achat(self, messages, *, role, temperature, max_tokens, stop, **extra):
        self.formats.append(extra.get("fmt"))
        return await super()._achat(messages, role=role, temperature=temperature, max_tokens=max_tokens,
                                    stop=stop, **extra)


def _admits(schema: dict, value: dict) -> bool:
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo(["a", "</s>"], stop_token_ids=[1])
    m = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False))
    return m.accept_string(json.dumps(value), debug_print=False) and m.accept_token(1) and m.is_terminated()


def test_strict_audit_is_a_short_keep_or_drop():
    keep = {"decision": "KEEP", "error_tags": ["not_deep"], "major_issues": [],
            "justification": "The criteria follow the leaves and the question needs them all"}
    judge = _StrictJudge({"verify": [json.dumps(keep)]})
    v = _one(_pair(), judge)
    assert v.kind == "verified" and v.record.decision == "KEEP"
    [fmt] = judge.formats
    schema = fmt.json_schema
    assert schema["properties"]["decision"]["enum"] == ["KEEP", "DROP"]
    assert _admits(schema, keep)
    # SmolLM2 wrote 3,731 tokens for one audit under the reply's own schema: a revision, unknown
    # tags and long prose are outside the strict format
    for bad in ({**keep, "decision": "REVISE"}, {**keep, "error_tags": ["shallow"]},
                {**keep, "justification": " ".join(["word"] * 40)},
                {**keep, "revised_rubrics": REVISED}):
        assert not _admits(schema, bad), bad


def test_pairs_are_embedded_in_batches_and_audited_concurrently():
    """Embedding pair by pair on the event loop kept one audit in flight at a time; each group of
    ``concurrency`` pairs is now embedded in one batch, and the audits overlap. Verdicts are the
    ones the pair-by-pair path gives."""
    import asyncio

    calls: list[int] = []

    def counting(texts):
        calls.append(len(texts))
        return _embed(texts)

    from deepr.llm.base import LLM

    class SlowJudge(LLM):  # keeps every pair, after a round-trip
        name, in_flight, peak = "slow-judge", 0, 0

        async def _achat(self, messages, **kw):
            SlowJudge.in_flight += 1
            SlowJudge.peak = max(SlowJudge.peak, SlowJudge.in_flight)
            await asyncio.sleep(0.05)
            SlowJudge.in_flight -= 1
            return _audit("KEEP")

    broken = _pair(lambda d: d["merge_trace"][-1].update(output="Other question here?"))
    pairs = [_pair(extra=True).model_copy(update={"id": f"p{i}"}) for i in range(5)] + [broken]
    got = verify(pairs, SlowJudge(), VerifyConfig(concurrency=4), embed=counting)
    assert len(calls) == 2  # two groups of at most 4 pairs, one embed call each
    assert SlowJudge.peak > 1
    one_by_one = {p.id: verify([p], SlowJudge(), VerifyConfig(concurrency=1), embed=_embed)[0] for p in pairs}
    assert sorted((v.record.id, v.kind) for v in got) == sorted((k, v.kind) for k, v in one_by_one.items())
    assert {v.kind for v in got} == {"verified", "dropped"}
