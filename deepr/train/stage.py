"""What every GRPO stage shares: :class:`StageConfig` (the one config base: each stage class names
its paper's values in ``PAPER``; fields left None take them), :func:`build_stage_trainer` (the one
trainer builder), :func:`train_stage` (checkpoints, --resume, Ctrl-C, metrics.jsonl, adapter and
deepr_meta.json) and the small helpers rollouts and reward functions use. The stage registry is
:mod:`deepr.train.stages`; stage modules import this module, and it imports none of them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from deepr.llm.base import GenDefaults
from deepr.train import runs
from deepr.train.runs import META, METRICS
from deepr.train.settings import TrainerSettings

# Stages whose reward has LLM-judged terms, and those terms (what the extractive judge stands in for).
JUDGED_TERMS = {"answerer": "J_rub", "rubric": "R_rubric and claim support in R_cite",
                "decor": "LJ of R_team and the role judges R_role",
                "warp-report": "the report-level rubric / quality judge",
                "warp-atomic": "outline and paragraph holistic quality and faithfulness"}


# What deepr sets on TRL's GRPOConfig (and LoRA) for every stage, unless the stage's paper or the
# user says otherwise. No stage paper names a loss aggregation, schedule or beta2 for the extra
# stages: TRL's token mean, a constant rate, AdamW's usual beta2.
GRPO_BASE: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "lora_r": 64, "lora_alpha": 128,  # DecomposeR Table 5
    "lora_dropout": 0.0, "lora_target_modules": "all-linear", "loss_type": "dapo",
    "lr_scheduler_type": "constant", "adam_beta2": 0.999, "warmup_steps": 0, "weight_decay": 0.0,
    "max_steps": -1, "num_train_epochs": 1.0, "save_strategy": "steps", "save_steps": 50, "save_total_limit": 2,
    "logging_steps": 1, "report_to": "none", "seed": 0}


class StageConfig(TrainerSettings):
    """Settings of ``deepr grpo --stage X``: deepr's own fields below; TRL's GRPOConfig fields and
    the LoRA settings by TRL's names (see :mod:`deepr.train.settings`). A stage class sets
    ``PAPER`` (its paper's values) and ``ROLE`` (the ``deepr run`` role its adapter serves)."""

    BASE: ClassVar[dict[str, Any]] = GRPO_BASE
    ROLE: ClassVar[str] = "agent"

    stage: str = Field(description="Training stage (a name of deepr.train.stages.STAGES).")
    model: str = Field(description="Starting model folder (planner: the SFT checkpoint; answerer: the base).")
    out: Path = Field(description="Output folder: adapter, tokenizer, deepr_meta.json, metrics.jsonl, checkpoints.")
    planner_adapter: Path | None = Field(None, description="answerer: planner adapter merged into --model first.")
    full: bool = Field(False, description="Full fine-tune instead of LoRA.")
    prompts_per_step: int | None = Field(None, ge=1, description="Unique prompts per generation batch; None: "
                                         "the paper's.")
    mini_batch_prompts: int | None = Field(None, ge=1, description="Prompts per optimiser update; None: half "
                                           "of prompts_per_step (2 mini-batches per step).")
    max_turn_tokens: int | None = Field(None, ge=8, description="Most tokens of one model turn (None: only the "
                                        "rollout budget bounds it); a turn cut here ends its rollout.")
    train_turns: int | None = Field(None, ge=1, description="planner / answerer: train on the first N model "
                                    "turns of each rollout only; every turn is still sampled and the reward "
                                    "reads them all. None: all.")
    rollout_formats: Literal["none", "schema"] = Field("none", description="How rollouts are sampled. none: "
                                                       "from the policy being trained (on-policy, every "
                                                       "backend). schema: planner turns under the decoding "
                                                       "schema `deepr run --formats schema` uses (transformers "
                                                       "path only); the gradient is then off-policy.")
    zero_advantage: Literal["stop", "warn", "off"] = Field("stop", description="When every group's reward is "
                                                           "constant in the first steps: stop, warn or off.")
    resume: bool = Field(False, description="Continue from the last checkpoint in --out.")
    corpus: str = Field("wiki", description="Corpus the environment searches (as `deepr run --corpus`).")
    retriever: str = Field("hybrid", description="dense, bm25 or hybrid.")
    k: int = Field(5, ge=1, le=50, description="Results per search (DecomposeR Table 5: up to 5).")
    fetch_limit: int = Field(4, ge=0, le=10, description="Pages a revision may fetch (DecomposeR Table 5: up to 4).")
    judge_llm: str = Field("extractive", description="Judge of the reward's LLM-judged terms (answerer J_rub, "
                           "rubric, decor, warp stages): extractive (no LLM, a stand-in) or openai:<model>, ...")
    judge_gen: GenDefaults = Field(default_factory=GenDefaults, description="Generation settings of the judge's "
                                   "calls (--max-tokens, --temperature, --top-p, --seed as given on the command "
                                   "line); a field left None keeps the judge role's own.")
    require_judge_llm: bool = Field(False, description="Refuse to start when the stage's reward has LLM-judged "
                                    "terms and judge_llm is extractive (runs that must be the paper's reward).")

    @field_validator("rollout_formats", mode="before")
    @classmethod
    def _off_is_none(cls, v: Any) -> Any:
        return "none" if v == "off" else v  # the name older configs used for on-policy sampling

    @model_validator(mode="after")
    def _judge_required(self) -> StageConfig:
        if self.require_judge_llm and self.stage in JUDGED_TERMS and self.judge_llm == "extractive":
            raise ValueError(f"--require-judge-llm: the {self.stage} reward has LLM-judged terms "
                             f"({JUDGED_TERMS[self.stage]}); give --judge-llm openai:<model> (or another LLM spec)")
        return self

    @model_validator(mode="after")
    def _fill(self) -> StageConfig:
        self.fill()
        if self.mini_batch_prompts is None:
            self.mini_batch_prompts = max(1, self.prompts_per_step // 2)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.prompts_per_step % self.mini_batch_prompts:
            raise ValueError(f"prompts_per_step {self.prompts_per_step} must be a multiple of mini_batch_prompts "
                             f"{self.mini_batch_prompts}")
        if self.mini_batch_prompts % world:
            raise ValueError(f"mini_batch_prompts {self.mini_batch_prompts} must be a multiple of the "
                             f"{world} training processes")
        self.check_stage_fields()
        return self

    def check_stage_fields(self) -> None:
        """Refuse settings that belong to other stages."""
        if self.planner_adapter is not None:
            raise ValueError(f"--planner-adapter is for --stage answerer, not {self.stage}")
        if self.train_turns is not None:
            raise ValueError(f"train_turns is for --stage planner and answerer, not {self.stage}")
        if self.rollout_formats != "none":
            raise ValueError(f"rollout_formats {self.rollout_formats!r} is for --stage planner, not {self.stage}")

    @property
    def role(self) -> str:
        return self.ROLE

    @property
    def adapter_roles(self) -> list[str]:
        """The ``deepr run`` roles that load the trained adapter (``--llm hf:...,adapter=<role>:<out>``)."""
        return [self.role]


@dataclass
class GrpoResult:
    out: Path
    steps: int
    rewards: list[tuple[int, float]]
    interrupted: bool = False
    seconds: float = 0.0
    llm_spec: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)


# --- judge, logging, meta ---------------------------------------------------------------------


def judge_record(config: StageConfig) -> dict[str, Any]:
    """What deepr_meta.json says about the reward's judge."""
    terms = JUDGED_TERMS.get(config.stage)
    return {"judge": config.judge_llm, "judged_terms": terms,
            "extractive_fallback": bool(terms) and config.judge_llm == "extractive"}


def sampling_record(config: StageConfig) -> dict[str, Any]:
    """What deepr_meta.json says about how rollouts were sampled."""
    return {"rollout_formats": config.rollout_formats, "on_policy": config.rollout_formats == "none"}


def warn_judge(config: StageConfig) -> None:
    """Say at start, loudly, when LLM-judged reward terms run on the extractive stand-in, and when
    rollouts are sampled under decoding constraints (an off-policy gradient)."""
    import sys

    if os.environ.get("RANK", "0") != "0":
        return
    rec = judge_record(config)
    if rec["extractive_fallback"]:
        print(f"WARNING: grpo --stage {config.stage}: no --judge-llm, so {rec['judged_terms']} are scored by the "
              "extractive judge (embeddings + word overlap), not an LLM: this is not the paper's reward. Pass "
              "--judge-llm openai:<model>, or --require-judge-llm to refuse such runs.", file=sys.stderr, flush=True)
    if config.rollout_formats != "none":
        print(f"NOTE: grpo --stage {config.stage}: rollouts are sampled under the {config.rollout_formats!r} "
              "decoding formats (rollout_formats), not from the policy alone: the gradient is off-policy, and "
              "`deepr run` must decode with the same formats.", file=sys.stderr, flush=True)


def llm_spec(config: StageConfig, base: str) -> str:
    # a stage may train one adapter that several agent roles use (DECOR's team): it names them all
    roles = config.adapter_roles
    return f"hf:{base}" if config.full else f"hf:{base}," + ",".join(f"adapter={r}:{config.out}" for r in roles)


def write_run_meta(config: StageConfig, status: str, data_fp: str, base: str, extra: dict[str, Any]) -> None:
    runs.write_run_meta(config, stage=f"grpo-{config.stage}", status=status, role=config.role, base_model=base,
                        llm_spec=llm_spec(config, base), data_fingerprint=data_fp, **judge_record(config),
                        **sampling_record(config), **extra)


# --- trainer ----------------------------------------------------------------------------------


def trl_args(config: StageConfig) -> Any:
    """TRL's GRPOConfig from the config's TRL settings, with the batch shape deepr derives: one
    group per micro-batch, mini_batch_prompts per update, prompts_per_step per generation."""
    import torch
    from trl import GRPOConfig

    from deepr.train.memory import checkpointing_args
    from deepr.train.settings import build_args

    on_gpu = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    given = dict(config.trl)
    # CPU too: each revision call trains on ~3k tokens and a micro-batch holds several
    checkpointing = given.pop("gradient_checkpointing", None) is not False
    if given.get("bf16") is None:
        given["bf16"] = on_gpu and torch.cuda.is_bf16_supported()
    return build_args(GRPOConfig, given, "TRL's GRPOConfig", output_dir=str(config.out),
                      per_device_train_batch_size=config.num_generations,
                      gradient_accumulation_steps=config.mini_batch_prompts // world,
                      steps_per_generation=config.prompts_per_step // world, use_cpu=not on_gpu,
                      **checkpointing_args(GRPOConfig, checkpointing))


def build_stage_trainer(config: StageConfig, rows: Sequence[dict[str, Any]], rollout_func: Any, reward_fn: Any,
                        callbacks: Sequence[Any] = (), trainer_cls: Any = None, model_path: str | None = None,
                        clock: Any = None) -> Any:
    """``trainer_cls`` (default TRL's GRPOTrainer) over ``model_path`` (default ``config.model``),
    with LoRA unless --full: every stage's trainer is built here. ``clock``: a
    :class:`~deepr.train.step_timing.PhaseClock` that times the step's phases."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from deepr.train.runs import load_tokenizer

    if trainer_cls is None:
        from trl import GRPOTrainer as trainer_cls
    path = model_path or config.model
    args = trl_args(config)  # before the weights load: a refused setting costs nothing
    peft_config = None if config.full else config.peft_config()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    if rollout_func is not None:
        from deepr.train.rollouts import rendered_once

        rollout_func = rendered_once(rollout_func)
    if clock is not None:
        from deepr.train.step_timing import timed_rollout, timed_trainer_cls

        trainer_cls, rollout_func = timed_trainer_cls(trainer_cls, clock), timed_rollout(clock, rollout_func)
    return trainer_cls(model=model, reward_funcs=[reward_fn], args=args, train_dataset=Dataset.from_list(list(rows)),
                       processing_class=load_tokenizer(path), peft_config=peft_config,
                       callbacks=list(callbacks), rollout_func=rollout_func)


def train_stage(config: StageConfig, rows: Sequence[dict[str, Any]], rollout_func: Any, reward_fn: Any, *,
                trainer_cls: Any = None, callbacks: Sequence[Any] = (),
                start: Callable[[], str] | None = None) -> GrpoResult:
    """One GRPO run: checkpoints and --resume, Ctrl-C saves, metrics.jsonl, adapter + deepr_meta.json.
    ``start()``: the starting weights when they are not ``config.model``, made once the output
    folder is checked (the answerer merges the planner adapter into ``<out>/base``)."""
    from deepr.train.runs import stop_callback
    from deepr.train.signals import zero_advantage_callback
    from deepr.train.step_timing import PhaseClock, step_clock

    t0 = time.perf_counter()
    data_fp, resume_now = prepare_out(config, rows)
    model_path = start() if start is not None else None
    stop, log = stop_callback(), runs.metrics_callback(config.out / METRICS)
    guard = zero_advantage_callback(config.zero_advantage, stage=config.stage)  # before `log`: it adds to the row
    clock = PhaseClock()  # its callback, before `log` too, adds each step's time/* to the row
    trainer = build_stage_trainer(config, rows, rollout_func, reward_fn, [stop, guard, step_clock(clock), log,
                                                                          *callbacks], trainer_cls, model_path, clock)
    return fit_and_save(config, trainer, stop, log, data_fp=data_fp, base=model_path or config.model,
                        n_rows=len(rows), resume_now=resume_now, t0=t0)


def prepare_out(config: StageConfig, rows: Sequence[dict[str, Any]]) -> tuple[str, bool]:
    """Fingerprint the data and check the output folder (refuses a different run without --resume)."""
    from deepr.train.runs import check_out, fingerprint

    if not rows:
        raise ValueError("no training rows: the data file is empty or every record was rejected")
    warn_judge(config)
    data_fp = fingerprint(rows)
    resume_now = check_out(config.out, config.resume, data_fp)
    config.out.mkdir(parents=True, exist_ok=True)
    return data_fp, resume_now


def fit_and_save(config: StageConfig, trainer: Any, stop: Any, log: Any, *, data_fp: str, base: str, n_rows: int,
                 resume_now: bool, t0: float) -> GrpoResult:
    """Train and save (:func:`deepr.train.runs.fit`); deepr_meta.json holds the reward curve."""
    key = f"rewards/{trainer.reward_func_names[0]}/mean"

    def record(status: str) -> None:
        done = {} if status == "running" else {"steps": trainer.state.global_step, "rewards": rewards(),
                                               "seconds": round(time.perf_counter() - t0, 3)}
        write_run_meta(config, status, data_fp, base, {"rows": n_rows, **done})

    def rewards() -> list[tuple[int, float]]:
        return [(h["step"], h[key]) for h in log.rows if key in h]

    status = runs.fit(trainer, config.out, stop, resume_now, record)
    return GrpoResult(out=config.out, steps=trainer.state.global_step, rewards=rewards(),
                      interrupted=status == "interrupted", seconds=time.perf_counter() - t0,
                      llm_spec=llm_spec(config, base), history=log.rows)


# --- helpers of rollouts and reward functions ---------------------------------------------------


def lookup_row(table: dict, key: Any, stage: str) -> Any:
    """The record behind a prompt TRL hands the rollout (TRL passes prompts only)."""
    if key not in table:
        raise KeyError(f"a prompt the {stage} stage did not build reached its rollout; build the rows with the "
                       f"stage's own dataset function")
    return table[key]
