"""The ``deepr`` command line. Each subcommand lives in its own module under ``deepr.cli``
and imports its heavy dependencies (torch, faiss, trl) inside the function body, so
``deepr --help`` stays instant."""

from __future__ import annotations

import typer
from rich.markup import escape

from deepr import __version__
from deepr.cli.app import app

# Each import registers its commands on `app`; only finished commands are listed here.
from deepr.cli import index_cmd  # noqa: E402,F401
from deepr.cli import trees_cmd  # noqa: E402,F401
from deepr.cli import rubrics_cmd  # noqa: E402,F401
from deepr.cli import verify_cmd  # noqa: E402,F401
from deepr.cli import grpo_cmd  # noqa: E402,F401
from deepr.cli import run_cmd  # noqa: E402,F401
from deepr.cli import sft_cmd  # noqa: E402,F401
from deepr.cli import eval_cmd  # noqa: E402,F401
from deepr.cli import bench_export_cmd  # noqa: E402,F401
from deepr.cli import export_cmd  # noqa: E402,F401


def _version(value: bool) -> None:
    if value:
        typer.echo(f"deepr {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """deepr: build, train, run and evaluate deep-research agents on your own corpus."""


def main() -> None:
    """Entry point: flag and usage mistakes get one line (not a boxed panel), exit 2."""
    import sys

    try:  # recent typer vendors click
        from typer._click import exceptions as click
    except ImportError:  # pragma: no cover
        from click import exceptions as click

    from deepr.cli.app import console

    try:
        code = app(standalone_mode=False)
    except click.NoArgsIsHelpError as e:
        e.show()
        sys.exit(e.exit_code)
    except click.UsageError as e:
        where = e.ctx.command_path if e.ctx else "deepr"
        console.print(f"[bold red]error:[/] {escape(e.format_message())} (see '{escape(where)} --help')",
                      highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        console.print(f"[bold red]error:[/] {escape(e.format_message())}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except typer.Abort:  # EOF at a prompt (Ctrl-C arrives as exit code 130 from typer itself);
        # click's exceptions module, which typer now vendors, no longer has Abort
        console.print("[bold red]aborted[/]", highlight=False)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
