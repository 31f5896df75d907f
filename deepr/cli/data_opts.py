"""What the data-stage commands share (``deepr build-trees``, ``synthesize-rubrics``, ``verify``):
their common flags, the models they build, resuming and sharding, the live view and the exit
status. The commands live in :mod:`deepr.cli.trees_cmd`, :mod:`deepr.cli.rubrics_cmd` and
:mod:`deepr.cli.verify_cmd`.

All three append each finished record at once (Ctrl-C or a kill loses nothing), skip ids
already in their outputs when re-run, split work with ``--shard K/N`` by tree id (the
same split in every stage, so shard K's trees feed shard K's pairs), write a rejects file
with reasons, a ``<out>.meta.json`` sidecar and print a summary table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.markup import escape

from deepr.cli import flags as F
from deepr.cli.app import console

T = TypeVar("T")
LLM_HELP = F.LLM_HELP


def llm_opt() -> Any:
    return typer.Option("extractive", "--llm", envvar="DEEPR_LLM", help=LLM_HELP)


def judge_opt(what: str) -> Any:
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


C = _common()  # the flags every data stage takes, by parameter name


def models(llm: str, judge: str | None, base_url: str | None, api_key: str | None, no_cache: bool,
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
        if m is not None:  # None: the extractive engine, no model to stop
            m.set_deadline(deadline)
    return main, other, main_p, other_p


def usage(model: Any) -> dict[str, Any]:
    """A model's calls and tokens for a stage's provenance sidecar (none for the extractive engine)."""
    from deepr.llm.base import Usage

    return (model.usage if model is not None else Usage()).as_dict()


def outcome(tally: Any, models: Sequence[Any], allow_fallback: bool) -> int:
    """Exit status from the stage's record tally (see deepr/cli/exit_codes.py); when every record
    failed, say so with the commonest reason first. ``--fallback extractive`` is the user accepting
    rebuilt records, so it counts as ``--allow-fallback``."""
    from deepr.cli.exit_codes import exit_code

    message = tally.verdict()
    if message:
        console.print(f"[red]{escape(message)}[/red]")
    return exit_code(tally.ok, tally.fallback, tally.failed, allow_fallback=allow_fallback,
                     auth=any(m is not None and m.auth_failed for m in models))


def guard(flag_in: Sequence[tuple[str, Path | None]], out: Path, *others: tuple[str, Path]) -> None:
    """Refuse an output that is or would overwrite an input, or cannot be written (before any work)."""
    from deepr.io import check_paths, meta_path, rejects_path

    check_paths(flag_in, [("--out", out), ("--out", rejects_path(out)), ("--out", meta_path(out)), *others])


def pending(items: Sequence[T], key: Callable[[T], str], shard: str | None, done: set[str],
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


def done_before(out: Path, others: Iterable[Path], rejects: Path, retry: bool,
                retry_ids: set[str] | None = None) -> set[str]:
    """Ids finished in earlier runs; with ``retry`` the rejects file is cleared of them first."""
    from deepr.io import done_ids, read_jsonl, write_jsonl

    done = done_ids(out)
    for p in others:
        done |= done_ids(p)
    if retry and rejects.exists():
        write_jsonl(rejects, [r for r in read_jsonl(rejects, tolerate_torn_tail=True)
                              if retry_ids is not None and r.get("id") not in retry_ids])
    return done | done_ids(rejects)


def drive(coro_fn: Callable[[Callable[[Any], None]], Any], total: int, label: str,
          write: Callable[[Any], None], *, unit: str = "", deadline: float | None = None) -> None:
    """Run a stage (a coroutine, or a function that runs one itself) under the live view
    (:mod:`deepr.cli.live`); ``write`` stores each result as it arrives."""
    import inspect

    from deepr.cli.live import LiveView
    from deepr.llm.base import run_sync

    with LiveView(label, total=total, unit=unit, deadline=deadline) as view:
        def on_result(r: Any) -> None:
            write(r)
            view.advance()

        work = coro_fn(on_result)
        if inspect.iscoroutine(work):
            run_sync(work)


def fallback_opt() -> Any:
    return typer.Option("none", "--fallback", help=(
        "extractive: a record the model cannot produce is made by the extractive engine instead "
        "(marked in the record and counted in the sidecar); none: it is rejected."))


def described(profile: Any) -> Any:
    return profile.describe() if profile is not None else None


def embed_fn() -> Any:
    from deepr.corpus.embed import get_embedder

    return get_embedder().encode
