"""`deepr serve-index` and `--corpus http://...`: the compatibility APIs as their clients send them,
the same ids and reports as the local index, bad requests, two processes on one server.

The server runs as a real `deepr serve-index` process on 127.0.0.1, started here and stopped
(with Ctrl-C, so it logs its summary) at the end of the module.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from deepr.cli import app

QUERIES = ["Who was Adam Smith?", "How does an abacus work?", "Aircraft carrier history", "Acid rain causes"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(retriever, mini_corpus, tmp_path_factory):
    """(url, log path) of a serve-index process over the session's mini corpus and its cached index."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "deepr", "serve-index", "--corpus", str(mini_corpus), "--port", str(port),
           "--cache-dir", str(retriever.path.parents[1])]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.getcwd()})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
        if proc.poll() is not None:
            pytest.fail(f"serve-index exited early: {log.read_text()}")
    else:
        proc.kill()
        pytest.fail(f"serve-index did not answer /health in 120 s: {log.read_text()}")
    yield url, log, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_search_r1_shaped_client_gets_the_local_index_ranking(server, retriever):
    """Search-R1's retrieval client: POST /retrieve {"queries", "topk", "return_scores"}; each
    result is {"document": {"id", "contents"}, "score"} and contents is '"title"\\ntext'."""
    url, *_ = server
    payload = {"queries": QUERIES, "topk": 3, "return_scores": True}
    body = httpx.post(url + "/retrieve", json=payload, timeout=60).json()
    assert list(body) == ["result"] and len(body["result"]) == len(QUERIES)
    local = retriever.search_many(QUERIES, k=3)
    for q_hits, hits in zip(body["result"], local):
        assert [r["document"]["id"] for r in q_hits] == [h.id for h in hits]
        for r, h in zip(q_hits, hits):
            title, _, text = r["document"]["contents"].partition("\n")
            assert title.strip('"') == h.title and text == h.text
            assert isinstance(r["score"], float) and abs(r["score"] - h.score) < 1e-6
    # without scores: a list of documents per query
    plain = httpx.post(url + "/retrieve", json={"queries": QUERIES[:1], "topk": 2, "return_scores": False}).json()
    assert [d["id"] for d in plain["result"][0]] == [h.id for h in local[0][:2]]


def test_skyrl_shaped_client_sends_query(server, retriever):
    url, *_ = server
    body = httpx.post(url + "/retrieve", json={"query": QUERIES[1], "topk": 2, "return_scores": True}).json()
    assert [r["document"]["id"] for r in body["result"][0]] == [h.id for h in retriever.search(QUERIES[1], k=2)]


def test_flashrag_shaped_client(server, retriever):
    """FlashRAG's serving API: /search answers [documents, scores] with return_score, /batch_search
    one list per query; documents are {"id", "contents"}; /health says healthy."""
    url, *_ = server
    assert httpx.get(url + "/health").json()["status"] == "healthy"
    docs, scores = httpx.post(url + "/search", json={"query": QUERIES[0], "top_n": 4, "return_score": True}).json()
    assert [d["id"] for d in docs] == [h.id for h in retriever.search(QUERIES[0], k=4)]
    assert len(scores) == 4 and scores == sorted(scores, reverse=True)
    batch = httpx.post(url + "/batch_search", json={"query": QUERIES, "top_n": 2}).json()
    assert [[d["id"] for d in q] for q in batch] == [[h.id for h in hs] for hs in retriever.search_many(QUERIES, k=2)]
    docs2, scores2 = httpx.post(url + "/batch_search", json={"query": QUERIES[:2], "top_n": 2, "return_score": True}).json()
    assert len(docs2) == len(scores2) == 2 and all(len(s) == 2 for s in scores2)


@pytest.mark.parametrize("path,payload,reason", [
    ("/retrieve", {"topk": 3}, "missing field 'queries'"),
    ("/retrieve", {"queries": [1, 2]}, "must be a string or a list of strings"),
    ("/retrieve", {"queries": ["x"], "topk": 0}, "'topk'=0"),
    ("/retrieve", {"queries": ["x"], "return_scores": "yes"}, "true or false"),
    ("/search", {"query": ["a", "b"]}, "use /batch_search"),
    ("/v1/search", {"queries": ["x"], "mode": "magic"}, "expected dense, bm25 or hybrid"),
    ("/retrieve", "not json", "not JSON"),
])
def test_bad_requests_get_400_with_one_line(server, path, payload, reason):
    url, *_ = server
    r = httpx.post(url + path, content=payload if isinstance(payload, str) else json.dumps(payload))
    assert r.status_code == 400 and reason in r.json()["error"] and "\n" not in r.json()["error"]


def test_remote_retriever_matches_the_local_one(server, retriever):
    """--corpus http://... : same hits, documents, passages, embeddings and seed topics."""
    from deepr.corpus import UnknownIdError, open_retriever
    from deepr.data.topics import sample_topics

    url, *_ = server
    remote = open_retriever(url)
    for mode in ("dense", "bm25", "hybrid"):
        got = remote.search_many(QUERIES, k=5, mode=mode)
        want = retriever.search_many(QUERIES, k=5, mode=mode)
        assert [[h.model_dump() for h in hs] for hs in got] == [[h.model_dump() for h in hs] for hs in want]
    doc = retriever.documents[3]
    assert remote.get_document(doc.id) == doc
    pid = retriever.passages[5].id
    assert remote.get_passage(pid) == retriever.passages[5]
    with pytest.raises(UnknownIdError):
        remote.get_document("no-such-doc")
    vec = remote.embedder.encode(["volcano"])
    assert vec.shape == (1, remote.embedder.dim) and abs(float(vec[0] @ retriever.embedder.encode(["volcano"])[0]) - 1) < 1e-5
    assert sample_topics(remote.documents, 6, seed=3) == sample_topics(retriever.documents, 6, seed=3)


def test_run_through_the_server_writes_the_local_report(server, retriever, mini_corpus, tmp_path):
    url, *_ = server
    q = "How did ancient Greek architecture influence later buildings?"
    reports = {}
    for name, corpus in (("local", ["--corpus", str(mini_corpus), "--cache-dir", str(retriever.path.parents[1])]),
                         ("remote", ["--corpus", url])):
        out = tmp_path / name / "report.md"
        r = CliRunner().invoke(app, ["run", q, "--out", str(out), *corpus])
        assert r.exit_code == 0, r.output
        reports[name] = json.loads((tmp_path / name / "report.json").read_text(encoding="utf-8"))
    assert reports["remote"]["citations"] and reports["remote"]["citations"] == reports["local"]["citations"]
    assert reports["remote"]["report"] == reports["local"]["report"]
    for cite in reports["remote"]["citations"].values():  # each citation is a passage of the corpus, verbatim
        assert retriever.get_passage(cite["passage_id"]).text == cite["text"]


def test_build_trees_through_the_server_writes_the_local_trees(server, retriever, mini_corpus, tmp_path):
    """Sampled seed topics (sampled by the server) and the trees grown from its searches equal a local run's."""
    url, *_ = server
    out = {}
    for name, corpus in (("local", ["--corpus", str(mini_corpus), "--cache-dir", str(retriever.path.parents[1])]),
                         ("remote", ["--corpus", url])):
        path = tmp_path / f"{name}.jsonl"
        r = CliRunner().invoke(app, ["build-trees", "--n-trees", "2", "--max-depth", "2", "--out", str(path), *corpus])
        assert r.exit_code == 0, r.output
        out[name] = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(out["remote"]) == 2
    strip = lambda trees: [{k: v for k, v in t.items() if k not in ("stats", "meta")} for t in trees]  # noqa: E731
    assert strip(out["remote"]) == strip(out["local"])


def test_grpo_environment_searches_through_the_server(server, tiny, tmp_path):
    """A GRPO planner step on the tiny model with --corpus URL opens the corpus on the server (a random
    tiny model writes no valid plan, so its rollouts reach no search: what is checked is that the
    environment's corpus is the server's, and that training runs with it)."""
    url, *_ = server
    from deepr.records import QRPair, RubricItem

    rubric = RubricItem(id="R1", type="factual", description="Adam Smith wrote The Wealth of Nations", weight=1.0,
                        source_leaf_ids=["L1"], evidence=["Adam Smith wrote The Wealth of Nations."])
    data = tmp_path / "q.jsonl"
    data.write_text(QRPair(id="q1", tree_id="t", question="Who was Adam Smith and what did he write?",
                           selected_leaf_ids=[], rubrics=[rubric]).model_dump_json() + "\n", encoding="utf-8")
    config = tmp_path / "grpo.json"  # a random tiny model earns the same reward everywhere: keep going
    config.write_text(json.dumps({"zero_advantage": "off", "lora_r": 4, "lora_alpha": 8}))
    before = httpx.get(url + "/v1/stats").json()["served"]["by_route"].get("/v1/stats", 0)
    r = CliRunner().invoke(app, ["grpo", "--stage", "planner", "--model", str(tiny), "--data", str(data),
                                 "--out", str(tmp_path / "g"), "--max-steps", "1", "--num-generations", "2",
                                 "--prompts-per-step", "1", "--max-completion-length", "64", "--corpus", url,
                                 "--k", "1", "--config", str(config)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "g" / "adapter_config.json").exists()
    # a /v1/stats request is counted after it is answered: "before" itself adds one, the run's open another
    assert httpx.get(url + "/v1/stats").json()["served"]["by_route"].get("/v1/stats", 0) - before >= 2


def test_a_server_lost_mid_run_stops_the_command_with_exit_4():
    """The server answers when the corpus opens, then fails every search: retried, then one line, exit 4."""
    import threading

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def stats(request):
        return JSONResponse({"corpus": "c", "mode": "hybrid", "documents": 1, "embedder": "e"})

    async def broken(request):
        return JSONResponse({"error": "index gone"}, status_code=503)

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/stats", stats), Route("/v1/search", broken,
                                                                                      methods=["POST"])]),
                                        host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not srv.started and time.time() < deadline:
            time.sleep(0.05)
        r = CliRunner().invoke(app, ["search", "anything", "--corpus", f"http://127.0.0.1:{port}"])
        assert r.exit_code == 4, r.output
        assert "/v1/search failed (HTTP 503)" in r.output and "Traceback" not in r.output
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def served_in_thread(app, port: int):
    """``app`` served by uvicorn on 127.0.0.1:``port`` in a thread of this process; yields the server."""
    import threading

    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield srv
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


def going_away(app, when):
    """``app``, except that the first search once ``when()`` is true stops the whole server (it
    closes its port), as a retrieval server that crashes mid-stage does. Returns (app, a dict
    where the caller puts the uvicorn server under "server")."""
    from starlette.responses import Response

    box: dict = {}

    async def wrapped(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/v1/search" and when():
            box["server"].should_exit = True
            return await Response(status_code=503)(scope, receive, send)
        await app(scope, receive, send)
    return wrapped, box


def test_build_trees_stops_when_the_server_goes_away_and_resumes(retriever, tmp_path):
    """The server dies once a tree is written: build-trees stops with one line (no traceback), exit 3
    (some trees finished: the README's 'some records failed'), keeps its finished trees, rejects
    nothing for the outage and writes its sidecar; the same command against the server back on
    the same port finishes the job, and the result is what an uninterrupted run writes."""
    from deepr.corpus.server import make_app
    from deepr.data.topics import sample_topics
    from deepr.io import meta_path

    def seeder(documents, n, seed, min_words):
        return [t.model_dump() for t in sample_topics(documents, n, seed=seed, min_words=min_words)]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    run = lambda out: CliRunner().invoke(app, ["build-trees", "--n-trees", "8", "--max-depth", "2",  # noqa: E731
                                               "--out", str(out), "--corpus", url])
    with served_in_thread(make_app(retriever, seeder=seeder), port):
        clean = run(tmp_path / "clean.jsonl")
    assert clean.exit_code in (0, 3), clean.output
    out = tmp_path / "trees.jsonl"
    lost, box = going_away(make_app(retriever, seeder=seeder), when=lambda: out.exists() and out.read_text().strip())
    with served_in_thread(lost, port) as srv:
        box["server"] = srv
        r = run(out)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    kept = (tmp_path / "trees.jsonl").read_text().splitlines()
    assert r.exit_code == 3 and 0 < len(kept) < 8, r.output
    assert len(errors) == 1 and "Traceback" not in r.output and "/v1/search failed" in errors[0]
    assert f"the {len(kept)} finished this run are saved, re-run the same command" in r.output.replace("\n", " ")
    rejects = tmp_path / "trees.rejects.jsonl"
    assert not rejects.exists() or "retrieval server" not in rejects.read_text()
    assert json.loads(meta_path(tmp_path / "trees.jsonl").read_text())["counts"]["trees in output"] == len(kept)
    with served_in_thread(make_app(retriever, seeder=seeder), port):
        again = run(tmp_path / "trees.jsonl")
    assert again.exit_code == clean.exit_code, again.output
    resumed = (tmp_path / "trees.jsonl").read_text().splitlines()
    assert resumed[:len(kept)] == kept  # the finished trees were kept, not built again
    ids = lambda lines: sorted(json.loads(x)["id"] for x in lines)  # noqa: E731
    assert ids(resumed) == ids((tmp_path / "clean.jsonl").read_text().splitlines())


def test_run_queries_stops_when_the_server_goes_away_and_resumes(retriever, tmp_path):
    """`deepr run --queries`: the server dies once a report is written; the batch stops with one
    line and exit 3, keeps that report, rejects no question for the outage, and the same command
    against the server back on its port answers the rest."""
    from deepr.corpus.server import make_app

    port = free_port()
    qfile, out = tmp_path / "q.jsonl", tmp_path / "runs"
    qfile.write_text("".join(json.dumps({"id": f"q{i}", "question": q}) + "\n" for i, q in enumerate(QUERIES)))
    index = out / "reports.jsonl"
    run = lambda: CliRunner().invoke(app, ["run", "--queries", str(qfile), "--out", str(out),  # noqa: E731
                                           "--corpus", f"http://127.0.0.1:{port}"])
    lost, box = going_away(make_app(retriever), when=lambda: index.exists() and index.read_text().strip())
    with served_in_thread(lost, port) as srv:
        box["server"] = srv
        r = run()
    kept = index.read_text().splitlines()
    assert r.exit_code == 3 and 0 < len(kept) < len(QUERIES), r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "/v1/search failed" in errors[0] and "Traceback" not in r.output
    assert f"the {len(kept)} finished this run are saved" in r.output.replace("\n", " ")
    rejects = out / "reports.rejects.jsonl"
    assert not rejects.exists() or not rejects.read_text().strip()
    with served_in_thread(make_app(retriever), port):
        again = run()
    assert again.exit_code == 0, again.output
    done = index.read_text().splitlines()
    assert done[:len(kept)] == kept  # the finished report was kept, not run again
    assert sorted(json.loads(x)["id"] for x in done) == [f"q{i}" for i in range(len(QUERIES))]


def test_build_trees_against_a_closed_port_runs_nothing(tmp_path):
    port = free_port()  # nothing listens there
    r = CliRunner().invoke(app, ["build-trees", "--n-trees", "2", "--out", str(tmp_path / "t.jsonl"),
                                 "--corpus", f"http://127.0.0.1:{port}"])
    assert r.exit_code == 2 and "Traceback" not in r.output and f"127.0.0.1:{port}" in r.output
    assert not (tmp_path / "t.jsonl").exists()


def test_parallel_run_every_search_reaches_the_server_once(server, tmp_path):
    """`deepr run --queries --parallel 3` against the server: the server counts exactly the
    searches the three reports' traces record."""
    url, *_ = server
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"id": f"q{i}", "question": q}) + "\n" for i, q in enumerate(QUERIES[:3])),
                     encoding="utf-8")
    before = httpx.get(url + "/v1/stats").json()["served"]["queries"]
    r = CliRunner().invoke(app, ["run", "--queries", str(qfile), "--parallel", "3", "--out", str(tmp_path / "runs"),
                                 "--corpus", url])
    assert r.exit_code == 0, r.output
    traces = [json.loads(p.read_text(encoding="utf-8")) for p in sorted((tmp_path / "runs").rglob("*.json"))
              if "tools" in json.loads(p.read_text(encoding="utf-8"))]
    assert len(traces) == 3
    searched = sum(1 for t in traces for call in t["tools"] if call["tool"] == "search")
    assert searched > 0 and httpx.get(url + "/v1/stats").json()["served"]["queries"] - before == searched


def test_two_processes_share_one_server_and_every_search_is_counted(server):
    url, *_ = server
    before = httpx.get(url + "/v1/stats").json()["served"]["queries"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-m", "deepr", "search", q, "--corpus", url, "--json", "-k", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for q in QUERIES[:2]]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert [len(json.loads(o[0])) for o in outs] == [2, 2]
    assert httpx.get(url + "/v1/stats").json()["served"]["queries"] - before == 2


def test_unreachable_server_is_a_one_line_error(tmp_path):
    port = free_port()  # nothing listens there
    r = subprocess.run([sys.executable, "-m", "deepr", "search", "x", "--corpus", f"http://127.0.0.1:{port}"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "serve-index" in r.stderr


def test_server_logs_its_request_summary_on_exit(server):
    """Last in this module: stop the server with Ctrl-C and read its summary line."""
    url, log, proc = server
    httpx.post(url + "/retrieve", json={"queries": ["abacus"], "topk": 1})
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    text = log.read_text()
    line = next((ln for ln in text.splitlines() if ln.startswith("served ")), None)
    assert line is not None, text
    assert "latency ms p50" in line and '"/retrieve"' in line and "Traceback" not in text


def test_serving_bench_quick(retriever, mini_corpus, tmp_path):
    """bench/serve_index.py end to end on the mini corpus: its targets are computed from its own runs."""
    out = tmp_path / "serve_index.json"
    r = subprocess.run([sys.executable, "bench/serve_index.py", "--corpus", str(mini_corpus), "--clients", "2",
                        "--per-client", "5", "--cache-dir", str(retriever.path.parents[1]), "--work",
                        str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["server"]["requests"] == 10 and res["server"]["errors"] == 0
    assert res["recall@10"]["server_hybrid"] == res["recall@10"]["local_hybrid"] > 0
    assert abs(res["recall@10"]["milvus_lite_hybrid"] - res["recall@10"]["local_hybrid"]) <= 0.1
    assert res["server_log_summary"].startswith("served ")


def test_grpo_stops_when_the_server_goes_away_with_one_line_and_the_readme_s_status(retriever, tiny, tmp_path):
    """A GRPO planner run whose retrieval server dies at its first rollout search: one error line
    naming the server, no traceback, exit 4 (the README's 'a served corpus stopped answering before
    anything was finished'); nothing half-written is left as a finished model."""
    from deepr.corpus.server import make_app
    from deepr.records import QRPair, RubricItem

    rub = RubricItem(id="R1", type="factual", description="Plate boundaries cause earthquakes", weight=1.0,
                     source_leaf_ids=["L1"], evidence=["Most earthquakes occur at plate boundaries."])
    pairs, config = tmp_path / "verified.jsonl", tmp_path / "grpo.json"
    pairs.write_text("".join(QRPair(id=f"p{i}", tree_id="t", question=q, selected_leaf_ids=[], rubrics=[rub],
                                    decision="KEEP").model_dump_json() + "\n" for i, q in enumerate(QUERIES[:2])))
    config.write_text(json.dumps({"lora_r": 4, "lora_alpha": 8, "zero_advantage": "off", "save_steps": 100,
                                  "mini_batch_prompts": 2, "max_completion_length": 400, "rollout_formats": "schema"}))
    port = free_port()
    lost, box = going_away(make_app(retriever), when=lambda: True)
    out = tmp_path / "grpo"
    with served_in_thread(lost, port) as srv:
        box["server"] = srv
        r = CliRunner().invoke(app, ["grpo", "--stage", "planner", "--model", str(tiny), "--data", str(pairs),
                                     "--out", str(out), "--config", str(config), "--max-steps", "2",
                                     "--num-generations", "2", "--prompts-per-step", "2", "--k", "2",
                                     "--corpus", f"http://127.0.0.1:{port}"])
    errors = r.output.split("error: ")[1:]  # the line may follow a progress bar's carriage return
    assert r.exit_code == 4, r.output[-3000:]
    assert len(errors) == 1 and f"retrieval server http://127.0.0.1:{port}: /v1/search failed" in errors[0]
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)
    assert not (out / "adapter_config.json").exists()  # no adapter is passed off as a finished run
