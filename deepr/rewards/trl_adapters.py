"""Reward functions with TRL's signature, so `deepr grpo` and `deepr eval` share one implementation.

TRL calls ``fn(prompts=..., completions=..., completion_ids=..., **columns)`` where the
columns are the dataset's other fields (one value per completion) plus ``log_metric``;
it expects one float per completion, None meaning "no reward from this function".

    from deepr.rewards.trl_adapters import PlanRewardFn, AnswerRewardFn
    GRPOTrainer(..., reward_funcs=[PlanRewardFn()])          # dataset column: rubrics
    GRPOTrainer(..., reward_funcs=[AnswerRewardFn()])        # columns: plan, rubrics[, query]

The planner completion's LAST JSON object with a "nodes" list is the revised plan (turn 2
follows turn 1); an unparseable plan scores 0 like an invalid one. The answerer completion
holds wave replies (JSON objects {node id: text}) and the final ``<answer>...</answer>``;
columns ``node_outputs`` / ``answer`` from a rollout function override parsing. A sample
whose rubrics are missing or malformed gets None (its reward is undefined), not 0; so does
a sample whose judge call failed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from deepr.llm.parse import strip_thinking
from deepr.rewards.answer_reward import score_answer
from deepr.rewards.judges import Judge, RewardInputError, coerce_rubrics
from deepr.rewards.plan_reward import plan_rewards
from deepr.text import Embed

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)


def completion_text(completion: Any) -> str:
    """Plain text of a completion: a string, or the assistant messages of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "\n".join(str(m.get("content", "")) for m in completion
                         if isinstance(m, dict) and m.get("role", "assistant") == "assistant")
    return str(completion)


def json_objects(text: str) -> list[dict]:
    """Every top-level JSON object in ``text`` after removing thinking blocks, in order."""
    body, out, i = strip_thinking(text), [], 0
    decoder = json.JSONDecoder()
    while (i := body.find("{", i)) >= 0:
        try:
            value, end = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            i += 1
            continue
        if isinstance(value, dict):
            out.append(value)
        i = end
    return out


def last_plan(text: str) -> Any:
    """The last JSON object with a "nodes" list, else the raw text (which fails validation)."""
    plans = [o for o in json_objects(text) if isinstance(o.get("nodes"), list)]
    return plans[-1] if plans else text


def parse_answerer(text: str, plan: Any) -> tuple[dict[str, str], str | None]:
    """Node outputs from wave replies and the final answer from the last <answer> block."""
    if isinstance(plan, str):
        try:
            plan = json.loads(plan)
        except json.JSONDecodeError:
            plan = {}
    nodes = plan.get("nodes", []) if isinstance(plan, dict) else getattr(plan, "nodes", [])
    ids = {n.get("id") if isinstance(n, dict) else getattr(n, "id", None) for n in nodes}
    outputs: dict[str, str] = {}
    for obj in json_objects(text):
        outputs.update({k: v for k, v in obj.items() if k in ids and isinstance(v, str)})
    answers = _ANSWER.findall(strip_thinking(text))
    return outputs, (answers[-1].strip() if answers else None)


def _column(columns: dict, name: str, n: int) -> list:
    values = columns.get(name)
    return list(values) if values is not None else [None] * n


def _default_embed() -> Embed:
    from deepr.corpus.embed import get_embedder

    return get_embedder().encode


def log_means(columns: dict, prefix: str, rows: Sequence[dict[str, Any]], names: Sequence[str]) -> None:
    """Batch mean of each named component through TRL's ``log_metric`` (lands in metrics.jsonl)."""
    log: Callable[[str, float], None] | None = columns.get("log_metric")
    if log is None:
        return
    for name in names:
        vals = [r[name] for r in rows if isinstance(r.get(name), (int, float))]
        if vals:
            log(f"{prefix}/{name}", float(sum(vals) / len(vals)))


class PlanRewardFn:
    """R_plan for planner rollouts; logs each sub-term's batch mean through ``log_metric``."""

    __name__ = "plan_reward"
    COMPONENTS = ("C_rub", "Q_search", "C_search", "D_search", "E_graph", "B_synth", "I_cross", "B_search", "valid")

    def __init__(self, embed: Embed | None = None, *, rubrics_column: str = "rubrics"):
        self._embed, self.rubrics_column = embed, rubrics_column

    @property
    def embed(self) -> Embed:
        if self._embed is None:
            self._embed = _default_embed()
        return self._embed

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float | None]:
        n = len(completions)
        given = _column(columns, "plan", n)
        rubrics = _column(columns, self.rubrics_column, n)
        batch, keep = [], []
        for k, (comp, plan, rub) in enumerate(zip(completions, given, rubrics)):
            try:
                coerce_rubrics(rub, where=f"sample {k}")
            except RewardInputError:
                continue
            batch.append((plan if plan is not None else last_plan(completion_text(comp)), rub))
            keep.append(k)
        out: list[float | None] = [None] * n
        results = plan_rewards(batch, self.embed)
        for k, r in zip(keep, results):
            out[k] = r.plan_reward
        log_means(columns, "plan", [r.as_dict() for r in results], self.COMPONENTS)
        return out


class AnswerRewardFn:
    """R_ans for answerer rollouts (async: TRL runs it concurrently with other async rewards)."""

    __name__ = "answer_reward"
    COMPONENTS = ("R_exec", "R_synth", "J_rub", "U_branch")

    def __init__(self, judge: Judge | None = None, embed: Embed | None = None, *,
                 rubrics_column: str = "rubrics"):
        self._embed, self._judge, self.rubrics_column = embed, judge, rubrics_column

    @property
    def embed(self) -> Embed:
        if self._embed is None:
            self._embed = _default_embed()
        return self._embed

    @property
    def judge(self) -> Judge:
        if self._judge is None:
            self._judge = Judge(None, self.embed)
        return self._judge

    async def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float | None]:
        import asyncio

        n = len(completions)
        cols = {c: _column(columns, c, n) for c in ("plan", "node_outputs", "answer", "query", "question")}
        rubrics = _column(columns, self.rubrics_column, n)

        async def one(k: int) -> dict[str, Any] | None:
            plan = cols["plan"][k]
            if plan is None:
                return None
            outputs, answer = parse_answerer(completion_text(completions[k]), plan)
            outputs = cols["node_outputs"][k] if cols["node_outputs"][k] is not None else outputs
            answer = cols["answer"][k] if cols["answer"][k] is not None else answer
            try:
                r = await score_answer(plan, outputs, answer, rubrics[k], self.embed, self.judge,
                                       question=cols["query"][k] or cols["question"][k])
            except RewardInputError:
                return None
            return r.as_dict()

        rows = await asyncio.gather(*(one(k) for k in range(n)))
        log_means(columns, "answer", [r for r in rows if r], self.COMPONENTS)
        return [r["answer_reward"] if r else None for r in rows]
