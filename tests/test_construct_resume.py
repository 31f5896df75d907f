"""Kill test: SIGINT ``deepr build-trees`` midway, re-run it and SIGKILL that run midway,
then re-run to the end; every tree id must be in the output exactly once (trees plus
rejects), every record complete, and each re-run must skip exactly the finished trees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepr.io import read_jsonl, rejects_path
from deepr.records import Reject, Tree
from deepr.data.topics import load_topics
from tree_helpers import volcano_docs, write_corpus

TOPICS = ["Volcano", "Plate tectonics", "Mount Vesuvius", "Igneous rock", "Mount Etna", "Lava", "Magma",
          "Mount Fuji"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("kill")
    corpus = write_corpus(volcano_docs(), root / "volcano.jsonl")
    topics = root / "topics.txt"
    topics.write_text("\n".join(TOPICS) + "\n")
    return corpus, topics, root / "cache"


def _cmd(corpus: Path, topics: Path, cache: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "deepr", "build-trees", "--corpus", str(corpus), "--topics", str(topics),
            "--cache-dir", str(cache), "--out", str(out), "--max-depth", "2", "--branching", "3,2",
            "--concurrency", "1"]


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}


def _finished(out: Path) -> int:
    """Trees and rejects fully written so far (complete lines only)."""
    return _lines(out) + _lines(rejects_path(out))


def _interrupt(cmd: list[str], out: Path, sig: int, after: int) -> tuple[int, str]:
    """Start the command, wait until ``after`` items are finished, send ``sig``; return (code, stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    deadline = time.time() + 300
    while _finished(out) < after and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"finished before it could be interrupted: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, err.decode()


def _check_complete(out: Path, topics: Path) -> None:
    trees = list(read_jsonl(out, Tree))  # raises on a torn or invalid line
    rejects = list(read_jsonl(rejects_path(out), Reject)) if rejects_path(out).exists() else []
    ids = [t.id for t in trees] + [r.id for r in rejects]
    assert sorted(ids) == sorted(t.id for t in load_topics(topics)), "each tree exactly once"
    assert len(trees) >= 3
    for t in trees:
        assert t.stats.nodes == len(t.nodes) >= 1 and t.nodes[0].id == t.root_id
        assert all(n.supporting_docs and n.statements for n in t.nodes)


def test_interrupted_build_resumes_without_loss_or_duplicates(setup, tmp_path: Path):
    corpus, topics, cache = setup
    out = tmp_path / "trees.jsonl"
    cmd = _cmd(corpus, topics, cache, out)

    code, err = _interrupt(cmd, out, signal.SIGINT, after=1)
    assert code == 130 and "re-run the same command to resume" in err
    after_int = _finished(out)
    assert 1 <= after_int < len(TOPICS), "the SIGINT came midway"

    code, _ = _interrupt(cmd, out, signal.SIGKILL, after=after_int + 1)
    assert code == -signal.SIGKILL
    after_kill = _finished(out)  # a line torn by the kill is not finished and not counted
    assert after_int < after_kill < len(TOPICS), "the SIGKILL came midway"

    done = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    assert done.returncode == 0, done.stderr[-2000:]
    _check_complete(out, topics)
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert meta["counts"]["already done"] == after_kill  # the re-run skipped exactly the finished trees
    assert meta["counts"]["to do now"] == len(TOPICS) - after_kill
