"""`deepr grpo` (staged RL) and `deepr grpo prepare`: files and flags around
:mod:`deepr.train.grpo` and :mod:`deepr.train.prepare`.

GPU users: `accelerate launch -m deepr grpo ...` spreads the rollouts over GPUs (DeepSpeed /
FSDP through an accelerate config); `--use-vllm --vllm-mode colocate` generates with vLLM
inside the training processes, `--vllm-mode server --vllm-server-base-url URL` with a
separate `trl vllm-serve --model <model>` process.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import typer

from deepr.cli import flags as F
from deepr.cli.app import app, fail, summary_table, user_errors
from deepr.cli.search_opts import ALLOW_OPT, CACHE_OPT, SEARCH_OPT, fetch_limit_options

grpo_app = typer.Typer(epilog=F.EXIT_HELP, help="DecomposeR staged RL (planner RL, then answerer RL): --stage planner, then `grpo prepare`, then "
                       "--stage answerer.", no_args_is_help=False)
app.add_typer(grpo_app, name="grpo")


def load_config_file(path: Path | None) -> dict[str, Any]:
    """Settings from a .json or .toml file (keys as in GrpoConfig; flags given on the command line win)."""
    if path is None:
        return {}
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".toml":
        import tomllib

        data = tomllib.loads(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {path}: line {e.lineno}: not valid JSON ({e.msg}); use JSON or .toml") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected an object of settings, got {type(data).__name__}")
    return data


# TRL settings a GRPO run sets most, as flags (any other: --set NAME=VALUE or --config).
GRPO_FLAGS: dict[str, tuple[str, Any, str]] = {
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
    planner_adapter: Path | None = typer.Option(None, "--planner-adapter", help="answerer: planner adapter to "
                                                "merge into --model before training."),
    full: bool | None = typer.Option(None, "--full/--lora", help="Full fine-tune instead of LoRA (default LoRA)."),
    prompts_per_step: int | None = typer.Option(None, "--prompts-per-step", help="Prompts per batch (8 / 4)."),
    corpus: str | None = typer.Option(None, "--corpus", help="planner: corpus the environment searches."),
    rollout_formats: str | None = typer.Option(None, "--rollout-formats", help="planner: none (default: rollouts "
                                               "sampled from the policy being trained) or schema (decoded under "
                                               "`deepr run --formats schema`'s schema; an off-policy gradient)."),
    plan_validity: str | None = typer.Option(None, "--plan-validity", help="planner: paper (default: Valid(G) of "
                                             "DecomposeR Eq. 17, the plan parses and keeps the typed-DAG rules) "
                                             "or run (also deepr run's acceptance checks; a departure)."),
    retriever: str | None = typer.Option(None, "--retriever", help="planner: dense, bm25 or hybrid."),
    k: int | None = typer.Option(None, "--k", help="planner: results per search node (default 5)."),
    judge_llm: str | None = typer.Option(None, "--judge-llm", help="answerer: judge of J_rub (default extractive)."),
    require_judge_llm: bool | None = typer.Option(None, "--require-judge-llm", help="Refuse to start when the "
                                                  "stage's reward has LLM-judged terms and no --judge-llm is given."),
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
    flags = {k_: v for k_, v in dict(
        planner_adapter=planner_adapter, full=full, prompts_per_step=prompts_per_step, corpus=corpus,
        retriever=retriever, k=k, rollout_formats=rollout_formats, plan_validity=plan_validity, judge_llm=judge_llm,
        require_judge_llm=require_judge_llm, stage=stage, model=model, out=out).items() if v is not None}
    with user_errors({"max_turn_tokens": "--max-tokens", **{n: f for n, (f, _, _) in GRPO_FLAGS.items()}}):
        from deepr.train.grpo import gen_settings

        gen = F.gen_defaults(max_tokens, temperature, top_p, seed)
        if gen.temperature == 0:
            raise ValueError("--temperature 0: GRPO compares sampled rollouts, so it needs a temperature > 0 "
                             "(the papers use 1.0)")
        settings = {**load_config_file(config_file), **(settings or {}), **flags, **gen_settings(gen),
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


@grpo_app.command("prepare")
@fetch_limit_options
def prepare_cmd(
    planner: str = typer.Option(..., "--planner", help="Trained planner: its output folder (adapter + "
                                "deepr_meta.json), a model folder, or an --llm spec such as extractive."),
    data: Path = typer.Option(..., "--data", help="verified.jsonl (QRPair rows: question + rubrics)."),
    out: Path = typer.Option(..., "--out", help="prepared.jsonl for --stage answerer (resumable)."),
    corpus: str = typer.Option("wiki", "--corpus", help="Corpus the planner's searches run on."),
    retriever: str = typer.Option("hybrid", "--retriever", help="dense, bm25 or hybrid."),
    k: int = typer.Option(5, "--k", help="Results per search node."),
    fetch_limit: int = typer.Option(4, "--fetch-limit", help="Pages a revision may fetch."),
    limit: int | None = typer.Option(None, "--limit", help="Prepare at most N queries (quick look)."),
    max_tokens: int | None = F.MAX_TOKENS, temperature: float | None = F.TEMPERATURE, top_p: float | None = F.TOP_P,
    seed: int | None = F.GEN_SEED,
    search: str = SEARCH_OPT, allow_host: list[str] | None = ALLOW_OPT, search_cache: str = CACHE_OPT,
) -> None:
    """Run the trained planner and the environment once per query; write plans, results, pages, catalogs."""
    from deepr.io import JsonlAppender, done_ids, read_jsonl, rejects_path, write_meta
    from deepr.records import QRPair, Reject

    t0 = time.perf_counter()
    with user_errors():
        from deepr.io import check_paths, meta_path

        check_paths([("--data", data)], [("--out", out), ("--out", rejects_path(out)), ("--out", meta_path(out))])
        from deepr.llm import get_llm
        from deepr.train.prepare import PrepareConfig, planner_spec, prepare_records

        gen = F.gen_defaults(max_tokens, temperature, top_p, seed)
        config = PrepareConfig(k=k, fetch_limit=fetch_limit)
        spec = planner_spec(planner)
        pairs = [p for p in read_jsonl(data, QRPair) if p.decision in (None, "KEEP", "REVISE")]
        done = done_ids(out) | done_ids(rejects_path(out))
        todo = [p for p in pairs if p.id not in done][:limit]
        llm = get_llm(spec, gen=gen)
        from deepr.corpus import open_retriever

        from deepr.cli.search_opts import open_search

        ret = open_search(search, allow_host, search_cache, None,
                          lambda: open_retriever(corpus, retriever=retriever, progress=True))
        counts = {"queries": len(pairs), "skipped_done": len(pairs) - len([p for p in pairs if p.id not in done]),
                  "prepared": 0, "rejected": 0}
        with JsonlAppender(out) as ok_out, JsonlAppender(rejects_path(out)) as bad_out:
            for rec in prepare_records(todo, llm, ret, config):
                is_reject = isinstance(rec, Reject)
                (bad_out if is_reject else ok_out).write(rec)
                counts["rejected" if is_reject else "prepared"] += 1
        write_meta(out, stage="grpo-prepare", config={**config.model_dump(), "planner": spec, "corpus": corpus,
                                                       "gen": vars(gen)},
                   inputs=[data], counts=counts, timings={"seconds": round(time.perf_counter() - t0, 3)})
    summary_table("grpo prepare", counts)
