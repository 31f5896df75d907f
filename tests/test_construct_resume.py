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
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    # SIGINT as a terminal delivers it: a shell that starts jobs with `&` (no job control) leaves
    # SIGINT ignored in its children, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
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


# --- kill -9 in every stage that claims to resume (issue 18.7) ---------------------------
# Each test runs the stage against a paced stub endpoint on 127.0.0.1 (or the extractive engine),
# kills it with SIGKILL once some records are written, re-runs it to the end and checks every id
# is in the outputs exactly once, each line whole.

from deepr.llm.stub_server import StubServer  # noqa: E402
from tree_helpers import good_synthesis, small_tree  # noqa: E402

N_ITEMS = 8


def _count(*paths: Path) -> Callable[[], int]:
    return lambda: sum(_lines(p) for p in paths)


def _kill_midway(cmd: list[str], progress: Callable[[], int], after: int = 1, cwd: Path | None = None) -> int:
    """Start ``cmd``, SIGKILL it once ``progress()`` reaches ``after``; return how far it got."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=cwd)
    deadline = time.time() + 300
    while progress() < after and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"finished before the kill: {proc.stderr.read().decode()[-2000:]}"
    proc.kill()
    proc.wait(timeout=60)
    return progress()


def _ids(*paths: Path) -> list[str]:
    return [r["id"] for p in paths if p.exists() for r in read_jsonl(p)]  # raises on a torn line


def _deepr(*args: object) -> list[str]:
    return [sys.executable, "-m", "deepr", *map(str, args)]


def _trees_file(path: Path) -> Path:
    path.write_text("".join(small_tree(f"tree-{i}").model_dump_json() + "\n" for i in range(N_ITEMS)))
    return path


def _stub(**kw: Any) -> list[str]:
    return ["--llm", "openai:stub", "--api-key", "k", "--no-cache", "--concurrency", "1"]


def test_killed_synthesize_rubrics_resumes_each_pair_once(tmp_path: Path):
    trees, out = _trees_file(tmp_path / "trees.jsonl"), tmp_path / "pairs.jsonl"
    with StubServer(reply=json.dumps(good_synthesis()), latency=0.3) as srv:
        cmd = _deepr("synthesize-rubrics", trees, "--out", out, *_stub(), "--base-url", srv.base_url)
        got = _kill_midway(cmd, _count(out, rejects_path(out)), after=2)
        assert 2 <= got < N_ITEMS
        done = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(_ids(out, rejects_path(out))) == sorted(f"tree-{i}-qr" for i in range(N_ITEMS))
    assert len(_ids(out)) == N_ITEMS


def test_killed_verify_resumes_each_pair_once(tmp_path: Path):
    trees, pairs = _trees_file(tmp_path / "trees.jsonl"), tmp_path / "pairs.jsonl"
    with StubServer(reply=json.dumps(good_synthesis())) as srv:
        made = subprocess.run(_deepr("synthesize-rubrics", trees, "--out", pairs, *_stub(), "--base-url",
                                     srv.base_url), capture_output=True, text=True, env=_env())
    assert made.returncode == 0, made.stderr[-2000:]
    out = tmp_path / "verified.jsonl"
    outs = (out, tmp_path / "verified.dropped.jsonl", rejects_path(out))
    with StubServer(reply="not an audit", latency=0.1) as srv:  # each pair: re-asked, then a reject line
        cmd = _deepr("verify", pairs, "--out", out, *_stub(), "--base-url", srv.base_url)
        got = _kill_midway(cmd, _count(*outs), after=2)
        assert 2 <= got < N_ITEMS
        done = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    assert done.returncode == 4, done.stderr[-2000:]  # every audit failed: "nothing succeeded"
    assert sorted(_ids(*outs)) == sorted(f"tree-{i}-qr" for i in range(N_ITEMS))


def test_killed_eval_resumes_each_item_once(tmp_path: Path):
    inp = tmp_path / "preds.jsonl"
    # distinct predictions: identical ones would be one judgement, cached, and all done before the kill
    inp.write_text("".join(json.dumps({"id": f"p{i}", "prediction": f"Paris ({i})", "answers": ["Paris"]}) + "\n"
                           for i in range(N_ITEMS)))
    out = tmp_path / "scores.jsonl"
    with StubServer(reply='{"verdict": "YES"}', latency=0.3) as srv:
        cmd = _deepr("eval", inp, "--metric", "lj", "--out", out, "--judge-llm", "openai:stub", "--base-url",
                     srv.base_url, "--api-key", "k", "--no-cache", "--concurrency", "1")
        got = _kill_midway(cmd, _count(out), after=2)
        assert 2 <= got < N_ITEMS
        done = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(read_jsonl(out))
    assert sorted(r["id"] for r in rows) == sorted(f"p{i}" for i in range(N_ITEMS))
    assert all(r["lj"] == 1.0 for r in rows)


def test_killed_run_queries_resumes_each_query_once(tmp_path: Path, mini_corpus: Path, retriever):
    queries = tmp_path / "q.jsonl"
    qs = ["How are volcanoes formed?", "What causes earthquakes?", "How do vaccines work?",
          "Why did Rome fall?", "How do bees make honey?", "What is photosynthesis?"]
    queries.write_text("".join(json.dumps({"id": f"q{i}", "question": q}) + "\n" for i, q in enumerate(qs)))
    out = tmp_path / "runs"
    cmd = _deepr("run", "--queries", queries, "--out", out, "--corpus", mini_corpus, "--cache-dir",
                 retriever.path.parents[1], "--record", tmp_path / "traj.jsonl")
    got = _kill_midway(cmd, _count(out / "reports.jsonl"), after=1)
    assert 1 <= got < len(qs)
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(read_jsonl(out / "reports.jsonl"))
    assert sorted(r["id"] for r in rows) == sorted(f"q{i}" for i in range(len(qs)))
    for r in rows:
        assert json.loads(Path(r["trace_path"]).read_text())["query"] == r["query"]
    traj = _ids(tmp_path / "traj.jsonl")
    assert len(traj) == len(set(traj)) == len(qs)


def test_killed_index_build_never_leaves_an_index_that_loads(tmp_path: Path, mini_corpus: Path, retriever):
    cache = tmp_path / "cache"

    def started() -> int:
        return int(any(cache.glob("index/*.partial")))

    _kill_midway(_deepr("index", "--corpus", mini_corpus, "--cache-dir", cache), started, after=1)
    left = [p for p in cache.glob("index/*") if p.is_dir() and not p.name.endswith(".partial")]
    assert not left, "a killed build left an index"
    again = subprocess.run(_deepr("search", "lava eruption", "--corpus", mini_corpus, "--cache-dir", cache, "-k",
                                  "5", "--json"), capture_output=True, text=True, env=_env())
    assert again.returncode == 0, again.stderr[-2000:]
    assert [h["id"] for h in json.loads(again.stdout)] == [h.id for h in retriever.search("lava eruption", k=5)]


def test_two_runs_share_cache_and_index_at_once(tmp_path: Path, setup):
    """Two `deepr run` processes on a cold index and one LLM cache file: both finish, nothing corrupt."""
    import sqlite3

    corpus, _, _ = setup
    cache = tmp_path / "cache"
    env = {**_env(), "DEEPR_CACHE": str(cache)}
    with StubServer(reply="not a plan", latency=0.02) as srv:
        procs = [subprocess.Popen(_deepr("run", "How do volcanoes erupt?", "--out", tmp_path / f"r{i}.md",
                                         "--corpus", corpus, "--cache-dir", cache, "--llm", "openai:stub",
                                         "--base-url", srv.base_url, "--api-key", "k", "--allow-fallback"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for i in range(2)]
        errs = [p.communicate(timeout=600)[1].decode() for p in procs]
    results = [(p.returncode, e) for p, e in zip(procs, errs)]
    for code, err in results:
        assert code == 0 and "Traceback" not in err, err[-2000:]
    reports = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(2)]
    assert reports[0]["report"] and reports[0]["report"] == reports[1]["report"]
    with sqlite3.connect(cache / "llm.sqlite") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_killed_sft_resumes_from_its_last_checkpoint(tmp_path: Path):
    from deepr.train.tiny import build_tiny_model, wiki_texts
    from test_sft import planner_example

    tiny = build_tiny_model(tmp_path / "tiny", corpus_texts=wiki_texts(300) or None)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(planner_example(i).model_dump_json() + "\n" for i in range(8)))
    out = tmp_path / "run"
    cmd = _deepr("sft", "--model", tiny, "--data", data, "--out", out, "--role", "planner", "--max-steps", "30",
                 "--save-steps", "2", "--batch-size", "4", "--grad-accum", "1", "--lr", "1e-2", "--lora-r", "4",
                 "--lora-alpha", "8", "--max-length", "512", "--logging-steps", "1")
    _kill_midway(cmd, lambda: len(list(out.glob("checkpoint-*"))), after=2)
    assert not (out / "adapter_model.safetensors").exists()
    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "run.meta.json").read_text())["counts"]["steps"] == 30


def test_killed_grpo_resumes_from_its_last_checkpoint(tiny: Path, mini_corpus: Path, tmp_path: Path):
    """kill -9 while a GRPO planner run is between checkpoints (or writing one): --resume starts
    from the last complete checkpoint and finishes the planned steps."""
    from deepr.records import QRPair, RubricItem

    rubric = RubricItem(id="R1", type="factual", description="Plate boundaries cause earthquakes", weight=1.0,
                        source_leaf_ids=["L1"], evidence=["Most earthquakes occur at plate boundaries."])
    data = tmp_path / "verified.jsonl"
    data.write_text("".join(QRPair(id=f"q{i}", tree_id="t", question=q, selected_leaf_ids=[], rubrics=[rubric])
                            .model_dump_json() + "\n" for i, q in enumerate(
                                ["What causes earthquakes?", "How do volcanoes affect the climate?"])))
    config = tmp_path / "grpo.json"  # a random tiny model earns the same reward everywhere: keep going
    config.write_text(json.dumps({"save_steps": 1, "zero_advantage": "off", "max_completion_length": 48,
                                  "lora_r": 4, "lora_alpha": 8}))
    out = tmp_path / "run"
    cmd = _deepr("grpo", "--stage", "planner", "--model", tiny, "--data", data, "--out", out, "--config", config,
                 "--max-steps", "6", "--num-generations", "2", "--prompts-per-step", "2", "--corpus", mini_corpus,
                 "--retriever", "bm25", "--k", "2", "--lr", "1e-3")
    _kill_midway(cmd, lambda: len(list(out.glob("checkpoint-*"))), after=2)
    assert not (out / "adapter_model.safetensors").exists()
    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "adapter_model.safetensors").is_file()
    steps = [json.loads(line).get("step") for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 6
    # the step the kill cut short was logged, then run again: its rows are there once
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_step = [r["step"] for r in rows if "step" in r and "train_runtime" not in r]
    assert sorted(per_step) == sorted(set(per_step))
    rollouts = [json.loads(line)["step"] for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts == sorted(rollouts) and all(rollouts.count(s) == 4 for s in set(rollouts))  # one group a step


def test_resume_drops_log_rows_of_steps_no_checkpoint_holds(tmp_path: Path):
    from deepr.train.runs import drop_rows_past

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in (1, 2, 3))
                                            + '{"note": "no step"}\n')
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 0, 1, 1, 2, 2)))
    drop_rows_past(tmp_path, 2)  # checkpoint-2: two steps done; the third (sampled at step 2) was cut short
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m.get("step") for m in metrics] == [1, 2, None]
    rollouts = [json.loads(x)["step"] for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts == [0, 0, 1, 1]
    drop_rows_past(tmp_path, 0)  # killed before its first checkpoint: the run starts over
    assert (tmp_path / "rollouts.jsonl").read_text() == ""
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [{"note": "no step"}]
