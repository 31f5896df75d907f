"""grpo --stage warp-atomic / warp-report: AgentCPM-Report's RL on the WARP writer (003 §2.3.2,
App. A.6, B.1 Table 7).

warp-atomic — single-step RL on action-level samples: ``rl.jsonl`` of ``deepr prune-trajectories``
(ChatExample rows of role ``warp``: the prompt messages plus the teacher's reply). The policy
writes one reply per prompt, scored by the ability-specific reward of the row's action:
- planning (initialize, expand): :func:`~deepr.rewards.agentcpm.outline_reward` of the outline it
  writes (2–7 sections, language consistency); an expand row also needs the decision to match;
- retrieval (search): recall of the documents its keywords retrieve against the documents the
  teacher's keywords retrieve (same retriever, top-k per keyword);
- writing (write): :func:`~deepr.rewards.agentcpm.paragraph_reward` (length, citation count,
  language, citation precision: F1 against the teacher, 0 with an id outside the evidence shown);
- with ``--judge-llm``, outline and paragraph rewards also average in the judge's holistic quality
  and faithfulness (:func:`~deepr.rewards.agentcpm.judged_terms`); a failed judgement leaves the
  row unscored, never 0;
- decision (terminate): :func:`~deepr.rewards.agentcpm.terminate_reward` against the pruned label.
An unparseable reply scores 0 (the model's fault, logged as ``warp/parse_fail``).
Table 7: lr 2.5e-6, 8 prompts × 8 rollouts per step.

warp-report — end-to-end: whole ``deepr run --mode warp`` episodes written by the policy, scored
at the report level (:mod:`deepr.rewards.report_quality`: R_rubric when the query has rubrics,
else the judge's comprehensiveness / insight / instruction-following / readability). Every call
of an episode is trained as its own sample under the prompt it was sampled from, with its
sampling log-probs and the episode's advantage (:mod:`deepr.train.warp_calls`). A reply that
fails to parse ends the episode with ``failed_reply_reward`` (−1). Table 7: lr 1e-6, 8 queries
× 4 rollouts.

    deepr grpo --stage warp-atomic --model runs/sft-warp --data rl.jsonl --out runs/rl-warp-atomic
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field

from deepr.records import ChatExample
from deepr.rewards.agentcpm import cited_ids, outline_reward, paragraph_reward, terminate_reward
from deepr.rewards.report_quality import QUALITY
from deepr.rewards.trl_adapters import log_means
from deepr.train.stage import StageConfig, lookup_row, train_stage

ACTIONS = ("initialize", "search", "write", "expand", "terminate")
_QUESTION = re.compile(r"User question:\s*\n(.*?)\n\s*\n", re.S)
_CONTENT = re.compile(r"<content>(.*?)(?:</content>|$)", re.S | re.I)
_EVIDENCE_ID = re.compile(r"^\[([A-Za-z][\w.\-]*-[RF]\d+)\]", re.M)


class WarpAtomicConfig(StageConfig):
    """Settings of ``deepr grpo --stage warp-atomic`` (defaults: 003 Table 7, single-step RL)."""

    PAPER: ClassVar[dict[str, Any]] = {"learning_rate": 2.5e-6, "beta": 0.0, "num_generations": 8,
                                       "prompts_per_step": 8, "mini_batch_prompts": 8,
                                       "max_completion_length": 4096}  # 003 names no loss aggregation: TRL's token mean
    ROLE: ClassVar[str] = "warp"
    stage: Literal["warp-atomic"] = Field("warp-atomic", description="Single-step RL on WARP actions.")


def question_of(messages: Sequence[dict[str, str]]) -> str:
    """The user question inside a WARP prompt (every action prompt starts with it)."""
    text = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
    m = _QUESTION.search(text + "\n\n")
    return (m.group(1) if m else text).strip()


def atomic_dataset(examples: Sequence[ChatExample]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Rows {id, prompt, action, reference, query} from warp examples, and (id, reason) of skipped ones."""
    rows, skipped = [], []
    for ex in examples:
        if ex.action not in ACTIONS:
            skipped.append((ex.id, f"action {ex.action!r} is not a WARP action ({', '.join(ACTIONS)})"))
            continue
        if not ex.messages or ex.messages[-1].get("role") != "assistant" or len(ex.messages) < 2:
            skipped.append((ex.id, "messages must end with the teacher's assistant reply after a prompt"))
            continue
        prompt = [dict(m) for m in ex.messages[:-1]]
        rows.append({"id": ex.id, "prompt": prompt, "action": ex.action, "query": question_of(prompt),
                     "reference": ex.messages[-1]["content"]})
    return rows, skipped


def action_json(text: str) -> dict[str, Any] | None:
    """The last JSON object of a reply (thinking removed), or None."""
    from deepr.rewards.trl_adapters import json_objects

    objs = json_objects(text or "")
    return objs[-1] if objs else None


def keywords_of(text: str) -> list[str] | None:
    obj = action_json(text)
    kws = obj.get("keywords") if obj else None
    if not isinstance(kws, list):
        return None
    return [k.strip() for k in kws if isinstance(k, str) and k.strip()][:5] or None


class WarpAtomicRewardFn:
    """Ability-specific reward per row (see the module docstring); logs each ability's mean. With an
    LLM ``judge`` the outline and paragraph rewards add its holistic-quality and faithfulness terms."""

    __name__ = "warp_atomic_reward"

    def __init__(self, retriever: Any = None, *, k: int = 5, judge: Any = None):
        self.retriever, self.k = retriever, k
        # Only a model judge adds the judged terms; the extractive engine would grade its own heuristics.
        self.judge = judge if getattr(judge, "llm", None) is not None else None

    def _docs(self, keywords: Sequence[str]) -> set[str]:
        return {h.doc_id for kw in keywords for h in self.retriever.search(kw, k=self.k)}

    def score(self, action: str, text: str, reference: str, query: str, prompt: Any) -> dict[str, Any]:
        """The terms that need no LLM; ``judge_basic`` / ``judge_kind`` say what the judge adds to."""
        out: dict[str, Any] = {"action": action, "parse_fail": 0.0}
        if action == "write":
            m = _CONTENT.search(text or "")
            if not m or not m.group(1).strip():
                return {**out, "reward": 0.0, "parse_fail": 1.0}
            shown = _EVIDENCE_ID.findall(prompt[-1]["content"] if prompt else "")
            teacher = cited_ids(_CONTENT.search(reference).group(1) if _CONTENT.search(reference) else reference,
                                shown)
            r = paragraph_reward(m.group(1).strip(), query, shown, teacher)
            return {**out, "reward": r["paragraph_reward"], "citation_f1": r["citation_f1"],
                    "citation_precision": r["citation_precision"], "judge_kind": "paragraph",
                    "judge_basic": [r["basic"], r["citation_precision"]], "judge_text": m.group(1).strip()}
        if action == "search":
            if self.retriever is None:
                raise ValueError("the search action's recall reward needs a retriever (WarpAtomicRewardFn(retriever))")
            mine, gold = keywords_of(text), keywords_of(reference)
            if mine is None:
                return {**out, "reward": 0.0, "parse_fail": 1.0}
            if gold is None:
                return {**out, "reward": None}  # a teacher reply without keywords cannot be scored
            want = self._docs(gold)
            return {**out, "reward": len(self._docs(mine) & want) / len(want) if want else 0.0}
        obj = action_json(text)
        if obj is None:
            return {**out, "reward": 0.0, "parse_fail": 1.0}
        if action == "initialize":
            basic = outline_reward(obj.get("sections") or [], query)["outline_reward"]
            return {**out, "reward": basic, "judge_kind": "outline", "judge_basic": [basic],
                    "judge_text": json.dumps(obj, ensure_ascii=False)}
        match = terminate_reward(str(obj.get("name", "")), action)
        row = {**out, "reward": match, "decision_ok": match}
        if action == "expand" and match:
            basic = outline_reward(obj.get("subsections") or [], query)["outline_reward"]
            row.update(reward=basic, judge_kind="outline", judge_basic=[basic],
                       judge_text=json.dumps(obj, ensure_ascii=False))
        return row

    async def judged(self, row: dict[str, Any], reference: str, prompt: Any) -> dict[str, Any]:
        """Add the judge's quality and faithfulness to an outline / paragraph row (no reward on failure)."""
        from deepr.rewards.agentcpm import judged_terms, with_judged

        if self.judge is None or "judge_kind" not in row:
            return row
        instruction = prompt[-1]["content"] if prompt else ""
        ref = _CONTENT.search(reference)
        terms = await judged_terms(self.judge, row["judge_kind"], instruction, row["judge_text"],
                                   ref.group(1).strip() if ref and row["judge_kind"] == "paragraph" else reference)
        if "failure" in terms:
            return {**row, "reward": None, "judge_failure": terms["failure"]}
        return {**row, **terms, "reward": with_judged(row["judge_basic"], terms)}

    async def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **cols: Any) -> list[float | None]:
        import asyncio

        from deepr.rewards.trl_adapters import completion_text

        rows = [self.score(cols["action"][i], completion_text(completions[i]), cols["reference"][i],
                           cols["query"][i], prompts[i]) for i in range(len(completions))]
        rows = list(await asyncio.gather(*(self.judged(r, cols["reference"][i], prompts[i])
                                           for i, r in enumerate(rows))))
        scored = [r for r in rows if r["reward"] is not None]
        log_means(cols, "warp", scored, ("reward", "parse_fail", "quality", "faithfulness"))
        for action in ACTIONS:
            log_means(cols, f"warp/{action}", [r for r in scored if r["action"] == action], ("reward",))
        return [r["reward"] for r in rows]


def train_warp_atomic(config: WarpAtomicConfig, examples: Sequence[ChatExample], retriever: Any = None, *,
                      reward_fn: Any = None, judge: Any = None, callbacks: Sequence[Any] = ()) -> Any:
    """Single-step GRPO over the warp examples (TRL's own generation: no environment turns)."""
    rows, skipped = atomic_dataset(examples)
    if not rows:
        reasons = "; ".join(f"{i}: {r}" for i, r in skipped[:3])
        raise ValueError(f"no WARP action examples to train on ({len(skipped)} skipped: {reasons}); give the "
                         "rl.jsonl of `deepr prune-trajectories` over warp trajectories")
    return train_stage(config, rows, None, reward_fn or WarpAtomicRewardFn(retriever, k=config.k, judge=judge),
                       callbacks=callbacks)


# --- warp-report: end-to-end WARP episodes, report-level reward -------------------------------------

class WarpReportConfig(StageConfig):
    """Settings of ``deepr grpo --stage warp-report`` (defaults: 003 Table 7, end-to-end RL)."""

    PAPER: ClassVar[dict[str, Any]] = {"learning_rate": 1e-6, "beta": 0.0, "num_generations": 4,
                                       "prompts_per_step": 8, "mini_batch_prompts": 8,
                                       "max_completion_length": 32768, "max_turn_tokens": 4096}
    ROLE: ClassVar[str] = "warp"
    stage: Literal["warp-report"] = Field("warp-report", description="End-to-end RL on whole WARP runs.")
    max_expansions: int = Field(12, ge=0, le=12, description="Most deepening expansions per episode.")
    max_levels: int = Field(3, ge=1, le=3, description="Deepest outline level.")
    failed_reply_reward: float = Field(-1.0, ge=-1.0, le=0.0, description="Reward of an episode in which a "
                                       "policy reply failed to parse (the episode ends there; as DECOR's format "
                                       "penalty, the extractive fallback earns the policy nothing).")


class EpisodeEnded(Exception):
    """Raised into the WARP loop at the policy's next call once one of its replies failed."""


def policy_llm(generate: Any, tokenizer: Any, cap: int, tracer: Any = None) -> Any:
    """The LLM interface over the rollout generator: every WARP call is sampled from the policy
    and recorded in ``.calls`` as a :class:`~deepr.train.warp_calls.Call` (the prompt's token ids,
    the reply's ids and sampling log-probs). Once ``tracer`` holds a failure (a reply that did not
    parse and was replaced by the extractive fallback) the next call raises :class:`EpisodeEnded`,
    so the episode stops there instead of collecting credit for the fallback's work."""
    from deepr.llm.base import LLM
    from deepr.train.rollouts import prompt_ids
    from deepr.train.warp_calls import Call

    class PolicyLLM(LLM):
        name = "policy"

        def __init__(self) -> None:
            super().__init__(max_concurrency=1)
            self.calls: list[Call] = []
            self.texts: list[str] = []

        async def _achat(self, messages, *, role, temperature, max_tokens, stop, **extra) -> str:
            if tracer is not None and tracer.failures:
                raise EpisodeEnded(tracer.failures[0].get("reason", "a policy reply failed"))
            prompt = prompt_ids(tokenizer, messages)
            ids, lps = generate([prompt], False, min(cap, max_tokens or cap))
            text = tokenizer.decode(ids[0], skip_special_tokens=True)
            self.calls.append(Call(prompt, list(ids[0]),
                                   list(lps[0]) if lps is not None and lps[0] is not None else None))
            self.texts.append(text)
            return text

    return PolicyLLM()


def play_episode(query: str, generate: Any, tokenizer: Any, retriever: Any, config: WarpReportConfig
                 ) -> tuple[list[Any], str, bool]:
    """One ``deepr run --mode warp`` episode written by the policy: (calls, report, policy_failed)."""
    from deepr.evidence.env import Ctx, RunConfig
    from deepr.evidence.trace import Tracer
    from deepr.agent.warp import run_warp
    from deepr.corpus.tools import ResearchTools
    from deepr.llm.base import run_sync

    run_cfg = RunConfig(mode="warp", k=config.k, max_expansions=config.max_expansions, max_levels=config.max_levels,
                        max_reasks=0, max_tokens=config.max_turn_tokens)
    tracer = Tracer(query, "warp")
    llm = policy_llm(generate, tokenizer, config.max_turn_tokens, tracer)
    try:
        out = run_sync(run_warp(Ctx(llm, ResearchTools(retriever, k=config.k), run_cfg, tracer), query))
        report = out.outline.markdown()
    except EpisodeEnded:
        report = ""
    return llm.calls, report, bool(tracer.failures)


def warp_report_rollout_func(queries: dict[str, dict[str, Any]], retriever: Any, config: WarpReportConfig, *,
                             generate_for: Any = None) -> Any:
    """TRL ``rollout_func``: one whole WARP episode per prompt. TRL gets one placeholder sample per
    episode (the prompt and a masked end token) to score; the episode's calls go to
    ``trainer._warp_calls``, which :class:`~deepr.train.warp_calls` trains on."""
    from deepr.train.rollouts import _log, _user_text, prompt_ids
    from deepr.train.sampling import policy_generate

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tok = trainer.processing_class
        gen = policy_generate(trainer, generate_for)
        eos = (list(getattr(trainer, "eos_token_ids", None) or []) or [tok.eos_token_id])[0]
        episodes, reports, failed = [], [], []
        for p in prompts:
            query = lookup_row(queries, _user_text(p), "warp-report")["query"]
            calls, report, bad = play_episode(query, gen, tok, retriever, config)
            episodes.append(calls), reports.append(report), failed.append(bad)
        trainer._warp_calls = episodes
        _log(trainer, "rollout/calls_per_episode", [float(len(c)) for c in episodes])
        _log(trainer, "rollout/trained_tokens_per_episode",
             [float(sum(len(x.completion_ids) for x in c)) for c in episodes])
        _log(trainer, "rollout/policy_failed", [float(b) for b in failed])
        return {"prompt_ids": [prompt_ids(tok, p) for p in prompts], "completion_ids": [[eos] for _ in prompts],
                "logprobs": [[0.0] for _ in prompts], "env_mask": [[0] for _ in prompts], "report": reports,
                "policy_failed": failed}

    return rollout_func


class WarpReportRewardFn:
    """R_rubric of the report when the row has rubrics, else the mean of the four quality criteria."""

    __name__ = "warp_report_reward"

    def __init__(self, judge: Any, *, failed_reply_reward: float = -1.0):
        self.judge, self.failed_reply_reward = judge, failed_reply_reward

    async def score(self, query: str, report: str, rubrics: Any) -> dict[str, Any] | None:
        from deepr.rewards.report_quality import report_score

        out = await report_score(query, report, rubrics, self.judge)
        return None if out["R"] is None else out

    async def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **cols: Any) -> list[float | None]:
        import asyncio

        n = len(completions)
        rubrics = cols.get("rubrics") or [None] * n
        failed = cols.get("policy_failed") or [False] * n

        async def one(i: int) -> dict[str, Any] | None:
            if failed[i]:  # a reply that did not parse ended the episode: no credit for the fallback's report
                return {"R": self.failed_reply_reward, "policy_failed": 1.0}
            out = await self.score(cols["query"][i], cols["report"][i], rubrics[i])
            return None if out is None else {**out, "policy_failed": 0.0}

        rows = await asyncio.gather(*(one(i) for i in range(n)))
        log_means(cols, "report", [r for r in rows if r], ("R", "R_rubric", "policy_failed", *QUALITY))
        return [r["R"] if r else None for r in rows]


def train_warp_report(config: WarpReportConfig, pairs: Sequence[Any], retriever: Any, *, judge: Any,
                      generate_for: Any = None, callbacks: Sequence[Any] = ()) -> Any:
    """End-to-end GRPO on queries (QRPair rows; rubrics optional) with ``judge`` for the reward."""
    from deepr.agent.warp import WARP_SYSTEM

    rows, lookup = [], {}
    for p in pairs:
        prompt = [{"role": "system", "content": WARP_SYSTEM}, {"role": "user", "content": p.question}]
        rows.append({"id": p.id, "prompt": prompt, "query": p.question,
                     "rubrics": [r.model_dump(mode="json") for r in p.rubrics]})
        lookup[p.question] = rows[-1]
    from deepr.train.warp_calls import warp_trainer_cls

    rollout = warp_report_rollout_func(lookup, retriever, config, generate_for=generate_for)
    reward = WarpReportRewardFn(judge, failed_reply_reward=config.failed_reply_reward)
    return train_stage(config, rows, rollout, reward, trainer_cls=warp_trainer_cls(), callbacks=callbacks)
