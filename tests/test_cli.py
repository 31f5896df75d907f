"""The CLI imports nothing heavy at start, lists only working commands, and explains every flag."""

from __future__ import annotations

import os
import subprocess
import sys

from typer.testing import CliRunner

from deepr import __version__
from deepr.cli import app

# Start-up time itself is measured in bench/cold_start.py (a timed unit test flakes on a busy
# machine); what keeps it low is that no command imports these at start.
HEAVY = ("torch", "faiss", "trl", "transformers", "sentence_transformers", "datasets", "peft",
         "openai", "bm25s", "accelerate", "xgrammar", "gguf", "trafilatura", "mcp", "httpx")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}


def test_help_imports_no_heavy_library():
    code = ("import sys; from deepr.cli import app; from typer.testing import CliRunner; "
            "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=True)
    assert out.stdout.strip() == "", f"`deepr --help` imported heavy modules: {out.stdout.strip()}"


def test_version():
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"deepr {__version__}"


def test_every_command_has_help_for_every_flag():
    import typer.main

    group = typer.main.get_command(app)
    assert group.commands, "no commands registered"
    for name, cmd in group.commands.items():
        assert cmd.help, f"command {name} has no help text"
        for p in cmd.params:
            if p.param_type_name == "option":
                assert p.help, f"deepr {name} {p.opts[0]} has no help text"
        r = CliRunner().invoke(app, [name, "--help"])
        assert r.exit_code == 0, f"deepr {name} --help failed: {r.output}"


def test_main_turns_an_abort_into_exit_1_and_lets_other_errors_through_unmasked(monkeypatch, capsys):
    """typer's vendored click has no ``exceptions.Abort``: naming it in an ``except`` clause turned
    every error escaping a command into an AttributeError raised while handling it."""
    import pytest
    import typer

    import deepr.cli as cli

    def aborting(**kw):
        raise typer.Abort()

    monkeypatch.setattr(cli, "app", aborting)
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 1 and "aborted" in capsys.readouterr().err

    def broken(**kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "app", broken)
    with pytest.raises(RuntimeError, match="boom"):
        cli.main()
