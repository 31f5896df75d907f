"""``deepr synthesize-rubrics``: files and flags around :mod:`deepr.data.rubrics` (resuming,
sharding, rejects and the sidecar as every data stage: :mod:`deepr.cli.data_opts`).

    deepr synthesize-rubrics data/trees.jsonl --out data/pairs.jsonl
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import typer

from deepr.cli import data_opts as D
from deepr.cli import flags as F
from deepr.cli.app import app, finish, summary_table, user_errors


@app.command("synthesize-rubrics", epilog=F.EXIT_HELP)
def synthesize_rubrics_command(
    trees: Path = typer.Argument(..., help="trees.jsonl written by build-trees."),
    out: Path = typer.Option(..., "--out", "-o", help="Output pairs.jsonl (appended; re-runs resume)."),
    n_select: int = typer.Option(5, "--n-select", help="Leaves to select per tree (the paper averages 5)."),
    min_rubrics: int = typer.Option(5, "--min-rubrics", help="Fewest rubric criteria per pair."),
    llm: str = D.llm_opt(),
    base_url: str | None = D.C["base_url"], api_key: str | None = D.C["api_key"], no_cache: bool = D.C["no_cache"],
    timeout: float = D.C["timeout"], concurrency: int = D.C["concurrency"], limit: int | None = D.C["limit"],
    dry_run: bool = D.C["dry_run"], shard: str | None = D.C["shard"], retry_rejects: bool = D.C["retry_rejects"],
    deadline: float | None = D.C["deadline"], allow_fallback: bool = D.C["allow_fallback"],
    max_tokens: int | None = D.C["max_tokens"], temperature: float | None = D.C["temperature"],
    top_p: float | None = D.C["top_p"], seed: int | None = D.C["gen_seed"], formats: str = D.C["formats"],
    reask: str = D.C["reask"],
    profile: str | None = D.C["profile"], fallback: str = D.fallback_opt(),
) -> None:
    """Co-generate one research question and ≥ 5 typed, weighted, leaf-grounded rubrics per tree,
    DeepRubric's constraints (bottom-up merge, Fig. 11) checked in code: violations are re-asked, then
    rejected."""
    from deepr.io import read_jsonl, rejects_path, require_records
    from deepr.records import Tree
    from deepr.roles.rubric_checks import RubricLimits
    from deepr.data.rubrics import SynthConfig, pair_id

    t0 = time.perf_counter()
    with user_errors():
        F.check_budget(timeout, deadline, concurrency, limit)
        gen = F.gen_defaults(max_tokens, temperature, top_p, seed, formats, reask)
        cfg = SynthConfig(n_select=n_select, concurrency=concurrency, limits=RubricLimits(min_rubrics=min_rubrics),
                          fallback=fallback)
        D.guard([("TREES", trees)], out)
        items = require_records(list(read_jsonl(trees, Tree)), trees, what="trees")
        rejects = rejects_path(out)
        done = D.done_before(out, [], rejects, retry_rejects, {pair_id(t.id) for t in items})
        todo, plan = D.pending(items, lambda t: t.id, shard, done, lambda t: pair_id(t.id), limit)
        if dry_run:
            summary_table("synthesize-rubrics --dry-run (nothing run)", [*plan.items(), ("llm", llm)])
            return
        model, _, prof, _ = D.models(llm, None, base_url, api_key, no_cache, timeout, concurrency, gen, deadline,
                                    (profile, formats, reask))
        tally = _run_synth(todo, model, cfg, trees, out, rejects, plan, t0, prof, deadline)
    finish(D.outcome(tally, [model], allow_fallback or fallback == "extractive"))


def _run_synth(todo: list[Any], model: Any, cfg: Any, trees: Path, out: Path, rejects: Path,
               plan: dict[str, int], t0: float, profile: Any = None, deadline: float | None = None) -> Any:
    from deepr.io import JsonlAppender, read_jsonl, write_meta
    from deepr.records import QRPair, Reject
    from deepr.data.outcomes import StageTally
    from deepr.data.rubrics import asynthesize_rubrics, pair_summary
    from deepr.roles import engine_info

    embed = D.embed_fn() if model is None else None  # the extractive synthesiser selects leaves by embedding
    counts, tally = Counter(), StageTally("synthesize-rubrics")
    try:
        with JsonlAppender(out) as sink, JsonlAppender(rejects) as rej:
            def write(r: Any) -> None:
                (rej if isinstance(r, Reject) else sink).write(r)
                counts["rejected" if isinstance(r, Reject) else "pairs written"] += 1
                tally.add(r)

            D.drive(lambda cb: asynthesize_rubrics(todo, model, cfg, embed=embed, on_result=cb, profile=profile),
                   len(todo), "synthesize-rubrics", write, unit="pairs", deadline=deadline)
    finally:
        pairs = list(read_jsonl(out, QRPair, tolerate_torn_tail=True)) if out.exists() else []
        stats = pair_summary(pairs)
        write_meta(out, stage="synthesize-rubrics", config=cfg, inputs=[trees],
                   counts={**plan, **counts, "pairs in output": len(pairs), **tally.counts()},
                   timings={"seconds": round(time.perf_counter() - t0, 2)},
                   extra={"llm": engine_info(model), "profile": D.described(profile), "usage": D.usage(model),
                          "summary": stats})
    summary_table(f"synthesize-rubrics → {out}", [*plan.items(), *counts.items(), *stats.items(), *tally.rows(),
                                                 ("rejects file", str(rejects) if counts["rejected"] else "-")])
    return tally
