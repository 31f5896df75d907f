"""The README's commands work as written: the offline quick start and the Python example run
(on the mini corpus instead of the whole wiki, to stay fast), every other `deepr ...` line parses
(`--help` after its flags fails on any unknown flag), and a line that needs a server or GPUs
says so."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.cli import app

README = Path(__file__).resolve().parents[1] / "README.md"
MARK = re.compile(r"#.*needs (a server|a GPU|GPUs)")


def _blocks(lang: str) -> list[tuple[str, str]]:
    """(heading above, text) of each fenced block in ``lang``."""
    out, heading = [], ""
    for part in re.split(r"(^```[a-z]*\n.*?^```$)", README.read_text(encoding="utf-8"), flags=re.S | re.M):
        if part.startswith(f"```{lang}\n"):
            out.append((heading, part.split("\n", 1)[1].rsplit("```", 1)[0]))
        else:
            heads = re.findall(r"^## (.+)$", part, re.M)
            heading = heads[-1] if heads else heading
    return out


def _commands() -> list[tuple[str, str, list[str]]]:
    """(section, raw line, deepr arguments) of every deepr command in a bash block."""
    found = []
    for heading, text in _blocks("bash"):
        for line in text.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "deepr" in words and (words[0] == "deepr" or words[words.index("deepr") - 1] == "-m"):
                found.append((heading, line, words[words.index("deepr") + 1:]))
    return found


COMMANDS = _commands()


def test_the_readme_has_commands_to_check():
    assert len(COMMANDS) >= 15 and any(h == "Try it offline in 5 minutes" for h, _, _ in COMMANDS)


@pytest.mark.parametrize("line,args", [(line, a) for _, line, a in COMMANDS], ids=lambda x: str(x)[:60])
def test_every_command_parses(line, args):
    r = CliRunner().invoke(app, [*args, "--help"])
    assert r.exit_code == 0, f"{line}\n{r.output}"


def test_lines_that_need_a_server_or_gpus_say_so():
    for _, line, args in COMMANDS:
        if "--base-url" in args or "--use-vllm" in args or line.lstrip().startswith("accelerate"):
            assert MARK.search(line), f"mark this README line '# needs a server' or '# needs GPUs': {line}"


def test_the_offline_quick_start_runs(tmp_path, monkeypatch, mini_corpus, retriever):
    monkeypatch.chdir(tmp_path)
    env = {"DEEPR_CACHE": str(retriever.path.parents[1]), "COLUMNS": "200"}
    steps = [a for h, _, a in COMMANDS if h == "Try it offline in 5 minutes"]
    assert [a[0] for a in steps] == ["index", "search", "run", "eval"]
    for args in steps:
        args = [str(mini_corpus) if x == "wiki" else x for x in args]
        if args[0] in ("index", "search", "run") and "--corpus" not in args:
            args += ["--corpus", str(mini_corpus)]
        r = CliRunner().invoke(app, args, env=env)
        assert r.exit_code == 0, f"deepr {' '.join(args)}\n{r.output}"
    assert Path("report.md").exists() and Path("report.html").exists() and Path("scores.jsonl").exists()


def _corpora(code: str) -> list[str]:
    """The ``corpus=`` arguments of the Python example, as written."""
    import ast

    return [kw.value.value for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Call)
            for kw in node.keywords if kw.arg == "corpus" and isinstance(kw.value, ast.Constant)]


def test_the_python_example_names_a_corpus_a_new_user_has():
    """As written: the wiki corpus the quick start indexes (a folder of your own would not exist)."""
    [(_, code)] = [b for b in _blocks("python")]
    assert _corpora(code) and all(c == "wiki" for c in _corpora(code)), _corpora(code)


def test_the_python_example_runs(tmp_path, monkeypatch, mini_corpus, retriever, capsys):
    [(_, code)] = [b for b in _blocks("python")]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DEEPR_CACHE", str(retriever.path.parents[1]))
    # the wiki corpus, as the quick start's commands are run: on the mini corpus
    assert code.count('corpus="wiki"') == len(_corpora(code))
    exec(compile(code.replace('corpus="wiki"', f"corpus={str(mini_corpus)!r}"), "README.md", "exec"), {})
    assert "scored" in capsys.readouterr().out and Path("report.md").exists()
