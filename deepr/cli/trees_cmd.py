"""``deepr build-trees``, ``deepr synthesize-rubrics`` and ``deepr verify``: files and flags
around :mod:`deepr.data.trees`, :mod:`deepr.data.rubrics` and :mod:`deepr.data.verify`.

    deepr build-trees --corpus wiki --n-trees 20 --out data/trees.jsonl
    deepr synthesize-rubrics data/trees.jsonl --out data/pairs.jsonl
    deepr verify data/pairs.jsonl --out data/verified.jsonl

All three append each finished record at once (Ctrl-C or a kill loses nothing), skip ids
already in their outputs when re-run, split work with ``--shard K/N`` by tree id (the
same split in every stage, so shard K's trees feed shard K's pairs), write a rejects file
with reasons, a ``<out>.meta.json`` sidecar and print a summary table.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.markup import escape

from deepr.cli import flags as F
from deepr.cli.app import app, console, finish, summary_table, user_errors
from deepr.cli.search_opts import ALLOW_OPT, CACHE_OPT, SEARCH_OPT, fetch_limit_options

T = TypeVar("T")
LLM_HELP = ("extractive (no LLM, the offline default), openai:<model>, hf:<path>[,adapter=<role>:<path>] "
            "or replay:<file>.")


def _llm_opt() -> Any:
    return typer.Option("extractive", "--llm", envvar="DEEPR_LLM", help=LLM_HELP)


def _judge_opt(what: str) -> Any:
    return typer.Option(None, "--judge-llm", help=f"Model for {what} (same forms as --llm; default: --llm).")


def _common() -> dict[str, Any]:
    return {
        "base_url": typer.Option(None, "--base-url",
                                 help="OpenAI-compatible endpoint URL (e.g. http://localhost:8000/v1)."),
        "api_key": typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="API key for the endpoint."),
        "no_cache": typer.Option(False, "--no-cache", help="Do not use the LLM response cache (on by default)."),
        "timeout": F.TIMEOUT, "deadline": F.DEADLINE, "allow_fallback": F.ALLOW_FALLBACK,
        "max_tokens": F.MAX_TOKENS, "temperature": F.TEMPERATURE, "top_p": F.TOP_P, "gen_seed": F.GEN_SEED,
        "formats": F.FORMATS,
        "reask": F.REASK,
        "profile": F.PROFILE,
        "concurrency": typer.Option(8, "--concurrency",
                                    help="Model calls in flight at once, and items worked on at once."),
        "limit": typer.Option(None, "--limit", help="Process at most N pending items (a quick look)."),
        "dry_run": typer.Option(False, "--dry-run",
                                help="Check inputs and settings and show what would run; run nothing."),
        "shard": typer.Option(None, "--shard",
                              help="Only shard K of N (e.g. 2/8), split by tree id; concatenate the outputs."),
        "retry_rejects": typer.Option(False, "--retry-rejects", help="Work again on items the rejects file lists."),
    }


C = _common()


def _models(llm: str, judge: str | None, base_url: str | None, api_key: str | None, no_cache: bool,
            timeout: float, concurrency: int, gen: Any = None, deadline: float | None = None,
            profiles: tuple[str | None, str | None, str | None] = (None, None, None)) -> tuple[Any, Any, Any, Any]:
    """The writing model and the judging one (the same when ``judge`` is unset), each with its
    profile (``profiles``: --profile, --formats, --reask)."""
    from deepr.llm import llm_from_flags

    name, formats, reask = profiles
    main_p = F.profile_of(llm, name, formats, reask)
    other_p = F.profile_of(judge, name, formats, reask) if judge and judge != llm else main_p
    main = llm_from_flags(llm, base_url, api_key, no_cache, timeout, concurrency, gen=gen,
                          decoding=dict(main_p.decoding))
    other = (llm_from_flags(judge, base_url, api_key, no_cache, timeout, concurrency, gen=gen,
                            decoding=dict(other_p.decoding)) if judge and judge != llm else main)
    for m in {id(main): main, id(other): other}.values():
        m.set_deadline(deadline)
    return main, other, main_p, other_p


def _outcome(tally: Any, models: Sequence[Any], allow_fallback: bool) -> int:
    """Exit status from the stage's record tally (see deepr/cli/exit_codes.py); when every record
    failed, say so with the commonest reason first. ``--fallback extractive`` is the user accepting
    rebuilt records, so it counts as ``--allow-fallback``."""
    from deepr.cli.exit_codes import exit_code

    message = tally.verdict()
    if message:
        console.print(f"[red]{escape(message)}[/red]")
    return exit_code(tally.ok, tally.fallback, tally.failed, allow_fallback=allow_fallback,
                     auth=any(m.auth_failed for m in models))


def _guard(flag_in: Sequence[tuple[str, Path | None]], out: Path, *others: tuple[str, Path]) -> None:
    """Refuse an output that is or would overwrite an input, or cannot be written (before any work)."""
    from deepr.io import check_paths, meta_path, rejects_path

    check_paths(flag_in, [("--out", out), ("--out", rejects_path(out)), ("--out", meta_path(out)), *others])


def _pending(items: Sequence[T], key: Callable[[T], str], shard: str | None, done: set[str],
             id_of: Callable[[T], str], limit: int | None) -> tuple[list[T], dict[str, int]]:
    from deepr.io import in_shard, parse_shard

    part = parse_shard(shard)
    mine = [x for x in items if in_shard(key(x), part)]
    todo = [x for x in mine if id_of(x) not in done]
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--limit {limit}: give a positive number")
        todo = todo[:limit]
    return todo, {"input": len(items), "in shard": len(mine), "already done": len(mine) - len([
        x for x in mine if id_of(x) not in done]), "to do now": len(todo)}


def _done(out: Path, others: Iterable[Path], rejects: Path, retry: bool, retry_ids: set[str] | None = None) -> set[str]:
    """Ids finished in earlier runs; with ``retry`` the rejects file is cleared of them first."""
    from deepr.io import done_ids, read_jsonl, write_jsonl

    done = done_ids(out)
    for p in others:
        done |= done_ids(p)
    if retry and rejects.exists():
        write_jsonl(rejects, [r for r in read_jsonl(rejects, tolerate_torn_tail=True)
                              if retry_ids is not None and r.get("id") not in retry_ids])
    return done | done_ids(rejects)


def _drive(coro_fn: Callable[[Callable[[Any], None]], Any], total: int, label: str,
           write: Callable[[Any], None]) -> None:
    """Run a stage (a coroutine, or a function that runs one itself) with a progress bar;
    ``write`` stores each result as it arrives."""
    import inspect

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from deepr.llm.base import run_sync

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(label, total=total)

        def on_result(r: Any) -> None:
            write(r)
            bar.advance(task)

        work = coro_fn(on_result)
        if inspect.iscoroutine(work):
            run_sync(work)


def _fallback_opt() -> Any:
    return typer.Option("none", "--fallback", help=(
        "extractive: a record the model cannot produce is made by the extractive engine instead "
        "(marked in the record and counted in the sidecar); none: it is rejected."))



def _parse_branching(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--branching {text!r}: expected comma-separated integers, e.g. 6,4,3") from None


@app.command("build-trees", epilog=F.EXIT_HELP)
@fetch_limit_options
def build_trees_command(
    out: Path = typer.Option(..., "--out", "-o", help="Output trees.jsonl (appended; re-runs resume)."),
    corpus: str = typer.Option("wiki", "--corpus", "-c", help=(
        "wiki, a .jsonl/.parquet file, a folder of .md/.txt, or hf:<dataset>[:<config>].")),
    n_trees: int = typer.Option(20, "--n-trees", help=(
        "Trees to build from topics sampled from the corpus (stratified by its topic field). A rejected "
        "topic is replaced by the next sampled one, up to N extra topics in all; when N trees still "
        "cannot be built, the summary says why and the command exits 3.")),
    topics: Path | None = typer.Option(None, "--topics", help=(
        "Seed topics file instead of sampling (.txt one per line, or .jsonl with 'topic').")),
    seed: int | None = typer.Option(None, "--seed", help="Seed of topic sampling (default 0; part of every "
                                    "tree id), also sent with every model call when given."),
    max_depth: int = typer.Option(3, "--max-depth", help="Depth of the deepest nodes (root = 0)."),
    branching: str = typer.Option("6,4,3", "--branching",
                                  help="Most children per node at the root, the next level, and deeper."),
    retrieve_k: int = typer.Option(8, "--retrieve-k", help="Passages retrieved per sub-query."),
    retriever: str = typer.Option("hybrid", "--retriever", "-r", help="dense, bm25 or hybrid ranking."),
    cache_dir: Path | None = typer.Option(None, "--cache-dir",
                                          help="Index cache (default $DEEPR_CACHE or ~/.cache/deepr)."),
    llm: str = _llm_opt(), judge_llm: str | None = _judge_opt("the judging roles, gate and ground"),
    base_url: str | None = C["base_url"], api_key: str | None = C["api_key"], no_cache: bool = C["no_cache"],
    timeout: float = C["timeout"], concurrency: int = C["concurrency"], limit: int | None = C["limit"],
    dry_run: bool = C["dry_run"], shard: str | None = C["shard"], retry_rejects: bool = C["retry_rejects"],
    search: str = SEARCH_OPT, allow_host: list[str] | None = ALLOW_OPT, search_cache: str = CACHE_OPT,
    read_pages: bool = typer.Option(True, "--read-pages/--snippets-only", help=(
        "With a web --search: read every result page (same reader, cache, guard and limits as browse) "
        "so each tree node rests on the page's passage that best matches its sub-query, cited by that "
        "passage's id <url>#<chunk>, as DeepRubric grows trees from read pages; "
        "--snippets-only keeps the search results' own text.")),
    deadline: float | None = C["deadline"], allow_fallback: bool = C["allow_fallback"],
    max_tokens: int | None = C["max_tokens"], temperature: float | None = C["temperature"],
    top_p: float | None = C["top_p"], formats: str = C["formats"], reask: str = C["reask"],
    profile: str | None = C["profile"], fallback: str = _fallback_opt(),
) -> None:
    """Grow evidence trees: seed topic → root query → breadth-first sub-queries, each grounded in
    retrieved documents with extracted statements (DeepRubric Alg. 1, App. C.2)."""
    from deepr.io import rejects_path
    from deepr.data.topics import load_topics, sample_topics
    from deepr.data.trees import TreeConfig

    t0 = time.perf_counter()
    with user_errors():
        F.check_budget(timeout, deadline, concurrency, limit)
        gen = F.gen_defaults(max_tokens, temperature, top_p, seed, formats, reask)
        cfg = TreeConfig(max_depth=max_depth, branching=_parse_branching(branching), retrieve_k=retrieve_k,
                         concurrency=concurrency, seed=seed or 0, fallback=fallback)
        corpus_file = Path(corpus) if Path(corpus).is_file() else None
        _guard([("--topics", topics), ("--corpus", corpus_file)], out)
        seed = seed or 0
        rejects = rejects_path(out)
        retriever_obj = None
        if topics is not None:
            seeds = load_topics(topics, seed=seed)
        else:
            from deepr.corpus import load_documents, open_retriever

            # 2N topics: a sample is a prefix of any longer one, so the spares never change the first N
            if dry_run or search != "corpus":  # web search: topics still come from the corpus documents
                seeds = sample_topics(load_documents(corpus), 2 * n_trees, seed=seed)
            else:
                retriever_obj = open_retriever(corpus, retriever=retriever, cache_dir=cache_dir, progress=True)
                seeds = sample_topics(retriever_obj.documents, 2 * n_trees, seed=seed)
        seeds, spares = (seeds[:n_trees], seeds[n_trees:]) if topics is None and limit is None else (seeds, [])
        done = _done(out, [], rejects, retry_rejects, {s.id for s in [*seeds, *spares]})
        todo, plan = _pending(seeds, lambda s: s.id, shard, done, lambda s: s.id, limit)
        spare_todo, _ = _pending(spares, lambda s: s.id, shard, done, lambda s: s.id, None)
        spare = _Spares(plan["in shard"] if spares else 0, spare_todo, ids={s.id for s in [*seeds, *spares]})
        if dry_run:
            summary_table("build-trees --dry-run (nothing run)", [*plan.items(), ("llm", llm), ("corpus", corpus),
                          *((f"topic {i + 1}", f"{s.title} [{s.category or '-'}]") for i, s in enumerate(todo[:10]))])
            return
        if retriever_obj is None or search != "corpus":
            from deepr.cli.search_opts import open_search
            from deepr.corpus import open_retriever

            corpus_obj = retriever_obj
            retriever_obj = open_search(search, allow_host, search_cache, cache_dir, lambda: corpus_obj or open_retriever(
                corpus, retriever=retriever, cache_dir=cache_dir, progress=True))
            if read_pages and hasattr(retriever_obj, "read_passages"):
                from deepr.search.reading import PageReadingRetriever

                retriever_obj = PageReadingRetriever(retriever_obj)
        model, judge, prof, judge_prof = _models(llm, judge_llm, base_url, api_key, no_cache, timeout, concurrency,
                                                 gen, deadline, (profile, formats, reask))
        inputs = [p for p in (topics, Path(corpus)) if p is not None and p.is_file()]
        from deepr.cli.search_opts import search_errors

        with search_errors(retriever_obj):
            tally = _run_trees(todo, retriever_obj, model, judge, cfg, out, rejects, plan, t0, inputs=inputs,
                                corpus=corpus, spare=spare, profiles=(prof, judge_prof))
    accept = allow_fallback or fallback == "extractive"
    finish(spare.outcome(tally, [model, judge], accept) if spare.used else _outcome(tally, [model, judge], accept))


class _Spares:
    """The topics sampled beyond --n-trees, standing in for rejected ones so that N asked for
    means N built, with at most N extra topics; what they did goes into the summary and decides
    the exit status."""

    def __init__(self, target: int, pool: list[Any], *, ids: set[str]) -> None:
        self.target, self.pool, self.ids, self.used, self.built = target, pool, ids, 0, 0

    def next(self, built: set[str]) -> list[Any]:
        """Spare topics for the trees still missing (none once N are built or none is left)."""
        self.built = len(built & self.ids)
        batch = self.pool[self.used:self.used + max(self.target - self.built, 0)]
        self.used += len(batch)
        return batch

    @property
    def missing(self) -> int:
        return max(self.target - self.built, 0)

    def rows(self) -> list[tuple[str, Any]]:
        if not self.target:
            return []
        rows = [("trees asked for", self.target), ("spare topics tried for rejected ones", self.used)]
        if self.missing:
            rows.append(("trees missing", f"{self.missing}, after {self.used} of {len(self.pool)} spare topics"))
        return rows

    def outcome(self, tally: Any, models: Sequence[Any], accept: bool) -> int:
        """Rejected topics replaced by built ones count as done: 0 when N trees stand, 3 when some
        are missing, 4 when none could be built (as without spares)."""
        from deepr.cli.exit_codes import PARTIAL, exit_code

        if tally.every_failed or any(m.auth_failed for m in models):
            return _outcome(tally, models, accept)
        if self.missing:
            console.print(f"[red]build-trees: {self.missing} of {self.target} trees could not be built; "
                          f"{self.used} spare topic(s) were tried too (reasons in the rejects file)[/red]")
            return PARTIAL
        console.print(f"build-trees: {self.target} trees; {self.used} rejected topic(s) were replaced by spare "
                      "topics (the rejected ones are in the rejects file)")
        return exit_code(tally.ok, tally.fallback, 0, allow_fallback=accept)


def _run_trees(todo: list[Any], retriever: Any, model: Any, judge: Any, cfg: Any, out: Path, rejects: Path,
               plan: dict[str, int], t0: float, *, inputs: list[Path], corpus: str, spare: "_Spares",
               profiles: tuple[Any, Any] = (None, None)) -> Any:
    from deepr.io import JsonlAppender, read_jsonl, write_meta
    from deepr.records import Reject, Tree
    from deepr.data.outcomes import StageTally
    from deepr.api import build_trees
    from deepr.data.trees import tree_summary

    from deepr.io import done_ids

    counts, tally = Counter(), StageTally("build-trees")
    built = done_ids(out) if out.exists() else set()
    try:
        with JsonlAppender(out) as sink, JsonlAppender(rejects) as rej:
            def write(r: Any) -> None:
                (rej if isinstance(r, Reject) else sink).write(r)
                counts["rejected" if isinstance(r, Reject) else "built"] += 1
                if not isinstance(r, Reject):
                    built.add(r.id)
                tally.add(r)

            batch = todo
            while batch:  # then spare topics for the rejected ones, while trees are missing
                _drive(lambda cb, b=batch: build_trees(corpus=retriever, topics=b, llm=model, judge=judge,
                                                       config=cfg, on_result=cb, profile=profiles[0],
                                                       judge_profile=profiles[1]),
                       len(batch), "building trees", write)
                batch = spare.next(built)
    finally:
        trees = list(read_jsonl(out, Tree, tolerate_torn_tail=True)) if out.exists() else []
        stats = tree_summary(trees)
        write_meta(out, stage="build-trees", config=cfg, inputs=inputs,
                   counts={**plan, **dict(spare.rows()), **counts, "trees in output": len(trees), **tally.counts()},
                   timings={"seconds": round(time.perf_counter() - t0, 2)},
                   extra={"corpus": corpus, "llm": model.describe(), "judge": judge.describe(),
                          "profile": _described(profiles[0]), "judge_profile": _described(profiles[1]),
                          "usage": model.usage.as_dict(), "retriever": _describe(retriever), "summary": stats,
                          **({"search": retriever.summary()} if hasattr(retriever, "summary") else {})})
    summary_table(f"build-trees → {out}", [*plan.items(), *spare.rows(), *counts.items(), *stats.items(), *tally.rows(),
                                          ("rejects file", str(rejects) if counts["rejected"] else "-")])
    return tally


def _describe(retriever: Any) -> Any:
    d = getattr(retriever, "describe", None)
    return d() if callable(d) else type(retriever).__name__


@app.command("synthesize-rubrics", epilog=F.EXIT_HELP)
def synthesize_rubrics_command(
    trees: Path = typer.Argument(..., help="trees.jsonl written by build-trees."),
    out: Path = typer.Option(..., "--out", "-o", help="Output pairs.jsonl (appended; re-runs resume)."),
    n_select: int = typer.Option(5, "--n-select", help="Leaves to select per tree (the paper averages 5)."),
    min_rubrics: int = typer.Option(5, "--min-rubrics", help="Fewest rubric criteria per pair."),
    llm: str = _llm_opt(),
    base_url: str | None = C["base_url"], api_key: str | None = C["api_key"], no_cache: bool = C["no_cache"],
    timeout: float = C["timeout"], concurrency: int = C["concurrency"], limit: int | None = C["limit"],
    dry_run: bool = C["dry_run"], shard: str | None = C["shard"], retry_rejects: bool = C["retry_rejects"],
    deadline: float | None = C["deadline"], allow_fallback: bool = C["allow_fallback"],
    max_tokens: int | None = C["max_tokens"], temperature: float | None = C["temperature"],
    top_p: float | None = C["top_p"], seed: int | None = C["gen_seed"], formats: str = C["formats"], reask: str = C["reask"],
    profile: str | None = C["profile"], fallback: str = _fallback_opt(),
) -> None:
    """Co-generate one research question and ≥ 5 typed, weighted, leaf-grounded rubrics per tree,
    DeepRubric's constraints (bottom-up merge, Fig. 11) checked in code: violations are re-asked, then
    rejected."""
    from deepr.io import read_jsonl, rejects_path, require_records
    from deepr.records import Tree
    from deepr.data.rubric_checks import RubricLimits
    from deepr.data.rubrics import SynthConfig, pair_id

    t0 = time.perf_counter()
    with user_errors():
        F.check_budget(timeout, deadline, concurrency, limit)
        gen = F.gen_defaults(max_tokens, temperature, top_p, seed, formats, reask)
        cfg = SynthConfig(n_select=n_select, concurrency=concurrency, limits=RubricLimits(min_rubrics=min_rubrics),
                          fallback=fallback)
        _guard([("TREES", trees)], out)
        items = require_records(list(read_jsonl(trees, Tree)), trees, what="trees")
        rejects = rejects_path(out)
        done = _done(out, [], rejects, retry_rejects, {pair_id(t.id) for t in items})
        todo, plan = _pending(items, lambda t: t.id, shard, done, lambda t: pair_id(t.id), limit)
        if dry_run:
            summary_table("synthesize-rubrics --dry-run (nothing run)", [*plan.items(), ("llm", llm)])
            return
        model, _, prof, _ = _models(llm, None, base_url, api_key, no_cache, timeout, concurrency, gen, deadline,
                                    (profile, formats, reask))
        tally = _run_synth(todo, model, cfg, trees, out, rejects, plan, t0, prof)
    finish(_outcome(tally, [model], allow_fallback or fallback == "extractive"))


def _described(profile: Any) -> Any:
    return profile.describe() if profile is not None else None


def _embed_fn() -> Any:
    from deepr.corpus.embed import get_embedder

    return get_embedder().encode


def _run_synth(todo: list[Any], model: Any, cfg: Any, trees: Path, out: Path, rejects: Path,
               plan: dict[str, int], t0: float, profile: Any = None) -> Any:
    from deepr.io import JsonlAppender, read_jsonl, write_meta
    from deepr.records import QRPair, Reject
    from deepr.data.outcomes import StageTally
    from deepr.data.rubrics import asynthesize_rubrics, pair_summary
    from deepr.extractive import needs_embedder

    embed = _embed_fn() if needs_embedder(model) else None
    counts, tally = Counter(), StageTally("synthesize-rubrics")
    try:
        with JsonlAppender(out) as sink, JsonlAppender(rejects) as rej:
            def write(r: Any) -> None:
                (rej if isinstance(r, Reject) else sink).write(r)
                counts["rejected" if isinstance(r, Reject) else "pairs written"] += 1
                tally.add(r)

            _drive(lambda cb: asynthesize_rubrics(todo, model, cfg, embed=embed, on_result=cb, profile=profile),
                   len(todo), "synthesising rubrics", write)
    finally:
        pairs = list(read_jsonl(out, QRPair, tolerate_torn_tail=True)) if out.exists() else []
        stats = pair_summary(pairs)
        write_meta(out, stage="synthesize-rubrics", config=cfg, inputs=[trees],
                   counts={**plan, **counts, "pairs in output": len(pairs), **tally.counts()},
                   timings={"seconds": round(time.perf_counter() - t0, 2)},
                   extra={"llm": model.describe(), "profile": _described(profile), "usage": model.usage.as_dict(),
                          "summary": stats})
    summary_table(f"synthesize-rubrics → {out}", [*plan.items(), *counts.items(), *stats.items(), *tally.rows(),
                                                 ("rejects file", str(rejects) if counts["rejected"] else "-")])
    return tally


def dropped_path(out: Path) -> Path:
    """``verified.jsonl`` → ``dropped.jsonl`` beside it; any other name gets ``<stem>.dropped.jsonl``."""
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name("dropped.jsonl" if stem == "verified" else f"{stem}.dropped.jsonl")


@app.command("verify", epilog=F.EXIT_HELP)
def verify_command(
    pairs: Path = typer.Argument(..., help="pairs.jsonl written by synthesize-rubrics."),
    out: Path = typer.Option(..., "--out", "-o", help="Output verified.jsonl (KEEP and REVISE; appended, resumable)."),
    dropped: Path | None = typer.Option(None, "--dropped",
                                        help="Where DROP decisions go (default: dropped.jsonl beside --out)."),
    trees: Path | None = typer.Option(None, "--trees",
                                      help="trees.jsonl, only for pairs that do not carry their selected leaves."),
    llm: str = _llm_opt(), judge_llm: str | None = _judge_opt("the audit (usually a stronger model)"),
    base_url: str | None = C["base_url"], api_key: str | None = C["api_key"], no_cache: bool = C["no_cache"],
    timeout: float = C["timeout"], concurrency: int = C["concurrency"], limit: int | None = C["limit"],
    dry_run: bool = C["dry_run"], shard: str | None = C["shard"], retry_rejects: bool = C["retry_rejects"],
    deadline: float | None = C["deadline"], allow_fallback: bool = C["allow_fallback"],
    max_tokens: int | None = C["max_tokens"], temperature: float | None = C["temperature"],
    top_p: float | None = C["top_p"], seed: int | None = C["gen_seed"], formats: str = C["formats"], reask: str = C["reask"],
    profile: str | None = C["profile"], fallback: str = _fallback_opt(),
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
        _guard([("PAIRS", pairs), ("--trees", trees)], out, ("--dropped", drop_to))
        items = require_records(list(read_jsonl(pairs, QRPair)), pairs, what="pairs")
        tree_map = {t.id: t for t in read_jsonl(trees, Tree)} if trees else None
        done = _done(out, [drop_to], rejects, retry_rejects, {p.id for p in items})
        todo, plan = _pending(items, lambda p: p.tree_id, shard, done, lambda p: p.id, limit)
        if dry_run:
            summary_table("verify --dry-run (nothing run)", [*plan.items(), ("judge", judge_llm or llm)])
            return
        _, judge, _, judge_prof = _models(llm, judge_llm or llm, base_url, api_key, no_cache, timeout, concurrency,
                                          gen, deadline, (profile, formats, reask))
        tally = _run_verify(todo, judge, cfg, tree_map, pairs, out, drop_to, rejects, plan, t0, judge_prof)
    finish(_outcome(tally, [judge], allow_fallback or fallback == "extractive"))


def _run_verify(todo: list[Any], judge: Any, cfg: Any, tree_map: Any, pairs: Path, out: Path, drop_to: Path,
                rejects: Path, plan: dict[str, int], t0: float, profile: Any = None) -> Any:
    from deepr.io import JsonlAppender, read_jsonl, write_meta
    from deepr.records import QRPair
    from deepr.data.outcomes import StageTally
    from deepr.data.verify import Verdict, averify, verify_summary

    counts, tally = Counter(), StageTally("verify")
    try:
        with JsonlAppender(out) as ok, JsonlAppender(drop_to) as gone, JsonlAppender(rejects) as rej:
            sinks = {"verified": ok, "dropped": gone, "reject": rej}

            def write(v: Any) -> None:
                sinks[v.kind].write(v.record)
                counts[v.kind] += 1
                tally.add(v)

            _drive(lambda cb: averify(todo, judge, cfg, embed=_embed_fn(), trees=tree_map, on_result=cb,
                                      profile=profile),
                   len(todo), "verifying pairs", write)
    finally:  # rates and tags over everything audited so far, resumed runs included
        seen = [Verdict(kind, r) for kind, path in (("verified", out), ("dropped", drop_to))
                if path.exists() for r in read_jsonl(path, QRPair, tolerate_torn_tail=True)]
        rates, tags = verify_summary(seen)
        write_meta(out, stage="verify", config=cfg, inputs=[pairs],
                   counts={**plan, **counts, **rates, **tally.counts()}, timings={"seconds": round(time.perf_counter() - t0, 2)},
                   extra={"judge": judge.describe(), "profile": _described(profile), "usage": judge.usage.as_dict(),
                          "dropped_file": str(drop_to),
                          "error_tags": tags})
    summary_table(f"verify → {out}", [*plan.items(), *counts.items(), *rates.items(),
                                     ("dropped file", str(drop_to))])
    summary_table("error tags (all audited pairs)", list(tags.items()) or [("none", 0)])
    summary_table("verify: records", tally.rows())
    return tally
