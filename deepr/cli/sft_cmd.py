"""`deepr sft`: files and flags around :mod:`deepr.train.sft`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from deepr.cli import flags as F
from deepr.cli.app import app, console, summary_table, user_errors


def _reject_rows(by_reason: dict[str, int], max_length: int) -> list[tuple[str, int]]:
    """Rejected examples per reason, short enough not to wrap (sft.rejects.jsonl has each one's)."""
    label = {"too_long": f"too long (> {max_length} tokens)", "bad_shape": "bad shape",
             "template_error": "template error"}
    return [(f"  {label.get(code, code)}", n) for code, n in by_reason.items()]


# TRL / LoRA settings an SFT run sets most, as flags (any other: --set NAME=VALUE); defaults: DecomposeR Table 4.
SFT_FLAGS: dict[str, tuple[str, Any, str]] = {
    "learning_rate": ("--lr", float, "Peak learning rate (default 1e-5)."),
    "num_train_epochs": ("--epochs", float, "Passes over the data (default 2)."),
    "max_steps": ("--max-steps", int, "Stop after N optimiser steps (-1: use --epochs)."),
    "max_length": ("--max-length", int, "Longest example in tokens (default 16384); longer ones are rejected, "
                   "never truncated."),
    "per_device_train_batch_size": ("--batch-size", int, "Examples per device per step (default 1)."),
    "gradient_accumulation_steps": ("--grad-accum", int, "Gradient accumulation steps (default 8)."),
    "lora_r": ("--lora-r", int, "LoRA rank (default 64)."), "lora_alpha": ("--lora-alpha", int, "LoRA alpha (128)."),
    "save_steps": ("--save-steps", int, "Checkpoint every N steps (default 200)."),
    "logging_steps": ("--logging-steps", int, "Log the loss every N steps (default 10)."),
    "report_to": ("--report-to", str, "Logging integration: none, tensorboard, wandb."),
    "seed": ("--seed", int, "Seed of initialisation and data order (default 0)."),
    "gradient_checkpointing": ("--gradient-checkpointing/--no-gradient-checkpointing", bool, "Recompute "
                               "activations in the backward pass: less memory, more compute (default on)."),
    "bf16": ("--bf16/--no-bf16", bool, "bf16 mixed precision (default: on a GPU that supports it)."),
}


@app.command("sft", epilog=F.EXIT_HELP)
@F.setting_options(SFT_FLAGS)
def sft_cmd(
    model: str = typer.Option(..., "--model", help="Base model folder (or hub name when online) with a chat "
                              "template; build a tiny offline one with `python -m deepr.train.tiny DIR`."),
    data: Path = typer.Option(..., "--data", help="sft.jsonl from `deepr prune-trajectories`."),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder: adapter (or model), tokenizer, "
                             "checkpoints, deepr_meta.json."),
    role: str = typer.Option("all", "--role", help="Train on this role's examples only (planner, answerer, "
                             "warp, ...); 'all' trains one shared adapter on every example."),
    loss: str = typer.Option("completion", "--loss", help="'completion': loss on each example's final reply "
                             "only; 'assistant': on every assistant turn. Prompts and tool output never."),
    full: bool = typer.Option(False, "--full", help="Full fine-tune instead of LoRA."),
    config_file: Path | None = typer.Option(None, "--config", help="JSON/TOML file of settings (any TRL "
                                            "SFTConfig / LoRA field by TRL's name); flags override it."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the last checkpoint in --out."),
    limit: int | None = typer.Option(None, "--limit", help="Use only the first N examples of --data."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Select and length-check the examples, train nothing."),
    settings: dict[str, Any] | None = None,
) -> None:
    """Fine-tune one role's LoRA adapter (or the full model) on turn-level chat examples
    (DecomposeR's SFT stage).
    Multi-GPU: `accelerate launch --config_file docs/accelerate/deepspeed_zero2.yaml -m deepr sft ...`."""
    from deepr.io import read_jsonl, require_records, write_jsonl, write_meta
    from deepr.records import ChatExample
    from deepr.train.sft import SftConfig, drop_too_long, load_tokenizer, reject_counts, select_examples, train_sft

    main = os.environ.get("RANK", "0") == "0"  # under `accelerate launch` only rank 0 writes and prints
    with user_errors({n: f.split("/")[0] for n, (f, _, _) in SFT_FLAGS.items()}):
        from deepr.io import check_paths, meta_path

        check_paths([("--data", data), ("--config", config_file)], [("--out", meta_path(out))],
                    [("--out", out, ["sft.rejects.jsonl"])])
        if Path(model).exists() and Path(model).resolve() == out.resolve():
            raise ValueError(f"--out {out} is the --model folder; training would overwrite the base model")
        config = SftConfig(**{**F.load_config_file(config_file), **(settings or {})}, model=model, out=out,
                           role=role, loss=loss, full=full, resume=resume)
        examples = require_records(list(read_jsonl(data, ChatExample)), data, "--data", "examples")[:limit]
        if dry_run:
            chosen, rejects = select_examples(examples, role)
            chosen, too_long = drop_too_long(chosen, load_tokenizer(model), config.max_length)
            summary_table("sft (dry run)", [("examples", len(examples)), (f"role {role}", len(chosen)),
                                            ("rejected", len(rejects) + len(too_long)),
                                            *_reject_rows(reject_counts(rejects + too_long), config.max_length)])
            return
        result = train_sft(examples, config)
    if not main:
        return
    write_jsonl(out / "sft.rejects.jsonl", result.rejects)
    write_meta(out, stage="sft", config=config.flat(), inputs=[data],
               counts={"examples": result.examples, "rejected": len(result.rejects),
                       "rejected_by_reason": reject_counts(result.rejects), "steps": result.steps},
               timings={"seconds": round(result.seconds, 3)},
               extra={"status": "interrupted" if result.interrupted else "done"})
    first, last = (result.losses[0], result.losses[-1]) if result.losses else ("not logged",) * 2
    summary_table("sft", [("role", role), ("examples", result.examples), ("rejected", len(result.rejects)),
                          *_reject_rows(reject_counts(result.rejects), config.max_length), ("steps", result.steps),
                          ("first loss", first), ("last loss", last),
                          ("seconds", result.seconds), ("output", str(out))])
    if result.interrupted:
        console.print(f"[yellow]interrupted[/]: checkpoint saved in {out}; re-run the same command with "
                      "--resume to continue.")
        raise typer.Exit(130)
