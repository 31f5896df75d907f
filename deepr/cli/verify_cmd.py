"""``deepr verify``: files and flags around :mod:`deepr.data.verify` (resuming, sharding,
rejects and the sidecar as every data stage: :mod:`deepr.cli.data_opts`).

    deepr verify data/pairs.jsonl --out data/verified.jsonl
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


def dropped_path(out: Path) -> Path:
    """``<stem>.dropped.jsonl`` beside ``--out``: every side file is named after its output
    (``<stem>.rejects.jsonl``, ``<out>.meta.json``; docs/artefacts.md)."""
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(f"{stem}.dropped.jsonl")


_KIND_NAMES = {"verified": "kept or revised", "dropped": "dropped", "reject": "audit failed (rejects file)"}


@app.command("verify", epilog=F.EXIT_HELP)
def verify_command(
    pairs: Path = typer.Argument(..., help="pairs.jsonl written by synthesize-rubrics."),
    out: Path = typer.Option(..., "--out", "-o", help="Output verified.jsonl (KEEP and REVISE; appended, resumable)."),
    dropped: Path | None = typer.Option(None, "--dropped",
                                        help="Where DROP decisions go (default: <out stem>.dropped.jsonl beside --out)."),
    trees: Path | None = typer.Option(None, "--trees",
                                      help="trees.jsonl, only for pairs that do not carry their selected leaves."),
    llm: str = D.llm_opt(), judge_llm: str | None = D.judge_opt("the audit (usually a stronger model)"),
    base_url: str | None = D.C["base_url"], api_key: str | None = D.C["api_key"], no_cache: bool = D.C["no_cache"],
    timeout: float = D.C["timeout"], concurrency: int = D.C["concurrency"], limit: int | None = D.C["limit"],
    dry_run: bool = D.C["dry_run"], shard: str | None = D.C["shard"], retry_rejects: bool = D.C["retry_rejects"],
    deadline: float | None = D.C["deadline"], allow_fallback: bool = D.C["allow_fallback"],
    max_tokens: int | None = D.C["max_tokens"], temperature: float | None = D.C["temperature"],
    top_p: float | None = D.C["top_p"], seed: int | None = D.C["gen_seed"], formats: str = D.C["formats"],
    reask: str = D.C["reask"],
    profile: str | None = D.C["profile"], fallback: str = D.fallback_opt(),
) -> None:
    """Audit each pair on six dimensions and KEEP / REVISE / DROP it; revisions must stay grounded
    in the selected leaves (checked in code)."""
    from deepr.io import read_jsonl, rejects_path, require_records
    from deepr.records import QRPair, Tree
    from deepr.data.verify import VerifyConfig

    t0 = time.perf_counter()
    with user_errors():
        F.check_budget(timeout, deadline, concurrency, limit)
        gen = F.gen_defaults(max_tokens, temperature, top_p, seed, formats, reask)
        cfg = VerifyConfig(concurrency=concurrency, fallback=fallback)
        drop_to, rejects = dropped or dropped_path(out), rejects_path(out)
        D.guard([("PAIRS", pairs), ("--trees", trees)], out, ("--dropped", drop_to))
        items = require_records(list(read_jsonl(pairs, QRPair)), pairs, what="pairs")
        tree_map = {t.id: t for t in read_jsonl(trees, Tree)} if trees else None
        done = D.done_before(out, [drop_to], rejects, retry_rejects, {p.id for p in items})
        todo, plan = D.pending(items, lambda p: p.tree_id, shard, done, lambda p: p.id, limit)
        if dry_run:
            summary_table("verify --dry-run (nothing run)", [*plan.items(), ("judge", judge_llm or llm)])
            return
        _, judge, _, judge_prof = D.models(llm, judge_llm or llm, base_url, api_key, no_cache, timeout, concurrency,
                                          gen, deadline, (profile, formats, reask))
        tally = _run_verify(todo, judge, cfg, tree_map, pairs, out, drop_to, rejects, plan, t0, judge_prof, deadline)
    finish(D.outcome(tally, [judge], allow_fallback or fallback == "extractive"))


def _run_verify(todo: list[Any], judge: Any, cfg: Any, tree_map: Any, pairs: Path, out: Path, drop_to: Path,
                rejects: Path, plan: dict[str, int], t0: float, profile: Any = None,
                deadline: float | None = None) -> Any:
    from deepr.io import JsonlAppender, read_jsonl, write_meta
    from deepr.records import QRPair, Reject
    from deepr.data.outcomes import StageTally
    from deepr.data.verify import Verdict, averify, verify_summary
    from deepr.roles import engine_info

    counts, tally = Counter(), StageTally("verify")
    try:
        with JsonlAppender(out) as ok, JsonlAppender(drop_to) as gone, JsonlAppender(rejects) as rej:
            sinks = {"verified": ok, "dropped": gone, "reject": rej}

            def write(v: Any) -> None:
                sinks[v.kind].write(v.record)
                counts[v.kind] += 1
                tally.add(v)

            D.drive(lambda cb: averify(todo, judge, cfg, embed=D.embed_fn(), trees=tree_map, on_result=cb,
                                      profile=profile),
                   len(todo), "verify", write, unit="pairs", deadline=deadline)
    finally:  # rates and tags over everything audited so far, resumed runs and failed audits included
        seen = [Verdict(kind, r) for kind, path in (("verified", out), ("dropped", drop_to))
                if path.exists() for r in read_jsonl(path, QRPair, tolerate_torn_tail=True)]
        seen += [Verdict("reject", r) for r in read_jsonl(rejects, Reject, tolerate_torn_tail=True)] \
            if rejects.exists() else []
        rates, tags = verify_summary(seen)
        write_meta(out, stage="verify", config=cfg, inputs=[pairs],
                   counts={**plan, **counts, **rates, **tally.counts()}, timings={"seconds": round(time.perf_counter() - t0, 2)},
                   extra={"judge": engine_info(judge), "profile": D.described(profile), "usage": D.usage(judge),
                          "dropped_file": str(drop_to),
                          "error_tags": tags})
    # this run's counts, then the rates over every pair in the output files (earlier runs too)
    now = [(f"this run: {_KIND_NAMES[k]}", counts[k]) for k in _KIND_NAMES]
    summary_table(f"verify → {out}", [*plan.items(), *now, *((f"{k} (all runs)", v) for k, v in rates.items()),
                                     ("dropped file", str(drop_to)),
                                     ("rejects file", str(rejects) if counts["reject"] else "-")])
    summary_table("error tags (all audited pairs)", list(tags.items()) or [("none", 0)])
    summary_table("verify: this run's records", tally.rows())
    return tally
