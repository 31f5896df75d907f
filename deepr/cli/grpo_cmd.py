"""`deepr grpo` (staged RL) and `deepr grpo prepare`: files and flags around
:mod:`deepr.train.grpo` and :mod:`deepr.train.prepare`.

GPU users: `accelerate launch -m deepr grpo ...` spreads the rollouts over GPUs (DeepSpeed /
FSDP through an accelerate config); `--use-vllm --vllm-mode colocate` generates with vLLM
inside the training processes, `--vllm-mode server --vllm-server-base-url URL` with a
separate `trl vllm-serve --model <model>` process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from deepr.cli import flags as F
from deepr.cli.app import app, fail, summary_table, user_errors
from deepr.cli.search_opts import ALLOW_OPT, CACHE_OPT, SEARCH_OPT, fetch_limit_options

grpo_app = typer.Typer(epilog=F.EXIT_HELP, help="DecomposeR staged RL (planner RL, then answerer RL): --stage planner, then `grpo prepare`, then "
                       "--stage answerer.", no_args_is_help=False)
app.add_typer(grpo_app, name="grpo")


# Settings a GRPO run sets most, as flags (any other deepr or TRL setting: --set NAME=VALUE or --config):
# deepr's own (the stage config's fields), then TRL's by TRL's name.
GRPO_FLAGS: dict[str, tuple[str, Any, str]] = {
    "planner_adapter": ("--planner-adapter", Path, "answerer: planner adapter to merge into --model first."),
    "full": ("--full/--lora", bool, "Full fine-tune instead of LoRA (default LoRA)."),
    "prompts_per_step": ("--prompts-per-step", int, "Prompts per batch (paper: 8 planner / 4 answerer)."),
    "corpus": ("--corpus", str, "Corpus the environment searches."),
    "retriever": ("--retriever", str, "dense, bm25 or hybrid."), "k": ("--k", int, "Results per search (5)."),
    "rollout_formats": ("--rollout-formats", str, "planner: none (default: sampled from the policy being "
                        "trained) or schema (under `deepr run --formats schema`; an off-policy gradient)."),
    "plan_validity": ("--plan-validity", str, "planner: paper (default: Valid(G) of DecomposeR Eq. 17) or run "
                      "(also deepr run's acceptance checks; a departure)."),
    "judge_llm": ("--judge-llm", str, "Judge of the reward's LLM-judged terms (default extractive)."),
    "require_judge_llm": ("--require-judge-llm", bool, "Refuse to start when the reward has LLM-judged terms "
                          "and no --judge-llm is given."),
    "learning_rate": ("--lr", float, "Learning rate (paper: 4e-6)."),
    "beta": ("--beta", float, "KL coefficient (paper: 0.001 planner, 0.005 answerer)."),
    "num_generations": ("--num-generations", int, "Rollouts per prompt (paper: 6)."),
    "max_completion_length": ("--max-completion-length", int, "Token budget of one rollout, environment "
                              "turns included."),
    "max_steps": ("--max-steps", int, "Stop after N optimiser steps."),
    "loss_type": ("--loss-type", str, "dapo, grpo, dr_grpo, bnpo, cispo, sapo, ..."),
    "lora_r": ("--lora-r", int, "LoRA rank (paper: 64)."), "lora_alpha": ("--lora-alpha", int, "LoRA alpha (128)."),
    "use_vllm": ("--use-vllm", bool, "Generate rollouts with vLLM (GPU)."),
    "vllm_mode": ("--vllm-mode", str, "colocate or server (a `trl vllm-serve` process)."),
    "vllm_server_base_url": ("--vllm-server-base-url", str, "URL of trl vllm-serve."),
    "report_to": ("--report-to", str, "none or tensorboard (or wandb)."),
}


@grpo_app.callback(invoke_without_command=True)
@fetch_limit_options
@F.setting_options(GRPO_FLAGS)
def grpo_cmd(
    ctx: typer.Context,
    stage: str | None = typer.Option(None, "--stage", help="planner (turn 1 → search → turn 2, reward R_plan), "
                                     "answerer (waves + final answer on prepared records, reward R_ans), rubric "
                                     "(tool-calling agent on verified.jsonl, composite rubric reward), decor "
                                     "(planner/filter/answerer team on {id, question, answers} JSONL), warp-atomic "
                                     "(single-step RL on rl.jsonl WARP actions) or warp-report (whole WARP runs, "
                                     "report-level reward)."),
    model: str | None = typer.Option(None, "--model", help="Starting model folder (planner: the SFT checkpoint; "
                                     "answerer: the base model)."),
    data: Path | None = typer.Option(None, "--data", help="planner: verified.jsonl; answerer: the prepared.jsonl "
                                     "of `deepr grpo prepare`."),
    out: Path | None = typer.Option(None, "--out", help="Output folder (adapter, tokenizer, deepr_meta.json, "
                                    "metrics.jsonl, checkpoints)."),
    config_file: Path | None = typer.Option(None, "--config", help="JSON/TOML file of settings (deepr's and any "
                                            "TRL GRPOConfig / LoRA field by TRL's name); flags override it."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the last checkpoint in --out."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Most tokens of one model turn of a rollout "
                                          "(a longer turn ends its rollout), and cap of each --judge-llm reply."),
    temperature: float | None = typer.Option(None, "--temperature", help="Sampling temperature of the rollouts, "
                                             "> 0 (default 1.0, Table 5); --judge-llm calls get it too."),
    top_p: float | None = typer.Option(None, "--top-p", help="Nucleus sampling mass of the rollouts, in (0, 1] "
                                       "(default 1.0); --judge-llm calls get it too."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of rollout sampling, data order and LoRA "
                                    "initialisation (default 0); also sent with every --judge-llm call."),
    search: str = SEARCH_OPT, allow_host: list[str] | None = ALLOW_OPT, search_cache: str = CACHE_OPT,
    settings: dict[str, Any] | None = None,
) -> None:
    """Train one stage with GRPO (the stages of deepr.train.stages.STAGES)."""
    if ctx.invoked_subcommand is not None:
        return
    flags = {k_: v for k_, v in dict(stage=stage, model=model, out=out).items() if v is not None}
    with user_errors({"max_turn_tokens": "--max-tokens", **{n: f for n, (f, _, _) in GRPO_FLAGS.items()}}):
        from deepr.train.grpo import gen_settings

        gen = F.gen_defaults(max_tokens, temperature, top_p, seed)
        if gen.temperature == 0:
            raise ValueError("--temperature 0: GRPO compares sampled rollouts, so it needs a temperature > 0 "
                             "(the papers use 1.0)")
        settings = {**F.load_config_file(config_file), **(settings or {}), **flags, **gen_settings(gen),
                    "resume": resume}
        missing = [f"--{n}" for n in ("stage", "model", "out") if n not in settings] + ([] if data else ["--data"])
        if missing:
            raise fail(f"missing {', '.join(missing)}; e.g. deepr grpo --stage planner --model M --data "
                       "verified.jsonl --out runs/rl-planner")
        _guard(data, Path(settings["out"]), str(settings["model"]), config_file)
        from deepr.cli.search_opts import open_search

        def source(cfg: Any) -> Any:  # rollouts search what --search names (default: the corpus)
            from deepr.corpus import open_retriever

            return open_search(search, allow_host, search_cache, None,
                               lambda: open_retriever(cfg.corpus, retriever=cfg.retriever, progress=True))

        from deepr.profiles.small.rollouts import planner_generate
        from deepr.train.stages import run_from_settings

        # --rollout-formats schema samples planner turns under the small profile's plan format
        res, n_rows, config = run_from_settings(settings, data, open_source=source, constrained=planner_generate)
    if os.environ.get("RANK", "0") == "0":
        last = res.rewards[-1][1] if res.rewards else float("nan")
        summary_table(f"grpo --stage {config.stage}", [
            ("prompts", n_rows), ("steps", res.steps), ("first reward", res.rewards[0][1] if res.rewards else "-"),
            ("last reward", round(last, 4)), ("status", "interrupted" if res.interrupted else "done"),
            ("seconds", round(res.seconds, 1)), ("load with", f"--llm {res.llm_spec}")])


def _guard(data: Path, out: Path, model: str, config_file: Path | None) -> None:
    """Refuse an --out folder that holds or is an input, or would replace the starting model."""
    from deepr.io import check_paths, meta_path

    check_paths([("--data", data), ("--config", config_file)], [("--out", meta_path(out))],
                [("--out", out, ["metrics.jsonl", "deepr_meta.json"])])
    if Path(model).exists() and Path(model).resolve() == out.resolve():
        raise ValueError(f"--out {out} is the --model folder; training would overwrite the starting model")
