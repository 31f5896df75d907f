"""R_plan (000 Eq. 17–24): every sub-term by hand on a 3-search / 2-aggregate graph."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deepr.rewards.judges import RewardInputError
from deepr.rewards.plan_reward import plan_reward, plan_rewards, plan_structure
from deepr.text import diminishing
from deepr.rewards.trl_adapters import PlanRewardFn, last_plan

# Hand-picked unit vectors, so every cosine below is a number you can check on paper.
VECS = {
    "u1": (1, 0, 0, 0), "u2": (0, 1, 0, 0),
    "qa": (0.6, 0.8, 0, 0), "qb": (0.8, 0, 0.6, 0), "qc": (0, 0, 0, 1),
    "kp1": (0, 0.6, 0.8, 0), "na1": (1, 0, 0, 0), "ka1": (0, 0, 1, 0),
    "na2": (0, 0.28, 0.96, 0), "final": (0, 1, 0, 0),
    "qa kp1": (0, 0, 0, 1), "ka1 na1": (0.5 ** 0.5, 0, 0.5 ** 0.5, 0),
}


class FakeEmbed:
    """Returns the fixed vector of each known string; counts calls; refuses unknown text."""

    def __init__(self, table=VECS):
        self.table, self.calls = table, []

    def __call__(self, texts):
        self.calls.append(list(texts))
        return np.array([self.table[t] for t in texts], dtype=np.float32)


def graph():
    return {"nodes": [
        {"id": "S1", "type": "search", "query": "qa", "key_points": ["kp1"]},
        {"id": "S2", "type": "search", "query": "qb"},
        {"id": "S3", "type": "search", "query": "qc"},
        {"id": "A1", "type": "aggregate", "need": "na1", "key_points": ["ka1"], "inputs": ["S1", "S2"]},
        {"id": "A2", "type": "aggregate", "need": "na2", "inputs": ["S1", "S3"]},
        {"id": "ANS", "type": "answer", "need": "final", "inputs": ["A1", "A2"]},
    ]}


RUBRICS = [{"id": "R1", "type": "factual", "description": "u1", "weight": 1.0},
           {"id": "R2", "type": "logical", "description": "u2", "weight": 0.5}]


def test_hand_worked_three_search_two_aggregate_graph():
    r = plan_reward(graph(), RUBRICS, FakeEmbed())
    assert r.valid and r.errors == []
    # C_rub: u1 best = na1 (1.0); u2 best = qa (0.8) -- the answer node "final" (1.0) is excluded.
    assert r.C_rub == pytest.approx((1.0 * 1.0 + 0.5 * 0.8) / 1.5)
    # C_search over queries only: u1 -> qb 0.8, u2 -> qa 0.8.
    assert r.C_search == pytest.approx(0.8)
    # D_search: pairs qa·qb = 0.48, qa·qc = 0, qb·qc = 0 -> 1 - 0.16.
    assert r.D_search == pytest.approx(0.84)
    assert r.Q_search == pytest.approx(0.5 * 0.8 + 0.5 * 0.84)
    # B_synth: f(2) = 0.5 times d_par. A1's node text "ka1 na1" (key points, then need) is
    # (1, 0, 1, 0)/√2; A2's is na2: d_par = 1 - 0.96/√2.
    assert r.d_par == pytest.approx(1 - 0.96 / np.sqrt(2), abs=1e-6)
    assert r.B_synth == pytest.approx(0.5 * (1 - 0.96 / np.sqrt(2)), abs=1e-6)
    # I_cross: S1 feeds A1 and A2 (r_fan 1/3); both aggregates have 2 parents (r_int 1).
    assert (r.r_fan, r.r_int) == (pytest.approx(1 / 3), 1.0)
    assert r.I_cross == pytest.approx(2 / 3)
    assert r.B_search == pytest.approx(2 / 3)
    e_graph = 0.4 * r.B_synth + 0.4 * 2 / 3 + 0.2 * 2 / 3
    assert r.E_graph == pytest.approx(0.46424, abs=1e-5) and r.E_graph == pytest.approx(e_graph, abs=1e-6)
    assert r.plan_reward == pytest.approx(0.4 * 2.8 / 3 + 0.3 * 0.82 + 0.3 * e_graph, abs=1e-6)


def test_diminishing_returns_function():
    assert [diminishing(k) for k in (0, 1, 2, 4)] == [0.0, 0.0, 0.5, 0.75]


def test_single_search_query_gives_zero_distinctness_and_breadth():
    plan = {"nodes": [{"id": "S1", "type": "search", "query": "qa"},
                      {"id": "A1", "type": "aggregate", "need": "na1", "inputs": ["S1"]},
                      {"id": "ANS", "type": "answer", "need": "final", "inputs": ["A1"]}]}
    r = plan_reward(plan, RUBRICS, FakeEmbed())
    assert r.D_search == 0.0 and r.B_search == 0.0
    # one answer parent: d_par = 1 but f(1) = 0, so no synthesis breadth
    assert r.d_par == 1.0 and r.B_synth == 0.0
    assert r.r_fan == 0.0 and r.r_int == 0.0


def test_negative_cosines_clamp_to_zero():
    table = {**VECS, "qa": (-1, 0, 0, 0), "qb": (1, 0, 0, 0)}
    plan = graph()
    plan["nodes"] = [n for n in plan["nodes"] if n["id"] != "S3"]
    plan["nodes"][3]["inputs"] = ["S1"]  # A2 now reads S1 only
    r = plan_reward(plan, RUBRICS, FakeEmbed(table))
    assert r.D_search == 1.0  # cos(qa, qb) = -1 clamps to 0


def test_invalid_graph_scores_zero_with_the_validator_errors():
    plan = graph()
    plan["nodes"][0]["inputs"] = ["A1"]  # a search node with inputs, and a cycle
    r = plan_reward(plan, RUBRICS, FakeEmbed())
    assert r.plan_reward == 0.0 and not r.valid
    assert any("S1" in e for e in r.errors)
    assert plan_reward("not json {", RUBRICS, FakeEmbed()).valid is False


def test_missing_weight_and_empty_rubrics_are_clear_errors():
    with pytest.raises(RewardInputError, match="R2 has no 'weight'"):
        plan_reward(graph(), [RUBRICS[0], {"id": "R2", "type": "logical", "description": "u2"}], FakeEmbed())
    with pytest.raises(RewardInputError, match="no rubric items"):
        plan_reward(graph(), [], FakeEmbed())
    with pytest.raises(RewardInputError, match="every rubric weight is 0"):
        plan_reward(graph(), [{**RUBRICS[0], "weight": 0}], FakeEmbed())


def test_negative_rubric_weight_counts_by_magnitude_in_coverage():
    neg = [RUBRICS[0], {**RUBRICS[1], "weight": -0.5}]
    assert plan_reward(graph(), neg, FakeEmbed()).C_rub == pytest.approx(2.8 / 3)


def test_batch_embeds_once_and_matches_single_calls():
    emb = FakeEmbed()
    batch = plan_rewards([(graph(), RUBRICS), (graph(), RUBRICS[:1]), ("{}", RUBRICS)], emb)
    assert len(emb.calls) == 1 and len(emb.calls[0]) == len(set(emb.calls[0]))
    assert batch[0].plan_reward == pytest.approx(plan_reward(graph(), RUBRICS, FakeEmbed()).plan_reward)
    assert batch[1].C_rub == pytest.approx(1.0) and not batch[2].valid


def test_structure_statistics():
    s = plan_structure(graph())
    assert (s["nodes"], s["edges"], s["search_nodes"], s["aggregate_nodes"], s["waves"]) == (6, 6, 3, 2, 1)
    assert plan_structure({"nodes": []})["plan_valid"] is False


def test_real_embedder_prefers_a_plan_that_covers_the_rubric(embedder):
    rubrics = [{"id": "R1", "type": "factual", "description": "The Eiffel Tower was completed in 1889", "weight": 1},
               {"id": "R2", "type": "factual", "description": "Its height is about 330 metres", "weight": 1}]

    def plan(q1, q2):
        return {"nodes": [{"id": "S1", "type": "search", "query": q1},
                          {"id": "S2", "type": "search", "query": q2},
                          {"id": "A1", "type": "aggregate", "need": "combine facts", "inputs": ["S1", "S2"]},
                          {"id": "ANS", "type": "answer", "need": "answer", "inputs": ["A1"]}]}

    good = plan_reward(plan("Eiffel Tower construction completion year", "Eiffel Tower height in metres"),
                       rubrics, embedder.encode)
    bad = plan_reward(plan("banana bread recipe", "football transfer news"), rubrics, embedder.encode)
    assert good.C_rub > bad.C_rub + 0.2 and good.plan_reward > bad.plan_reward
    assert 0.0 <= bad.plan_reward <= good.plan_reward <= 1.0


def test_trl_adapter_scores_the_revised_plan_and_logs_components():
    turn1 = {"nodes": [{"id": "S1", "type": "search", "query": "qa"}]}  # invalid on its own
    completion = f"<think>draft</think>{json.dumps(turn1)} results... revised: {json.dumps(graph())}"
    assert last_plan(completion)["nodes"][-1]["id"] == "ANS"
    logged = {}
    fn = PlanRewardFn(FakeEmbed())
    # the keyword arguments GRPOTrainer passes besides the dataset columns
    out = fn(prompts=["p"] * 3, completions=[completion, "no plan at all", completion], completion_ids=[[1]] * 3,
             rubrics=[RUBRICS, RUBRICS, None], trainer_state=None, log_extra=lambda c, v: None,
             log_metric=lambda k, v: logged.__setitem__(k, v))
    assert out[0] == pytest.approx(plan_reward(graph(), RUBRICS, FakeEmbed()).plan_reward)
    assert out[1] == 0.0      # unparseable plan: invalid, reward 0
    assert out[2] is None     # no rubrics: reward undefined, TRL ignores it
    assert logged["plan/valid"] == 0.5 and "plan/C_rub" in logged
    chat = [{"role": "assistant", "content": json.dumps(graph())}]
    assert fn(prompts=["p"], completions=[chat], rubrics=[RUBRICS])[0] == pytest.approx(out[0])


def test_repeated_input_cannot_raise_the_graph_terms():
    # Issue 15.1: repeating an input made r_fan / r_int count it twice (I_cross 0 -> 0.5).
    from deepr.records import Plan
    from deepr.rewards.plan_reward import _graph_terms
    from deepr.text import Vectors

    g = graph()
    g["nodes"][3]["inputs"] = ["S1"]          # A1 <- S1 only
    g["nodes"][4]["inputs"] = ["S2", "S3"]    # A2 integrates two searches; nothing fans out
    base = plan_reward(g, RUBRICS, FakeEmbed())
    assert base.valid and (base.r_fan, base.r_int) == (0.0, 0.5)
    g["nodes"][3]["inputs"] = ["S1", "S1"]
    r = plan_reward(g, RUBRICS, FakeEmbed())
    assert not r.valid and r.plan_reward == 0.0
    assert any("lists input 'S1' more than once" in e for e in r.errors)
    # and the terms themselves count distinct parents/children even on an unvalidated plan
    plan = Plan.model_validate(g)
    terms = _graph_terms(plan, Vectors(FakeEmbed(), ["ka1 na1", "na2"]))
    assert (terms["r_fan"], terms["r_int"], terms["I_cross"]) == (0.0, 0.5, 0.25)


def test_rollouts_sharing_texts_embed_only_what_is_new():
    """R_plan embeds the texts its terms read: each field, and the joined node text of the answer's
    aggregate parents (d_par). A search node's joined text is read by no term, so it is not embedded."""
    emb = FakeEmbed({**VECS, "kp2": (0, 0, 0.6, 0.8)})
    first = plan_reward(graph(), RUBRICS, emb)
    texts = set(emb.calls[0])
    assert "qa kp1" not in texts and {"ka1 na1", "na2"} <= texts
    other = graph()
    other["nodes"][0]["key_points"] = ["kp2"]
    second = plan_reward(other, RUBRICS, emb)
    assert set(emb.calls[1]) - texts == {"kp2"}
    assert first.valid and second.valid and first.d_par == second.d_par


def test_d_par_reads_each_parents_node_text():
    """App. A.5: d_par is one minus the mean pairwise cos⁺ among the parents' node texts (a node's
    fields joined), not a mix of its field vectors."""
    from deepr.records import Plan
    from deepr.rewards.plan_reward import parent_distinctness
    from deepr.text import Vectors

    plan = Plan.model_validate(graph())
    a1, a2 = plan.nodes[3], plan.nodes[4]
    table = {**VECS, "ka1 na1": (0, 0.28, 0.96, 0)}  # A1's text now says what A2's does
    vec = Vectors(FakeEmbed(table), ["ka1 na1", "na2"])
    assert parent_distinctness(vec, [a1, a2]) == pytest.approx(0.0, abs=1e-6)
    assert parent_distinctness(Vectors(FakeEmbed(), ["ka1 na1", "na2"]), [a1, a2]) == pytest.approx(
        1 - 0.96 / np.sqrt(2), abs=1e-6)
    assert parent_distinctness(vec, [a1]) == 1.0 and parent_distinctness(vec, []) == 1.0
    r = plan_reward(graph(), RUBRICS, FakeEmbed(table))
    assert r.d_par == pytest.approx(0.0, abs=1e-6) and r.B_synth == pytest.approx(0.0, abs=1e-6)


def test_identical_aggregate_parents_give_zero_d_par():
    g = graph()
    g["nodes"][4] = {**g["nodes"][3], "id": "A2", "inputs": ["S1", "S3"]}  # A2: A1's need and key point
    r = plan_reward(g, RUBRICS, FakeEmbed())
    assert r.valid and r.d_par == pytest.approx(0.0, abs=1e-6) and r.B_synth == pytest.approx(0.0, abs=1e-6)


def test_cached_and_uncached_embedders_give_the_same_reward(embedder):
    """The embedder's per-text cache must not move R_plan: score rollouts with the cache
    cleared before each call, then again with it warm, and compare every sub-term."""
    base = {"nodes": [
        {"id": "S1", "type": "search", "query": "Eiffel Tower construction", "key_points": ["completed in 1889"]},
        {"id": "S2", "type": "search", "query": "Eiffel Tower height"},
        {"id": "S3", "type": "search", "query": "Gustave Eiffel company"},
        {"id": "A1", "type": "aggregate", "need": "when the tower was built", "key_points": ["year of opening"],
         "inputs": ["S1", "S2"]},
        {"id": "A2", "type": "aggregate", "need": "who designed it", "key_points": ["engineer", "firm"],
         "inputs": ["S2", "S3"]},
        {"id": "ANS", "type": "answer", "need": "answer", "inputs": ["A1", "A2"]}]}
    other = json.loads(json.dumps(base))
    other["nodes"][4]["key_points"] = ["the engineering firm of Gustave Eiffel"]
    rubrics = [{"id": "R1", "type": "factual", "description": "The Eiffel Tower was completed in 1889", "weight": 1}]
    uncached = []
    for plan in (base, other):
        embedder.clear_cache()
        uncached.append(plan_reward(plan, rubrics, embedder.encode))
    embedder.clear_cache()
    cached = [plan_reward(base, rubrics, embedder.encode)]
    before = embedder.encoded
    cached.append(plan_reward(other, rubrics, embedder.encode))
    # only the new key point and A2's node text (d_par reads it whole) reached the model
    assert embedder.encoded == before + 2
    for u, c in zip(uncached, cached):
        assert u.valid and 0.0 < u.d_par < 1.0
        for key, value in u.as_dict().items():
            if key != "errors":
                assert getattr(c, key) == pytest.approx(value, abs=1e-6), key
