"""The ``deepr`` command line. Each subcommand lives in its own module under ``deepr.cli``
and imports its heavy dependencies (torch, faiss, trl) inside the function body, so
``deepr --help`` stays instant."""

from __future__ import annotations

import typer

from deepr import __version__
from deepr.cli.app import app

# Each import registers its commands on `app`; only finished commands are listed here.
from deepr.cli import index_cmd  # noqa: E402,F401
from deepr.cli import trees_cmd  # noqa: E402,F401
from deepr.cli import grpo_cmd  # noqa: E402,F401
from deepr.cli import run_cmd  # noqa: E402,F401
from deepr.cli import sft_cmd  # noqa: E402,F401
from deepr.cli import eval_cmd  # noqa: E402,F401
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
    app()
