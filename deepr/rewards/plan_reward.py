"""DecomposeR planner reward R_plan (App. A.5, Eq. 17–24) on a revised plan.

Input: a plan graph (dict, JSON text or records.Plan) and rubric items (description, weight).
Output: :class:`PlanReward` with every sub-term under the paper's names. Pure: the embedder is passed in, and every text of one call (or of a whole batch
with :func:`plan_rewards`) is embedded in one ``embed`` call.

    deepr eval plans.jsonl --metric plan_reward --out plan_scores.jsonl

Definitions this module fixes where the paper leaves room:
- fields(n) are the non-empty query, key points and need of node n, in that order;
- the node text of an aggregate answer-parent (for d_par) is its fields joined by spaces
  (:func:`node_text`), embedded as one string (the embedder caches by text);
- rubric weights enter C_rub and C_search as |w| (a plan should make room to check a
  misleading claim as much as a true one), normalised by Σ|w|;
- r_fan is 0 without search nodes and r_int is 0 without aggregate nodes; both count distinct
  parents / children, so repeating an id in ``inputs`` adds no edge (the validator rejects it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from deepr.evidence.plan import answer_node, children_map, nodes_of, parents_of, validate_plan
from deepr.records import Plan, PlanNode, RubricItem
from deepr.rewards.judges import coerce_rubrics
from deepr.text import Embed, Vectors, diminishing, mean_pairwise


class PlanRewardWeights(BaseModel):
    """Weights of Eq. 17–24 (000 Table 6); change them only for ablations."""

    cov: float = Field(0.40, description="weight of rubric coverage C_rub in R_plan")
    search: float = Field(0.30, description="weight of search quality Q_search in R_plan")
    graph: float = Field(0.30, description="weight of graph expressiveness E_graph in R_plan")
    search_cov: float = Field(0.50, description="weight of C_search inside Q_search")
    search_dist: float = Field(0.50, description="weight of D_search inside Q_search")
    synth: float = Field(0.40, description="weight of B_synth inside E_graph")
    cross: float = Field(0.40, description="weight of I_cross inside E_graph")
    breadth: float = Field(0.20, description="weight of B_search inside E_graph")


DEFAULT_WEIGHTS = PlanRewardWeights()


@dataclass
class PlanReward:
    """R_plan and its sub-terms; an invalid plan has plan_reward 0 and its errors."""

    plan_reward: float
    valid: bool
    C_rub: float = 0.0
    Q_search: float = 0.0
    C_search: float = 0.0
    D_search: float = 0.0
    E_graph: float = 0.0
    B_synth: float = 0.0
    I_cross: float = 0.0
    B_search: float = 0.0
    r_fan: float = 0.0
    r_int: float = 0.0
    d_par: float = 0.0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def node_fields(node: PlanNode) -> list[str]:
    """fields(n): the node's non-empty query, key points and need, in DecomposeR's order (App. A.5),
    so d_par's joined node text reads the same as the paper's."""
    out = [node.query or "", *node.key_points, node.need or ""]
    return [t.strip() for t in out if t and t.strip()]


def node_text(node: PlanNode) -> str:
    """The node's text for d_par: its fields joined by spaces."""
    return " ".join(node_fields(node))


def _texts(plan: Plan, rubrics: Sequence[RubricItem]) -> list[str]:
    """Every text the terms read: rubric items, each node's fields, and the node text of the
    answer's aggregate parents (d_par)."""
    out = [r.description for r in rubrics]
    for n in plan.nodes:
        out.extend(node_fields(n))
    by_id = {n.id: n for n in plan.nodes}
    out.extend(node_text(by_id[p]) for p in parents_of(answer_node(plan)) if by_id[p].type == "aggregate")
    return out


def parent_distinctness(vec: Vectors, parents: Sequence[PlanNode]) -> float:
    """d_par = 1 − mean pairwise cos⁺ of the parents' node texts (App. A.5); 1 with fewer than two
    (f(|P_ans|) is 0 then, so B_synth is 0 whatever d_par is)."""
    pair = mean_pairwise(vec, [node_text(p) for p in parents])
    return 1.0 if pair is None else 1.0 - pair


def coverage_score(vec: Vectors, rubrics: Sequence[RubricItem], candidates: Sequence[str]) -> float:
    """Σ_u |w_u| max_c cos⁺(u, c) / Σ_u |w_u| (0 when there is no candidate text)."""
    if not candidates:
        return 0.0
    best = vec.sim([r.description for r in rubrics], list(candidates)).max(axis=1)
    den = sum(abs(r.weight) for r in rubrics)
    return float(sum(abs(r.weight) * float(b) for r, b in zip(rubrics, best)) / den)


def _graph_terms(plan: Plan, vec: Vectors) -> dict[str, float]:
    searches, aggs = nodes_of(plan, "search"), nodes_of(plan, "aggregate")
    children = children_map(plan)
    ans = answer_node(plan)
    by_id = {n.id: n for n in plan.nodes}
    # graph terms count distinct edges (the validator also rejects repeated inputs)
    parents = [by_id[p] for p in parents_of(ans) if by_id[p].type == "aggregate"]
    d_par = parent_distinctness(vec, parents)
    r_fan = sum(len(children[s.id]) >= 2 for s in searches) / len(searches) if searches else 0.0
    r_int = sum(len(parents_of(a)) >= 2 for a in aggs) / len(aggs) if aggs else 0.0
    return {"B_synth": diminishing(len(parents)) * d_par, "d_par": d_par, "r_fan": r_fan,
            "r_int": r_int, "I_cross": 0.5 * (r_fan + r_int), "B_search": diminishing(len(searches))}


def _score(plan: Plan, rubrics: Sequence[RubricItem], vec: Vectors, w: PlanRewardWeights) -> PlanReward:
    ans = answer_node(plan)
    fields = [c for n in plan.nodes if n.id != ans.id for c in node_fields(n)]
    queries = [n.query.strip() for n in nodes_of(plan, "search") if n.query and n.query.strip()]
    c_rub = coverage_score(vec, rubrics, fields)
    c_search = coverage_score(vec, rubrics, queries)
    pair = mean_pairwise(vec, queries)
    d_search = 0.0 if pair is None else 1.0 - pair
    q_search = w.search_cov * c_search + w.search_dist * d_search
    g = _graph_terms(plan, vec)
    e_graph = w.synth * g["B_synth"] + w.cross * g["I_cross"] + w.breadth * g["B_search"]
    total = w.cov * c_rub + w.search * q_search + w.graph * e_graph
    return PlanReward(plan_reward=total, valid=True, C_rub=c_rub, Q_search=q_search, C_search=c_search,
                      D_search=d_search, E_graph=e_graph, **g)


def plan_rewards(items: Iterable[tuple[Any, Any]], embed: Embed, *,
                 weights: PlanRewardWeights = DEFAULT_WEIGHTS) -> list[PlanReward]:
    """R_plan for many (plan, rubrics) pairs with ONE embed call over all their texts.

    Invalid plans score 0 with the validator's errors. Missing or weightless rubrics raise
    :class:`~deepr.rewards.judges.RewardInputError` (the reward is undefined without them).
    """
    prepared: list[tuple[Plan | None, list[str], list[RubricItem]]] = []
    texts: list[str] = []
    for k, (plan_obj, raw_rubrics) in enumerate(items):
        rubrics = coerce_rubrics(raw_rubrics, where=f"plan {k + 1}")
        plan, errors = validate_plan(plan_obj)
        prepared.append((plan, errors, rubrics))
        if plan is not None:
            texts.extend(_texts(plan, rubrics))
    vec = Vectors(embed, texts)
    return [PlanReward(0.0, False, errors=errors) if plan is None else _score(plan, rubrics, vec, weights)
            for plan, errors, rubrics in prepared]


def plan_reward(plan: Any, rubrics: Any, embed: Embed, *,
                weights: PlanRewardWeights = DEFAULT_WEIGHTS) -> PlanReward:
    """R_plan of one plan (see :func:`plan_rewards`)."""
    return plan_rewards([(plan, rubrics)], embed, weights=weights)[0]


def plan_structure(plan: Any) -> dict[str, Any]:
    """Plan statistics for `deepr eval --metric structure` (defined for invalid plans too)."""
    from deepr.evidence.plan import waves

    p, errors = validate_plan(plan)
    if p is None:
        return {"plan_valid": False, "plan_errors": errors}
    return {"plan_valid": True, "nodes": len(p.nodes), "edges": sum(len(n.inputs) for n in p.nodes),
            "search_nodes": len(nodes_of(p, "search")), "aggregate_nodes": len(nodes_of(p, "aggregate")),
            "waves": len(waves(p)), "fetch": len(p.fetch)}
