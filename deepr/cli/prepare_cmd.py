"""`deepr grpo prepare`: files and flags around :mod:`deepr.train.prepare` (the answerer stage's
records: the trained planner's plans and what their searches found)."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from deepr.cli import flags as F
from deepr.cli.app import summary_table, user_errors
from deepr.cli.grpo_cmd import grpo_app
from deepr.cli.search_opts import ALLOW_OPT, CACHE_OPT, SEARCH_OPT, fetch_limit_options


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
