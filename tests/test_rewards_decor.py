"""DECOR (001 Eq. 2–3, 6): EM / F1 normalisation, LJ, R_team, format gate, advantages."""

from __future__ import annotations

import asyncio

import pytest

from deepr.llm.replay import ReplayLLM
from deepr.rewards.decor import (
    exact_match,
    f1_score,
    format_ok,
    llm_judge,
    r_team,
    r_total,
    role_advantages,
    role_content,
    role_judge,
)
from deepr.rewards.judges import Judge
from deepr.text import squad_normalize
from test_rewards_answer import bow_embed


def run(coro):
    return asyncio.run(coro)


def test_squad_normalisation_articles_punctuation_case_space():
    assert squad_normalize("  The Princess, and the   Frog! ") == "princess and frog"
    assert squad_normalize("An apple a day") == "apple day"
    assert squad_normalize("theatre") == "theatre"  # only whole-word articles go


def test_exact_match_against_several_gold_answers():
    assert exact_match("the Pacific Ocean.", ["Atlantic", "Pacific Ocean"]) == 1.0
    assert exact_match("Pacific", ["Pacific Ocean"]) == 0.0
    assert exact_match('"Einstein"', "einstein") == 1.0


def test_f1_by_hand_and_max_over_gold():
    # pred tokens [cat, sat, on, mat] vs gold [cat, sat]: P = 2/4, R = 1 -> F1 = 2/3
    assert f1_score("The cat sat on a mat.", ["a cat sat"]) == pytest.approx(2 / 3)
    assert f1_score("The cat sat on a mat.", ["dog", "cat sat on the mat"]) == 1.0
    # repeated tokens count as a bag: pred [paris, paris] vs gold [paris] -> P .5, R 1
    assert f1_score("Paris Paris", "Paris") == pytest.approx(2 / 3)
    assert f1_score("anything", []) == 0.0
    assert f1_score("the", "a") == 1.0  # both normalise to nothing
    assert f1_score("x", "the") == 0.0


def test_llm_judge_yes_no_and_failure():
    judge = Judge(ReplayLLM(['{"verdict": "yes"}', '<think>no way</think>{"verdict": "NO"}']))
    assert run(llm_judge("q", "Paris", ["Paris"], judge)).value == 1.0
    assert run(llm_judge("q", "Lyon", ["Paris"], judge)).value == 0.0
    bad = Judge(ReplayLLM(["maybe", "perhaps", "dunno"]))
    v = run(llm_judge("q", "Rome", ["Paris"], bad))
    assert not v.ok and v.value is None and "gave up" in v.reason


def test_extractive_equivalence():
    judge = Judge(None, bow_embed)
    assert run(llm_judge("q", "It is the Pacific Ocean", ["Pacific Ocean"], judge)).value == 1.0
    assert run(llm_judge("q", "Atlantic", ["Pacific Ocean"], judge)).value == 0.0


def test_team_and_total_reward():
    assert r_team(0.5, 1.0) == pytest.approx(0.75)
    assert r_total(True, 0.75, 1) == pytest.approx(0.6 * 0.75 + 0.4)
    assert r_total(True, 0.75, -1) == pytest.approx(0.6 * 0.75 - 0.4)
    assert r_total(False, 1.0, 1) == -1.0
    with pytest.raises(ValueError, match="must be \\+1 or -1"):
        r_total(True, 0.5, 0.3)


def test_format_gate_per_role():
    assert format_ok("planner", "<think>why</think><search>Kyoto country</search>") == (True, "")
    ok, why = format_ok("planner", "<think>x</think><search>q</search> extra words")
    assert not ok and "outside" in why
    assert not format_ok("filter", "<think>x</think>")[0]
    assert not format_ok("answerer", "<think>x</think><answer> </answer>")[0]
    assert role_content("answerer", "<think>x</think><answer> Japan </answer>") == "Japan"
    with pytest.raises(ValueError, match="unknown role"):
        format_ok("critic", "")


def test_role_judge_llm_and_extractive():
    llm_j = Judge(ReplayLLM(['{"verdict": "NO"}']))
    assert run(role_judge(llm_j, "filter", "q", "docs", "<think/>", "gold")).value == -1
    ext = Judge(None, bow_embed)
    good = "<think>read the docs</think><answer>Japan</answer>"
    assert run(role_judge(ext, "answerer", "Where is Kyoto?", "Kyoto is in Japan.", good, "Japan")).value == 1
    assert run(role_judge(ext, "answerer", "Where is Kyoto?", "", "Japan", "Japan")).value == -1  # broken format
    planner = "<think>need the country</think><search>Kyoto city country</search>"
    q = "Which country is Kyoto in?"
    assert run(role_judge(ext, "planner", q, "", planner, "Japan")).value == 1
    assert run(role_judge(ext, "planner", q, "Kyoto city country", planner, "Japan")).value == -1  # a repeat


def test_role_wise_group_normalisation_by_hand():
    rewards = [1.0, 0.0, 0.2, 0.5, 0.5, -1.0]
    roles = ["planner", "planner", "filter", "planner", "planner", "answerer"]
    groups = ["q1", "q1", "q1", "q2", "q2", "q2"]
    adv = role_advantages(rewards, roles, groups, eps=0.0 + 1e-6)
    # (q1, planner): mean .5, population std .5 -> ±1 (up to eps)
    assert adv[0] == pytest.approx(1.0, rel=1e-5) and adv[1] == pytest.approx(-1.0, rel=1e-5)
    # singleton groups and identical rewards give 0, never a division by zero
    assert adv[2] == 0.0 and adv[3] == 0.0 and adv[4] == 0.0 and adv[5] == 0.0
    with pytest.raises(ValueError, match="differ in length"):
        role_advantages([1.0], ["planner", "filter"], ["q"])
