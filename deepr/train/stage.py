"""What every GRPO stage shares: :class:`StageConfig` (the one config base: each stage class names
its paper's values in ``PAPER``; fields left None take them), :func:`build_stage_trainer` (the one
trainer builder), :func:`train_stage` (checkpoints, --resume, Ctrl-C, metrics.jsonl, adapter and
deepr_meta.json) and the small helpers rollouts and reward functions use. The stage registry is
:mod:`deepr.train.stages`; stage modules import this module, and it imports none of them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deepr.io import redact, versions, write_json
from deepr.llm.base import GenDefaults
from deepr.train.runs import META, METRICS

# Stages whose reward has LLM-judged terms, and those terms (what the extractive judge stands in for).
JUDGED_TERMS = {"answerer": "J_rub", "rubric": "R_rubric and claim support in R_cite",
                "decor": "LJ of R_team and the role judges R_role",
                "warp-report": "the report-level rubric / quality judge",
                "warp-atomic": "outline and paragraph holistic quality and faithfulness"}


class StageConfig(BaseModel):
    """Settings of ``deepr grpo --stage X``. A stage class sets ``PAPER`` (its paper's values for
    fields left None, see :meth:`paper`) and ``ROLE`` (the ``deepr run`` role its adapter serves)."""

    model_config = ConfigDict(extra="forbid")
    PAPER: ClassVar[dict[str, Any]] = {}
    ROLE: ClassVar[str] = "agent"

    stage: str = Field(description="Training stage (a name of deepr.train.stages.STAGES).")
    model: str = Field(description="Starting model folder (planner: the SFT checkpoint; answerer: the base).")
    out: Path = Field(description="Output folder: adapter, tokenizer, deepr_meta.json, metrics.jsonl, checkpoints.")
    planner_adapter: Path | None = Field(None, description="answerer: planner adapter merged into --model first.")
    full: bool = Field(False, description="Full fine-tune instead of LoRA.")
    lora_r: int = Field(64, ge=1, description="LoRA rank (DecomposeR Table 5: 64).")
    lora_alpha: int = Field(128, ge=1, description="LoRA alpha (DecomposeR Table 5: 128).")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA branch.")
    target_modules: str | list[str] = Field("all-linear", description="Modules that get LoRA weights.")
    learning_rate: float | None = Field(None, gt=0, description="Learning rate, no warm-up; None: the paper's.")
    beta: float | None = Field(None, ge=0, description="KL coefficient; None: the paper's.")
    num_generations: int | None = Field(None, ge=2, description="Rollouts per prompt (the GRPO group); None: "
                                        "the paper's.")
    prompts_per_step: int | None = Field(None, ge=1, description="Unique prompts per generation batch; None: "
                                         "the paper's.")
    mini_batch_prompts: int | None = Field(None, ge=1, description="Prompts per optimiser update; None: half "
                                           "of prompts_per_step (2 mini-batches per step).")
    max_completion_length: int | None = Field(None, ge=8, description="Token budget of one rollout, environment "
                                              "turns included; None: the paper's.")
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
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of rollouts (DecomposeR Table 5: 1.0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of rollouts (DecomposeR Table 5: 1.0).")
    loss_type: str | None = Field(None, description="TRL loss aggregation; None: the stage paper's. grpo = "
                                  "mean over each rollout's tokens, then over rollouts (DecomposeR Eq. 16; a "
                                  "rollout of several model calls counts once); dapo = one mean over every "
                                  "token of the batch (long rollouts weigh more); also dr_grpo, bnpo, cispo, "
                                  "sapo, luspo, vespo.")
    lr_scheduler: str | None = Field(None, description="Learning-rate schedule (transformers name); None: the "
                                     "paper's (constant; DECOR cosine).")
    adam_beta2: float | None = Field(None, gt=0, lt=1, description="AdamW beta2; None: the paper's (0.999; "
                                     "DECOR 0.95).")
    epsilon: float = Field(0.2, gt=0, description="Lower clip range of the ratio.")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clip range (asymmetric clip); None = epsilon.")
    importance_sampling_level: Literal["token", "sequence"] = Field("token", description="Ratio per token or per "
                                                                    "sequence (GSPO).")
    scale_rewards: str = Field("group", description="Advantage scaling: group, batch or none.")
    use_vllm: bool = Field(False, description="Generate with vLLM (GPU only).")
    vllm_mode: Literal["colocate", "server"] = Field("colocate", description="colocate: vLLM in the training "
                                                     "processes; server: a `trl vllm-serve` process.")
    vllm_server_base_url: str | None = Field(None, description="server mode: URL of `trl vllm-serve`.")
    max_steps: int = Field(-1, description="Stop after this many optimiser steps; -1: one pass over the data.")
    epochs: float = Field(1.0, gt=0, description="Passes over the data when max_steps is -1.")
    save_steps: int = Field(50, ge=1, description="Checkpoint every this many steps (what --resume restarts from).")
    logging_steps: int = Field(1, ge=1, description="Log metrics every this many steps.")
    zero_advantage: Literal["stop", "warn", "off"] = Field("stop", description="When every group's reward is "
                                                           "constant in the first steps: stop, warn or off.")
    report_to: str = Field("none", description="Extra logging integration: none, tensorboard, wandb.")
    bf16: bool | None = Field(None, description="bf16; None: on when the GPU supports it.")
    gradient_checkpointing: bool | None = Field(None, description="Recompute activations in the backward pass; "
                                                "None: on (turn 2 of a planner rollout is ~3k tokens; storing them "
                                                "took a 135M model's step past 12 GB on CPU, docs/benchmarks.md).")
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of sampling, data order and LoRA initialisation.")
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

    @field_validator("model")
    @classmethod
    def _absolute_local_model(cls, v: str) -> str:
        # the adapter records this as its base: relative to today's directory, it would not load
        # from another one (`deepr run --llm hf:<adapter>` elsewhere)
        from deepr.llm.hf_adapters import local_path

        return local_path(v)

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
        for name, value in self.paper().items():
            if getattr(self, name, None) is None:
                setattr(self, name, value)
        if self.mini_batch_prompts is None:
            self.mini_batch_prompts = max(1, self.prompts_per_step // 2)
        fill_optimiser(self)  # loss / schedule / beta2 the paper leaves open
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.prompts_per_step % self.mini_batch_prompts:
            raise ValueError(f"prompts_per_step {self.prompts_per_step} must be a multiple of mini_batch_prompts "
                             f"{self.mini_batch_prompts}")
        if self.mini_batch_prompts % world:
            raise ValueError(f"mini_batch_prompts {self.mini_batch_prompts} must be a multiple of the "
                             f"{world} training processes")
        self.check_stage_fields()
        return self

    def paper(self) -> dict[str, Any]:
        """The paper's values of this stage (fields left None take them)."""
        return self.PAPER

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


def fill_optimiser(config: StageConfig) -> None:
    """Values no stage paper sets: TRL's token-mean loss, a constant rate, AdamW's usual beta2."""
    for name, value in (("loss_type", "dapo"), ("lr_scheduler", "constant"), ("adam_beta2", 0.999)):
        if getattr(config, name) is None:
            setattr(config, name, value)


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


def metrics_callback(path: Path) -> Any:
    """A TrainerCallback appending every log row (all reward sub-terms TRL collected) to ``path``."""
    from transformers import TrainerCallback

    class MetricsLog(TrainerCallback):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            if not logs or not state.is_world_process_zero:
                return
            row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            self.rows.append(row)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())

    return MetricsLog()


def llm_spec(config: StageConfig, base: str) -> str:
    # a stage may train one adapter that several agent roles use (DECOR's team): it names them all
    roles = config.adapter_roles
    return f"hf:{base}" if config.full else f"hf:{base}," + ",".join(f"adapter={r}:{config.out}" for r in roles)


def write_run_meta(config: StageConfig, status: str, data_fp: str, base: str, extra: dict[str, Any]) -> None:
    write_json(config.out / META, {
        "stage": f"grpo-{config.stage}", "status": status, "role": config.role, "base_model": base,
        "adapter": not config.full, "llm_spec": llm_spec(config, base), "data_fingerprint": data_fp,
        "config": redact(config.model_dump(mode="json")), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": versions(), **judge_record(config), **sampling_record(config), **extra})


# --- trainer ----------------------------------------------------------------------------------


def trl_args(config: StageConfig) -> Any:
    """GRPOConfig from our config: one group per micro-batch, mini_batch_prompts per update."""
    import torch
    from trl import GRPOConfig

    from deepr.train.memory import checkpointing_args

    on_gpu = torch.cuda.is_available()
    bf16_ok = on_gpu and torch.cuda.is_bf16_supported()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    vllm = {"vllm_mode": config.vllm_mode}
    if config.vllm_server_base_url:
        vllm["vllm_server_base_url"] = config.vllm_server_base_url
    return GRPOConfig(
        output_dir=str(config.out), learning_rate=config.learning_rate, lr_scheduler_type=config.lr_scheduler,
        adam_beta2=config.adam_beta2, warmup_steps=0, weight_decay=0.0, max_steps=config.max_steps,
        num_train_epochs=config.epochs,
        per_device_train_batch_size=config.num_generations,
        gradient_accumulation_steps=config.mini_batch_prompts // world,
        steps_per_generation=config.prompts_per_step // world, num_generations=config.num_generations,
        max_completion_length=config.max_completion_length, temperature=config.temperature, top_p=config.top_p,
        beta=config.beta, loss_type=config.loss_type, epsilon=config.epsilon, epsilon_high=config.epsilon_high,
        importance_sampling_level=config.importance_sampling_level, scale_rewards=config.scale_rewards,
        use_vllm=config.use_vllm, **vllm, bf16=bf16_ok if config.bf16 is None else config.bf16,
        # CPU too: each revision call trains on ~3k tokens and a micro-batch holds several (see the field)
        **checkpointing_args(GRPOConfig, config.gradient_checkpointing is not False),
        save_strategy="steps", save_steps=config.save_steps, save_total_limit=2,
        logging_steps=config.logging_steps, report_to=config.report_to, seed=config.seed,
        use_cpu=not on_gpu, dataloader_num_workers=0, log_completions=False)


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
    args = trl_args(config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    peft_config = None
    if not config.full:
        from peft import LoraConfig

        peft_config = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                                 target_modules=config.target_modules, task_type="CAUSAL_LM")
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
    stop, log = stop_callback(), metrics_callback(config.out / METRICS)
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
    """Train (Ctrl-C stops cleanly at a step), then save adapter + tokenizer + run metadata on rank 0.
    Every stage ends here, so outputs and deepr_meta.json look the same whatever the stage."""
    from deepr.train.memory import lean_lm_head, return_freed_memory_to_os
    from deepr.train.runs import graceful_interrupt

    return_freed_memory_to_os()
    main = trainer.is_world_process_zero()
    if main:
        write_run_meta(config, "running", data_fp, base, {"rows": n_rows})
    with graceful_interrupt(stop), lean_lm_head():
        trainer.train(resume_from_checkpoint=True if resume_now else None)
    status = "interrupted" if stop.requested else "done"
    key = f"rewards/{trainer.reward_func_names[0]}/mean"
    rewards = [(h["step"], h[key]) for h in log.rows if key in h]
    if main:
        if status == "done":
            trainer.save_model(str(config.out))
            trainer.processing_class.save_pretrained(str(config.out))
        write_run_meta(config, status, data_fp, base, {
            "rows": n_rows, "steps": trainer.state.global_step, "rewards": rewards,
            "seconds": round(time.perf_counter() - t0, 3)})
    return GrpoResult(out=config.out, steps=trainer.state.global_step, rewards=rewards, interrupted=stop.requested,
                      seconds=time.perf_counter() - t0, llm_spec=llm_spec(config, base), history=log.rows)


# --- helpers of rollouts and reward functions ---------------------------------------------------


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


def make_judge(spec: str, gen: Any = None) -> Any:
    """The reward judge: extractive (embeddings) or an LLM spec such as openai:<model>, called with
    ``gen`` (the command's GenDefaults: --max-tokens, --temperature, --top-p, --seed)."""
    from deepr.corpus.embed import get_embedder
    from deepr.rewards.judges import Judge

    embed = get_embedder().encode
    if spec == "extractive":
        return Judge(None, embed)
    from deepr.llm import get_llm

    return Judge(get_llm(spec, gen=gen), embed)
