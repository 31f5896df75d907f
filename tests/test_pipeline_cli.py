"""The whole pipeline through the CLI, each subcommand invoked once on tiny inputs, each step
reading the previous step's artefact: what `make demo` does, small enough for the test suite."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.cli import app
from deepr.io import read_jsonl
from deepr.records import QRPair, Trajectory, Tree


def invoke(*args: str) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, f"deepr {' '.join(map(str, args))} failed:\n{result.output}"
    return result.output


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tree_helpers import volcano_docs

    path = tmp_path_factory.mktemp("pipeline") / "volcano.jsonl"
    path.write_text("".join(d.model_dump_json() + "\n" for d in volcano_docs()), encoding="utf-8")
    return path


def test_every_subcommand_chains_on_tiny_inputs(corpus: Path, tmp_path: Path):
    from deepr.train.tiny import build_tiny_model

    d = tmp_path
    c = ["--corpus", corpus]
    invoke("index", *c)
    hits = invoke("search", "lava eruption", *c, "-k", "2")
    assert re.search(r"\[[^\]]+#\d+\]", hits) and "lava" in hits.lower()  # stable snippet ids, relevant text

    (d / "topics.txt").write_text("Volcano\nPlate tectonics\n")
    invoke("build-trees", *c, "--topics", d / "topics.txt", "--out", d / "trees.jsonl")
    trees = list(read_jsonl(d / "trees.jsonl", Tree))
    assert trees and all(t.stats.nodes > 1 for t in trees)

    invoke("synthesize-rubrics", d / "trees.jsonl", "--out", d / "pairs.jsonl")
    invoke("verify", d / "pairs.jsonl", "--out", d / "verified.jsonl")
    verified = list(read_jsonl(d / "verified.jsonl", QRPair))
    assert verified and all(len(p.rubrics) >= 5 and p.decision in ("KEEP", "REVISE") for p in verified)

    invoke("run", *c, "--queries", d / "verified.jsonl", "--limit", "1", "--out", d / "runs",
           "--record", d / "traj.jsonl")
    assert list(read_jsonl(d / "traj.jsonl", Trajectory))
    invoke("prune-trajectories", d / "traj.jsonl", "--out-dir", d / "data", "--heldout", "0")
    assert (d / "data" / "sft.jsonl").stat().st_size > 0

    invoke("eval", d / "runs", "--metric", "plan_reward,structure", "--rubrics", d / "verified.jsonl",
           "--out", d / "scores.jsonl")
    scores = list(read_jsonl(d / "scores.jsonl"))
    assert scores and 0.0 < scores[0]["plan_reward"] <= 1.0

    tiny = build_tiny_model(d / "tiny")
    invoke("sft", "--model", tiny, "--data", d / "data" / "sft.jsonl", "--role", "planner",
           "--out", d / "sft", "--max-steps", "1", "--grad-accum", "1", "--max-length", "4096")
    assert json.loads((d / "sft" / "deepr_meta.json").read_text())["role"] == "planner"
    invoke("grpo", "--stage", "planner", "--model", tiny, "--data", d / "verified.jsonl", "--out", d / "grpo",
           "--max-steps", "1", "--num-generations", "2", "--prompts-per-step", "1",
           "--max-completion-length", "64", *c, "--k", "1")
    assert (d / "grpo" / "adapter_config.json").exists()
