"""DecomposeR answerer reward R_ans (000 Eq. 25–31 and partial credit).

Input: the fixed plan, ``node_outputs`` {aggregate node id: text} (a node that failed to
parse is absent or None), the final answer (None when it did not parse), the query-level
rubric items and a :class:`~deepr.rewards.judges.Judge` for J_rub. Output:
:class:`AnswerReward` with R_exec, R_synth, J_rub, U_branch and r_v / K_emb / K_lex per
aggregate node.

    deepr eval answers.jsonl --metric answer_reward --rubrics verified.jsonl --out ans.jsonl

:func:`answer_terms` is the pure, deterministic part (everything but J_rub);
:func:`score_answer` adds the judge. Definitions fixed here: an aggregate node without key
points uses its need as its one key point; key points with no content token are left out
of K_lex's mean; a plan without aggregate nodes has R_exec = U_branch = 0 (noted). If the
judge fails, J_rub / R_synth / answer_reward are None with ``failure`` set — never 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from deepr.evidence.plan import answer_node, nodes_of, validate_plan
from deepr.records import Plan, PlanNode
from deepr.rewards.judges import Judge, coerce_rubrics
from deepr.text import Embed, Vectors, coverage, split_sentences, strip_citations, tok

W_EXEC, W_SYNTH = 0.50, 0.50      # Eq. 25
W_EMB, W_LEX = 0.50, 0.50         # Eq. 26
W_JUDGE, W_UTIL = 0.50, 0.50      # Eq. 30


@dataclass
class AnswerReward:
    """R_ans and its parts. ``partial`` names the partial-credit rule applied, if any."""

    answer_reward: float | None
    valid: bool
    R_exec: float = 0.0
    R_synth: float | None = 0.0
    J_rub: float | None = None
    U_branch: float = 0.0
    r_v: dict[str, float] = field(default_factory=dict)
    K_emb: dict[str, float] = field(default_factory=dict)
    K_lex: dict[str, float] = field(default_factory=dict)
    partial: str | None = None
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    judge: str | None = None
    failure: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def key_points(node: PlanNode) -> list[str]:
    pts = [p.strip() for p in node.key_points if p and p.strip()]
    return pts or ([node.need.strip()] if node.need and node.need.strip() else [])


def greedy_match(sim: np.ndarray) -> float:
    """Sum of cos⁺ over a greedy one-to-one matching (best remaining pair first)."""
    m = np.array(sim, dtype=np.float64, copy=True)
    total = 0.0
    for _ in range(min(m.shape) if m.size else 0):
        i, j = np.unravel_index(int(np.argmax(m)), m.shape)
        if m[i, j] < 0:
            break
        total += float(m[i, j])
        m[i, :] = -1.0
        m[:, j] = -1.0
    return total


def harmonic_exec(r: Sequence[float]) -> float:
    """Shifted harmonic mean |N_a| / Σ 1/(1+r_v) − 1: all 0 → 0, all 1 → 1."""
    return len(r) / sum(1.0 / (1.0 + x) for x in r) - 1.0 if r else 0.0


def _node_texts(plan: Plan, outputs: Mapping[str, str | None]) -> list[str]:
    texts: list[str] = []
    for n in nodes_of(plan, "aggregate"):
        texts.extend(key_points(n))
        out = outputs.get(n.id)
        if out is not None:
            texts.extend(split_sentences(strip_citations(out)))
    return texts


def _node_score(node: PlanNode, output: str, vec: Vectors) -> tuple[float, float]:
    pts = key_points(node)
    if not pts:
        return 0.0, 0.0
    sents = split_sentences(strip_citations(output))
    k_emb = greedy_match(vec.sim(pts, sents)) / len(pts) if sents else 0.0
    out_tok = tok(output)
    lex = [c for c in (coverage(p, out_tok) for p in pts) if c is not None]
    return k_emb, (sum(lex) / len(lex) if lex else 0.0)


def _terms(plan: Plan, outputs: Mapping[str, str | None], answer: str | None, vec: Vectors) -> AnswerReward:
    aggs = nodes_of(plan, "aggregate")
    res = AnswerReward(answer_reward=None, valid=True, R_synth=None)
    parsed = {n.id: outputs[n.id] for n in aggs if outputs.get(n.id) is not None}
    for n in aggs:
        if n.id in parsed:
            res.K_emb[n.id], res.K_lex[n.id] = _node_score(n, parsed[n.id], vec)
            res.r_v[n.id] = W_EMB * res.K_emb[n.id] + W_LEX * res.K_lex[n.id]
        else:
            res.r_v[n.id] = 0.0  # partial credit: a node that never parsed scores 0
    res.R_exec = harmonic_exec(list(res.r_v.values()))
    if not aggs:
        res.notes.append("plan has no aggregate nodes: R_exec and U_branch are 0 by definition")
    elif not parsed:
        res.partial, res.R_exec = "no_aggregate_parsed", 0.0
    elif len(parsed) < len(aggs):
        res.partial = "missing_nodes"
        res.errors.append("no parsed output for " + ", ".join(n.id for n in aggs if n.id not in parsed))
    if answer is None or not answer.strip():
        res.partial = res.partial or "answer_unparsed"
    else:
        y = tok(answer)
        util = [c for c in (coverage(b, y) for b in parsed.values()) if c is not None]
        res.U_branch = sum(util) / len(util) if util else 0.0
    if res.partial is not None:
        res.R_synth, res.J_rub = 0.0, None
        res.answer_reward = 0.0 if res.partial == "no_aggregate_parsed" else W_EXEC * res.R_exec
    return res


def answer_terms(plan: Any, node_outputs: Mapping[str, str | None], answer: str | None,
                 embed: Embed, *, vectors: Vectors | None = None) -> AnswerReward:
    """Everything of R_ans except J_rub. With full credit pending, answer_reward stays None
    until :func:`combine` adds J_rub; partial-credit cases are final here."""
    p, errors = validate_plan(plan)
    if p is None:
        return AnswerReward(answer_reward=0.0, valid=False, R_synth=0.0, partial="invalid_plan",
                            errors=errors)
    vec = vectors or Vectors(embed, _node_texts(p, node_outputs))
    return _terms(p, node_outputs, answer, vec)


def combine(terms: AnswerReward, j_rub: float) -> AnswerReward:
    """Full-credit R_ans = 0.5 R_exec + 0.5 (0.5 J_rub + 0.5 U_branch)."""
    terms.J_rub = j_rub
    terms.R_synth = W_JUDGE * j_rub + W_UTIL * terms.U_branch
    terms.answer_reward = W_EXEC * terms.R_exec + W_SYNTH * terms.R_synth
    return terms


async def score_answer(plan: Any, node_outputs: Mapping[str, str | None], answer: str | None,
                       rubrics: Any, embed: Embed, judge: Judge, *, question: str | None = None) -> AnswerReward:
    """R_ans with J_rub from ``judge`` (rubric-weighted five-level scores of the answer)."""
    items = coerce_rubrics(rubrics, where="answer_reward")
    terms = answer_terms(plan, node_outputs, answer, embed)
    if terms.answer_reward is not None:  # invalid plan or partial credit: no judge needed
        return terms
    p, _ = validate_plan(plan)
    q = question or (answer_node(p).need or "")
    verdict = await judge.rubrics(q, answer or "", items)
    terms.judge = verdict.judge
    if not verdict.ok:
        terms.R_synth = None
        terms.failure = verdict.reason
        return terms
    return combine(terms, verdict.value["score"])


def answer_terms_batch(items: Iterable[tuple[Any, Mapping[str, str | None], str | None]],
                       embed: Embed) -> list[AnswerReward]:
    """:func:`answer_terms` for many answers with ONE embed call over all their texts."""
    rows = [(validate_plan(p), outs, ans) for p, outs, ans in items]
    texts = [t for (plan, _), outs, _ in rows if plan is not None for t in _node_texts(plan, outs)]
    vec = Vectors(embed, texts)
    out = []
    for (plan, errors), outs, ans in rows:
        if plan is None:
            out.append(AnswerReward(0.0, False, R_synth=0.0, partial="invalid_plan", errors=errors))
        else:
            out.append(_terms(plan, outs, ans, vec))
    return out
