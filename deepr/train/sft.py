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
from typing import Any, ClassVar, Literal

from pydantic import Field

from deepr.records import ChatExample, Reject
from deepr.train import runs
from deepr.train.runs import check_out, fingerprint, load_tokenizer, stop_callback
from deepr.train.settings import TrainerSettings

STAGE = "sft"
_ROLES = {"system", "user", "assistant", "tool"}


# What deepr sets on TRL's SFTConfig and LoRA unless the user says otherwise: DecomposeR Table 4
# (lr 1e-5, 2 epochs, max length 16384, batch 1 x 8 accumulation, cosine, no weight decay).
SFT_BASE: dict[str, Any] = {
    "learning_rate": 1e-5, "num_train_epochs": 2.0, "max_length": 16384, "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 8, "lr_scheduler_type": "cosine", "warmup_steps": 0, "weight_decay": 0.0,
    "max_steps": -1, "save_strategy": "steps", "save_steps": 200, "save_total_limit": 2, "logging_steps": 10,
    "report_to": "none", "seed": 0, "lora_r": 64, "lora_alpha": 128, "lora_dropout": 0.05,
    "lora_target_modules": "all-linear"}


class SftConfig(TrainerSettings):
    """Settings of ``deepr sft``: deepr's own fields below; TRL's SFTConfig fields and the LoRA
    settings by TRL's names (:mod:`deepr.train.settings`). ``max_length`` (TRL's) also rejects
    longer examples, so no reply is trained without its context."""

    BASE: ClassVar[dict[str, Any]] = SFT_BASE
    model: str = Field(description="Base model: a local folder (or a hub name when online) with a chat template.")
    out: Path = Field(description="Output folder for the adapter / model, tokenizer, checkpoints and deepr_meta.json.")
    role: str = Field("all", description="Train on examples of this role only (planner, answerer, ...); 'all' "
                      "trains one shared adapter on every example.")
    loss: Literal["completion", "assistant"] = Field(
        "completion", description="'completion': loss on the final reply only; 'assistant': loss on every "
        "assistant turn (needs a chat template TRL can add generation markers to).")
    full: bool = Field(False, description="Full fine-tune instead of LoRA.")
    resume: bool = Field(False, description="Continue from the last checkpoint in --out.")


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


# --- training -------------------------------------------------------------------------------


def _trl_args(config: SftConfig, on_gpu: bool, bf16_ok: bool) -> Any:
    from trl import SFTConfig

    from deepr.train.memory import checkpointing_args
    from deepr.train.settings import build_args

    given = dict(config.trl)
    # Stored activations filled memory on CPU (SmolLM2-135M at ~3.5k tokens peaked at 11.4 GB without
    # checkpointing, docs/training.md); recomputing them costs ~30 % more time.
    checkpointing = given.pop("gradient_checkpointing", None) is not False
    if given.get("bf16") is None:
        given["bf16"] = bf16_ok
    given.setdefault("optim", "adamw_torch_fused" if on_gpu else "adamw_torch")
    if given["max_steps"] > 0:  # a run shorter than the logging interval would log no loss at all
        given["logging_steps"] = min(given["logging_steps"], given["max_steps"])
    # use_cpu on every CPU run: transformers refuses bf16 without a GPU unless told, and without it
    # `torchrun --nproc_per_node 2` on CPU starts two unrelated one-process runs (accelerate joins CPU
    # ranks into a gloo group only under use_cpu) that train on the same batches and both save.
    return build_args(SFTConfig, given, "TRL's SFTConfig", output_dir=str(config.out),
                      completion_only_loss=config.loss == "completion", assistant_only_loss=config.loss == "assistant",
                      dataset_num_proc=None, dataloader_pin_memory=on_gpu, use_cpu=not on_gpu,
                      **checkpointing_args(SFTConfig, checkpointing))


def build_trainer(config: SftConfig, examples: Sequence[ChatExample], tokenizer: Any,
                  callbacks: Sequence[Any] = ()) -> Any:
    """An SFTTrainer over ``examples`` (already selected and length-checked)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    on_gpu = torch.cuda.is_available()
    bf16_ok = on_gpu and torch.cuda.is_bf16_supported()
    args = _trl_args(config, on_gpu, bf16_ok)  # before the weights load: a refused setting costs nothing
    peft_config = None if config.full else config.peft_config()
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.bfloat16 if bf16_ok else torch.float32)
    dataset = Dataset.from_list([to_row(e, config.loss) for e in examples])
    return SFTTrainer(model=model, args=args, train_dataset=dataset,
                      processing_class=tokenizer, peft_config=peft_config, callbacks=list(callbacks))


def train_sft(examples: Sequence[ChatExample], config: SftConfig, *, callbacks: Sequence[Any] = ()) -> SftResult:
    """Train ``config.role``'s adapter on ``examples``; returns losses, steps and rejects."""
    t0 = time.perf_counter()
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

    def record(status: str) -> None:  # deepr_meta.json: counts, then steps, losses and seconds when done
        done = {} if status == "running" else {"steps": trainer.state.global_step}
        runs.write_run_meta(config, stage=STAGE, status=status, role=config.role, base_model=config.model,
                            loss=config.loss, data_fingerprint=data_fp, counts={**counts, **done},
                            losses=[round(x, 5) for x in losses()], seconds=round(time.perf_counter() - t0, 3))

    def losses() -> list[float]:
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    status = runs.fit(trainer, config.out, stop, resume_now, record)
    return SftResult(out=config.out, examples=len(chosen), steps=trainer.state.global_step, losses=losses(),
                     rejects=rejects, interrupted=status == "interrupted", seconds=time.perf_counter() - t0)
