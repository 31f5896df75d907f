"""AgentCPM atomic rewards, DeepResearch Bench RACE scoring and the FACT citation check."""

from __future__ import annotations

import asyncio
import json

import pytest

from deepr.io import RecordError
from deepr.llm.replay import ReplayLLM
from deepr.rewards.agentcpm import (
    count_tokens,
    language_consistency,
    outline_reward,
    paragraph_reward,
    terminate_reward,
)
from deepr.rewards.fact import FactResult, extract_pairs, fact_check, fact_summary
from deepr.rewards.judges import Judge
from deepr.rewards.race import (
    RaceCriteria,
    RaceTask,
    clean_article,
    load_race_tasks,
    race_from_scores,
    race_score,
    race_summary,
)
from test_rewards_answer import bow_embed


def run(coro):
    return asyncio.run(coro)


# --- AgentCPM ----------------------------------------------------------------------------


def test_outline_subsection_count_and_language():
    ok = "## Background\n## Mechanisms\n## Risks\n"
    assert outline_reward(ok, "How do vaccines work?") == {"outline_reward": 1.0, "sections": 3.0,
                                                          "count_ok": 1.0, "language": 1.0}
    assert outline_reward(["Only one"], "query")["outline_reward"] == 0.0
    assert outline_reward([f"S{i}" for i in range(8)], "query")["count_ok"] == 0.0
    assert outline_reward([{"title": "A"}, {"title": "B"}], "q")["sections"] == 2.0
    zh = outline_reward("## 背景\n## 机制\n", "How do vaccines work?")
    assert zh["language"] == 0.0 and zh["outline_reward"] == 0.0


def test_language_consistency_by_character_share():
    assert language_consistency("abcd 中文", "english query") == pytest.approx(4 / 6)
    assert language_consistency("1234", "query") == 1.0  # no letters: nothing to disagree with


def test_paragraph_reward_length_citations_and_hallucination():
    body = " ".join(["word"] * 120)
    para = f"{body} [N1-R1] and more [N1-R2]."
    r = paragraph_reward(para, "query", retrieved_ids=["N1-R1", "N1-R2", "N1-R3"], teacher_ids=["N1-R1", "N1-R3"])
    assert r["length_ok"] == 1.0 and r["citations"] == 2.0
    assert r["citation_f1"] == pytest.approx(0.5)  # 1 shared of 2 and 2
    assert r["paragraph_reward"] == pytest.approx(0.5 * 1.0 + 0.5 * 0.5)
    fake = paragraph_reward(para + " [N9-R9]", "query", ["N1-R1", "N1-R2"], ["N1-R1"])
    # Issue 15.5 (changed assertion): a hallucinated id zeroes citation precision only (003 App. A.6.1),
    # the length / count / language term still counts.
    assert fake["hallucinated_ids"] == 1.0 and fake["citation_precision"] == 0.0 and fake["basic"] == 1.0
    assert fake["paragraph_reward"] == pytest.approx(0.5)
    short = paragraph_reward("Too short.", "query", [], [])
    assert short["length_ok"] == 0.0 and short["citation_f1"] == 1.0 and short["paragraph_reward"] == 0.5
    many = " ".join(f"[N1-R{i}]" for i in range(13))
    assert paragraph_reward(body + many, "q", [f"N1-R{i}" for i in range(13)], [])["count_ok"] == 0.0
    assert count_tokens("深度研究 agent") == 5


def test_terminate_reward():
    assert terminate_reward("<decision>TERMINATE</decision>", "terminate") == 1.0
    assert terminate_reward("Expand section 2", "TERMINATE") == 0.0
    assert terminate_reward("???", "EXPAND") == 0.0
    with pytest.raises(ValueError, match="cannot read a decision"):
        terminate_reward("TERMINATE", "")


# --- RACE ----------------------------------------------------------------------------------

CRITERIA = {"id": 1, "prompt": "Compare solar and wind power.",
            "dimension_weight": {"comprehensiveness": 0.6, "insight": 0.4},
            "criterions": {"comprehensiveness": [{"criterion": "Covers costs", "explanation": "", "weight": 0.5},
                                                 {"criterion": "Covers capacity", "explanation": "", "weight": 0.5}],
                           "insight": [{"criterion": "Explains trade-offs", "explanation": "why", "weight": 1.0}]}}
TASK = RaceTask("1", CRITERIA["prompt"], RaceCriteria.model_validate(CRITERIA), "Reference article text.")


def test_race_score_by_hand():
    scores = {"comprehensiveness-1": (8, 4), "comprehensiveness-2": (6, 4), "insight-1": (5, 5)}
    r = race_from_scores(TASK, scores)
    assert r.target_avg == {"comprehensiveness": 7.0, "insight": 5.0}
    assert r.reference_avg == {"comprehensiveness": 4.0, "insight": 5.0}
    assert r.dims == {"comprehensiveness": pytest.approx(7 / 11), "insight": 0.5}
    assert (r.T, r.R) == (pytest.approx(0.6 * 7 + 0.4 * 5), pytest.approx(0.6 * 4 + 0.4 * 5))
    assert r.score == pytest.approx(6.2 / (6.2 + 4.4))
    tie = race_from_scores(TASK, {k: (0, 0) for k in scores})  # issue 19: both zero scores 0, as DRB does
    assert tie.score == 0.0 and tie.dims == {"comprehensiveness": 0.0, "insight": 0.0} and "0" in tie.notes[0]
    s = race_summary([r, tie, type(r)("2", None, failure="judge failed")])
    assert s["overall"] == pytest.approx(r.score / 2) and s["failed"] == 1


def test_race_reads_benchmark_files_and_joins_by_prompt(tmp_path):
    crit = tmp_path / "criteria.jsonl"
    ref = tmp_path / "reference.jsonl"
    crit.write_text(json.dumps(CRITERIA) + "\n")
    ref.write_text(json.dumps({"id": 99, "prompt": CRITERIA["prompt"], "article": "Ref."}) + "\n")
    tasks = load_race_tasks(crit, ref)
    assert tasks["1"].reference == "Ref."
    bad = dict(CRITERIA, dimension_weight={"insight": 1.0})
    crit.write_text(json.dumps(bad) + "\n")
    with pytest.raises(RecordError, match="criteria.jsonl:1 field 'dimension_weight'"):
        load_race_tasks(crit, ref)


def test_race_judge_call_strips_citations_and_checks_every_criterion():
    reply_missing = '{"scores": {"comprehensiveness-1": {"article_1": 8, "article_2": 4}}}'
    reply_ok = json.dumps({"scores": {"comprehensiveness-1": {"article_1": 8, "article_2": 4},
                                      "comprehensiveness-2": {"article_1": 6, "article_2": 4},
                                      "insight-1": {"article_1": 5, "article_2": 5}}})
    llm = ReplayLLM([reply_missing, reply_ok])
    target = "Solar is cheap [N1-R2]. Wind too [3].\n\n## References\n[1] http://example.org\n"
    r = run(race_score(TASK, target, Judge(llm)))
    assert r.score == pytest.approx(6.2 / 10.6)
    prompt = llm.calls[0][1][1]["content"]
    assert "[N1-R2]" not in prompt and "example.org" not in prompt and "0.5" not in prompt
    assert "missing scores for: comprehensiveness-2, insight-1" in llm.calls[1][1][-1]["content"]


def test_race_empty_target_and_extractive_judge():
    r = run(race_score(TASK, "## References\n[1] x", Judge(ReplayLLM([]))))
    assert r.score == 0.0 and "empty target" in r.notes[0]
    ext = run(race_score(TASK, "Costs and capacity of solar and wind compared, with trade-offs.",
                         Judge(None, bow_embed)))
    assert ext.judge == "extractive" and 0.0 < ext.score < 1.0


def test_clean_article():
    assert clean_article("A [1] claim.\n# Sources\n- [1] http://x\n") == "A claim."


# --- FACT ----------------------------------------------------------------------------------

STORE = {"N1-R1": {"doc_id": "d1", "text": "The Eiffel Tower was completed in 1889.", "url": "http://a"},
         "N1-R2": {"doc_id": "d2", "text": "Bananas are yellow.", "url": "http://b"},
         "N2-R1": {"doc_id": "d3", "text": "", "url": None}}


def test_fact_pairs_and_verdicts():
    report = ("The tower was completed in 1889 [N1-R1, N1-R2]. It is iron [N2-R1]. "
              "See [the site](http://a) for more. The tower was completed in 1889 [N1-R1].")
    pairs = extract_pairs(report, STORE)
    assert [(p.statement, p.source) for p in pairs] == [
        ("The tower was completed in 1889.", "N1-R1"), ("The tower was completed in 1889.", "N1-R2"),
        ("It is iron.", "N2-R1"), ("See the site for more.", "http://a")]
    llm = ReplayLLM(['{"verdict": "supported"}', '{"verdict": "Unsupported"}', '{"verdict": "supported"}'])
    r = run(fact_check(report, STORE, Judge(llm)))
    assert (r.supported, r.unsupported, r.unknown) == (2, 1, 1)  # N2-R1 has no text: unknown
    assert r.accuracy == pytest.approx(2 / 3) and len(llm.calls) == 3


def test_fact_summary_accuracy_and_effective_citations():
    a = FactResult(pairs=[1, 2, 3], supported=2, unsupported=1)
    b = FactResult(pairs=[1], supported=0, unsupported=1)
    c = FactResult()  # no citations
    d = FactResult(pairs=[1], failure="fact judge failed: timeout")
    s = fact_summary([a, b, c, d])
    assert s["citation_accuracy"] == pytest.approx(2 / 4)
    assert s["effective_citations"] == pytest.approx(2 / 2) and s["reports_with_citations"] == 2
    assert s["failed"] == 1


def test_fact_judge_failure_is_not_a_zero():
    r = run(fact_check("X was built in 1889 [N1-R1].", STORE, Judge(ReplayLLM(["?", "?", "?"]))))
    assert r.failure and r.accuracy is None
    ext = run(fact_check("The Eiffel Tower was completed in 1889 [N1-R1]. Bananas are blue [N1-R1].",
                         STORE, Judge(None, bow_embed)))
    assert [p.verdict for p in ext.pairs] == ["supported", "unsupported"]
