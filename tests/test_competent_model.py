"""Every command that calls a model, driven through a competent fake model (tests/fake_model.py):
replies valid under the format deepr sent and plausible, so each command must exit 0 with its
artefacts complete, and no report may show a bracket that is not an id of its citation map."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.cli import app
from deepr.io import read_jsonl
from deepr.llm.stub_server import StubServer

from fake_model import CompetentModel

QUESTION = "How do volcanic eruptions affect the climate and the people living nearby?"
_BRACKET = re.compile(r"\[([^\[\]\n]*)\]")


@pytest.fixture(scope="module")
def served():
    fake = CompetentModel()
    with StubServer(fake) as srv:
        yield fake, srv


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tree_helpers import volcano_docs

    path = tmp_path_factory.mktemp("competent") / "volcano.jsonl"
    path.write_text("".join(d.model_dump_json() + "\n" for d in volcano_docs()), encoding="utf-8")
    return path


def deepr(*args: object) -> str:
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, f"deepr {' '.join(map(str, args))} exited {r.exit_code}:\n{r.output}"
    return r.output


def model(srv: StubServer) -> list[str]:
    return ["--llm", "openai:fake", "--base-url", srv.base_url, "--no-cache"]


def stray_brackets(md: str, citations: dict) -> list[str]:
    """Bracket groups of a report that are not ids of its citation map."""
    return [m.group(0) for m in _BRACKET.finditer(md)
            if not all(t in citations for t in re.split(r"[,;\s]+", m.group(1).strip()) if t)
            or not m.group(1).strip()]


def check_report(md_path: Path) -> dict:
    md = md_path.read_text(encoding="utf-8")
    trace = json.loads(md_path.with_suffix(".json").read_text(encoding="utf-8"))
    assert trace["citations"], f"{md_path}: the report cites nothing"
    assert stray_brackets(md, trace["citations"]) == [], md
    assert not trace.get("failures"), trace.get("failures")
    return trace


@pytest.mark.parametrize("mode", ["dag", "warp", "decor", "tools"])
def test_every_mode_runs_clean_on_a_competent_model(served, corpus, tmp_path, mode):
    fake, srv = served
    out = tmp_path / "report.md"
    deepr("run", QUESTION, "--mode", mode, "--out", out, "--corpus", corpus, *model(srv))
    trace = check_report(out)
    assert all(c["ok"] for c in trace["calls"]) and trace["calls"], "every model call answered"
    assert fake.invalid == []


def test_the_data_pipeline_and_its_judges_run_clean(served, corpus, tmp_path):
    fake, srv = served
    d = tmp_path
    (d / "topics.txt").write_text("Volcano\nPlate tectonics\n", encoding="utf-8")
    deepr("build-trees", "--corpus", corpus, "--topics", d / "topics.txt", "--out", d / "trees.jsonl", *model(srv))
    trees = list(read_jsonl(d / "trees.jsonl"))
    assert len(trees) == 2 and all(t["stats"]["nodes"] > 1 for t in trees)
    deepr("synthesize-rubrics", d / "trees.jsonl", "--out", d / "pairs.jsonl", *model(srv))
    assert len(list(read_jsonl(d / "pairs.jsonl"))) == 2
    deepr("verify", d / "pairs.jsonl", "--out", d / "verified.jsonl", *model(srv))
    verified = list(read_jsonl(d / "verified.jsonl"))
    assert len(verified) == 2 and all(p["decision"] == "KEEP" for p in verified)

    deepr("run", "--queries", d / "verified.jsonl", "--parallel", "2", "--out", d / "runs", "--corpus", corpus,
          "--record", d / "traj.jsonl", *model(srv))
    index = list(read_jsonl(d / "runs" / "reports.jsonl"))
    assert len(index) == 2 and all(r["citations"] > 0 and r["failures"] == 0 for r in index)
    for r in index:
        check_report(Path(r["report_path"]))

    deepr("prune-trajectories", d / "traj.jsonl", "--out-dir", d / "data", "--heldout", "0",
          "--judge-llm", "openai:fake", "--base-url", srv.base_url)
    assert (d / "data" / "sft.jsonl").stat().st_size > 0

    deepr("eval", d / "runs", "--metric", "rubric,citation,support", "--rubrics", d / "verified.jsonl",
          "--out", d / "scores.jsonl", "--judge-llm", "openai:fake", "--base-url", srv.base_url, "--no-cache")
    scores = list(read_jsonl(d / "scores.jsonl"))
    assert len(scores) == 2 and all(s["rubric"] > 0 and s["R_cite"] > 0 and s["F1_mean"] > 0
                                    and s["support"] > 0 and not s["failures"] for s in scores), scores
    roles = set(fake.roles)
    assert {"root_query_write", "gate_judge", "decompose_split", "ground_judge", "extract_quote",
            "synthesize_pair", "verify_audit", "planner_plan", "answerer_final", "judge_rubric",
            "judge_claim"} <= roles, roles
    assert fake.invalid == []


def test_a_command_on_the_openai_backend_leaves_no_client_open(served, corpus, tmp_path):
    """Each event loop's SDK client is closed with its loop: with ResourceWarnings shown, an open
    connection would print "unclosed ..." at the end of the command."""
    _, srv = served
    r = subprocess.run([sys.executable, "-W", "always::ResourceWarning", "-m", "deepr", "run", QUESTION,
                        "--mode", "decor", "--out", str(tmp_path / "r.md"), "--corpus", str(corpus), *model(srv)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "unclosed" not in r.stderr.lower(), r.stderr[-1500:]
