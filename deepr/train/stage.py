"""What every extra GRPO stage (rubric, decor, warp-atomic, warp-report) shares: the stage config
with the paper's defaults filled in, one trainer builder, one fit-and-save path, and the small
helpers rollouts and reward functions use. Stage modules import this; nothing here imports them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from pydantic import Field, model_validator

from deepr.train.grpo import (METRICS, GrpoConfig, GrpoResult, fill_optimiser, fit_and_save, metrics_callback,
                              prepare_out, trl_args)


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
        fill_optimiser(self)  # loss / schedule / beta2 the paper leaves open
        if self.prompts_per_step % self.mini_batch_prompts:
            raise ValueError(f"prompts_per_step {self.prompts_per_step} must be a multiple of mini_batch_prompts "
                             f"{self.mini_batch_prompts}")
        if self.planner_adapter is not None:
            raise ValueError(f"--planner-adapter is for --stage answerer, not {self.stage}")
        if self.train_turns is not None:
            raise ValueError(f"train_turns is for --stage planner and answerer, not {self.stage}")
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
    from deepr.train.signals import zero_advantage_callback

    t0 = time.perf_counter()
    data_fp, resume_now = prepare_out(config, rows)
    stop, log = _make_stop_callback(), metrics_callback(config.out / METRICS)
    guard = zero_advantage_callback(config.zero_advantage, stage=config.stage)  # before `log`: it adds to the row
    trainer = build_stage_trainer(config, rows, rollout_func, reward_fn, [stop, guard, log, *callbacks], trainer_cls)
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
