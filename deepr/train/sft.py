"""sft: supervised fine-tuning of one role's adapter on turn-level chat examples (DecomposeR Tables 4–5).

Input: :class:`~deepr.records.ChatExample` records (``sft.jsonl`` from prune-trajectories),
a base model folder or hub name. Output: a folder with the LoRA adapter (or the full model
with ``full=True``), the tokenizer and ``deepr_meta.json`` (role, base model, settings,
losses), loadable by ``deepr run --llm hf:<base>,adapter=<role>:<out>``.

Only the reply of each example carries loss: the prompt (system, user and tool messages,
earlier assistant turns) is masked, with TRL's completion-only loss on a prompt/completion
dataset (``loss="completion"``, the default) or its assistant-only loss on the whole
conversation (``loss="assistant"``, every assistant turn trained). Defaults follow
DecomposeR Table 4: lr 1e-5, 2 epochs, max length 16384, batch 1 x 8 accumulation, cosine
schedule, no weight decay; bf16 on GPU; gradient checkpointing on everywhere. Runs as is under
``accelerate launch`` (the Trainer picks up the launcher's settings).

    deepr sft --model Qwen/Qwen3-8B --data data/sft.jsonl --role planner --out runs/planner
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deepr.io import redact, versions, write_json
from deepr.records import ChatExample, Reject
from deepr.train.runs import (META, check_out, fingerprint, graceful_interrupt, load_tokenizer,  # noqa: F401
                              set_aside_incomplete_checkpoints, stop_callback)

STAGE = "sft"
_ROLES = {"system", "user", "assistant", "tool"}


class SftConfig(BaseModel):
    """Settings of ``deepr sft``; validated on construction."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Base model: a local folder (or a hub name when online) with a chat template.")
    out: Path = Field(description="Output folder for the adapter / model, tokenizer, checkpoints and deepr_meta.json.")
    role: str = Field("all", description="Train on examples of this role only (planner, answerer, ...); 'all' "
                      "trains one shared adapter on every example.")
    loss: Literal["completion", "assistant"] = Field(
        "completion", description="'completion': loss on the final reply only; 'assistant': loss on every "
        "assistant turn (needs a chat template TRL can add generation markers to).")
    full: bool = Field(False, description="Full fine-tune instead of LoRA.")
    lora_r: int = Field(64, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(128, ge=1, description="LoRA alpha (scale = alpha / r).")
    lora_dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA branch.")
    target_modules: str | list[str] = Field("all-linear", description="Modules that get LoRA weights.")
    learning_rate: float = Field(1e-5, gt=0, description="Peak learning rate (Table 4: 1e-5).")
    epochs: float = Field(2.0, gt=0, description="Passes over the data (Table 4: 2).")
    max_steps: int = Field(-1, description="Stop after this many optimiser steps; -1 uses epochs.")
    max_length: int = Field(16384, ge=16, description="Longest example in tokens; longer ones are rejected, "
                            "not truncated, so no reply is trained without its context.")
    batch_size: int = Field(1, ge=1, description="Examples per device per step (Table 4: 1).")
    grad_accum: int = Field(8, ge=1, description="Gradient accumulation steps (Table 4: 8).")
    lr_scheduler: str = Field("cosine", description="Learning-rate schedule (Table 4: cosine).")
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="Fraction of steps spent warming up.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay (Table 4: 0).")
    optim: str | None = Field(None, description="Optimiser name for transformers; None: fused AdamW on GPU, "
                              "plain AdamW on CPU.")
    bf16: bool | None = Field(None, description="bf16 mixed precision; None: on when the GPU supports it.")
    gradient_checkpointing: bool | None = Field(None, description="Recompute activations in the backward pass "
                                                "instead of storing them; None: on (CPU and GPU alike).")
    save_steps: int = Field(200, ge=1, description="Checkpoint every this many steps (what --resume restarts from).")
    logging_steps: int = Field(10, ge=1, description="Log the loss every this many steps.")
    report_to: str = Field("none", description="Trainer logging integration: none, tensorboard, wandb, ...")
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of initialisation and data order.")
    resume: bool = Field(False, description="Continue from the last checkpoint in --out.")

    @field_validator("model")
    @classmethod
    def _absolute_local_model(cls, v: str) -> str:
        # the adapter records this as its base: relative to today's directory, it would not load
        # from another one (`deepr run --llm hf:<adapter>` elsewhere)
        from deepr.llm.hf_adapters import local_path

        return local_path(v)


@dataclass
class SftResult:
    out: Path
    examples: int
    steps: int
    losses: list[float]
    rejects: list[Reject] = field(default_factory=list)
    interrupted: bool = False
    seconds: float = 0.0


# --- examples -> rows -----------------------------------------------------------------------


def example_errors(ex: ChatExample) -> list[str]:
    """Why an example cannot be trained on (its shape, not its content)."""
    msgs = ex.messages
    if len(msgs) < 2:
        return ["needs at least one prompt message and the assistant reply"]
    errors = [f"message {i}: role {m.get('role')!r} is not one of {sorted(_ROLES)}"
              for i, m in enumerate(msgs) if m.get("role") not in _ROLES]
    if msgs[-1].get("role") != "assistant" or not str(msgs[-1].get("content", "")).strip():
        errors.append("the last message must be the assistant reply, with text")
    return errors


def select_examples(examples: Sequence[ChatExample], role: str) -> tuple[list[ChatExample], list[Reject]]:
    """Examples of ``role`` ('all': every one) that have a trainable shape; the rest as rejects."""
    chosen = [e for e in examples if role == "all" or e.role == role]
    if not chosen:
        present = sorted({e.role for e in examples}) or ["none"]
        raise ValueError(f"no examples with role {role!r} in the data (roles present: {', '.join(present)}); "
                         "pick one of those or --role all")
    good, rejects = [], []
    for e in chosen:
        errors = example_errors(e)
        if errors:
            rejects.append(Reject(id=e.id, stage=STAGE, reason="bad_shape: " + "; ".join(errors)))
        else:
            good.append(e)
    return good, rejects


def to_row(ex: ChatExample, loss: str) -> dict[str, Any]:
    msgs = [{"role": m["role"], "content": str(m.get("content", ""))} for m in ex.messages]
    if loss == "assistant":
        return {"messages": msgs}
    return {"prompt": msgs[:-1], "completion": msgs[-1:]}


def drop_too_long(examples: list[ChatExample], tokenizer: Any, max_length: int
                  ) -> tuple[list[ChatExample], list[Reject]]:
    """Reject examples the chat template cannot render or whose rendering exceeds ``max_length`` tokens."""
    from jinja2 import TemplateError

    keep, rejects = [], []
    for e in examples:
        try:
            n = len(tokenizer.apply_chat_template(e.messages, tokenize=True, return_dict=False))
        except (TemplateError, ValueError, TypeError) as err:  # e.g. a role the template does not know
            rejects.append(Reject(id=e.id, stage=STAGE, reason=f"template_error: the chat template cannot "
                                  f"render this example ({err})"))
            continue
        if n > max_length:
            rejects.append(Reject(id=e.id, stage=STAGE, reason=f"too_long: {n} tokens > max_length {max_length} "
                                  "(raise --max-length or shorten the prompts)"))
        else:
            keep.append(e)
    return keep, rejects


def reject_counts(rejects: Sequence[Reject]) -> dict[str, int]:
    """Rejects per reason code (too_long, bad_shape, template_error): the run's sidecar and
    deepr_meta.json say how many examples --max-length dropped, not only how many were dropped."""
    return dict(sorted(Counter(r.reason.split(":", 1)[0] for r in rejects).items()))


def write_run_meta(config: SftConfig, status: str, data_fp: str, counts: dict[str, Any],
                   losses: Sequence[float] = (), seconds: float = 0.0) -> None:
    write_json(config.out / META, {
        "stage": STAGE, "status": status, "role": config.role, "base_model": config.model,
        "adapter": not config.full, "loss": config.loss, "data_fingerprint": data_fp,
        "config": redact(config.model_dump(mode="json")), "counts": counts,
        "losses": [round(x, 5) for x in losses], "seconds": round(seconds, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions(),
    })


# --- training -------------------------------------------------------------------------------


def _trl_args(config: SftConfig, on_gpu: bool, bf16_ok: bool) -> Any:
    from trl import SFTConfig

    from deepr.train.memory import checkpointing_args

    return SFTConfig(
        output_dir=str(config.out), learning_rate=config.learning_rate, num_train_epochs=config.epochs,
        max_steps=config.max_steps, per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum, lr_scheduler_type=config.lr_scheduler,
        warmup_steps=config.warmup_ratio, weight_decay=config.weight_decay,
        optim=config.optim or ("adamw_torch_fused" if on_gpu else "adamw_torch"),
        bf16=bf16_ok if config.bf16 is None else config.bf16,
        # Stored activations filled memory on CPU (SmolLM2-135M at ~3.5k tokens peaked at 11.4 GB without
        # checkpointing, see docs/benchmarks.md); recomputing them costs ~30 % more time.
        **checkpointing_args(SFTConfig, config.gradient_checkpointing is not False),
        max_length=config.max_length, completion_only_loss=config.loss == "completion",
        assistant_only_loss=config.loss == "assistant", save_strategy="steps", save_steps=config.save_steps,
        # a run shorter than the logging interval would log no loss at all (`deepr sft --max-steps 4`)
        save_total_limit=2, report_to=config.report_to, seed=config.seed,
        logging_steps=min(config.logging_steps, config.max_steps) if config.max_steps > 0 else config.logging_steps,
        dataset_num_proc=None, dataloader_pin_memory=on_gpu,
        # use_cpu on every CPU run: transformers refuses bf16 without a GPU unless told, and without it
        # `torchrun --nproc_per_node 2` on CPU starts two unrelated one-process runs (accelerate joins CPU
        # ranks into a gloo group only under use_cpu) that train on the same batches and both save.
        use_cpu=not on_gpu)


def build_trainer(config: SftConfig, examples: Sequence[ChatExample], tokenizer: Any,
                  callbacks: Sequence[Any] = ()) -> Any:
    """An SFTTrainer over ``examples`` (already selected and length-checked)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    on_gpu = torch.cuda.is_available()
    bf16_ok = on_gpu and torch.cuda.is_bf16_supported()
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.bfloat16 if bf16_ok else torch.float32)
    peft_config = None
    if not config.full:
        from peft import LoraConfig

        peft_config = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                                 target_modules=config.target_modules, task_type="CAUSAL_LM")
    dataset = Dataset.from_list([to_row(e, config.loss) for e in examples])
    return SFTTrainer(model=model, args=_trl_args(config, on_gpu, bf16_ok), train_dataset=dataset,
                      processing_class=tokenizer, peft_config=peft_config, callbacks=list(callbacks))


def train_sft(examples: Sequence[ChatExample], config: SftConfig, *, callbacks: Sequence[Any] = ()) -> SftResult:
    """Train ``config.role``'s adapter on ``examples``; returns losses, steps and rejects."""
    from deepr.train.memory import lean_lm_head, return_freed_memory_to_os

    t0 = time.perf_counter()
    return_freed_memory_to_os()
    chosen, rejects = select_examples(examples, config.role)
    tokenizer = load_tokenizer(config.model)
    chosen, too_long = drop_too_long(chosen, tokenizer, config.max_length)
    rejects += too_long
    if not chosen:
        raise ValueError(f"no trainable examples left for role {config.role!r}: {len(rejects)} rejected "
                         f"(first: {rejects[0].reason if rejects else 'none'})")
    data_fp = fingerprint([to_row(e, config.loss) for e in chosen])
    resume_now = check_out(config.out, config.resume, data_fp)
    counts = {"examples": len(chosen), "rejected": len(rejects), "rejected_by_reason": reject_counts(rejects),
              "by_action": dict(sorted(Counter(e.action for e in chosen).items()))}
    stop = stop_callback()
    trainer = build_trainer(config, chosen, tokenizer, [stop, *callbacks])
    main = trainer.is_world_process_zero()
    if main:
        config.out.mkdir(parents=True, exist_ok=True)
        write_run_meta(config, "running", data_fp, counts)
    with graceful_interrupt(stop), lean_lm_head():
        trainer.train(resume_from_checkpoint=True if resume_now else None)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    status = "interrupted" if stop.requested else "done"
    if main:
        if status == "done":
            trainer.save_model(str(config.out))
            trainer.processing_class.save_pretrained(str(config.out))
        counts["steps"] = trainer.state.global_step
        write_run_meta(config, status, data_fp, counts, losses, time.perf_counter() - t0)
    return SftResult(out=config.out, examples=len(chosen), steps=trainer.state.global_step, losses=losses,
                     rejects=rejects, interrupted=stop.requested, seconds=time.perf_counter() - t0)
