"""DeepRubric composite (002 Eq. 5, App. A.1–A.4): format, search, claims, R_fmt, R_cite, judges."""

from __future__ import annotations

import asyncio

import pytest

from deepr.llm.replay import ReplayLLM
from deepr.records import RubricItem
from deepr.rewards.judges import Judge, JudgeCache, RewardInputError, rubric_weighted
from deepr.rewards.rubric_reward import (
    _distribution,
    citation_format,
    citation_reward,
    extract_claims,
    r_format,
    r_search,
    report_structure,
    rubric_composite,
    rubric_score,
    tool_calls,
)
from test_rewards_answer import bow_embed


def run(coro):
    return asyncio.run(coro)


CALL = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
STORE = {"a": "The Eiffel Tower was completed in 1889 for the World's Fair.",
         "b": "The tower is 330 metres tall.", "c": "Paris is the capital of France."}


def test_format_indicators():
    full = f'<think>plan</think>{CALL}<answer>Fact <cite id="a">The tower was completed in 1889</cite>.</answer>'
    assert r_format(full) == {"R_format": 1.0, "I_answer": 1.0, "I_cite": 1.0, "I_tool": 1.0, "I_think": 1.0}
    assert r_format("<think>x</think><answer>text</answer>")["R_format"] == pytest.approx(0.7)
    assert r_format("<answer>unclosed")["I_answer"] == 0.0
    assert r_format("<think> </think><answer></answer>")["R_format"] == 0.0  # empty blocks count for nothing


def test_tool_calls_and_search_reward_saturate_at_six():
    bad = '<tool_call>{"name": "delete", "arguments": {}}</tool_call><tool_call>{oops</tool_call>'
    assert tool_calls(CALL * 2 + bad) == (2, 2)
    assert [r_search(n) for n in (0, 3, 6, 9)] == [0.0, 0.5, 1.0, 1.0]


def test_claims_from_cite_spans_markers_and_plain_sentences():
    text = ('## Intro\nThis report looks at the tower. <cite id="a, b">It was completed in 1889 and is tall</cite>. '
            "Paris is the capital [c]. So it goes.")
    claims = extract_claims(text, known=STORE)
    assert [(c.text, c.ids) for c in claims] == [
        ("This report looks at the tower.", []),
        ("It was completed in 1889 and is tall", ["a", "b"]),
        ("Paris is the capital.", ["c"]),
        ("So it goes.", []),
    ]
    assert claims[1].start == text.index("<cite")
    # without the store, "[c]" could be any bracketed text: only markers with a digit count
    assert extract_claims("Paris is the capital [c]. It is old [N1-R3].")[0].ids == []
    assert extract_claims("Paris is the capital [c]. It is old [N1-R3].")[1].ids == ["N1-R3"]


def test_distribution_hand_cases():
    assert _distribution([0.1, 0.5, 0.9])["d"] == pytest.approx(1.0)
    d = _distribution([0.2, 0.3, 0.7])
    assert d["span"] == pytest.approx(0.5 / 0.6)
    assert d["uniformity"] == pytest.approx(0.4)  # gaps .1/.4, mean .25, mean |dev| .15 -> 1 - .6
    assert d["center"] == pytest.approx(0.8)
    assert d["d"] == pytest.approx(0.4 * 0.5 / 0.6 + 0.4 * 0.4 + 0.2 * 0.8)
    assert _distribution([0.5]) == {"d": pytest.approx(0.2), "span": 0.0, "uniformity": 0.0, "center": 1.0}
    assert _distribution([])["d"] == 0.0


def test_citation_format_validity_meaningful_ratio_and_count():
    text = ('<cite id="a">The tower was completed in 1889</cite> filler filler filler filler. '
            '<cite id="b">It is 330 metres tall today</cite> more filler text here. '
            '<cite id="zz">Short</cite> and <cite id="c">Paris is the capital of France</cite>')
    claims = extract_claims(text)
    f = citation_format(text, claims, STORE)
    assert f["v"] == pytest.approx(3 / 4) and f["unknown_ids"] == 1
    assert f["m"] == pytest.approx(3 / 4)  # "Short" is under 4 words / 18 characters
    assert f["n"] == pytest.approx(3 / 6)
    expected_d = _distribution([text.index('<cite id="a"') / len(text), text.index('<cite id="b"') / len(text),
                                text.index('<cite id="c"') / len(text)])["d"]
    assert f["d"] == pytest.approx(expected_d)
    assert f["R_fmt"] == pytest.approx(0.5625 * (0.7 + 0.1 * expected_d + 0.2 * 0.5))
    none = citation_format("No citations at all here.", extract_claims("No citations at all here."), STORE)
    assert none["R_fmt"] == 0.0 and none["v"] == 0.0


def test_per_claim_f1_with_recorded_judge():
    text = ('Intro sentence that sets the scene. <cite id="a">The tower was completed in 1889</cite>. '
            '<cite id="b">The tower is 330 metres tall</cite>. <cite id="ghost">A claim with a bad id</cite>. '
            "Paris has eleven million people.")
    replies = ['{"support": "full", "relevant": true}', '{"support": "partial", "relevant": true}',
               '{"needs_citation": [false, true]}']
    judge = Judge(ReplayLLM(replies))
    r = run(citation_reward("q", text, STORE, judge))
    f1s = [c["f1"] for c in r.claims]
    # intro (no citation needed) 1; full 1; partial 2*.5*1/1.5; unknown id 0 (no call); uncited fact 0
    assert f1s == pytest.approx([1.0, 1.0, 2 / 3, 0.0, 0.0])
    assert r.F1_mean == pytest.approx((1 + 1 + 2 / 3) / 5)
    assert r.R_cite == pytest.approx(0.6 * r.F1_mean + 0.4 * r.fmt["R_fmt"])
    assert len(judge.llm.calls) == 3


def test_empty_report_and_judge_failure():
    judge = Judge(ReplayLLM([]))
    r = run(citation_reward("q", "", STORE, judge))
    assert r.R_cite == 0.0 and "empty report" in r.notes[0]
    assert run(rubric_score("q", "  ", [{"id": "R1", "type": "factual", "description": "d", "weight": 1}],
                            judge))["R_rubric"] == 0.0
    bad = Judge(ReplayLLM(["{}"] * 3))
    r = run(citation_reward("q", '<cite id="a">The tower was completed in 1889</cite>', STORE, bad))
    assert r.R_cite is None and "claim judge failed" in r.failure


def test_weighted_rubric_mean_with_a_negative_item():
    items = [RubricItem(id="R1", type="factual", description="d1", weight=0.5),
             RubricItem(id="R2", type="logical", description="d2", weight=1.0),
             RubricItem(id="R3", type="factual", description="misleading claim", weight=-0.5)]
    # Issue 15.10 (changed assertions): signed weights, normalised by the positive weights.
    # R3 scored 1.0 = the report asserts the misleading claim -> it subtracts 0.5
    assert rubric_weighted(items, [1.0, 0.5, 1.0]) == pytest.approx((0.5 * 1 + 1.0 * 0.5 - 0.5 * 1) / 1.5)
    # not asserting it earns nothing (it used to earn the full |w|)
    assert rubric_weighted(items, [1.0, 0.5, 0.0]) == pytest.approx((0.5 + 0.5) / 1.5)
    # an empty report (nothing met, nothing asserted) gets 0, not the penalty items' weight
    assert rubric_weighted(items, [0.0, 0.0, 0.0]) == 0.0
    assert rubric_weighted(items, [0.0, 0.0, 1.0]) == 0.0  # clipped at 0


def test_rubric_judge_scores_normalises_and_caches():
    rubrics = [{"id": "R1", "type": "factual", "description": "states the year", "weight": 1.0, "evidence": ["1889"]},
               {"id": "R2", "type": "logical", "description": "compares heights", "weight": 0.5}]
    llm = ReplayLLM(['```json\n{"score": 4}\n```', '<think>hmm</think>{"score": 1}'])
    judge = Judge(llm)
    r = run(rubric_score("When?", "It opened in 1889.", rubrics, judge))
    assert r["R_rubric"] == pytest.approx((1.0 * 1.0 + 0.5 * 0.25) / 1.5)
    assert r["items"] == {"R1": 1.0, "R2": 0.25}
    assert "Supporting evidence: 1889" in llm.calls[0][1][1]["content"]
    again = run(rubric_score("When?", "It opened in 1889.", rubrics, judge))  # no replies left: all cached
    assert again["R_rubric"] == r["R_rubric"] and len(llm.calls) == 2


def test_rubric_judge_failure_is_reported_not_zero():
    judge = Judge(ReplayLLM(['{"score": 9}', '{"score": 7}', "nothing"]))
    r = run(rubric_score("q", "report", [{"id": "R1", "type": "factual", "description": "d", "weight": 1}], judge))
    assert r["R_rubric"] is None and "R1" in r["failure"] and judge.failures == 1
    with pytest.raises(RewardInputError):
        run(rubric_score("q", "report", [{"id": "R1", "type": "factual", "description": "d"}], judge))


def test_judge_cache_file_survives_a_restart(tmp_path):
    path = tmp_path / "judge.jsonl"
    item = [{"id": "R1", "type": "factual", "description": "d", "weight": 1}]
    j1 = Judge(ReplayLLM(['{"score": 2}']), cache=JudgeCache(path))
    assert run(rubric_score("q", "r", item, j1))["R_rubric"] == 0.5
    j1.cache.close()
    j2 = Judge(ReplayLLM([]), cache=JudgeCache(path))
    assert run(rubric_score("q", "r", item, j2))["R_rubric"] == 0.5


def test_composite_by_hand():
    completion = (f'<think>go</think>{CALL}{CALL}{CALL}<answer><cite id="a">The tower was completed in 1889</cite>'
                  "</answer>")
    replies = ['{"score": 2}', '{"support": "full", "relevant": true}']
    out = run(rubric_composite("q", completion, [{"id": "R1", "type": "factual", "description": "year",
                                                  "weight": 1}], STORE, Judge(ReplayLLM(replies))))
    # one valid cite at position 0: v=1, m=1, n=1/6, d = 0.2*center(0)=0 -> R_fmt = 0.7 + 0.2/6
    r_fmt = 1.0 * (0.7 + 0.1 * 0.0 + 0.2 / 6)
    assert out["R_fmt"] == pytest.approx(r_fmt)
    assert out["R_cite"] == pytest.approx(0.6 * 1.0 + 0.4 * r_fmt)
    assert out["R"] == pytest.approx(0.5 * 0.5 + 0.2 * 1.0 + 0.2 * out["R_cite"] + 0.1 * 0.5)


def test_extractive_judge_says_so_and_prefers_relevant_reports(embedder):
    judge = Judge(None, embedder.encode)
    rub = [{"id": "R1", "type": "factual", "description": "The Eiffel Tower was completed in 1889", "weight": 1}]
    good = run(rubric_score("q", "The Eiffel Tower was completed in 1889 in Paris.", rub, judge))
    bad = run(rubric_score("q", "Bananas grow in tropical climates.", rub, judge))
    assert good["judge"] == "extractive" and good["R_rubric"] > bad["R_rubric"]
    assert good["R_rubric"] in (0.0, 0.25, 0.5, 0.75, 1.0)


def test_extractive_citation_judge_runs_offline():
    judge = Judge(None, bow_embed)
    text = '<cite id="a">The Eiffel Tower was completed in 1889</cite>. <cite id="c">Bananas are yellow fruit</cite>.'
    r = run(citation_reward("q", text, STORE, judge))
    assert r.claims[0]["recall"] > r.claims[1]["recall"] and r.judge == "extractive"


def test_report_structure_counts():
    s = report_structure("# T\n## A\nX is y [a]. Z is w [a, zz].\n", {"a": "doc1"})
    assert (s["sections"], s["citations"], s["cited_ids"], s["unique_sources"]) == (2, 3, 2, 1)
    assert s["cited_id_validity"] == 0.5 and s["unknown_cited_ids"] == ["zz"]
