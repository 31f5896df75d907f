"""grpo --stage rubric: the DeepRubric tool-calling agent trained with the composite rubric reward
(002 §3.3, App. A–B, D).

Input: verified query–rubric pairs (``verified.jsonl``, QRPair rows kept or revised by
``deepr verify``). Each rollout is the agent of ``deepr run --mode tools``: ``<think>`` →
``<tool_call>`` → the environment's ``<tool_response>`` (search / browse / scholar over the
corpus, ids issued by code) → ... → ``<answer>`` with ``<cite id>`` spans, at most 20 tool
turns. Tool responses are environment tokens: 0 in ``env_mask``, so they carry no loss.
Reward: R = 0.5 R_rubric + 0.2 R_format + 0.2 R_cite + 0.1 R_search
(:func:`deepr.rewards.rubric_reward.rubric_composite`), every component logged per step in
``<out>/metrics.jsonl`` under ``rubric/``. Output: the LoRA adapter (role ``agent``), so
``deepr run --mode tools --llm hf:<base>,adapter=agent:<out>`` runs the trained agent.

Defaults from 002 App. B (RL): lr 1e-6 constant, KL 0, 8 rollouts per query, temperature 1.0,
2,048 tokens per model turn, 28,288 tokens per rollout.

    deepr grpo --stage rubric --model runs/sft-agent --data verified.jsonl --out runs/rl-agent

This module also holds what the issue-8 stages share: :class:`StageConfig` (paper defaults per
stage) and :func:`train_stage` (one GRPO run over any rollout function and trainer class).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field

from deepr.records import QRPair
from deepr.rewards.judges import LazyJudge
from deepr.train.grpo import GrpoResult
from deepr.rewards.trl_adapters import log_means
from deepr.train.stage import StageConfig, lookup_row, train_stage

# --- the rubric stage -----------------------------------------------------------------------------


class RubricStageConfig(StageConfig):
    """Settings of ``deepr grpo --stage rubric``."""

    PAPER: ClassVar[dict[str, Any]] = {"learning_rate": 1e-6, "beta": 0.0, "num_generations": 8,
                                       "prompts_per_step": 8, "mini_batch_prompts": 4,
                                       "max_completion_length": 28288, "max_turn_tokens": 2048,
                                       "loss_type": "grpo"}  # Table 5 names plain GRPO: per-sequence mean
    ROLE: ClassVar[str] = "agent"
    stage: Literal["rubric"] = Field("rubric", description="The DeepRubric tool-calling agent.")
    tool_turns: int = Field(20, ge=1, le=50, description="Most tool calls per rollout (002: 20 in training).")


def rubric_dataset(pairs: Sequence[QRPair], tool_turns: int = 20) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Rows {id, prompt, query, rubrics} (verified pairs only) and the prompt → question lookup."""
    from deepr.agent.tools_agent import first_messages

    rows, lookup = [], {}
    for p in pairs:
        if p.decision not in (None, "KEEP", "REVISE") or not p.rubrics:
            continue
        prompt = first_messages(p.question, tool_turns)
        rows.append({"id": p.id, "prompt": prompt, "query": p.question,
                     "rubrics": [r.model_dump(mode="json") for r in p.rubrics]})
        lookup[prompt[-1]["content"]] = p.question
    return rows, lookup


def session_factory(retriever: Any, *, k: int = 5, scholar: Any = None) -> Callable[[str], Any]:
    """A fresh :class:`~deepr.agent.tools_agent.ToolSession` per rollout (its own citation catalog)."""
    from deepr.evidence.env import Ctx, RunConfig
    from deepr.agent.tools_agent import ToolSession
    from deepr.evidence.trace import Tracer
    from deepr.corpus.tools import ResearchTools

    def make(question: str) -> ToolSession:
        tools = ResearchTools(retriever, k=k, scholar=scholar)
        # llm=None: the policy's turns come from the trainer; every other role runs extractive
        return ToolSession(Ctx(llm=None, tools=tools, config=RunConfig(mode="tools", k=k),
                               tracer=Tracer(question, "tools")))

    return make


def tool_rollouts(prompts: Sequence[Any], lookup: dict[str, str], make_session: Callable[[str], Any],
                  generate: Any, tokenizer: Any, *, budget: int, eos_ids: Sequence[int], tool_turns: int = 20,
                  turn_cap: int | None = None) -> tuple[list[Any], dict[str, list]]:
    """Agent turns with tool responses in between; a turn that is not a tool call ends the rollout."""
    from deepr.agent.tools_agent import FINAL_NUDGE, parse_step, tool_response
    from deepr.train.rollouts import _user_text, prompt_ids, run_turns

    questions = [lookup_row(lookup, _user_text(p), "rubric") for p in prompts]
    sessions = [make_session(q) for q in questions]

    def reply(i: int, r: Any) -> str | None:
        step, s = parse_step(r.texts[-1]), sessions[i]
        if step.kind != "tool":
            return None
        if s.calls >= tool_turns:
            return FINAL_NUDGE
        return tool_response(s.execute(step.name, step.arguments))

    rollouts = run_turns([prompt_ids(tokenizer, p) for p in prompts], generate, reply, tokenizer, budget=budget,
                         eos_ids=eos_ids, max_turns=tool_turns + 2, turn_cap=turn_cap)
    extra = {"transcript": ["\n".join(r.texts) for r in rollouts], "store": [s.store() for s in sessions],
             "n_tool_calls": [s.valid for s in sessions], "question": questions}
    return rollouts, extra


def make_tool_rollout_func(lookup: dict[str, str], make_session: Callable[[str], Any], *, budget: int,
                           tool_turns: int = 20, turn_cap: int | None = None,
                           generate_for: Callable[[Any], Any] | None = None) -> Callable[[list[Any], Any], dict]:
    """TRL ``rollout_func`` of the rubric stage (``generate_for`` swaps the generator, for tests)."""
    from deepr.train.rollouts import _log, _mask_stats
    from deepr.train.sampling import policy_generate

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tok = trainer.processing_class
        eos_ids = list(getattr(trainer, "eos_token_ids", None) or [tok.eos_token_id])
        gen = policy_generate(trainer, generate_for)
        rollouts, extra = tool_rollouts(prompts, lookup, make_session, gen,
                                        tok, budget=budget, eos_ids=eos_ids, tool_turns=tool_turns,
                                        turn_cap=turn_cap)
        _mask_stats(trainer, rollouts)
        _log(trainer, "rollout/tool_calls", [float(n) for n in extra["n_tool_calls"]])
        lps = [r.logprobs for r in rollouts]
        return {"prompt_ids": [r.prompt_ids for r in rollouts], "completion_ids": [r.completion_ids for r in rollouts],
                "logprobs": None if any(lp is None for lp in lps) else lps,
                "env_mask": [r.env_mask for r in rollouts], **extra}

    return rollout_func


class RubricRewardFn(LazyJudge):
    """R of 002 Eq. 5 per rollout; logs R and every component (``rubric/...``) per step.

    Columns: ``rubrics`` and ``query`` (dataset), ``transcript`` / ``store`` / ``n_tool_calls``
    (rollout). Without a transcript the decoded completion is scored. A failed judge call gives
    None (no reward), never a silent 0."""

    __name__ = "rubric_reward"
    COMPONENTS = ("R", "R_rubric", "R_format", "R_cite", "R_search", "F1_mean", "R_fmt", "I_answer", "I_cite",
                  "I_tool", "I_think", "tool_calls")

    def __init__(self, judge: Any = None, embed: Any = None):
        self._judge, self._embed = judge, embed

    async def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **cols: Any) -> list[float | None]:
        from deepr.rewards.rubric_reward import rubric_composite
        from deepr.rewards.trl_adapters import completion_text

        n = len(completions)
        get = {c: (list(cols[c]) if cols.get(c) is not None else [None] * n)
               for c in ("transcript", "store", "n_tool_calls", "query", "question", "rubrics")}

        async def one(i: int) -> dict[str, Any] | None:
            if not get["rubrics"][i]:
                return None
            text = get["transcript"][i] if get["transcript"][i] is not None else completion_text(completions[i])
            return await rubric_composite(get["question"][i] or get["query"][i] or "", text, get["rubrics"][i],
                                          get["store"][i] or {}, self.judge, n_tool_calls=get["n_tool_calls"][i])

        rows = await asyncio.gather(*(one(i) for i in range(n)))
        log_means(cols, "rubric", [r for r in rows if r], self.COMPONENTS)
        return [r["R"] if r else None for r in rows]


def train_rubric(config: RubricStageConfig, pairs: Sequence[QRPair], retriever: Any, *, reward_fn: Any = None,
                 scholar: Any = None, generate_for: Any = None, callbacks: Sequence[Any] = ()) -> GrpoResult:
    """Run the rubric stage on verified pairs over ``retriever`` (and ``scholar``, a second corpus)."""
    rows, lookup = rubric_dataset(pairs, config.tool_turns)
    rollout = make_tool_rollout_func(lookup, session_factory(retriever, k=config.k, scholar=scholar),
                                     budget=config.max_completion_length, tool_turns=config.tool_turns,
                                     turn_cap=config.max_turn_tokens, generate_for=generate_for)
    return train_stage(config, rows, rollout, reward_fn or RubricRewardFn(), callbacks=callbacks)
