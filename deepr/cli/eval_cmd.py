"""`deepr eval`: files and flags around :mod:`deepr.eval` (loading, resume, summary, HTML)."""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

import typer

from deepr.cli import flags as F
from deepr.cli.app import app, console, finish, user_errors
from deepr.cli.search_opts import ALLOW_OPT, CACHE_OPT, fetch_limit_options
from deepr.eval.inputs import load_items, load_references


def _bar_svg(labels: list[str], values: list[float], width: int = 420) -> str:
    rows = []
    top = max([1.0, *values])
    for i, (lab, v) in enumerate(zip(labels, values)):
        w = int((width - 170) * max(v, 0.0) / top)
        y = 6 + i * 22
        rows.append(f'<text x="0" y="{y + 13}" font-size="12">{html.escape(lab)}</text>'
                    f'<rect x="150" y="{y}" width="{w}" height="16" fill="#4c78a8"/>'
                    f'<text x="{154 + w}" y="{y + 13}" font-size="11">{v:.3f}</text>')
    return f'<svg width="{width}" height="{12 + 22 * len(labels)}">{"".join(rows)}</svg>'


def _hist_svg(values: list[float], bins: int = 10) -> str:
    lo, hi = min([0.0, *values]), max([1.0, *values])
    counts = [0] * bins
    for v in values:
        counts[min(int((v - lo) / (hi - lo) * bins), bins - 1)] += 1
    peak = max(counts) or 1
    bars = "".join(f'<rect x="{10 + i * 30}" y="{110 - int(100 * c / peak)}" width="26" '
                   f'height="{int(100 * c / peak)}" fill="#f58518"><title>{c}</title></rect>'
                   for i, c in enumerate(counts))
    return (f'<svg width="{20 + bins * 30}" height="130">{bars}'
            f'<text x="10" y="125" font-size="11">{lo:.2f}</text>'
            f'<text x="{bins * 30 - 20}" y="125" font-size="11">{hi:.2f}</text></svg>')


def render_html(scores: list[dict], rows: list[dict], totals: dict, metrics: list[str], title: str) -> str:
    """A self-contained page: summary table, a histogram per metric, per-component mean bars."""
    from deepr.eval.summary import SUMMARY_FIELDS, values_of

    table = "".join(f"<tr><td>{r['metric']}</td><td>{r['field']}</td><td>{_num(r['mean'])}</td>"
                    f"<td>{_num(r['std'])}</td><td>{r['n']}</td><td>{'' if r['failures'] is None else r['failures']}"
                    "</td></tr>" for r in rows)
    parts = [f"<h1>{html.escape(title)}</h1><p>{len(scores)} items</p><table border=1 cellpadding=4>"
             "<tr><th>metric</th><th>field</th><th>mean</th><th>std</th><th>n</th><th>failures</th></tr>"
             f"{table}</table>"]
    from deepr.eval.summary import legend

    parts.append("<dl>" + "".join(f"<dt><code>{html.escape(f)}</code></dt><dd>{html.escape(d)}</dd>"
                                  for f, d in legend(rows)) + "</dl>")
    if totals:
        parts.append("<ul>" + "".join(f"<li>{html.escape(k)}: {_num(v)}</li>" for k, v in totals.items()) + "</ul>")
    for m in metrics:
        ok = [s for s in scores if m not in (s.get("failures") or {})]
        head = SUMMARY_FIELDS[m][0]
        parts.append(f"<h2>{m}</h2><h3>distribution of {head}</h3>{_hist_svg(values_of(ok, head))}")
        comps = [(f, values_of(ok, f)) for f in SUMMARY_FIELDS[m]]
        comps = [(f, sum(v) / len(v)) for f, v in comps if v]
        if len(comps) > 1:
            parts.append("<h3>mean per component</h3>" + _bar_svg([f for f, _ in comps], [v for _, v in comps]))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>" + html.escape(title)
            + "</title></head><body style='font-family:sans-serif'>" + "".join(parts) + "</body></html>")


def _num(v: Any) -> str:
    return "—" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


@app.command("eval", epilog=F.EXIT_HELP)
@fetch_limit_options
def eval_command(
    input: Path = typer.Argument(..., help="Scores these: a JSONL of records (plans, answers, reports, "
                                 "predictions), a deepr run sidecar report.json, or a folder of sidecars."),
    metric: str = typer.Option(..., "--metric", "-m", help="Comma-separated metrics: rubric, citation, format, "
                               "search, composite, plan_reward, answer_reward, em, f1, lj, team, structure, "
                               "race, fact, support, recall."),
    out: Path = typer.Option(..., "--out", "-o", help="Per-item scores (JSONL); re-running skips ids already in it."),
    rubrics: Path | None = typer.Option(None, "--rubrics", help="verified.jsonl with rubrics (or ResearchRubrics' "
                                        "{sample_id, prompt, rubrics: [{criterion, weight, axis}]}), joined "
                                        "by id, else by question text."),
    gold: Path | None = typer.Option(None, "--gold", help='Gold answers {"id", "answers"} for em/f1/lj/team.'),
    qrels: Path | None = typer.Option(None, "--qrels", help="TREC qrels (query-id iteration doc-id relevance) "
                                      "for --metric recall, e.g. BrowseComp-Plus's qrel_evidence.txt."),
    judge_llm: str = typer.Option("extractive", "--judge-llm", help="Judge backend: " + F.LLM_HELP),
    base_url: str | None = typer.Option(None, "--base-url", help="OpenAI-compatible endpoint for the judge."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY",
                                       help="API key for the judge endpoint (default: $OPENAI_API_KEY)."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Do not use the judge LLM's disk cache."),
    judge_cache: Path | None = typer.Option(None, "--judge-cache", help="JSONL file that keeps judgements "
                                            "across runs (e.g. when adding metrics later)."),
    timeout: float = F.TIMEOUT, deadline: float | None = F.DEADLINE, allow_fallback: bool = F.ALLOW_FALLBACK,
    max_tokens: int | None = F.MAX_TOKENS, temperature: float | None = F.TEMPERATURE,
    top_p: float | None = F.TOP_P, seed: int | None = F.GEN_SEED, formats: str = F.FORMATS, reask: str = F.REASK,
    concurrency: int = typer.Option(8, "--concurrency", help="Items (and judge calls) in flight at once."),
    race_criteria: Path | None = typer.Option(None, "--race-criteria", help="DeepResearch Bench criteria JSONL."),
    race_reference: Path | None = typer.Option(None, "--race-reference", help="DeepResearch Bench reference "
                                               "reports JSONL {id, prompt, article}."),
    html_out: Path | None = typer.Option(None, "--html", help="Also write a self-contained HTML summary here."),
    limit: int | None = typer.Option(None, "--limit", help="Score at most N items (after skipping done ones)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Load and join the inputs, print what would be "
                                 "scored, call no judge."),
    allow_host: list[str] | None = ALLOW_OPT,
    search_cache: str = CACHE_OPT,
) -> None:
    """Score reports, plans and answers: DeepRubric's rubric and citation rewards, DecomposeR's
    planner and answerer rewards, DECOR's EM / F1 / LLM judge, DeepResearch Bench's RACE and FACT,
    structure and support. The summary ends with a legend of its fields."""
    with user_errors():
        F.check_budget(timeout, deadline, concurrency, limit)
        gen = F.gen_defaults(max_tokens, temperature, top_p, seed, formats, reask)
        _guard(input, out, rubrics, gold, qrels, race_criteria, race_reference, html_out, judge_cache)
        code = _run(input, metric, out, rubrics, gold, judge_llm, base_url, api_key, no_cache, judge_cache,
                    (timeout, deadline, gen), concurrency, race_criteria, race_reference, html_out, limit, dry_run,
                    allow_fallback, pages=(allow_host, search_cache), qrels=qrels)
    finish(code)


def _guard(input: Path, out: Path, *refs: Path | None) -> None:
    """Refuse an output that is or would overwrite an input (sidecars of a folder included)."""
    from deepr.io import check_paths, meta_path

    *files, html_out, judge_cache = refs
    ins = [("INPUT", p) for p in (sorted(input.rglob("*.json")) if input.is_dir() else [input])]
    if input.is_dir() and (_inside(out, input) and out.suffix == ".json"):
        raise ValueError(f"--out {out}: inside the input folder {input} it would be read as a run sidecar")
    ins += [("--rubrics / --gold / --race-*", p) for p in files]
    outs = [("--out", out), ("--out", meta_path(out)), ("--html", html_out)]
    check_paths(ins, outs)
    check_paths(ins, [("--judge-cache", judge_cache)])


def _inside(path: Path, folder: Path) -> bool:
    return folder.resolve() in path.resolve().parents


def _outcome(scores: list[dict], scored: dict[str, list[str]], judge: Any, allow_fallback: bool) -> int:
    """Items scored now: every metric scored now computed (ok), some failed (degraded), all failed."""
    from deepr.cli.exit_codes import exit_code

    tally = {"ok": 0, "degraded": 0, "failed": 0}
    for r in scores:
        if r.get("id") in scored:
            n = len(set(r.get("failures") or {}) & set(scored[r["id"]]))
            tally["ok" if n == 0 else "failed" if n >= len(scored[r["id"]]) else "degraded"] += 1
    auth = bool(judge is not None and getattr(judge, "llm", None) is not None and judge.llm.auth_failed)
    return exit_code(tally["ok"], tally["degraded"], tally["failed"], allow_fallback=allow_fallback, auth=auth)


def _run(input, metric, out, rubrics, gold, judge_llm, base_url, api_key, no_cache, judge_cache, budget,
         concurrency, race_criteria, race_reference, html_out, limit, dry_run, allow_fallback=False,
         pages=(None, "use"), qrels=None) -> int:
    from pydantic import ValidationError

    from deepr.eval.evaluate import EvalConfig, EvalContext, evaluate, missing_inputs
    from deepr.eval.summary import benchmark_totals, latest_rows, merge_score, metric_done, summarize
    from deepr.io import JsonlAppender, read_jsonl, require_records, write_jsonl, write_meta, write_text

    try:
        cfg = EvalConfig(metrics=[m.strip() for m in metric.split(",") if m.strip()], judge=judge_llm,
                         limit=limit, concurrency=concurrency)
    except ValidationError as e:
        raise ValueError(F.flag_error(e)) from None
    items = require_records(load_items(input), input, what="items to score")
    ctx = EvalContext(rubrics=load_references(rubrics, "rubrics") if rubrics else ({}, {}),
                      gold=load_references(gold, "gold") if gold else ({}, {}))
    if qrels is not None:
        from deepr.eval.benchmarks import load_qrels

        ctx.qrels = load_qrels(qrels)
    if race_criteria or race_reference:
        if not (race_criteria and race_reference):
            raise ValueError("RACE needs both --race-criteria and --race-reference")
        from deepr.rewards.race import load_race_tasks

        ctx.race_tasks = load_race_tasks(race_criteria, race_reference)
    problems = missing_inputs(cfg.metrics, items, ctx)
    if problems:
        raise ValueError("; ".join(problems))
    # Resume per (item, metric): an item already in --out is scored again only for the metrics
    # its row lacks (a new --metric, or one that failed before).
    before = {r["id"]: r for r in latest_rows(list(read_jsonl(out, tolerate_torn_tail=True)))} if out.exists() else {}
    pending = {it.id: [m for m in cfg.metrics if not metric_done(before.get(it.id), m)] for it in items}
    todo = [it for it in items if pending[it.id]][: cfg.limit]
    done = sum(1 for it in items if not pending[it.id])
    console.print(f"eval: {len(items)} items, {done} already scored, {len(todo)} to score; "
                  f"metrics {', '.join(cfg.metrics)}; judge {cfg.judge}")
    if dry_run:
        return 0
    if "fact" in cfg.metrics:  # reports citing URLs: their pages are read through the search layer
        from deepr.cli.search_opts import search_config
        from deepr.search import open_reader

        ctx.pages = open_reader(search_config("corpus", pages[0], pages[1], None))
    t0 = time.perf_counter()
    if todo:
        _attach_models(ctx, cfg, base_url, api_key, no_cache, judge_cache, budget)
        from deepr.cli.live import LiveView

        groups: dict[tuple[str, ...], list[Any]] = {}
        for it in todo:
            groups.setdefault(tuple(pending[it.id]), []).append(it)
        with JsonlAppender(out) as sink, LiveView("eval", total=len(todo), unit="items", deadline=budget[1]) as view:
            for metrics, group in groups.items():
                run_sync_eval(evaluate(group, list(metrics), ctx, concurrency=cfg.concurrency,
                                       sink=lambda sc: sink.write(merge_score(before.get(sc.id), sc.model_dump())),
                                       progress=view.advance))
        if ctx.judge is not None:
            ctx.judge.cache.close()
    if ctx.pages is not None:
        ctx.pages.close()
    scores = latest_rows(list(read_jsonl(out, tolerate_torn_tail=True))) if out.exists() else []
    if before and todo:  # merged rows were appended: keep one row per id
        write_jsonl(out, scores)
    rows, totals = summarize(scores, cfg.metrics), benchmark_totals(scores, cfg.metrics)
    _print_summary(rows, totals)
    judge_name = ctx.judge.name if ctx.judge else None
    write_meta(out, stage="eval", config=cfg, inputs=[p for p in (input, rubrics, gold, qrels, race_criteria,
                                                                     race_reference) if p],
               counts={"items": len(items), "scored_now": len(todo), "total_scored": len(scores)},
               timings={"seconds": round(time.perf_counter() - t0, 3)},
               extra={"judge": judge_name, "summary": rows, "totals": totals})
    if html_out:
        write_text(html_out, render_html(scores, rows, totals, cfg.metrics, f"deepr eval: {input.name}"))
    return _outcome(scores, {it.id: pending[it.id] for it in todo}, ctx.judge, allow_fallback)


def run_sync_eval(coro: Any) -> Any:
    from deepr.llm.base import run_sync

    return run_sync(coro)


def _attach_models(ctx, cfg, base_url, api_key, no_cache, judge_cache, budget) -> None:
    """Load the judge and the embedder only when the chosen metrics need them."""
    from deepr.api import attach_models

    def make_llm(spec: str) -> Any:
        from deepr.llm import llm_from_flags

        timeout, deadline, gen = budget
        llm = llm_from_flags(spec, base_url, api_key, no_cache, timeout, cfg.concurrency, gen=gen)
        llm.set_deadline(deadline)
        return llm

    attach_models(ctx, cfg.metrics, cfg.judge, cache_path=judge_cache, make_llm=make_llm)


def _print_summary(rows: list[dict], totals: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="deepr eval", header_style="bold")
    for col in ("metric", "field", "mean", "std", "n", "failures"):
        table.add_column(col, justify="left" if col in ("metric", "field") else "right")
    for r in rows:
        table.add_row(escape(str(r["metric"])), escape(str(r["field"])), _num(r["mean"]), _num(r["std"]), str(r["n"]),
                      "" if r["failures"] is None else str(r["failures"]))
    console.print(table)
    for k, v in totals.items():
        console.print(f"{escape(str(k))}: {_num(v)}")
    for r in rows:
        if r.get("top_failure"):
            console.print(f"{r['metric']} failed on {r['failures']} item(s); commonest reason: "
                          f"{escape(str(r['top_failure']))}")
    from deepr.eval.summary import legend

    console.print("\n".join(f"  {f}: {meaning}" for f, meaning in legend(rows)), style="dim", highlight=False)
