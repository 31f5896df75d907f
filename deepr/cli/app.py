"""The shared typer app and the small helpers every command uses for errors and tables."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
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
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn expected bad-input exceptions into a clear message and exit code 2, no traceback."""
    from deepr.io import RecordError

    try:
        yield
    except (RecordError, FileNotFoundError, ValueError) as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: finished records are saved; re-run the same command to resume.")
        raise typer.Exit(130) from None


def summary_table(title: str, rows: Mapping[str, Any] | list[tuple[str, Any]]) -> None:
    """Print a two-column summary table of counts / metrics to stderr."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("what")
    table.add_column("value", justify="right")
    items = rows.items() if isinstance(rows, Mapping) else rows
    for k, v in items:
        table.add_row(str(k), f"{v:.4g}" if isinstance(v, float) else str(v))
    console.print(table)


def eprint(*a: Any) -> None:
    print(*a, file=sys.stderr)
