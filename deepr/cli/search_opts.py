"""Shared ``--search`` / ``--allow-host`` / ``--search-cache`` options for every command that searches.

A command declares the three options with the defaults below and calls :func:`open_search`
with a function that opens the corpus retriever; with ``--search corpus`` (the default) it
gets exactly that retriever back, so offline behaviour is unchanged.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape

SEARCH_HELP = (
    "Where searches go, sources joined by '+': corpus (the local index, default, offline), "
    "searxng:URL (self-hosted SearXNG, no key), serper (key in $SERPER_API_KEY), tavily ($TAVILY_API_KEY), "
    "brave ($BRAVE_API_KEY), jina ($JINA_API_KEY), mcp:<command or URL> (any MCP server with a search "
    "tool). Example: corpus+searxng:http://127.0.0.1:8888. Keys are read only from those environment "
    "variables and are never written to traces, caches or logs. Pages are read locally with trafilatura; "
    "set DEEPR_READER=jina to read them through the Jina reader (r.jina.ai, $JINA_API_KEY) instead. "
    "Fetch limits: see --fetch-timeout, --fetch-max-bytes, --fetch-types, --fetch-per-host, "
    "--fetch-concurrency, --search-rate (each defaults to its environment variable, then to the built-in "
    "value); DEEPR_SEARCH_TTL_HOURS (168) sets the cache lifetime.")


# flag -> (SearchConfig field, environment variable, type, built-in default shown in --help, help)
LIMIT_FLAGS: dict[str, tuple[str, str, Any, str, str]] = {
    "--fetch-timeout": ("timeout", "DEEPR_FETCH_TIMEOUT", float, "15",
                        "Seconds one search or page request may take (each retry gets as long again)."),
    "--fetch-max-bytes": ("max_bytes", "DEEPR_FETCH_MAX_BYTES", int, "5000000",
                          "Size cap of one fetched page in bytes; a bigger page is a failed fetch."),
    "--fetch-types": ("content_types", "DEEPR_FETCH_TYPES", str,
                      "text/html,application/xhtml+xml,text/plain,application/pdf",
                      "Content types a page may have, comma-separated; anything else is a failed fetch."),
    "--fetch-per-host": ("per_host", "DEEPR_FETCH_PER_HOST", int, "4",
                         "Most requests in flight to one host at a time."),
    "--fetch-concurrency": ("concurrency", "DEEPR_FETCH_CONCURRENCY", int, "8",
                            "Most requests in flight overall."),
    "--search-rate": ("rate", "DEEPR_SEARCH_RATE", float, "unlimited",
                      "Most request starts per second, all hosts together (a 429's Retry-After pauses its "
                      "host on top of this)."),
}
_FIELD_FLAG = {field: flag for flag, (field, *_rest) in LIMIT_FLAGS.items()}
_cli_limits: dict[str, Any] = {}  # flag values of the command now running (set by fetch_limit_options)


def _limit_error(err: dict[str, Any]) -> str | None:
    """A validation error of a fetch limit, named by its flag and environment variable."""
    field = str(err["loc"][0]) if err.get("loc") else ""
    if field == "ttl_hours":
        return f"DEEPR_SEARCH_TTL_HOURS: {err['msg']}"
    flag = _FIELD_FLAG.get(field)
    if flag is None:
        return None
    source = flag if field in _cli_limits else f"{LIMIT_FLAGS[flag][1]} (default of {flag})"
    value = err.get("input")
    shown = ",".join(value) if isinstance(value, (tuple, list)) else value
    return f"{source} {shown}: {str(err['msg']).removeprefix('Value error, ')}"


def fetch_limit_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add the fetch-limit flags of :data:`LIMIT_FLAGS` to a typer command (put it under
    ``@app.command``): their values are checked at once (a bad one is a one-line error naming the
    flag, exit 2) and used by every :func:`search_config` the command makes."""
    import functools
    import inspect

    # parameter names of their own (``limit_timeout``...): a command may have a ``timeout`` already
    extra = [inspect.Parameter(
        f"limit_{field}", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[conv],  # noqa: UP007 (typer reads it)
        default=typer.Option(None, flag, help=f"{text} Default: ${env}, else {default}.",
                             rich_help_panel="Fetch limits"))
        for flag, (field, env, conv, default, text) in LIMIT_FLAGS.items()]
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = {p.name.removeprefix("limit_"): kwargs[p.name] for p in extra if kwargs.get(p.name) is not None}
        kwargs = {k: v for k, v in kwargs.items() if k not in {p.name for p in extra}}
        if "content_types" in given:
            from deepr.search.config import LIMIT_ENV  # not at import: `deepr --help` stays light

            given["content_types"] = LIMIT_ENV["DEEPR_FETCH_TYPES"][1](given["content_types"])
        saved = dict(_cli_limits)
        _cli_limits.clear()
        _cli_limits.update(given)
        try:
            check_limits()
            check_ready(kwargs.get("search"))
            return fn(*args, **kwargs)
        finally:
            _cli_limits.clear()
            _cli_limits.update(saved)

    wrapper.__signature__ = sig.replace(parameters=[*params, *extra])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {**getattr(fn, "__annotations__", {}), **{p.name: p.annotation for p in extra}}
    return wrapper


def check_limits() -> None:
    """Validate the fetch limits now (flags and environment); a bad one exits 2 with one line."""
    from deepr.cli.app import fail

    try:
        search_config("corpus", None, "use", None)
    except ValueError as e:
        raise fail(str(e)) from None


def check_ready(search: Any) -> None:
    """A web ``--search`` without its API key or without the ``web`` extra exits 2 with one line,
    before the command opens a corpus or calls a model."""
    from deepr.cli.app import fail
    from deepr.search.config import not_ready

    if not isinstance(search, str):
        return
    try:
        why = not_ready(search, os.environ.get("DEEPR_READER") or "trafilatura")
    except ValueError:  # a malformed --search is reported by the command with its other flags
        return
    if why:
        raise fail(why)


ALLOW_HELP = ("Let page fetches reach this host (HOST or HOST:PORT) even though it resolves to a "
              "loopback, private or link-local address; repeatable. Without it such addresses are refused "
              "after every redirect.")
CACHE_HELP = ("Search/fetch cache: use (read fresh entries, store new ones; default), refresh (store, never "
              "read), off, or replay (cached results only; anything not cached is an error, no network).")

SEARCH_OPT: Any = typer.Option("corpus", "--search", help=SEARCH_HELP)
ALLOW_OPT: Any = typer.Option(None, "--allow-host", help=ALLOW_HELP)
CACHE_OPT: Any = typer.Option("use", "--search-cache", help=CACHE_HELP)


def search_config(search: str, allow_host: list[str] | None, search_cache: str, cache_dir: Path | None) -> Any:
    """The validated SearchConfig; a bad flag value raises ValueError naming the flag."""
    from pydantic import ValidationError

    from deepr.search.config import search_config as build

    try:
        return build(search, allow_host or (), search_cache, cache_dir, **_cli_limits)
    except ValidationError as e:
        err = e.errors()[0]
        if err["loc"] and err["loc"][0] == "reader":
            raise ValueError("DEEPR_READER: expected trafilatura or jina") from None
        named = _limit_error(err)
        if named:
            raise ValueError(named) from None
        raise ValueError(str(err["msg"]).removeprefix("Value error, ")) from None


def open_search(search: str, allow_host: list[str] | None, search_cache: str, cache_dir: Path | None,
                open_corpus: Callable[[], Any]) -> Any:
    """The retriever for this command: the corpus one for ``--search corpus``, else a web source."""
    from deepr.search import open_source

    return open_source(search_config(search, allow_host, search_cache, cache_dir), open_corpus)


def search_summary(retriever: Any) -> dict[str, Any] | None:
    """Counts and estimated cost of a web source (None for the plain corpus)."""
    fn = getattr(retriever, "summary", None)
    return fn() if callable(fn) else None


def attach(result: Any, retriever: Any, before: dict[str, Any] | None = None) -> None:
    """Put this run's search counts into its trace (report.json) and provenance config."""
    summary = search_summary(retriever)
    if summary is None:
        return
    if before:
        for key in ("searches", "results", "fetches", "bytes", "cache_hits", "network_requests", "failed",
                    "failed_searches"):
            summary[key] = summary.get(key, 0) - before.get(key, 0)
        summary["cost_usd"] = round(summary["cost_usd"] - before.get("cost_usd", 0.0), 6)
        summary["failures"] = summary["failures"][len(before.get("failures", [])):]
    setattr(result.trace, "search", summary)
    cfg = result.trace.model_extra.get("config")
    if isinstance(cfg, dict):
        cfg["search"] = {**retriever.config.public(), "counts": {k: v for k, v in summary.items() if k != "failures"}}


def check_usable(retriever: Any, result: Any = None) -> None:
    """Fail (exit 4, "nothing succeeded", with the reasons) when web searches ran and none gave a
    readable page, or when ``result`` (a run) cites no source at all, so a run never ends with
    an empty report and exit status 0."""
    summary = search_summary(retriever)
    if not summary or summary["searches"] == 0:
        return
    from deepr.cli.app import console
    from deepr.cli.exit_codes import NOTHING

    if summary["failed_searches"] >= summary["searches"]:
        reasons = sorted({f["reason"] for f in summary["failures"] if f["kind"] == "search"})[:3]
        console.print(f"[red]error[/]: every web search failed ({summary['failed_searches']}): " + escape("; ".join(reasons)))
        raise typer.Exit(NOTHING)
    if summary["results"] == 0:
        reasons = sorted({f["reason"] for f in summary["failures"]})[:3]
        console.print(f"[red]error[/]: no search returned a readable page ({summary['failed']} failures"
                      + (": " + escape("; ".join(reasons)) if reasons else "") + ")")
        raise typer.Exit(NOTHING)
    trace = getattr(result, "trace", None)
    if trace is not None and not getattr(trace, "citations", None):
        reasons = sorted({f["reason"] for f in summary["failures"]})[:3]
        console.print(f"[red]error[/]: the report cites no source: {summary['results']} web results, none used "
                      f"({summary['failed']} failed searches or fetches" + (": " + escape("; ".join(reasons)) if reasons
                                                                            else "") + "); no report written")
        raise typer.Exit(NOTHING)


@contextlib.contextmanager
def search_errors(retriever: Any = None) -> Iterator[None]:
    """One-line errors for replay misses and unusable providers; closes the source afterwards."""
    from deepr.search.cache import CacheMiss

    try:
        yield
    except CacheMiss as e:
        from deepr.cli.app import console

        console.print(f"[red]error[/]: {escape(str(e))}")
        raise typer.Exit(2) from None
    except typer.Exit:  # already reported (e.g. by check_usable itself): say it once
        raise
    except Exception:
        check_usable(retriever)  # an agent that found nothing at all: name the real cause
        raise
    finally:
        close = getattr(retriever, "close", None)
        if callable(close):
            close()
