"""``deepr build-trees``: files and flags around :mod:`deepr.data.trees` (resuming, sharding,
rejects and the sidecar as every data stage: :mod:`deepr.cli.data_opts`).

    deepr build-trees --corpus wiki --n-trees 20 --out data/trees.jsonl
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer

from deepr.cli import data_opts as D
from deepr.cli import flags as F
from deepr.cli.app import app, console, finish, summary_table, user_errors
from deepr.cli.search_opts import ALLOW_OPT, CACHE_OPT, SEARCH_OPT, fetch_limit_options


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
    llm: str = D.llm_opt(), judge_llm: str | None = D.judge_opt("the judging roles, gate and ground"),
    base_url: str | None = D.C["base_url"], api_key: str | None = D.C["api_key"], no_cache: bool = D.C["no_cache"],
    timeout: float = D.C["timeout"], concurrency: int = D.C["concurrency"], limit: int | None = D.C["limit"],
    dry_run: bool = D.C["dry_run"], shard: str | None = D.C["shard"], retry_rejects: bool = D.C["retry_rejects"],
    search: str = SEARCH_OPT, allow_host: list[str] | None = ALLOW_OPT, search_cache: str = CACHE_OPT,
    read_pages: bool = typer.Option(True, "--read-pages/--snippets-only", help=(
        "With a web --search: read every result page (same reader, cache, guard and limits as browse) "
        "so each tree node rests on the page's passage that best matches its sub-query, cited by that "
        "passage's id <url>#<chunk>, as DeepRubric grows trees from read pages; "
        "--snippets-only keeps the search results' own text.")),
    deadline: float | None = D.C["deadline"], allow_fallback: bool = D.C["allow_fallback"],
    max_tokens: int | None = D.C["max_tokens"], temperature: float | None = D.C["temperature"],
    top_p: float | None = D.C["top_p"], formats: str = D.C["formats"], reask: str = D.C["reask"],
    profile: str | None = D.C["profile"], fallback: str = D.fallback_opt(),
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
        D.guard([("--topics", topics), ("--corpus", corpus_file)], out)
        seed = seed or 0
        rejects = rejects_path(out)
        retriever_obj = None
        if topics is not None:
            seeds = load_topics(topics, seed=seed)
        else:
            from deepr.corpus import load_documents, open_retriever

            # 2N topics: a sample is a prefix of any longer one, so the spares never change the first N
            served = corpus.strip().lower().startswith(("http://", "https://", "milvus:"))
            if (dry_run or search != "corpus") and not served:  # web search: topics still from the corpus documents
                seeds = sample_topics(load_documents(corpus), 2 * n_trees, seed=seed)
            else:
                retriever_obj = open_retriever(corpus, retriever=retriever, cache_dir=cache_dir, progress=True)
                seeds = sample_topics(retriever_obj.documents, 2 * n_trees, seed=seed)
        seeds, spares = (seeds[:n_trees], seeds[n_trees:]) if topics is None and limit is None else (seeds, [])
        done = D.done_before(out, [], rejects, retry_rejects, {s.id for s in [*seeds, *spares]})
        todo, plan = D.pending(seeds, lambda s: s.id, shard, done, lambda s: s.id, limit)
        spare_todo, _ = D.pending(spares, lambda s: s.id, shard, done, lambda s: s.id, None)
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
        model, judge, prof, judge_prof = D.models(llm, judge_llm, base_url, api_key, no_cache, timeout, concurrency,
                                                 gen, deadline, (profile, formats, reask))
        inputs = [p for p in (topics, Path(corpus)) if p is not None and p.is_file()]
        from deepr.cli.search_opts import search_errors

        with search_errors(retriever_obj):
            tally = _run_trees(todo, retriever_obj, model, judge, cfg, out, rejects, plan, t0, inputs=inputs,
                                corpus=corpus, spare=spare, profiles=(prof, judge_prof), deadline=deadline)
    accept = allow_fallback or fallback == "extractive"
    finish(spare.outcome(tally, [model, judge], accept) if spare.used else D.outcome(tally, [model, judge], accept))


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

        if tally.every_failed or any(m is not None and m.auth_failed for m in models):
            return D.outcome(tally, models, accept)
        if self.missing:
            console.print(f"[red]build-trees: {self.missing} of {self.target} trees could not be built; "
                          f"{self.used} spare topic(s) were tried too (reasons in the rejects file)[/red]")
            return PARTIAL
        console.print(f"build-trees: {self.target} trees; {self.used} rejected topic(s) were replaced by spare "
                      "topics (the rejected ones are in the rejects file)")
        return exit_code(tally.ok, tally.fallback, 0, allow_fallback=accept)


def _run_trees(todo: list[Any], retriever: Any, model: Any, judge: Any, cfg: Any, out: Path, rejects: Path,
               plan: dict[str, int], t0: float, *, inputs: list[Path], corpus: str, spare: "_Spares",
               profiles: tuple[Any, Any] = (None, None), deadline: float | None = None) -> Any:
    from deepr.io import JsonlAppender, read_jsonl, write_meta
    from deepr.records import Reject, Tree
    from deepr.data.outcomes import StageTally
    from deepr.api import build_trees
    from deepr.corpus.remote import CorpusUnavailable
    from deepr.data.trees import tree_summary
    from deepr.roles import engine_info

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

            # a resumed run whose own topics are all done may still owe spare topics for their rejects
            batch = todo or spare.next(built)
            while batch:  # then spare topics for the rejected ones, while trees are missing
                D.drive(lambda cb, b=batch: build_trees(corpus=retriever, topics=b, llm=model, judge=judge,
                                                       config=cfg, on_result=cb, profile=profiles[0],
                                                       judge_profile=profiles[1]),
                       len(batch), "build-trees", write, unit="trees", deadline=deadline)
                batch = spare.next(built)
    except CorpusUnavailable as e:  # the served corpus went away: say what this run finished (app.corpus_lost)
        e.kept = counts["built"]  # type: ignore[attr-defined]
        raise
    finally:
        trees = list(read_jsonl(out, Tree, tolerate_torn_tail=True)) if out.exists() else []
        stats = tree_summary(trees)
        write_meta(out, stage="build-trees", config=cfg, inputs=inputs,
                   counts={**plan, **dict(spare.rows()), **counts, "trees in output": len(trees), **tally.counts()},
                   timings={"seconds": round(time.perf_counter() - t0, 2)},
                   extra={"corpus": corpus, "llm": engine_info(model), "judge": engine_info(judge),
                          "profile": D.described(profiles[0]), "judge_profile": D.described(profiles[1]),
                          "usage": D.usage(model), "retriever": _describe(retriever), "summary": stats,
                          **({"search": retriever.summary()} if hasattr(retriever, "summary") else {})})
    summary_table(f"build-trees → {out}", [*plan.items(), *spare.rows(), *counts.items(), *stats.items(), *tally.rows(),
                                          ("rejects file", str(rejects) if counts["rejected"] else "-")])
    return tally


def _describe(retriever: Any) -> Any:
    d = getattr(retriever, "describe", None)
    return d() if callable(d) else type(retriever).__name__
