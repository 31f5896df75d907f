"""The shared typer app and the small helpers every command uses for errors and tables."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

app = typer.Typer(
    name="deepr",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
console = Console(stderr=True)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print a one-line error (what went wrong and how to fix it) and exit non-zero."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


INTERRUPTED = "interrupted: finished records are saved; re-run the same command to resume."


def interrupted_run(model: Any) -> str:
    """What a stopped single run leaves behind, truthfully: no report; the replies received so
    far only where the reply cache is on."""
    cache = getattr(model, "cache", None)
    if cache is None:
        return "interrupted: no report was written and nothing was kept; re-running starts over."
    return (f"interrupted: no report was written. The model replies received so far are kept in the reply "
            f"cache ({cache.path}): re-running the same command takes them from there instead of asking again.")


@contextmanager
def user_errors(flags: Mapping[str, str] | None = None, interrupted: str = INTERRUPTED) -> Iterator[None]:
    """Turn expected bad-input exceptions into a one-line message and exit code 2, no traceback.

    A config's ValidationError is reported by its flag (``flags`` maps unusual field names).
    ``interrupted``: what Ctrl-C leaves behind, as this command keeps it.
    """
    from pydantic import ValidationError

    from deepr.cli.flags import flag_error
    from deepr.corpus.remote import CorpusUnavailable
    from deepr.io import RecordError

    try:
        yield
    except ValidationError as e:
        raise fail(flag_error(e, dict(flags or {}))) from None
    except CorpusUnavailable as e:  # a served corpus went away mid-run: nothing more can be searched
        raise fail(*corpus_lost(e)) from None
    except (RecordError, FileNotFoundError, ValueError) as e:
        raise fail(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    except (IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError) as e:
        raise fail(f"{e.filename or ''}: {e.strerror or e}".lstrip(": ")) from None
    except KeyboardInterrupt:
        console.print(f"[yellow]{escape(interrupted)}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None


def corpus_lost(e: Exception) -> tuple[str, int]:
    """The one line and exit status for a retrieval server or Milvus that stopped answering mid-run.
    The command stops there; what it finished is kept and the rest is not rejected, so the same
    command resumes it. Status as the README's table counts units: ``e.kept`` (set by a stage,
    the units it finished this run) and the rest failed, so 3 when some were finished, else 4."""
    from deepr.cli.exit_codes import exit_code

    kept = int(getattr(e, "kept", 0) or 0)
    saved = f"the {kept} finished this run are saved" if kept else "finished records are saved"
    return f"{e}; {saved}, re-run the same command to resume once it answers again", exit_code(kept, failed=1)


def finish(code: int) -> None:
    """End a command with the exit status of :mod:`deepr.cli.exit_codes` (0 returns normally)."""
    if code:
        from deepr.cli.exit_codes import AUTH, NOTHING, PARTIAL

        why = {PARTIAL: "some records or turns failed or fell back (see the rejects / trace; "
                        "--allow-fallback accepts this)",
               NOTHING: "nothing succeeded (see the rejects / trace for the reasons)",
               AUTH: "the endpoint refused the credentials; check --api-key / OPENAI_API_KEY"}.get(code, "")
        console.print(f"[yellow]exit {code}[/]: {why}", highlight=False, soft_wrap=True)
        raise typer.Exit(code)


def summary_table(title: str, rows: Mapping[str, Any] | list[tuple[str, Any]]) -> None:
    """Print a two-column summary table of counts / metrics to stderr."""
    # cells and titles hold model text, ids and paths: '[/evidence]' there is text, not markup
    table = Table(title=escape(title), show_header=True, header_style="bold")
    table.add_column("what")
    table.add_column("value", justify="right", overflow="fold")  # paths whole, never cut with "…"
    items = rows.items() if isinstance(rows, Mapping) else rows
    for k, v in items:
        table.add_row(escape(str(k)), f"{v:.4g}" if isinstance(v, float) else escape(str(v)))
    console.print(table)


def eprint(*a: Any) -> None:
    print(*a, file=sys.stderr)
