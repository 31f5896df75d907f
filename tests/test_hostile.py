"""Hostile use of every subcommand (issue 18): bad files, odd output paths, bad flags, a failing
endpoint. Each case runs ``python -m deepr`` in a subprocess, as a user would, and must end with
no traceback, one ``error:`` line, the documented exit status, and every input byte-identical.

The cases fail before any model or index is touched, so they run side by side in a few seconds
per batch; the exit-status cases use a stub endpoint on 127.0.0.1 and need no embedder.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from deepr.llm.stub_server import StubServer
from tree_helpers import good_synthesis, small_tree

USAGE, PARTIAL, NOTHING, AUTH = 2, 3, 4, 5


def _env() -> dict[str, str]:
    root = Path(__file__).resolve().parents[1]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
            "COLUMNS": "80", "PYTHONDONTWRITEBYTECODE": "1"}


def deepr(*args: object, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepr", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env=_env(), timeout=timeout)


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _inputs(d: Path) -> None:
    """One folder of inputs every case reads: valid, empty, invalid and wrong-shaped files."""
    tree = small_tree().model_dump(mode="json")
    _jsonl(d / "trees.jsonl", [tree])
    (d / "empty.jsonl").write_text("")
    (d / "invalid.jsonl").write_text('{"id": "a", "oops\n')
    _jsonl(d / "shape.jsonl", [{"id": "x1", "unexpected": 1}])
    _jsonl(d / "queries.jsonl", [{"id": "q1", "question": "How do volcanoes erupt?"}])
    _jsonl(d / "q_rubric_str.jsonl", [{"id": "q1", "question": "How do volcanoes erupt?", "rubrics": "abc"}])
    _jsonl(d / "pd" / "sft.jsonl", [{"id": "t1", "query": "q", "mode": "dag", "turns": []}])
    _jsonl(d / "runs" / "reports.jsonl", [{"id": "q1", "question": "How do volcanoes erupt?"}])
    (d / "topics.txt").write_text("Volcano\nLava\n")
    _jsonl(d / "corpus.jsonl", [{"id": "d1", "title": "Lava", "text": "Lava is molten rock."}])
    (d / "afile").write_text("not a folder\n")
    (d / "adir").mkdir()
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text("{}")


# (command line, expected exit status, a phrase the one error line must contain)
CASES: dict[str, tuple[list[str], int, str]] = {
    # build-trees
    "trees/topics-dir": (["build-trees", "--topics", "adir", "--out", "o.jsonl"], USAGE, "is a folder"),
    "trees/same-as-output": (["build-trees", "--topics", "topics.txt", "--out", "topics.txt"], USAGE,
                             "would overwrite the input"),
    "trees/out-dir": (["build-trees", "--topics", "topics.txt", "--out", "adir"], USAGE, "is a folder"),
    "trees/out-parent-file": (["build-trees", "--topics", "topics.txt", "--out", "afile/t.jsonl"], USAGE,
                              "is a file, not a folder"),
    "trees/max-depth": (["build-trees", "--topics", "topics.txt", "--out", "o.jsonl", "--max-depth", "9"], USAGE,
                        "--max-depth 9: must be >= 1 and <= 6"),
    "trees/retrieve-k": (["build-trees", "--topics", "topics.txt", "--out", "o.jsonl", "--retrieve-k", "0"],
                         USAGE, "--retrieve-k 0: must be >= 1 and <= 50"),
    "trees/concurrency": (["build-trees", "--topics", "topics.txt", "--out", "o.jsonl", "--concurrency", "0"],
                          USAGE, "--concurrency 0"),
    # synthesize-rubrics
    "synth/dir": (["synthesize-rubrics", "adir", "--out", "p.jsonl"], USAGE, "is a folder"),
    "synth/empty": (["synthesize-rubrics", "empty.jsonl", "--out", "p.jsonl"], USAGE, "holds no trees"),
    "synth/invalid": (["synthesize-rubrics", "invalid.jsonl", "--out", "p.jsonl"], USAGE,
                      "invalid.jsonl:1: not valid JSON"),
    "synth/wrong-shape": (["synthesize-rubrics", "shape.jsonl", "--out", "p.jsonl"], USAGE, "shape.jsonl:1 field"),
    "synth/same-as-output": (["synthesize-rubrics", "trees.jsonl", "--out", "trees.jsonl", "--limit", "1"], USAGE,
                             "would overwrite the input"),
    "synth/out-dir": (["synthesize-rubrics", "trees.jsonl", "--out", "adir"], USAGE, "is a folder"),
    "synth/out-parent-file": (["synthesize-rubrics", "trees.jsonl", "--out", "afile/p.jsonl"], USAGE,
                              "is a file, not a folder"),
    "synth/n-select": (["synthesize-rubrics", "trees.jsonl", "--out", "p.jsonl", "--n-select", "0"], USAGE,
                       "--n-select 0: must be >= 1 and <= 20"),
    "synth/min-rubrics": (["synthesize-rubrics", "trees.jsonl", "--out", "p.jsonl", "--min-rubrics", "0"], USAGE,
                          "--min-rubrics 0: must be >= 1"),
    "synth/timeout": (["synthesize-rubrics", "trees.jsonl", "--out", "p.jsonl", "--timeout", "-5"], USAGE,
                      "--timeout -5"),
    "synth/temperature": (["synthesize-rubrics", "trees.jsonl", "--out", "p.jsonl", "--temperature", "3"], USAGE,
                          "--temperature 3"),
    # verify
    "verify/dir": (["verify", "adir", "--out", "v.jsonl"], USAGE, "is a folder"),
    "verify/empty": (["verify", "empty.jsonl", "--out", "v.jsonl"], USAGE, "holds no pairs"),
    "verify/invalid": (["verify", "invalid.jsonl", "--out", "v.jsonl"], USAGE, "not valid JSON"),
    "verify/wrong-shape": (["verify", "trees.jsonl", "--out", "v.jsonl"], USAGE, "trees.jsonl:1 field"),
    "verify/same-as-output": (["verify", "trees.jsonl", "--out", "trees.jsonl"], USAGE, "would overwrite the input"),
    "verify/dropped-is-input": (["verify", "trees.jsonl", "--out", "v.jsonl", "--dropped", "trees.jsonl"], USAGE,
                                "--dropped trees.jsonl would overwrite the input"),
    "verify/out-parent-file": (["verify", "trees.jsonl", "--out", "afile/v.jsonl"], USAGE, "is a file"),
    # run
    "run/queries-dir": (["run", "--queries", "adir", "--out", "r"], USAGE, "is a folder"),
    "run/queries-empty": (["run", "--queries", "empty.jsonl", "--out", "r"], USAGE, "holds no queries"),
    "run/queries-invalid": (["run", "--queries", "invalid.jsonl", "--out", "r"], USAGE, "not valid JSON"),
    "run/queries-wrong-shape": (["run", "--queries", "shape.jsonl", "--out", "r"], USAGE,
                                "shape.jsonl:1 field 'question'"),
    "run/rubrics-str": (["run", "--queries", "q_rubric_str.jsonl", "--out", "r"], USAGE,
                        "expected a list of rubric items, got str"),
    "run/queries-in-out": (["run", "--queries", "runs/reports.jsonl", "--out", "runs"], USAGE,
                           "would overwrite the input"),
    "run/record-is-queries": (["run", "--queries", "queries.jsonl", "--out", "r", "--record", "queries.jsonl"],
                              USAGE, "--record queries.jsonl"),
    "run/out-is-file": (["run", "--queries", "queries.jsonl", "--out", "afile"], USAGE, "expected a folder"),
    "run/out-parent-file": (["run", "How do volcanoes erupt?", "--out", "afile/r.md"], USAGE, "is a file"),
    "run/top-k": (["run", "q", "--out", "r.md", "-k", "0"], USAGE, "-k 0: must be >= 1 and <= 50"),
    "run/deadline": (["run", "q", "--out", "r.md", "--deadline", "0"], USAGE, "--deadline 0"),
    "run/unknown-flag": (["run", "q", "--out", "r.md", "--max-depth", "3"], USAGE, "No such option: --max-depth"),
    # prune-trajectories
    "prune/dir": (["prune-trajectories", "adir", "--out-dir", "o"], USAGE, "is a folder"),
    "prune/empty": (["prune-trajectories", "empty.jsonl", "--out-dir", "o"], USAGE, "holds no trajectories"),
    "prune/invalid": (["prune-trajectories", "invalid.jsonl", "--out-dir", "o"], USAGE, "not valid JSON"),
    "prune/wrong-shape": (["prune-trajectories", "shape.jsonl", "--out-dir", "o"], USAGE, "shape.jsonl:1 field"),
    "prune/same-as-output": (["prune-trajectories", "pd/sft.jsonl", "--out-dir", "pd"], USAGE,
                             "would overwrite the input"),
    "prune/out-is-file": (["prune-trajectories", "pd/sft.jsonl", "--out-dir", "afile"], USAGE, "expected a folder"),
    "prune/heldout": (["prune-trajectories", "pd/sft.jsonl", "--out-dir", "o", "--heldout", "1.5"], USAGE,
                      "--heldout 1.5: must be >= 0.0 and < 1.0"),
    "prune/max-upsample": (["prune-trajectories", "pd/sft.jsonl", "--out-dir", "o", "--max-upsample", "0.5"],
                           USAGE, "--max-upsample 0.5: must be >= 1.0"),
    "prune/total": (["prune-trajectories", "pd/sft.jsonl", "--out-dir", "o", "--total", "0"], USAGE,
                    "--total 0: must be >= 1"),
    "prune/target-ratios": (["prune-trajectories", "pd/sft.jsonl", "--out-dir", "o", "--target-ratios", "plan=2"],
                            USAGE, "--target-ratios"),
    # eval
    "eval/dir-without-sidecars": (["eval", "adir", "--metric", "format", "--out", "s.jsonl"], USAGE,
                                  "holds no report.json"),
    "eval/empty": (["eval", "empty.jsonl", "--metric", "format", "--out", "s.jsonl"], USAGE, "holds no items"),
    "eval/invalid": (["eval", "invalid.jsonl", "--metric", "format", "--out", "s.jsonl"], USAGE, "not valid JSON"),
    "eval/same-as-output": (["eval", "queries.jsonl", "--metric", "format", "--out", "queries.jsonl"], USAGE,
                            "would overwrite the input"),
    "eval/html-is-input": (["eval", "queries.jsonl", "--metric", "format", "--out", "s.jsonl", "--html",
                            "queries.jsonl"], USAGE, "--html queries.jsonl would overwrite"),
    "eval/out-dir": (["eval", "queries.jsonl", "--metric", "format", "--out", "adir"], USAGE, "is a folder"),
    "eval/bad-metric": (["eval", "queries.jsonl", "--metric", "bogus", "--out", "s.jsonl"], USAGE,
                        "--metric: unknown metric"),
    # index
    "index/empty-folder": (["index", "--corpus", "adir"], USAGE, "folder has no .md or .txt files"),
    "index/empty": (["index", "--corpus", "empty.jsonl"], USAGE, "has no documents"),
    "index/invalid": (["index", "--corpus", "invalid.jsonl"], USAGE, "invalid.jsonl:1: not valid JSON"),
    "index/cache-dir-file": (["index", "--corpus", "corpus.jsonl", "--cache-dir", "afile"], USAGE,
                             "Not a directory"),
    # sft / grpo
    "sft/data-dir": (["sft", "--model", "model", "--data", "adir", "--out", "o"], USAGE, "is a folder"),
    "sft/data-empty": (["sft", "--model", "model", "--data", "empty.jsonl", "--out", "o"], USAGE, "holds no examples"),
    "sft/out-is-data": (["sft", "--model", "model", "--data", "trees.jsonl", "--out", "trees.jsonl"], USAGE,
                        "expected a folder"),
    "sft/out-is-model": (["sft", "--model", "model", "--data", "trees.jsonl", "--out", "model"], USAGE,
                         "would overwrite the base model"),
    "grpo/data-dir": (["grpo", "--stage", "planner", "--model", "model", "--data", "adir", "--out", "o"], USAGE,
                      "is a folder"),
    "grpo/out-is-data": (["grpo", "--stage", "planner", "--model", "model", "--data", "trees.jsonl", "--out",
                          "trees.jsonl"], USAGE, "expected a folder"),
    "grpo/out-is-model": (["grpo", "--stage", "planner", "--model", "model", "--data", "trees.jsonl", "--out",
                           "model"], USAGE, "overwrite the starting model"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, bool]]:
    """Run every case in its own copy of the inputs, a few at a time."""
    root = tmp_path_factory.mktemp("hostile")

    def one(name: str) -> tuple[subprocess.CompletedProcess, bool]:
        d = root / name.replace("/", "__")
        _inputs(d)
        before = _hashes(d)
        proc = deepr(*CASES[name][0], cwd=d)
        after = {k: v for k, v in _hashes(d).items() if k in before}
        return proc, before == after

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(CASES, pool.map(one, CASES)))


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_one_line_and_the_documented_exit(results, name: str):
    proc, untouched = results[name]
    _, code, phrase = CASES[name]
    err = proc.stderr
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert phrase in lines[0], lines[0]
    assert proc.returncode == code, (proc.returncode, err)
    assert untouched, "an input file changed"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_output_folder_is_refused_before_work(tmp_path: Path):
    _inputs(tmp_path)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        proc = deepr("synthesize-rubrics", "trees.jsonl", "--out", "ro/p.jsonl", cwd=tmp_path)
    finally:
        ro.chmod(0o700)
    assert proc.returncode == USAGE and "permission denied" in proc.stderr and "Traceback" not in proc.stderr


# --- exit status from what happened ---------------------------------------------------


def _two_trees(d: Path) -> Path:
    return _jsonl(d / "trees.jsonl", [small_tree("tree-a").model_dump(mode="json"),
                                      small_tree("tree-b").model_dump(mode="json")])


def _synth(d: Path, srv: StubServer, *extra: str) -> subprocess.CompletedProcess:
    return deepr("synthesize-rubrics", "trees.jsonl", "--out", "pairs.jsonl", "--llm", "openai:stub",
                 "--base-url", srv.base_url, "--api-key", "k", "--no-cache", "--concurrency", "1", "--timeout", "5",
                 *extra, cwd=d)


def test_exit_status_all_ok_partial_and_nothing(tmp_path: Path):
    good = json.dumps(good_synthesis())
    for sub, reply, code in (("ok", [good], 0), ("partial", [good] + ["no json"] * 40, PARTIAL),
                             ("none", ["no json"], NOTHING)):
        d = tmp_path / sub
        _two_trees(d)
        with StubServer(reply=reply) as srv:
            proc = _synth(d, srv, "--max-tokens", "300", "--temperature", "0.5", "--top-p", "0.9", "--seed", "7")
        assert proc.returncode == code, (sub, proc.stderr[-1500:])
        assert "Traceback" not in proc.stderr
        # --max-tokens caps every role's own budget (top_p / seed reach backends that send them)
        assert srv.requests and all(0 < r["max_tokens"] <= 300 for r in srv.requests), srv.requests[0]


def test_auth_error_stops_at_once_with_its_own_status(tmp_path: Path):
    _two_trees(tmp_path)
    with StubServer(fail_first=100, fail_status=401) as srv:
        proc = _synth(tmp_path, srv)
    assert proc.returncode == AUTH, proc.stderr[-1500:]
    assert srv.n_requests == 1, "no request after the endpoint refused the key"
    rejects = [json.loads(x) for x in (tmp_path / "pairs.rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 2 and all("credentials" in r["reason"] or "401" in r["reason"] for r in rejects)


def test_deadline_bounds_a_hanging_endpoint(tmp_path: Path):
    """Two trees against an endpoint that never answers, 30 s per call: --deadline 3 ends it."""
    _two_trees(tmp_path)
    with StubServer(fail_first=100, fail_status="hang", hang_s=60) as srv:
        proc = deepr("synthesize-rubrics", "trees.jsonl", "--out", "pairs.jsonl", "--llm", "openai:stub",
                     "--base-url", srv.base_url, "--api-key", "k", "--no-cache", "--timeout", "30",
                     "--deadline", "3", cwd=tmp_path, timeout=120)
    assert proc.returncode == NOTHING, proc.stderr[-1500:]
    rejects = [json.loads(x) for x in (tmp_path / "pairs.rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 2 and all("deadline of 3 s reached" in r["reason"] for r in rejects)
    meta = json.loads((tmp_path / "pairs.jsonl.meta.json").read_text())
    assert meta["timings"]["seconds"] < 25, "the run ended at its deadline, not after the call timeouts"


def test_deadline_on_the_llm_object_fails_fast_after_it():
    """The mechanism itself: a hanging loopback endpoint, a 1 s budget, then instant failures."""
    import time

    from deepr.llm import LLMError, get_llm

    with StubServer(fail_first=100, fail_status="hang", hang_s=30) as srv:
        llm = get_llm("openai:stub", base_url=srv.base_url, api_key="k", cache=False, timeout=20)
        llm.set_deadline(1.0)
        t0 = time.monotonic()
        with pytest.raises(LLMError, match="deadline of 1 s reached"):
            llm.chat([{"role": "user", "content": "hi"}])
        assert time.monotonic() - t0 < 5
        n = srv.n_requests
        t1 = time.monotonic()
        with pytest.raises(LLMError, match="deadline of 1 s reached"):
            llm.chat([{"role": "user", "content": "again"}])
        assert time.monotonic() - t1 < 0.5 and srv.n_requests == n, "no request after the deadline"
        llm.close()


def test_exit_code_rules():
    from deepr.cli.exit_codes import exit_code

    assert exit_code(5) == 0 and exit_code(0) == 0  # all good; nothing to do
    assert exit_code(4, degraded=1) == PARTIAL and exit_code(4, failed=1) == PARTIAL
    assert exit_code(0, failed=2) == NOTHING
    # units written with a failed part (an eval item with one metric unscorable) are partial: 3, not 4
    assert exit_code(0, degraded=3) == PARTIAL and exit_code(0, degraded=3, failed=1) == PARTIAL
    assert exit_code(4, degraded=1, allow_fallback=True) == 0 and exit_code(0, degraded=3, allow_fallback=True) == 0
    assert exit_code(4, failed=1, allow_fallback=True) == PARTIAL  # a missing record is not a fallback
    assert exit_code(9, auth=True) == AUTH


def test_an_output_reached_through_a_link_or_dots_is_still_the_input(tmp_path: Path):
    from deepr.io import check_paths

    src = _jsonl(tmp_path / "a" / "in.jsonl", [{"id": "x"}])
    (tmp_path / "link.jsonl").symlink_to(src)
    for out in (tmp_path / "link.jsonl", tmp_path / "a" / ".." / "a" / "in.jsonl"):
        with pytest.raises(ValueError, match="would overwrite the input IN"):
            check_paths([("IN", src)], [("--out", out)])
    check_paths([("IN", src)], [("--out", tmp_path / "new" / "deeper" / "out.jsonl")])  # fine: created later


def test_validation_errors_name_the_flag_and_the_whole_range():
    from pydantic import ValidationError

    from deepr.cli.flags import flag_error
    from deepr.roles.rubric_checks import RubricLimits
    from deepr.data.rubrics import SynthConfig

    with pytest.raises(ValidationError) as e:
        SynthConfig(limits=RubricLimits(min_rubrics=5), n_select=99)
    assert flag_error(e.value) == "--n-select 99: must be >= 1 and <= 20"
    with pytest.raises(ValidationError) as e:
        SynthConfig(limits={"min_rubrics": 0})
    assert flag_error(e.value) == "--min-rubrics 0: must be >= 1"
