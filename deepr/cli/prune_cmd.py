"""`deepr prune-trajectories`: files and flags around :mod:`deepr.train.trajectories`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from deepr.cli import flags as F
from deepr.cli.app import app, console, finish, summary_table, user_errors


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

        from deepr.llm import llm_from_flags

        llm = llm_from_flags(judge_llm, base_url, api_key, False, timeout, 8, gen=gen)
        if llm is not None:  # None: the extractive judge
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
