"""DECOR short-answer metrics and the hybrid team/role reward (001 Eq. 2–3, 6).

Input: predictions and gold answers (``{"id", "prediction", "answers": [str]}``), role
outputs of the planner / filter / answerer. Output: EM and F1 (SQuAD v1.1 normalisation,
max over gold answers), LJ (YES/NO judge), R_team = λ F1 + (1 − λ) LJ, the per-role
R_total with its format gate, and role-wise group-normalised advantages.

    deepr eval answers.jsonl --metric em,f1,lj,team --out qa_scores.jsonl

The LJ and role judges live here (our prompts; extractive twins described in
deepr.rewards.judges). Advantages use the population standard deviation of each (question, role) group; a group
of one gets advantage 0.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, field_validator

from deepr.rewards.judges import Judge, Verdict
from deepr.text import coverage, squad_normalize

LAMBDA = 0.5   # Eq. 2: weight of F1 in R_team
ALPHA = 0.6    # Eq. 3: weight of R_team in R_total (β = 1 − α)
EPS = 1e-6     # Eq. 6

# Each role's output protocol (001 App. B.2–B.4): blocks that must appear, and nothing outside.
ROLE_BLOCKS = {"planner": ("think", "search"), "filter": ("think", "filter"), "answerer": ("think", "answer")}


def _golds(answers: str | Sequence[str]) -> list[str]:
    return [answers] if isinstance(answers, str) else list(answers)


def exact_match(prediction: str, answers: str | Sequence[str]) -> float:
    """1.0 when the normalised prediction equals some normalised gold answer."""
    pred = squad_normalize(prediction)
    return float(any(pred == squad_normalize(g) for g in _golds(answers)))


def _f1(pred: str, gold: str) -> float:
    p, g = squad_normalize(pred).split(), squad_normalize(gold).split()
    if not p or not g:
        return float(p == g)
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, answers: str | Sequence[str]) -> float:
    """Token-bag F1 after SQuAD normalisation, max over gold answers (0 with no gold)."""
    golds = _golds(answers)
    return max((_f1(prediction, g) for g in golds), default=0.0)


# --- judges: answer equivalence (001 App. B.1) and roles (001 App. B.2–B.4) -----------------


class _YesNo(BaseModel):
    verdict: Literal["YES", "NO"]

    @field_validator("verdict", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.strip().upper() if isinstance(v, str) else v


EQUIV_PROMPT = """Decide whether a predicted answer is correct for the question, using the
reference answers as ground truth. It is correct when it agrees in substance with at least
one reference: ignore case, quotes, articles, punctuation and formatting; accept the same
entity under another name, a number written in words, a standard abbreviation, or a more
detailed answer that adds nothing false. It is wrong when it names a different entity,
value, date, place or unit, is less precise than the question demands, or adds a false fact.

Question: {question}
Prediction: {prediction}
Reference answers: {answers}

Return {{"verdict": "YES"}} or {{"verdict": "NO"}}."""

ROLE_PROMPTS = {
    "planner": """Judge one step of a search planner. Say YES when its search query is a sensible
web-search phrase that keeps the explicit constraints of the user question (names, years,
categories), does not repeat an earlier search, does not already contain the answer, and
its output keeps reasoning inside <think> and the query inside <search> with nothing else.
Say NO for an irrelevant, repeated, garbled or answer-leaking query, or a broken format.""",
    "filter": """Judge one step of an evidence filter. Say YES when its <filter> paragraph keeps the
facts needed to reach the reference answer, drops clearly irrelevant material, distorts
nothing, is one coherent paragraph, and the output has only <think> and <filter> blocks.
Say NO when key facts are missing, it invents or swaps facts, or the format is broken.""",
    "answerer": """Judge the final step of a question-answering team. Say YES when reasoning sits
inside <think>, a concise answer sits inside <answer>, nothing is outside those blocks, and
the answer matches the reference in substance given the evidence. Say NO when the answer is
wrong or missing, invents facts absent from the evidence, or the tags are broken.""",
}

ROLE_INPUT = """

Question: {query}
Context the step saw:
<<<
{context}
>>>
Step output:
<<<
{output}
>>>
Reference answer: {gold}

Return {{"verdict": "YES"}} or {{"verdict": "NO"}}."""


def equivalent_local(judge: Judge, prediction: str, answers: Sequence[str]) -> bool:
    """Extractive equivalence: every gold token present (maybe more detail), or support ≥ 0.9."""
    pred = set(squad_normalize(prediction).split())
    for gold in answers:
        g = set(squad_normalize(gold).split())
        if g and g <= pred:
            return True
    return any(judge.support(gold, prediction) >= 0.9 for gold in answers if gold.strip())


async def llm_judge(question: str, prediction: str, answers: str | Sequence[str], judge: Judge) -> Verdict:
    """LJ: Verdict whose value is 1.0 (YES) or 0.0 (NO), or a failure with its reason."""
    golds = _golds(answers)
    return await judge.run(
        "lj", [question, prediction, golds],
        local=lambda: 1.0 if equivalent_local(judge, prediction, golds) else 0.0,
        prompt=EQUIV_PROMPT.format(question=question, prediction=prediction, answers=" | ".join(golds)),
        schema=_YesNo, convert=lambda v: 1.0 if v.verdict == "YES" else 0.0)


def _role_local(judge: Judge, role: str, query: str, context: str, output: str, gold: str) -> int:
    if not format_ok(role, output)[0]:
        return -1
    body = role_content(role, output)
    if role == "planner":  # a fresh query that touches the question
        fresh = all(judge.support(body, past) < 0.9 for past in context.splitlines() if past.strip())
        return 1 if fresh and (coverage(query, body) or 0) > 0 else -1
    if role == "filter":  # keeps at least half of the gold answer's content
        return 1 if (coverage(gold, body) or 0) >= 0.5 else -1
    return 1 if equivalent_local(judge, body, [gold]) else -1


async def role_judge(judge: Judge, role: str, query: str, context: str, output: str, gold: str) -> Verdict:
    """R_role ∈ {+1, −1} for one planner / filter / answerer step."""
    if role not in ROLE_PROMPTS:
        raise ValueError(f"unknown role {role!r}; role judges exist for {', '.join(ROLE_PROMPTS)}")
    return await judge.run(
        "role", [role, query, context, output, gold],
        local=lambda: _role_local(judge, role, query, context, output, gold),
        prompt=ROLE_PROMPTS[role] + ROLE_INPUT.format(query=query, context=context, output=output, gold=gold),
        schema=_YesNo, convert=lambda v: 1 if v.verdict == "YES" else -1)


def r_team(f1: float, lj: float, lam: float = LAMBDA) -> float:
    return lam * f1 + (1 - lam) * lj


def format_ok(role: str, output: str) -> tuple[bool, str]:
    """Does ``output`` follow ``role``'s block protocol? (ok, reason when not)."""
    if role not in ROLE_BLOCKS:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLE_BLOCKS)}")
    rest = output or ""
    for tag in ROLE_BLOCKS[role]:
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", rest, re.S)
        if len(found) != 1:
            return False, f"expected exactly one <{tag}>...</{tag}> block, found {len(found)}"
        if tag != "think" and not found[0].strip():
            return False, f"<{tag}> block is empty"
        rest = re.sub(rf"<{tag}>.*?</{tag}>", "", rest, count=1, flags=re.S)
    if rest.strip():
        return False, f"text outside the {' / '.join(ROLE_BLOCKS[role])} blocks: {rest.strip()[:40]!r}"
    return True, ""


def role_content(role: str, output: str) -> str:
    """The text of the role's main block (<search>, <filter> or <answer>)."""
    tag = ROLE_BLOCKS[role][-1]
    m = re.search(rf"<{tag}>(.*?)</{tag}>", output or "", re.S)
    return m.group(1).strip() if m else ""


def r_total(format_valid: bool, team: float, role_reward: float, alpha: float = ALPHA) -> float:
    """Eq. 3: −1 for a broken format, else α R_team + (1 − α) R_role (R_role ∈ {+1, −1})."""
    if not format_valid:
        return -1.0
    if role_reward not in (1, -1):
        raise ValueError(f"role reward must be +1 or -1, got {role_reward}")
    return alpha * team + (1 - alpha) * role_reward


def role_advantages(rewards: Sequence[float], roles: Sequence[str], groups: Sequence[Hashable],
                    eps: float = EPS) -> list[float]:
    """Eq. 6: A = (R − μ_u) / (σ_u + ε) with μ, σ over the same (question, role) group."""
    if not (len(rewards) == len(roles) == len(groups)):
        raise ValueError(f"rewards, roles and groups differ in length: "
                         f"{len(rewards)}, {len(roles)}, {len(groups)}")
    members: dict[tuple, list[int]] = defaultdict(list)
    for i, key in enumerate(zip(groups, roles)):
        members[key].append(i)
    adv = [0.0] * len(rewards)
    for idx in members.values():
        vals = [float(rewards[i]) for i in idx]
        mu = sum(vals) / len(vals)
        sigma = math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals))
        for i, v in zip(idx, vals):
            adv[i] = (v - mu) / (sigma + eps)
    return adv
