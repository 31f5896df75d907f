"""``deepr run``: the research agent on one query, or on a file of queries (resumable by id).

Inputs: a question (or ``--queries FILE``: JSONL with ``id`` and ``question`` / ``query`` /
``prompt`` (BrowseComp-Plus's ``query_id`` and ResearchRubrics' ``sample_id`` name the id; their
``{criterion, weight, axis}`` rubrics are read), a ``.tsv`` of id TAB question, or a text file
with one question per line), a corpus and an LLM backend. ``--answer short`` ends dag, decor and
tools runs with BrowseComp's Explanation / Exact Answer / Confidence.
Outputs: ``report.md``, the ``report.json`` audit sidecar, ``report.html`` with ``--html``,
``report.md.meta.json``; ``--record`` appends the run as a training trajectory. With
``--queries``, ``--out`` is a folder holding ``<id>.md`` / ``<id>.json`` per query and a
``reports.jsonl`` index that marks finished ids (re-running skips them).

    deepr run "Why did the Bronze Age collapse?" --out report.md --mode dag --html
    deepr run --queries verified.jsonl --out reports/ --mode warp --force-expand 6 --record traj.jsonl
"""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from deepr.cli import flags as F
from deepr.cli.app import app, console, finish, interrupted_run, summary_table, user_errors
from deepr.cli.exit_codes import exit_code
from deepr.cli.search_opts import ALLOW_OPT, CACHE_OPT, SEARCH_OPT, fetch_limit_options

MODES = ("dag", "warp", "decor", "tools")
_FLAGS = {"k": "-k", "search_rounds": "--search-rounds", "max_cycles": "--max-cycles", "mode": "--mode",
          "force_expand": "--force-expand", "decor_steps": "--steps", "memory_limit": "--memory-limit",
          "max_reasks": "--max-reasks", "temperature": "--temperature", "max_tokens": "--max-tokens",
          "answer": "--answer"}
QUERY_FIELDS = ("question", "query", "prompt")
ID_FIELDS = ("id", "query_id", "sample_id")  # deepr, BrowseComp-Plus, ResearchRubrics


def _config(**kw: Any) -> Any:
    from pydantic import ValidationError

    from deepr.agent import RunConfig

    try:
        return RunConfig(**kw)
    except ValidationError as e:
        raise ValueError(F.flag_error(e, _FLAGS)) from None


def _rubrics_of(rec: dict[str, Any], path: Path, n: int) -> None:
    """A query's optional rubrics must be a list of rubric items (checked before any run)."""
    from pydantic import ValidationError

    from deepr.io import RecordError
    from deepr.records import RubricItem, criteria_rubrics, is_criteria

    raw = rec.get("rubrics")
    if raw is None:
        return
    if is_criteria(raw):  # ResearchRubrics' {criterion, weight, axis}
        try:
            rec["rubrics"] = criteria_rubrics(raw)
        except ValueError as e:
            raise RecordError(path, n, str(e), field="rubrics") from None
        return
    if not isinstance(raw, list):
        raise RecordError(path, n, f"expected a list of rubric items, got {type(raw).__name__}", field="rubrics")
    for i, item in enumerate(raw):
        try:
            RubricItem.model_validate(item)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise RecordError(path, n, f"rubric item #{i + 1}: {err['msg']}",
                              field=f"rubrics.{i}" + (f".{loc}" if loc else "")) from None


def _turn_counts(res: Any, llm: Any) -> tuple[int, int]:
    """(model turns that worked, turns that failed or fell back to the extractive engine)."""
    if llm is None:  # no model: every turn is the extractive engine's, by design
        return 1, 0
    turns = res.trajectory.turns
    ok = sum(1 for t in turns if t.ok and not (t.model_extra or {}).get("extractive"))
    extra = res.trace.model_extra or {}
    # a failure or fallback recorded outside any turn (citations removed while rendering) still
    # degraded the report
    written_around = extra.get("failures") or any(d.get("fallback") for d in extra.get("decisions", []))
    return ok, max(len(turns) - ok, int(bool(written_around)))


def load_queries(path: Path) -> list[dict[str, Any]]:
    """Query records from JSONL (id + question/query/prompt) or a text file (one per line)."""
    from deepr.io import RecordError, parse_line

    if not path.exists():
        raise FileNotFoundError(f"{path}: no such queries file")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".tsv":  # BrowseComp-Plus topics: id <TAB> query
        return _tsv_queries(lines, path)
    if path.suffix not in (".jsonl", ".json"):
        return [{"id": f"q{n}", "query": ln.strip()} for n, ln in enumerate(lines, 1) if ln.strip()]
    out, seen = [], set()
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        rec = parse_line(raw, None, path, n)
        text = next((rec[f] for f in QUERY_FIELDS if isinstance(rec.get(f), str) and rec[f].strip()), None)
        if text is None:
            raise RecordError(path, n, "needs a non-empty question text", field="question")
        _rubrics_of(rec, path, n)
        qid = next((rec[f] for f in ID_FIELDS if rec.get(f) is not None and str(rec[f]).strip()), None)
        if qid is None:
            raise RecordError(path, n, "needs an id (resuming skips finished ids)", field="id")
        if str(qid) in seen:
            raise RecordError(path, n, f"id {qid!r} appears twice; ids must be unique", field="id")
        seen.add(str(qid))
        out.append({**rec, "id": str(qid), "query": text})
    return out


def _tsv_queries(lines: list[str], path: Path) -> list[dict[str, Any]]:
    from deepr.io import RecordError

    out, seen = [], set()
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        qid, _, text = raw.partition("\t")
        if not qid.strip() or not text.strip():
            raise RecordError(path, n, "expected 'id<TAB>question'", field="query")
        if qid.strip() in seen:
            raise RecordError(path, n, f"id {qid.strip()!r} appears twice; ids must be unique", field="id")
        seen.add(qid.strip())
        out.append({"id": qid.strip(), "query": text.strip()})
    return out


def _safe_name(qid: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", qid).strip("._")[:80] or "query"
    return safe if safe == qid else f"{safe}-{hashlib.sha1(qid.encode()).hexdigest()[:6]}"


def _pages_fetched(trace: Any) -> int:
    """Pages this run fetched: with web search every page read (each result's page is read to
    verify it, and browse reads more), as report.json's search counts say; on the corpus, the
    documents opened by browse."""
    search = (trace.model_extra or {}).get("search")
    if isinstance(search, dict) and "fetches" in search:
        return int(search["fetches"])
    return sum(1 for t in trace.tools if t["tool"] == "browse" and not t.get("refused"))


def _stats(result: Any) -> list[tuple[str, Any]]:
    tr = result.trace
    extra = tr.model_extra or {}
    rows = [("mode", result.mode), ("backend", extra.get("backend", {}).get("backend")),
            ("wall seconds", round(result.seconds, 2)),
            ("search calls", sum(1 for t in tr.tools if t["tool"] == "search")),
            ("pages fetched", _pages_fetched(tr)),
            ("model calls", len(tr.calls)), ("failed model calls", sum(1 for c in tr.calls if not c.ok)),
            ("citations in report", len(tr.citations)), ("recorded failures", len(extra.get("failures", [])))]
    if result.mode == "dag":
        rows += [("plan nodes", len(tr.plans[-1]["plan"]["nodes"])), ("waves", len(extra.get("waves", [])))]
    elif result.mode == "warp":
        rows += [("expansions", extra.get("expansions")), ("drafts", len(result.trajectory.drafts))]
    elif result.mode == "tools":
        rows += [("agent tool calls", extra.get("tool_calls"))]
    else:
        rows += [("search steps", len(extra.get("queries", [])))]
    return rows


def _run_one(query: str, tools: Any, llm: Any, config: Any, *, html: bool, query_id: str | None = None,
             rubrics: Any = (), profile: Any = None, deadline: float | None = None) -> Any:
    import deepr
    from deepr.cli.live import LiveView

    with LiveView(f"run {config.mode}", deadline=deadline) as view:
        view.phase("starting")
        return deepr.run(query, tools=tools, llm=llm, config=config, query_id=query_id, rubrics=rubrics,
                         html=html, profile=profile, on_phase=view.phase)


def _reason_rows(res: Any) -> list[tuple[str, Any]]:
    """The run's commonest failure reasons with the next step: its recorded failures, else its failed calls."""
    from deepr.data.outcomes import failure_rows

    tr = res.trace
    return failure_rows((tr.model_extra or {}).get("failures") or [
        {"where": c.role, "reason": c.error or "failed"} for c in tr.calls if not c.ok])


def _unique(record: Path, base: str) -> str:
    from deepr.io import done_ids

    taken, n, cid = done_ids(record), 1, base
    while cid in taken:
        n += 1
        cid = f"{base}#{n}"
    return cid


def _batch(items: list[dict[str, Any]], out: Path, tools: Any, llm: Any, config: Any, *, html: bool,
           record: Path | None, limit: int | None = None, parallel: int = 1, profile: Any = None,
           deadline: float | None = None) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Run every query not yet in ``out/reports.jsonl``, ``parallel`` at a time; returns counts for
    the summary and its top failure reasons. Each finished query is written at once, so a stopped
    batch resumes where it was."""
    from deepr.io import JsonlAppender, done_ids, rejects_path, versions
    from deepr.llm.base import run_sync

    # Every report's sidecar names the library versions; reading them (a sys.path scan) before the
    # questions start keeps it off the first report's write, which the questions in flight wait on.
    versions()
    index = out / "reports.jsonl"
    done = done_ids(index)
    todo = [it for it in items if it["id"] not in done][:limit]
    counts = {"queries": len(items), "already done": len(done & {i["id"] for i in items}), "run now": 0,
              "rejected": 0, "degraded": 0, "seconds": 0.0}
    batch = _Batch(out, tools, llm, config, html, record, counts, done_ids(record) if record else set())
    batch.profile = profile
    from deepr.cli.live import LiveView
    from deepr.corpus.remote import CorpusUnavailable

    try:
        with JsonlAppender(index) as batch.sink, JsonlAppender(rejects_path(index)) as batch.rejects, \
                LiveView(f"run {config.mode}", total=len(todo), unit="questions", deadline=deadline) as batch.status:
            run_sync(batch.run_all(todo, parallel))
    except CorpusUnavailable as e:  # the served corpus went away: say what this run finished (app.corpus_lost)
        e.kept = counts["run now"]  # type: ignore[attr-defined]
        raise
    return counts, batch.tally.reason_rows(3)


class _Batch:
    """The queries of one ``deepr run --queries``, ``parallel`` in flight on one event loop (their
    model calls meet in the backend: the hf backend decodes waiting greedy calls as one batch)."""

    def __init__(self, out: Path, tools: Any, llm: Any, config: Any, html: bool, record: Path | None,
                 counts: dict[str, Any], recorded: set[str]) -> None:
        self.out, self.tools, self.llm, self.config, self.html = out, tools, llm, config, html
        self.record, self.counts, self.recorded = record, counts, recorded
        self.sink: Any = None
        self.rejects: Any = None
        self.status: Any = None
        self.profile: Any = None
        from deepr.data.outcomes import StageTally

        self.tally = StageTally("run")  # the reasons of rejected questions and of failed turns

    async def run_all(self, todo: list[dict[str, Any]], parallel: int) -> None:
        import asyncio

        gate = asyncio.Semaphore(parallel)

        async def one(n: int, it: dict[str, Any]) -> None:
            async with gate:
                await self.run_one(it, f"{it['id']}: ")

        await asyncio.gather(*(one(n, it) for n, it in enumerate(todo, 1)))

    async def run_one(self, it: dict[str, Any], label: str) -> None:
        from deepr.api import arun
        from deepr.cli.search_opts import attach, search_summary
        from deepr.llm.base import LLMError
        from deepr.records import Reject, RubricItem

        try:
            rubrics = [RubricItem.model_validate(r) for r in it.get("rubrics", [])]
            before = search_summary(self.tools.retriever)
            res = await arun(it["query"], tools=self.tools.fresh(), llm=self.llm, config=self.config,
                             query_id=it["id"], rubrics=rubrics, html=self.html, profile=self.profile,
                             on_phase=lambda p: self.status.phase(f"{label}{p}"))
            attach(res, self.tools.retriever, before)
            if self.llm is not None and self.llm.unreachable:  # every turn fell back without reaching it
                raise LLMError(f"{self.llm.unreachable}; no report written")
        except (ValueError, LLMError, RuntimeError) as e:
            self.rejects.write(Reject(id=it["id"], stage="run", reason=str(e), record={"query": it["query"]}))
            self.counts["rejected"] += 1
            self.tally.add_failures([{"where": "question", "reason": str(e)}])
            self.status.advance()
            return
        self.tally.add_failures(res.trace.model_extra.get("failures", []))
        self.write(it, res)
        self.status.advance()

    def write(self, it: dict[str, Any], res: Any) -> None:
        from deepr.agent import write_report
        from deepr.io import JsonlAppender

        paths = write_report(res, self.out / f"{_safe_name(it['id'])}.md")
        if self.record and res.trajectory.id not in self.recorded:
            with JsonlAppender(self.record) as traj:
                traj.write(res.trajectory)
        self.sink.write({"id": it["id"], "query": it["query"], "mode": res.mode, "answer": res.answer,
                         # absolute: the index is read from other directories (deepr drb, benches)
                         "report_path": str(paths["report"].resolve()), "trace_path": str(paths["trace"].resolve()),
                         "seconds": round(res.seconds, 3), "citations": len(res.trace.citations),
                         "failures": len(res.trace.model_extra.get("failures", [])),
                         **{k: it[k] for k in ("answers", "rubrics") if k in it}})
        self.counts["run now"] += 1
        self.counts["degraded"] += int(_turn_counts(res, self.llm)[1] > 0)
        self.counts["seconds"] += res.seconds
        # no highlighting: rich's highlighter regexes cost more than the rest of this line's work
        console.print(escape(f"{it['id']}: {res.seconds:.1f}s, {len(res.trace.citations)} citations -> {paths['report']}"),
                      highlight=False)


@app.command("run", epilog=F.EXIT_HELP)
@fetch_limit_options
def run_command(
    query: str | None = typer.Argument(None, help="The research question (leave out when using --queries)."),
    out: Path = typer.Option(..., "--out", "-o", help="Report path (.md); report.json (audit trace) and "
                             "report.html go beside it. With --queries: a folder for all reports."),
    mode: str = typer.Option("dag", "--mode", "-m", help="dag (plan graph + waves), warp (draft and deepen "
                             "an outline), decor (planner/filter/answerer for short answers) or tools "
                             "(DeepRubric agent: <tool_call> search/browse loop, ≤ 10 tool turns, <cite> answer)."),
    corpus: str = typer.Option("wiki", "--corpus", "-c", help="Corpus: wiki, a .jsonl/.parquet file, a folder "
                               "of .md/.txt, or hf:<dataset>[:<config>]."),
    retriever: str = typer.Option("hybrid", "--retriever", "-r", help="dense, bm25 or hybrid ranking."),
    embedder: str | None = typer.Option(None, "--embedder", help="Sentence-transformers model for the index and "
                                        "the extractive engine (default all-MiniLM-L6-v2; docs/models.md)."),
    language: str = typer.Option("auto", "--language", help="The corpus's language for BM25: auto, en, zh, ja, "
                                 "th, lo, km, my (docs/languages.md)."),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help="Index cache (default $DEEPR_CACHE or "
                                          "~/.cache/deepr)."),
    llm: str = typer.Option("extractive", "--llm", envvar="DEEPR_LLM", help=F.LLM_HELP),
    base_url: str | None = typer.Option(None, "--base-url", help="OpenAI-compatible endpoint URL."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="API key for --base-url."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Do not use the LLM response cache."),
    timeout: float = F.TIMEOUT,
    concurrency: int = typer.Option(8, "--concurrency", help="Model calls in flight at once."),
    deadline: float | None = F.DEADLINE, allow_fallback: bool = F.ALLOW_FALLBACK,
    max_tokens: int | None = F.MAX_TOKENS, temperature: float | None = F.TEMPERATURE,
    top_p: float | None = F.TOP_P, seed: int | None = F.GEN_SEED, formats: str = F.FORMATS, reask: str = F.REASK,
    profile: str | None = F.PROFILE,
    record: Path | None = typer.Option(None, "--record", help="Append the run as a training trajectory "
                                       "(JSONL) for prune-trajectories."),
    html: bool = typer.Option(False, "--html", help="Also write a self-contained HTML report with the plan graph."),
    k: int = typer.Option(5, "-k", "--top-k", help="Results per search."),
    search_rounds: int = typer.Option(1, "--search-rounds", help="dag: inner search agent rounds per node."),
    rubric_scaffold: bool = typer.Option(False, "--rubric-scaffold", help="dag: persistent + ephemeral rubrics; "
                                         "evidence gaps trigger more planning cycles."),
    max_cycles: int = typer.Option(3, "--max-cycles", help="dag with --rubric-scaffold: most planning cycles."),
    force_expand: int = typer.Option(0, "--force-expand", help="warp: expand exactly N times (teacher runs "
                                     "for trajectory pruning)."),
    steps: int = typer.Option(4, "--steps", help="decor: most planner/filter steps (T_max)."),
    memory_limit: int = typer.Option(4096, "--memory-limit", help="decor: memory tokens before condensing."),
    max_reasks: int = typer.Option(2, "--max-reasks", help="Re-asks per model turn after an unusable reply."),
    answer: str = typer.Option("report", "--answer", help="report (a long cited report) or short: a "
                               "fact-seeking question's Explanation / Exact Answer / Confidence 0-100, as "
                               "BrowseComp-Plus grades it (dag, decor or tools)."),
    queries: Path | None = typer.Option(None, "--queries", help="Run every query of this file (JSONL with id "
                                        "and question, BrowseComp-Plus or ResearchRubrics JSONL, id<TAB>question "
                                        ".tsv, or one question per line); resumable by id."),
    parallel: int = typer.Option(1, "--parallel", help="With --queries: queries in flight at once. Their model "
                                 "calls overlap (an hf model decodes waiting calls as one batch; a server "
                                 "batches them itself). Not with web search: its per-run counts would mix."),
    limit: int | None = typer.Option(None, "--limit", help="With --queries: run at most N pending queries."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the inputs and settings, run nothing."),
    search: str = SEARCH_OPT,
    allow_host: list[str] | None = ALLOW_OPT,
    search_cache: str = CACHE_OPT,
) -> None:
    """Research a question and write a cited report plus its full audit trace."""
    with user_errors(_FLAGS):
        F.check_budget(timeout, deadline, concurrency, limit)
        gen = F.gen_defaults(max_tokens, temperature, top_p, seed, formats, reask)
        prof = F.profile_of(llm, profile, formats, reask)
        if mode not in MODES:
            raise ValueError(f"--mode {mode!r}: choose one of {', '.join(MODES)}")
        if (query is None) == (queries is None):
            raise ValueError("give either a QUERY argument or --queries FILE (not both)")
        if queries is None and out.suffix != ".md":
            raise ValueError(f"--out {out}: a single run writes a .md report (report.json goes beside it)")
        if queries is not None and out.suffix:
            raise ValueError(f"--out {out}: with --queries, --out is a folder (e.g. reports/)")
        if query is not None and not query.strip():
            raise ValueError("the query is empty: pass the research question as text")
        _check_parallel(parallel, queries, search)
        config = _config(mode=mode, k=k, search_rounds=search_rounds, rubric_scaffold=rubric_scaffold,
                         max_cycles=max_cycles, force_expand=force_expand, decor_steps=steps,
                         memory_limit=memory_limit, max_reasks=max_reasks, answer=answer)
        _guard_run(query, queries, out, corpus, record, html)
        from deepr.io import require_records

        items = require_records(load_queries(queries), queries, "--queries", "queries") if queries else []
        if queries:
            _guard_batch(items, queries, out, corpus, record)
        if dry_run:
            console.print(escape(f"run: mode {mode}, llm {llm}, corpus {corpus}, "
                                 + (f"{len(items)} queries from {queries}" if queries else "1 query") + "; nothing run"))
            return
        from deepr.cli.search_opts import attach, check_usable, open_search, search_errors
        from deepr.corpus import ResearchTools, open_retriever
        from deepr.llm import llm_from_flags

        t0 = time.perf_counter()
        source = open_search(search, allow_host, search_cache, cache_dir,
                             lambda: open_retriever(corpus, retriever=retriever, cache_dir=cache_dir, progress=True,
                                                    embedder=embedder, language=language))
        tools = ResearchTools(source, k=k)
        model = llm_from_flags(llm, base_url, api_key, no_cache, timeout, concurrency, gen=gen,
                               decoding=dict(prof.decoding))
        if model is not None:  # None: --llm extractive, no model
            model.set_deadline(deadline)
        if prof.name != "default":
            console.print(f"profile {prof.name}: " + ", ".join(f"{k} {v}" for k, v in prof.describe().items()
                                                           if k in ("formats", "reask")))
        if queries:
            out.mkdir(parents=True, exist_ok=True)
            with search_errors(source):
                counts, reasons = _batch(items, out, tools, model, config, html=html, record=record, limit=limit,
                                         parallel=parallel, profile=prof, deadline=deadline)
            _finish_batch(out, queries, {**config.model_dump(), "profile": prof.describe()}, counts,
                          time.perf_counter() - t0, reasons)
            finish(exit_code(counts["run now"] - counts["degraded"], counts["degraded"], counts["rejected"],
                             allow_fallback=allow_fallback, auth=model is not None and model.auth_failed))
            return
        from deepr.agent import write_report

        with search_errors(source):
            try:
                res = _run_one(query, tools, model, config, html=html, profile=prof, deadline=deadline)
            except KeyboardInterrupt:
                console.print(f"[yellow]{escape(interrupted_run(model))}[/]", highlight=False, soft_wrap=True)
                raise typer.Exit(130) from None
            _check_reached(model)
            check_usable(source, res)
            attach(res, source)
        paths = write_report(res, out)
        if record:
            from deepr.io import JsonlAppender

            with JsonlAppender(record) as sink:
                sink.write(res.trajectory.model_copy(update={"id": _unique(record, res.trajectory.id)}))
    summary_table(f"deepr run — {out}", _stats(res) + _reason_rows(res)
                  + [(f"wrote {k}", str(p)) for k, p in paths.items()])
    ok, bad = _turn_counts(res, model)
    # one run's units are its turns: with none working, nothing succeeded (unless fallback is accepted)
    finish(exit_code(ok, bad if ok or allow_fallback else 0, 0 if ok or allow_fallback else bad,
                     allow_fallback=allow_fallback, auth=model is not None and model.auth_failed))


def _check_reached(model: Any) -> None:
    """A model that could not be reached wrote nothing: stop with its reason, write no report."""
    if model is not None and model.unreachable:
        from deepr.cli.exit_codes import NOTHING

        console.print(f"[red]error[/]: {escape(model.unreachable)}; no report written", highlight=False,
                      soft_wrap=True)
        raise typer.Exit(NOTHING)


def _check_parallel(parallel: int, queries: Path | None, search: str) -> None:
    if not 1 <= parallel <= 64:
        raise ValueError(f"--parallel {parallel}: must be between 1 and 64")
    if parallel > 1 and queries is None:
        raise ValueError(f"--parallel {parallel}: runs queries side by side, so it needs --queries FILE")
    if parallel > 1 and search != "corpus":
        raise ValueError(f"--parallel {parallel} with --search {search}: each report records its own web "
                         "searches and their cost, which overlapping runs would mix; use --parallel 1")


def _guard_run(query: str | None, queries: Path | None, out: Path, corpus: str, record: Path | None,
               html: bool) -> None:
    """Refuse outputs that are or would overwrite an input, or cannot be written (before any work)."""
    from deepr.agent.runner import sidecar_path
    from deepr.io import check_paths, meta_path

    ins = [("--queries", queries), ("--corpus", Path(corpus) if Path(corpus).is_file() else None)]
    if queries is not None:
        check_paths(ins, [("--record", record)], [("--out", out, ["reports.jsonl", "reports.rejects.jsonl",
                                                                   "reports.jsonl.meta.json"])])
        return
    outs = [("--out", out), ("--out", sidecar_path(out)), ("--out", meta_path(out)), ("--record", record)]
    check_paths(ins, outs + ([("--out", out.with_suffix(".html"))] if html else []))


def _guard_batch(items: list[dict[str, Any]], queries: Path, out: Path, corpus: str, record: Path | None) -> None:
    """Per-query report files must not land on an input either (``<id>.md`` / ``.json`` / ``.html``)."""
    from deepr.io import check_paths

    names = [f"{_safe_name(it['id'])}{ext}" for it in items for ext in (".md", ".json", ".html", ".md.meta.json")]
    check_paths([("--queries", queries), ("--corpus", Path(corpus) if Path(corpus).is_file() else None),
                 ("--record", record)], [], [("--out", out, names)])


def _finish_batch(out: Path, queries: Path, config: Any, counts: dict[str, Any], seconds: float,
                  reasons: list[tuple[str, str]] = ()) -> None:
    from deepr.io import write_meta

    write_meta(out / "reports.jsonl", stage="run", config=config, inputs=[queries],
               counts={k: v for k, v in counts.items() if k != "seconds"},
               timings={"run_seconds": round(counts["seconds"], 3), "total_seconds": round(seconds, 3)})
    counts["seconds"] = round(counts["seconds"], 1)
    summary_table(f"deepr run — {out}", [*counts.items(), *reasons])
