"""`deepr run` on the command line: files written, trajectories recorded, batches resumed, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.agent import cited_ids
from deepr.cli import app


@pytest.fixture(scope="module")
def corpus_args(retriever, mini_corpus):
    # The session retriever's cache folder: the CLI finds the same index there, no rebuild.
    return ["--corpus", str(mini_corpus), "--cache-dir", str(retriever.path.parents[1])]


def invoke(*args: str):
    return CliRunner().invoke(app, ["run", *args])


def test_single_run_writes_report_sidecar_html_meta_and_trajectory(tmp_path, corpus_args):
    out, traj = tmp_path / "r" / "report.md", tmp_path / "traj.jsonl"
    r = invoke("How did ancient Greek architecture influence later buildings?", "--out", str(out),
               "--html", "--record", str(traj), *corpus_args)
    assert r.exit_code == 0, r.output
    md = out.read_text(encoding="utf-8")
    side = json.loads((tmp_path / "r" / "report.json").read_text(encoding="utf-8"))
    assert {"query", "mode", "plans", "calls", "tools", "citations", "report"} <= set(side)
    assert side["mode"] == "dag" and side["report"] == md
    assert set(cited_ids(md)) == set(side["citations"]) and side["citations"]
    assert "<svg" in (tmp_path / "r" / "report.html").read_text(encoding="utf-8")
    meta = json.loads((tmp_path / "r" / "report.md.meta.json").read_text(encoding="utf-8"))
    assert meta["stage"] == "run" and meta["counts"]["citations"] == len(side["citations"])
    rows = [json.loads(line) for line in traj.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 1 and rows[0]["mode"] == "dag" and rows[0]["turns"][0]["action"] == "plan"
    # A second run of the same query appends a second trajectory under a distinct id.
    assert invoke("How did ancient Greek architecture influence later buildings?", "--out", str(out),
                  "--record", str(traj), "--mode", "decor", *corpus_args).exit_code == 0
    ids = [json.loads(line)["id"] for line in traj.read_text(encoding="utf-8").splitlines()]
    assert len(ids) == 2 and len(set(ids)) == 2


def test_batch_is_resumable_by_id(tmp_path, corpus_args):
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "smith", "question": "Who was Adam Smith?", "answers": ["economist"]},
        {"id": "bridge/1", "prompt": "Where is the Akashi Kaikyo Bridge?"}]), encoding="utf-8")
    out, traj = tmp_path / "reports", tmp_path / "traj.jsonl"
    args = ["--queries", str(queries), "--out", str(out), "--mode", "decor", "--record", str(traj), *corpus_args]
    r = invoke(*args, "--limit", "1")
    assert r.exit_code == 0, r.output
    index = [json.loads(x) for x in (out / "reports.jsonl").read_text().splitlines()]
    assert [i["id"] for i in index] == ["smith"] and index[0]["answers"] == ["economist"]
    assert (out / "smith.md").exists() and (out / "smith.json").exists()
    assert invoke(*args).exit_code == 0  # resumes: only the missing id runs
    index = [json.loads(x) for x in (out / "reports.jsonl").read_text().splitlines()]
    assert [i["id"] for i in index] == ["smith", "bridge/1"]
    assert json.loads((out / index[1]["trace_path"].split("/")[-1]).read_text())["query"].startswith("Where")
    # the index is read from other directories (deepr drb, the learning bench): absolute paths
    assert all(Path(i[k]).is_absolute() and Path(i[k]).is_file() for i in index for k in ("trace_path", "report_path"))
    assert len(traj.read_text().splitlines()) == 2
    assert invoke(*args).exit_code == 0
    assert len((out / "reports.jsonl").read_text().splitlines()) == 2  # nothing re-run


def test_parallel_queries_write_what_one_at_a_time_writes(tmp_path, corpus_args, tiny):
    """--parallel keeps several questions in flight (a local model decodes their waiting calls
    together); every id still gets its own report, with the replies a one-at-a-time run gets."""
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps({"id": f"q{i}", "question": q}) + "\n" for i, q in enumerate(
        ["Who was Adam Smith?", "Where is the Akashi Kaikyo Bridge?", "How did Greek architecture spread?"])))
    answers = {}
    for parallel in ("1", "3"):
        out = tmp_path / f"p{parallel}"
        r = invoke("--queries", str(queries), "--out", str(out), "--llm", f"hf:{tiny}", "--max-tokens", "24",
                   "--max-reasks", "0", "--parallel", parallel, "--allow-fallback", "--no-cache", *corpus_args)
        assert r.exit_code in (0, 3), r.output
        index = {json.loads(x)["id"]: json.loads(x) for x in (out / "reports.jsonl").read_text().splitlines()}
        assert set(index) == {"q0", "q1", "q2"}
        traces = {i: json.loads((out / f"{i}.json").read_text()) for i in index}
        assert all(t["query"] == index[i]["query"] for i, t in traces.items())
        # each call's own token counts, though the other runs' calls move the backend's totals meanwhile
        answers[parallel] = {i: ([(c["reply"], c["prompt_tokens"], c["completion_tokens"], c.get("tokens_estimated", False))
                                  for c in t["calls"]], index[i]["answer"]) for i, t in traces.items()}
    assert answers["1"] == answers["3"]
    calls = [c for cs, _ in answers["3"].values() for c in cs]
    assert calls and not any(estimated for *_, estimated in calls)


@pytest.mark.parametrize("args, message", [
    (["--parallel", "0"], "--parallel 0: must be between 1 and 64"),
    (["--parallel", "2"], "needs --queries FILE"),
])
def test_parallel_needs_a_batch_of_queries(args, message, tmp_path):
    r = invoke("Who was Adam Smith?", "--out", str(tmp_path / "r.md"), *args)
    assert r.exit_code == 2 and message in r.output


def test_replay_backend_from_the_command_line(tmp_path, corpus_args):
    replies = tmp_path / "replies.jsonl"
    replies.write_text("\n".join(json.dumps(x) for x in [
        {"role": "decor_planner", "reply": "<search>Adam Smith</search>"},
        {"role": "decor_filter", "reply": "<filter>Adam Smith was an economist [S1-R1].</filter>"},
        {"role": "decor_planner", "reply": "<search>STOP</search>"},
        {"role": "decor_answerer", "reply": "<answer>An economist [S1-R1].</answer>"}]), encoding="utf-8")
    out = tmp_path / "a.md"
    r = invoke("Who was Adam Smith?", "--out", str(out), "--mode", "decor", "--llm", f"replay:{replies}",
               *corpus_args)
    assert r.exit_code == 0, r.output
    assert "An economist [S1-R1]." in out.read_text() and "without a language model" not in out.read_text()


@pytest.mark.parametrize("args, message", [
    (["   ", "--out", "x.md"], "the query is empty"),
    (["q", "--out", "x.txt"], "writes a .md report"),
    (["q", "--out", "x.md", "--mode", "tree"], "--mode 'tree'"),
    (["q", "--out", "x.md", "--force-expand", "20"], "--force-expand"),
    (["q", "--out", "x.md", "--search-rounds", "0"], "--search-rounds"),
    (["--out", "x.md"], "either a QUERY argument or --queries"),
    (["--queries", "missing.jsonl", "--out", "reports"], "missing.jsonl: no such queries file"),
])
def test_bad_input_gives_a_clean_error(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = invoke(*args, "--dry-run")
    assert r.exit_code == 2
    assert message in " ".join(r.output.split()) and "Traceback" not in r.output


def test_malformed_queries_file_names_file_line_and_field(tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text('{"id": "a", "question": "fine?"}\n{"id": "b"}\n', encoding="utf-8")
    r = invoke("--queries", str(q), "--out", str(tmp_path / "out"), "--dry-run")
    assert r.exit_code == 2 and "q.jsonl:2 field 'question'" in " ".join(r.output.split())
    q.write_text('{"id": "a", "question": "fine?"\n', encoding="utf-8")
    r = invoke("--queries", str(q), "--out", str(tmp_path / "out"), "--dry-run")
    assert r.exit_code == 2 and "q.jsonl:1: not valid JSON" in " ".join(r.output.split())


def test_dry_run_reads_queries_and_runs_nothing(tmp_path):
    q = tmp_path / "q.txt"
    q.write_text("First question?\n\nSecond question?\n", encoding="utf-8")
    r = invoke("--queries", str(q), "--out", str(tmp_path / "out"), "--dry-run")
    assert r.exit_code == 0 and "2 queries" in r.output and not (tmp_path / "out").exists()


def test_openai_compatible_backend_end_to_end(tmp_path, corpus_args):
    """The same loop through the real OpenAI client against a loopback stub server."""
    from deepr.llm.stub_server import StubServer

    def reply(body: dict) -> str:
        system, user = body["messages"][0]["content"], body["messages"][-1]["content"]
        if "plan the searches" in system:
            return "<search>STOP</search>" if "S1-R1" in user else "<search>Akashi Kaikyo Bridge</search>"
        if "filter search results" in system:
            return "<filter>The bridge links Kobe and Awaji Island [S1-R1].</filter>"
        return "<answer>Between Kobe and Awaji Island [S1-R1].</answer>"

    out = tmp_path / "bridge.md"
    with StubServer(reply=reply, latency=0.05) as srv:
        r = invoke("Where is the Akashi Kaikyo Bridge?", "--out", str(out), "--mode", "decor", "--llm",
                   "openai:stub-model", "--base-url", srv.base_url, "--no-cache", *corpus_args)
        sent = list(srv.requests)
    assert r.exit_code == 0, r.output
    side = json.loads(out.with_suffix(".json").read_text())
    assert len(sent) == len(side["calls"]) == 4 and all(b["model"] == "stub-model" for b in sent)
    assert all(c["latency_s"] >= 0.05 and c["completion_tokens"] > 0 for c in side["calls"])
    assert side["answer"] == "Between Kobe and Awaji Island [S1-R1]."
    assert side["backend"]["backend"] == "openai" and "api_key" not in json.dumps(side["backend"]).lower()


def test_an_endpoint_answering_html_ends_the_run_normally_with_its_trace(tmp_path, corpus_args):
    """Issue 18.2, end to end: a 200 text/html body on every call is a recorded failure per turn;
    `deepr run` writes its report and trace (every turn fell back) and says so in its exit status."""
    import os
    import subprocess
    import sys

    from deepr.llm.stub_server import Raw, StubServer

    out = tmp_path / "r.md"
    with StubServer(reply=[Raw("<html>this is not json</html>", "text/html")]) as srv:  # the last repeats
        proc = subprocess.run([sys.executable, "-m", "deepr", "run", "How do volcanoes form?", "--out", str(out),
                               "--llm", "openai:stub", "--base-url", srv.base_url, "--api-key", "k", "--no-cache",
                               *corpus_args], capture_output=True, text=True,
                              env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 4, proc.stderr[-2000:]  # nothing the model wrote was usable
    trace = json.loads(out.with_suffix(".json").read_text())
    assert out.is_file() and trace["calls"] and all(not c["ok"] for c in trace["calls"])
    assert any("not JSON" in (c.get("error") or "") for c in trace["calls"])
