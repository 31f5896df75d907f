"""The Python API of the README (deepr.run / build_trees / evaluate): it works from a notebook,
the CLI goes through it, and `import deepr` loads none of the heavy libraries."""

from __future__ import annotations

import subprocess
import sys

import pytest

import deepr


def test_import_deepr_is_light():
    code = ("import sys, deepr; heavy = [m for m in ('torch', 'transformers', 'numpy', 'deepr.agent') "
            "if m in sys.modules]; print(heavy); sys.exit(bool(heavy))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_run_build_trees_and_evaluate_from_python(tmp_path, retriever):
    report = deepr.run("How do earthquakes cause tsunamis?", corpus=retriever, out=tmp_path / "r.md")
    assert report.trace.citations and (tmp_path / "r.md").read_text() == report.markdown
    assert (tmp_path / "r.json").exists()
    trees = deepr.build_trees(corpus=retriever, topics=["Earthquake"], max_depth=2)
    assert len(trees) == 1 and trees[0].id.startswith("tree-earthquake")
    [score] = deepr.evaluate(tmp_path / "r.json", metrics=["structure"])
    assert score.failures == {} and score.model_extra["citations"] >= 1
    with pytest.raises(ValueError, match="--rubrics"):
        deepr.evaluate(tmp_path / "r.json", metrics=["rubric"])


def test_the_run_command_calls_deepr_run(tmp_path, monkeypatch, retriever, mini_corpus):
    from typer.testing import CliRunner

    from deepr.cli import app

    calls = []
    real = deepr.run
    monkeypatch.setattr(deepr, "run", lambda q, **kw: calls.append(q) or real(q, **kw))
    r = CliRunner().invoke(app, ["run", "What is acceleration?", "--out", str(tmp_path / "a.md"), "--corpus",
                                 str(mini_corpus), "--cache-dir", str(retriever.path.parents[1])])
    assert r.exit_code == 0, r.output
    assert calls == ["What is acceleration?"]
