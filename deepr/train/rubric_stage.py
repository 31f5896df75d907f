"""grpo --stage rubric: the DeepRubric tool-calling agent trained with the composite rubric reward
(002 §3.3, App. A–B, D; SPEC §6, §8).

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
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from deepr.records import QRPair
from deepr.rewards.judges import LazyJudge
from deepr.train.grpo import METRICS, GrpoConfig, GrpoResult, fit_and_save, metrics_callback, prepare_out, \
    trl_args

# --- what the issue-8 stages share -------------------------------------------------------------


class StageConfig(GrpoConfig):
    """GrpoConfig for a stage whose paper values live in ``PAPER`` (fields left None take them)."""

    PAPER: ClassVar[dict[str, Any]] = {}
    ROLE: ClassVar[str] = "agent"
    stage: str = Field(description="Training stage.")
    learning_rate: float | None = Field(None, gt=0, description="Learning rate, constant; None: the paper's.")
    num_generations: int | None = Field(None, ge=2, description="Rollouts per prompt (the group); None: the "
                                        "paper's.")

    @model_validator(mode="after")
    def _fill(self) -> StageConfig:
        for name, value in self.PAPER.items():
            if getattr(self, name, None) is None:
                setattr(self, name, value)
        if self.mini_batch_prompts is None:
            self.mini_batch_prompts = max(1, self.prompts_per_step // 2)
        if self.prompts_per_step % self.mini_batch_prompts:
            raise ValueError(f"prompts_per_step {self.prompts_per_step} must be a multiple of mini_batch_prompts "
                             f"{self.mini_batch_prompts}")
        if self.planner_adapter is not None:
            raise ValueError(f"--planner-adapter is for --stage answerer, not {self.stage}")
        return self

    @property
    def role(self) -> str:
        return self.ROLE

    @property
    def adapter_roles(self) -> list[str]:
        """The ``deepr run`` roles that load the trained adapter (``--llm hf:...,adapter=<role>:<out>``)."""
        return [self.ROLE]


def build_stage_trainer(config: StageConfig, rows: Sequence[dict[str, Any]], rollout_func: Any,
                        reward_fn: Any, callbacks: Sequence[Any] = (), trainer_cls: Any = None) -> Any:
    """GRPOTrainer (or ``trainer_cls``, e.g. DECOR's) over ``config.model`` with LoRA unless --full."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from deepr.train.sft import load_tokenizer

    if trainer_cls is None:
        from trl import GRPOTrainer as trainer_cls
    args = trl_args(config)
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    peft_config = None
    if not config.full:
        from peft import LoraConfig

        peft_config = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                                 target_modules=config.target_modules, task_type="CAUSAL_LM")
    return trainer_cls(model=model, reward_funcs=[reward_fn], args=args, train_dataset=Dataset.from_list(list(rows)),
                       processing_class=load_tokenizer(config.model), peft_config=peft_config,
                       callbacks=list(callbacks), rollout_func=rollout_func)


def train_stage(config: StageConfig, rows: Sequence[dict[str, Any]], rollout_func: Any, reward_fn: Any, *,
                trainer_cls: Any = None, callbacks: Sequence[Any] = ()) -> GrpoResult:
    """One GRPO run: checkpoints and --resume, Ctrl-C saves, metrics.jsonl, adapter + deepr_meta.json."""
    from deepr.train.sft import _make_stop_callback

    t0 = time.perf_counter()
    data_fp, resume_now = prepare_out(config, rows)
    stop, log = _make_stop_callback(), metrics_callback(config.out / METRICS)
    trainer = build_stage_trainer(config, rows, rollout_func, reward_fn, [stop, log, *callbacks], trainer_cls)
    return fit_and_save(config, trainer, stop, log, data_fp=data_fp, base=config.model, n_rows=len(rows),
                        resume_now=resume_now, t0=t0)


def lookup_row(table: dict, key: Any, stage: str) -> Any:
    """The record behind a prompt TRL hands the rollout (TRL passes prompts only)."""
    if key not in table:
        raise KeyError(f"a prompt the {stage} stage did not build reached its rollout; build the rows with the "
                       f"stage's own dataset function")
    return table[key]


def log_means(columns: dict, prefix: str, rows: Sequence[dict[str, Any]], names: Sequence[str]) -> None:
    """Batch mean of each named component through TRL's ``log_metric`` (lands in metrics.jsonl)."""
    log: Callable[[str, float], None] | None = columns.get("log_metric")
    for name in names if log else ():
        vals = [float(r[name]) for r in rows if isinstance(r.get(name), (int, float))]
        if vals:
            log(f"{prefix}/{name}", sum(vals) / len(vals))


# --- the rubric stage -----------------------------------------------------------------------------


class RubricStageConfig(StageConfig):
    """Settings of ``deepr grpo --stage rubric``."""

    PAPER: ClassVar[dict[str, Any]] = {"learning_rate": 1e-6, "beta": 0.0, "num_generations": 8,
                                       "prompts_per_step": 8, "mini_batch_prompts": 4,
                                       "max_completion_length": 28288, "max_turn_tokens": 2048}
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
    from deepr.agent.env import Ctx, RunConfig
    from deepr.agent.tools_agent import ToolSession
    from deepr.agent.trace import Tracer
    from deepr.corpus.tools import ResearchTools
    from deepr.llm.extractive import ExtractiveLLM

    def make(question: str) -> ToolSession:
        tools = ResearchTools(retriever, k=k, scholar=scholar)
        return ToolSession(Ctx(ExtractiveLLM(), tools, RunConfig(mode="tools", k=k), Tracer(question, "tools")))

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
    from deepr.train.rollouts import _log, _mask_stats, trainer_generate

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tok = trainer.processing_class
        eos_ids = list(getattr(trainer, "eos_token_ids", None) or [tok.eos_token_id])
        rollouts, extra = tool_rollouts(prompts, lookup, make_session, (generate_for or trainer_generate)(trainer),
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


# --- `deepr grpo --stage rubric|decor|warp-atomic|warp-report` from CLI settings ------------------

EXTRA_STAGES = ("rubric", "decor", "warp-atomic", "warp-report")


def make_judge(spec: str) -> Any:
    """The reward judge: extractive (embeddings) or an LLM spec such as openai:<model>."""
    from deepr.corpus.embed import get_embedder
    from deepr.rewards.judges import Judge

    embed = get_embedder().encode
    if spec == "extractive":
        return Judge(None, embed)
    from deepr.llm import get_llm

    return Judge(get_llm(spec), embed)


def run_from_settings(settings: dict[str, Any], data: Any) -> tuple[GrpoResult, int, StageConfig]:
    """Read ``data`` for the stage, open the corpus, train; returns (result, rows, config)."""
    from deepr.corpus import open_retriever
    from deepr.io import read_jsonl

    stage = settings["stage"]
    if stage == "rubric":
        config: StageConfig = RubricStageConfig(**settings)
        pairs = list(read_jsonl(data, QRPair))
        retriever = open_retriever(config.corpus, retriever=config.retriever, progress=True)
        res = train_rubric(config, pairs, retriever, reward_fn=RubricRewardFn(make_judge(config.judge_llm)))
        return res, len(rubric_dataset(pairs)[0]), config
    if stage == "decor":
        from deepr.train.decor_stage import DecorRewardFn, DecorStageConfig, QARecord, train_decor

        config = DecorStageConfig(**settings)
        records = list(read_jsonl(data, QARecord))
        retriever = open_retriever(config.corpus, retriever=config.retriever, progress=True)
        reward = DecorRewardFn(make_judge(config.judge_llm), alpha=config.alpha, lam=config.lam)
        return train_decor(config, records, retriever, reward_fn=reward), 3 * len(records), config
    if stage == "warp-atomic":
        from deepr.records import ChatExample
        from deepr.train.warp_stage import WarpAtomicConfig, train_warp_atomic

        config = WarpAtomicConfig(**settings)
        examples = list(read_jsonl(data, ChatExample))
        retriever = open_retriever(config.corpus, retriever=config.retriever, progress=True)
        return train_warp_atomic(config, examples, retriever), len(examples), config
    from deepr.train.warp_stage import WarpReportConfig, train_warp_report

    config = WarpReportConfig(**settings)
    pairs = list(read_jsonl(data, QRPair))
    retriever = open_retriever(config.corpus, retriever=config.retriever, progress=True)
    return train_warp_report(config, pairs, retriever, judge=make_judge(config.judge_llm)), len(pairs), config
