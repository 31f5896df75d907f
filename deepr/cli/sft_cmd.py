"""`deepr prune-trajectories` and `deepr sft`: files and flags around :mod:`deepr.train.trajectories`
and :mod:`deepr.train.sft`."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from deepr.cli import flags as F
from deepr.cli.app import app, console, finish, summary_table, user_errors


def _main_process() -> bool:
    """Under `accelerate launch` every rank runs this command; only rank 0 writes and prints."""
    return os.environ.get("RANK", "0") == "0"


def attach_rubrics(trajs: list, path: Path) -> None:
    """Give trajectories recorded without rubrics those of their question (whitespace-normalised)."""
    from deepr.io import read_jsonl
    from deepr.records import QRPair

    by_query = {" ".join(p.question.split()): p.rubrics for p in read_jsonl(path, QRPair)}
    for t in trajs:
        if not t.rubrics:
            t.rubrics = by_query.get(" ".join(t.query.split()), [])


def _judge_factory(judge_llm: str, base_url: str | None, api_key: str | None, timeout: float,
                   gen: Any = None, deadline: float | None = None) -> Any:
    def make() -> Any:
        from deepr.corpus.embed import get_embedder
        from deepr.rewards.judges import Judge

        llm = None
        if judge_llm != "extractive":
            from deepr.llm import llm_from_flags

            llm = llm_from_flags(judge_llm, base_url, api_key, False, timeout, 8, gen=gen)
            llm.set_deadline(deadline)
        return Judge(llm, get_embedder().encode)

    return make


def _action_table(stats: dict[str, Any]) -> None:
    before, after = stats["actions_before"], stats["actions_after"]
    actions = sorted({a for d in (*before.values(), *after.values()) for a in d})
    table = Table(title="actions before -> after balancing", header_style="bold")
    for col in ("action", "sft before", "sft after", "rl before", "rl after"):
        table.add_column(col, justify="left" if col == "action" else "right")
    for a in actions:
        table.add_row(escape(str(a)), *(str(d[s].get(a, 0)) for s in ("sft", "rl") for d in (before, after)))
    console.print(table)


PRUNE_OUTPUTS = ["sft.jsonl", "rl.jsonl", "sft.jsonl.meta.json", "rl.jsonl.meta.json", "prune.rejects.jsonl"]


@app.command("prune-trajectories", epilog=F.EXIT_HELP)
def prune_trajectories_cmd(
    trajectories: Path = typer.Argument(..., help="Teacher trajectories (JSONL) written by `deepr run --record`."),
    out_dir: Path = typer.Option(..., "--out-dir", "-o", help="Folder for sft.jsonl, rl.jsonl, "
                                 "prune.rejects.jsonl and their .meta.json sidecars."),
    rubrics: Path | None = typer.Option(None, "--rubrics", help="verified.jsonl (or pairs.jsonl): rubrics for "
                                        "trajectories recorded without them, matched by question text; they "
                                        "score warp drafts."),
    target_ratios: str = typer.Option("uniform", "--target-ratios", help="Wanted share per action after "
                                      "balancing, e.g. plan=0.3,terminate=0.2 (unnamed actions share the rest); "
                                      "'uniform' = equal shares; 'none' = keep the natural mix."),
    max_upsample: float = typer.Option(3.0, "--max-upsample", help="Most copies of one example balancing may "
                                       "make; the split shrinks instead of repeating rare actions more."),
    total: int | None = typer.Option(None, "--total", help="Most examples per split after balancing."),
    heldout: float = typer.Option(0.1, "--heldout", help="Fraction of queries held out for rl.jsonl."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the split and of the balancing draws "
                                    "(default 0); also sent with every judge call when given."),
    no_prune: bool = typer.Option(False, "--no-prune", help="Keep warp trajectories whole (no best-draft cut)."),
    judge_llm: str = typer.Option("extractive", "--judge-llm", help="Judge scoring warp drafts against "
                                  "their rubrics: " + F.LLM_HELP),
    base_url: str | None = typer.Option(None, "--base-url", help="OpenAI-compatible endpoint for the judge."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="Key for the judge."),
    timeout: float = F.TIMEOUT, deadline: float | None = F.DEADLINE,
    max_tokens: int | None = F.MAX_TOKENS, temperature: float | None = F.TEMPERATURE,
    top_p: float | None = F.TOP_P,
    limit: int | None = typer.Option(None, "--limit", help="Read only the first N trajectories."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the counts, write nothing."),
) -> None:
    """Filter, prune and balance teacher trajectories into turn-level SFT / RL examples
    (AgentCPM-Report's pruning at the best draft and action balancing; DecomposeR's turn-level SFT)."""
    from deepr.io import read_jsonl, require_records
    from deepr.records import Trajectory
    from deepr.train.trajectories import STAGE, PruneConfig, judge_scorer, prune_trajectories

    t0 = time.perf_counter()
    # only an openai: judge's replies are cached (deepr.llm.get_llm), so only they outlive a Ctrl-C
    kept = ("the judge's replies received so far stay in the reply cache, so a re-run asks only for the rest"
            if judge_llm.startswith("openai:") else "a re-run starts over")
    with user_errors({"": "--target-ratios"}, interrupted="interrupted: nothing was written (prune-trajectories "
                     f"writes its outputs at the end); {kept}."):
        F.check_budget(timeout, deadline, None, limit)
        gen = F.gen_defaults(max_tokens, temperature, top_p, seed)
        config = PruneConfig(target_ratios=target_ratios, max_upsample=max_upsample, total=total,
                             heldout=heldout, seed=seed or 0, prune_drafts=not no_prune)
        from deepr.io import check_paths

        check_paths([("TRAJECTORIES", trajectories), ("--rubrics", rubrics)], [],
                    [("--out-dir", out_dir, PRUNE_OUTPUTS)])
        trajs = require_records(list(read_jsonl(trajectories, Trajectory)), trajectories, what="trajectories")[:limit]
        if rubrics is not None:
            attach_rubrics(trajs, rubrics)
        scorer = judge_scorer(_judge_factory(judge_llm, base_url, api_key, timeout, gen, deadline))
        if judge_llm == "extractive":
            examples, rejects, stats = prune_trajectories(trajs, config, scorer)
        else:  # a model judges the drafts: calls worth watching
            from deepr.cli.live import LiveView

            with LiveView("prune-trajectories", deadline=deadline):
                examples, rejects, stats = prune_trajectories(trajs, config, scorer)
    rows = [("trajectories read", stats["trajectories"]), ("kept", stats["kept"])]
    rows += [(f"dropped: {code}", n) for code, n in stats["dropped"].items()]
    rows += [("warp trajectories cut at best draft", stats["trajectories_cut"]),
             ("turns removed by pruning", stats["turns_removed"]),
             ("decisions relabeled TERMINATE", stats["relabeled_terminate"]),
             ("queries sft / rl", f"{stats['queries']['sft']} / {stats['queries']['rl']}"),
             ("examples sft / rl", f"{len(examples['sft'])} / {len(examples['rl'])}")]
    summary_table(STAGE + (" (dry run)" if dry_run else ""), rows)
    _action_table(stats)
    if dry_run:
        return
    with user_errors():
        _write_prune_outputs(out_dir, examples, rejects, stats, config, [trajectories, rubrics], judge_llm, t0)
    from deepr.cli.exit_codes import exit_code

    # Dropping failed trajectories is the stage's job, not a failure; producing nothing is.
    n = len(examples["sft"]) + len(examples["rl"])
    finish(exit_code(n, failed=0 if n or not stats["trajectories"] else 1))


def _write_prune_outputs(out_dir: Path, examples: dict, rejects: list, stats: dict, config: Any,
                         inputs: list[Path | None], judge_llm: str, t0: float) -> None:
    from deepr.io import rejects_path, write_jsonl, write_meta
    from deepr.train.trajectories import STAGE

    for split in ("sft", "rl"):
        out = out_dir / f"{split}.jsonl"
        write_jsonl(out, examples[split])
        write_meta(out, stage=STAGE, config=config.model_dump(), inputs=[p for p in inputs if p],
                   counts={**stats, "examples": len(examples[split])},
                   timings={"seconds": round(time.perf_counter() - t0, 3)}, extra={"judge": judge_llm})
    rejected = rejects_path(out_dir / "prune.jsonl")
    write_jsonl(rejected, rejects)
    console.print(f"wrote {out_dir / 'sft.jsonl'}, {out_dir / 'rl.jsonl'} and {rejected} ({len(rejects)} rejected)",
                  markup=False)


def _reject_rows(by_reason: dict[str, int], max_length: int) -> list[tuple[str, int]]:
    """Rejected examples per reason, short enough not to wrap (sft.rejects.jsonl has each one's)."""
    label = {"too_long": f"too long (> {max_length} tokens)", "bad_shape": "bad shape",
             "template_error": "template error"}
    return [(f"  {label.get(code, code)}", n) for code, n in by_reason.items()]


@app.command("sft", epilog=F.EXIT_HELP)
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
    lora_r: int = typer.Option(64, "--lora-r", help="LoRA rank."),
    lora_alpha: int = typer.Option(128, "--lora-alpha", help="LoRA alpha."),
    lr: float = typer.Option(1e-5, "--lr", help="Peak learning rate."),
    epochs: float = typer.Option(2.0, "--epochs", help="Passes over the data."),
    max_steps: int = typer.Option(-1, "--max-steps", help="Stop after N optimiser steps (-1: use --epochs)."),
    max_length: int = typer.Option(16384, "--max-length", help="Longest example in tokens; longer ones are "
                                   "rejected, never truncated."),
    batch_size: int = typer.Option(1, "--batch-size", help="Examples per device per step."),
    grad_accum: int = typer.Option(8, "--grad-accum", help="Gradient accumulation steps."),
    save_steps: int = typer.Option(200, "--save-steps", help="Checkpoint every N steps."),
    logging_steps: int = typer.Option(10, "--logging-steps", help="Log the loss every N steps."),
    report_to: str = typer.Option("none", "--report-to", help="Logging integration: none, tensorboard, wandb."),
    seed: int = typer.Option(0, "--seed", help="Seed of initialisation and data order."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the last checkpoint in --out."),
    checkpointing: bool = typer.Option(True, "--gradient-checkpointing/--no-gradient-checkpointing",
                                       help="Recompute activations in the backward pass: less memory, more "
                                       "compute; off stores them (docs/training.md compares the two)."),
    bf16: bool | None = typer.Option(None, "--bf16/--no-bf16", help="bf16 mixed precision (default: on a GPU "
                                     "that supports it; it also speeds up CPU steps, see docs/training.md)."),
    limit: int | None = typer.Option(None, "--limit", help="Use only the first N examples of --data."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Select and length-check the examples, train nothing."),
) -> None:
    """Fine-tune one role's LoRA adapter (or the full model) on turn-level chat examples
    (DecomposeR's SFT stage).
    Multi-GPU: `accelerate launch --config_file docs/accelerate/deepspeed_zero2.yaml -m deepr sft ...`."""
    from deepr.io import read_jsonl, require_records, write_jsonl, write_meta
    from deepr.records import ChatExample
    from deepr.train.sft import SftConfig, drop_too_long, load_tokenizer, reject_counts, select_examples, train_sft

    main = _main_process()
    with user_errors({"learning_rate": "--lr"}):
        from deepr.io import check_paths, meta_path

        check_paths([("--data", data)], [("--out", meta_path(out))], [("--out", out, ["sft.rejects.jsonl"])])
        if Path(model).exists() and Path(model).resolve() == out.resolve():
            raise ValueError(f"--out {out} is the --model folder; training would overwrite the base model")
        config = SftConfig(model=model, out=out, role=role, loss=loss, full=full, lora_r=lora_r,
                           lora_alpha=lora_alpha, learning_rate=lr, epochs=epochs, max_steps=max_steps,
                           max_length=max_length, batch_size=batch_size, grad_accum=grad_accum,
                           save_steps=save_steps, logging_steps=logging_steps, report_to=report_to, seed=seed,
                           resume=resume, gradient_checkpointing=checkpointing, bf16=bf16)
        examples = require_records(list(read_jsonl(data, ChatExample)), data, "--data", "examples")[:limit]
        if dry_run:
            chosen, rejects = select_examples(examples, role)
            chosen, too_long = drop_too_long(chosen, load_tokenizer(model), max_length)
            summary_table("sft (dry run)", [("examples", len(examples)), (f"role {role}", len(chosen)),
                                            ("rejected", len(rejects) + len(too_long)),
                                            *_reject_rows(reject_counts(rejects + too_long), max_length)])
            return
        result = train_sft(examples, config)
    if not main:
        return
    write_jsonl(out / "sft.rejects.jsonl", result.rejects)
    write_meta(out, stage="sft", config=config.model_dump(mode="json"), inputs=[data],
               counts={"examples": result.examples, "rejected": len(result.rejects),
                       "rejected_by_reason": reject_counts(result.rejects), "steps": result.steps},
               timings={"seconds": round(result.seconds, 3)},
               extra={"status": "interrupted" if result.interrupted else "done"})
    first, last = (result.losses[0], result.losses[-1]) if result.losses else ("not logged",) * 2
    summary_table("sft", [("role", role), ("examples", result.examples), ("rejected", len(result.rejects)),
                          *_reject_rows(reject_counts(result.rejects), max_length), ("steps", result.steps),
                          ("first loss", first), ("last loss", last),
                          ("seconds", result.seconds), ("output", str(out))])
    if result.interrupted:
        console.print(f"[yellow]interrupted[/]: checkpoint saved in {out}; re-run the same command with "
                      "--resume to continue.")
        raise typer.Exit(130)
