"""R_ans (000 Eq. 25–31): execution, synthesis, partial credit, judge failures, TRL adapter."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import zlib

import numpy as np
import pytest

from deepr.llm.replay import ReplayLLM
from deepr.rewards.answer_reward import answer_terms, answer_terms_batch, greedy_match, harmonic_exec, score_answer
from deepr.rewards.judges import Judge, RewardInputError
from deepr.rewards.trl_adapters import AnswerRewardFn, parse_answerer

VECS = {
    "alpha beta": (1, 0, 0, 0), "delta zeta": (0, 1, 0, 0),
    "Alpha beta gamma.": (0.8, 0.6, 0, 0), "Omega omega.": (0, 0, 1, 0),
    "gamma ray": (0, 0, 0.6, 0.8), "Gamma ray burst.": (0, 0, 0, 1),
}


def fake_embed(texts):
    return np.array([VECS[t] for t in texts], dtype=np.float32)


def bow_embed(texts):
    """Any text: hashed bag of words (deterministic), for tests that do not hand-work numbers."""
    out = np.zeros((len(texts), 64), dtype=np.float32)
    for i, t in enumerate(texts):
        for w in re.findall(r"[a-z0-9]+", t.lower()):
            out[i, zlib.crc32(w.encode()) % 64] += 1.0
        out[i, 0] += 1e-3
    return out / np.linalg.norm(out, axis=1, keepdims=True)


PLAN = {"nodes": [
    {"id": "S1", "type": "search", "query": "q one"},
    {"id": "S2", "type": "search", "query": "q two"},
    {"id": "A1", "type": "aggregate", "need": "first", "key_points": ["alpha beta", "delta zeta"], "inputs": ["S1"]},
    {"id": "A2", "type": "aggregate", "need": "second", "key_points": ["gamma ray"], "inputs": ["S2"]},
    {"id": "ANS", "type": "answer", "need": "what happened", "inputs": ["A1", "A2"]},
]}
OUTPUTS = {"A1": "Alpha beta gamma. Omega omega.", "A2": "Gamma ray burst [N2-R1]."}
ANSWER = "Alpha gamma ray."
RUBRICS = [{"id": "R1", "type": "factual", "description": "mentions alpha", "weight": 0.25},
           {"id": "R2", "type": "logical", "description": "links gamma and ray", "weight": 0.75}]
R_A1 = 0.5 * 0.4 + 0.5 * 0.5   # K_emb 0.4 (one-to-one matching), K_lex 0.5
R_A2 = 0.5 * 0.8 + 0.5 * 1.0
R_EXEC = 2 / (1 / (1 + R_A1) + 1 / (1 + R_A2)) - 1


def run(coro):
    return asyncio.run(coro)


def test_greedy_matching_is_one_to_one():
    # both key points prefer sentence 0; the second must take sentence 1 (0.0), not reuse 0.6
    assert greedy_match(np.array([[0.8, 0.0], [0.6, 0.0]])) == pytest.approx(0.8)
    assert greedy_match(np.zeros((2, 0))) == 0.0


def test_harmonic_mean_ends_and_middle():
    assert harmonic_exec([0.0, 0.0, 0.0]) == 0.0
    assert harmonic_exec([1.0, 1.0]) == pytest.approx(1.0)
    assert harmonic_exec([0.0, 1.0]) == pytest.approx(1 / 3)  # below the arithmetic mean 0.5


def test_execution_terms_by_hand():
    t = answer_terms(PLAN, OUTPUTS, ANSWER, fake_embed)
    assert t.K_emb == {"A1": pytest.approx(0.4), "A2": pytest.approx(0.8)}
    assert t.K_lex == {"A1": 0.5, "A2": 1.0}  # the [N2-R1] marker is stripped before tokenising
    assert t.r_v == {"A1": pytest.approx(R_A1), "A2": pytest.approx(R_A2)}
    assert t.R_exec == pytest.approx(R_EXEC)
    # U_branch: A1 shares {alpha, gamma} of 4 tokens, A2 {gamma, ray} of 3
    assert t.U_branch == pytest.approx((2 / 4 + 2 / 3) / 2)
    assert t.answer_reward is None and t.partial is None  # J_rub still pending


def test_full_reward_with_recorded_judge_replies():
    judge = Judge(ReplayLLM(['{"score": 3}', 'Sure: {"score": 2}']))
    r = run(score_answer(PLAN, OUTPUTS, ANSWER, RUBRICS, fake_embed, judge, question="q?"))
    j = (0.25 * 0.75 + 0.75 * 0.5) / 1.0
    assert r.J_rub == pytest.approx(j)
    assert r.R_synth == pytest.approx(0.5 * j + 0.5 * (2 / 4 + 2 / 3) / 2)
    assert r.answer_reward == pytest.approx(0.5 * R_EXEC + 0.5 * r.R_synth)
    assert r.judge.startswith("llm:replay")


def test_partial_credit_missing_node_scores_zero_and_no_synthesis():
    judge = Judge(ReplayLLM([]))  # any judge call would fail: none may happen
    r = run(score_answer(PLAN, {"A1": OUTPUTS["A1"]}, ANSWER, RUBRICS, fake_embed, judge))
    assert r.partial == "missing_nodes" and r.r_v["A2"] == 0.0
    assert r.R_exec == pytest.approx(2 / (1 / (1 + R_A1) + 1) - 1)
    assert r.R_synth == 0.0 and r.answer_reward == pytest.approx(0.5 * r.R_exec)
    assert "A2" in r.errors[0]


def test_partial_credit_unparsed_answer_and_no_aggregate():
    judge = Judge(ReplayLLM([]))
    r = run(score_answer(PLAN, OUTPUTS, None, RUBRICS, fake_embed, judge))
    assert r.partial == "answer_unparsed" and r.answer_reward == pytest.approx(0.5 * R_EXEC)
    r = run(score_answer(PLAN, {"A1": None}, ANSWER, RUBRICS, fake_embed, judge))
    assert r.partial == "no_aggregate_parsed" and r.answer_reward == 0.0


def test_invalid_plan_scores_zero():
    bad = {"nodes": [{"id": "A1", "type": "aggregate", "need": "x", "inputs": ["A1"]}]}
    r = run(score_answer(bad, {}, "y", RUBRICS, fake_embed, Judge(ReplayLLM([]))))
    assert r.answer_reward == 0.0 and not r.valid and r.partial == "invalid_plan" and r.errors


def test_judge_failure_is_recorded_not_zero():
    judge = Judge(ReplayLLM(["no json here", "still none", "nope"]))
    r = run(score_answer(PLAN, OUTPUTS, ANSWER, RUBRICS[:1], fake_embed, judge))
    assert r.answer_reward is None and r.J_rub is None and r.R_synth is None
    assert "R1" in r.failure and "gave up after 3 attempts" in r.failure
    assert r.R_exec == pytest.approx(R_EXEC)  # the deterministic parts are still reported


def test_missing_rubric_weight_is_a_clear_error():
    with pytest.raises(RewardInputError, match="no 'weight'"):
        run(score_answer(PLAN, OUTPUTS, ANSWER, [{"id": "R9", "type": "factual", "description": "d"}],
                         fake_embed, Judge(ReplayLLM([]))))


def test_node_without_key_points_uses_its_need_and_batch_embeds_once():
    plan = json.loads(json.dumps(PLAN))
    plan["nodes"][3]["key_points"] = []
    calls = []

    def counting(texts):
        calls.append(texts)
        return bow_embed(texts)

    rows = answer_terms_batch([(plan, OUTPUTS, ANSWER), (PLAN, OUTPUTS, ANSWER)], counting)
    assert len(calls) == 1
    assert rows[0].K_lex["A2"] == 0.0  # need "second" is not in "Gamma ray burst"
    assert rows[1].K_lex["A2"] == 1.0


def test_real_embedder_rewards_covering_the_key_points(embedder):
    plan = {"nodes": [{"id": "S1", "type": "search", "query": "Eiffel Tower"},
                      {"id": "A1", "type": "aggregate", "need": "history",
                       "key_points": ["year the tower was completed", "who designed the tower"], "inputs": ["S1"]},
                      {"id": "ANS", "type": "answer", "need": "summary", "inputs": ["A1"]}]}
    good = answer_terms(plan, {"A1": "The tower was completed in 1889. Gustave Eiffel's company designed it."},
                        "x", embedder.encode)
    bad = answer_terms(plan, {"A1": "Bananas are rich in potassium. Football is popular."}, "x", embedder.encode)
    assert good.r_v["A1"] > bad.r_v["A1"] + 0.2


def test_trl_answer_adapter_parses_waves_and_final_answer():
    completion = (f'<think>wave 1</think>{json.dumps(OUTPUTS)}\n'
                  f'<think>final</think><answer>{ANSWER}</answer>')
    outs, ans = parse_answerer(completion, PLAN)
    assert outs == OUTPUTS and ans == ANSWER
    fn = AnswerRewardFn(Judge(None, bow_embed), bow_embed)
    assert inspect.iscoroutinefunction(fn.__call__)  # how TRL decides to await a reward function
    logged = {}
    res = run(fn(prompts=["p"] * 3, completions=[completion, "<answer>only an answer</answer>", completion],
                 plan=[PLAN, PLAN, PLAN], rubrics=[RUBRICS, RUBRICS, None],
                 log_metric=lambda k, v: logged.__setitem__(k, v)))
    assert 0.0 < res[0] <= 1.0
    assert res[1] == 0.0  # no aggregate parsed
    assert res[2] is None  # no rubrics: undefined, not 0
    assert "answer/R_exec" in logged
