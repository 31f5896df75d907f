"""Milvus Lite round trip: `deepr index --to milvus:PATH.db` (idempotent, sharded, edits), searching
it with `--corpus milvus:...`, and an offline `deepr run` whose citations resolve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.cli import app

pytest.importorskip("pymilvus")
pytest.importorskip("milvus_lite")

QUERIES = ["Who was Adam Smith?", "How does an abacus work?", "Aircraft carrier history", "Acid rain causes",
           "Abraham Lincoln presidency", "Aboriginal Australians history"]


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def loaded(retriever, mini_corpus, tmp_path_factory) -> str:
    """The mini corpus loaded into a Milvus Lite file (vectors from the session index's embedding cache)."""
    spec = f"milvus:{tmp_path_factory.mktemp('milvus') / 'mini.db'}"
    r = cli("index", "--corpus", str(mini_corpus), "--to", spec, "--cache-dir", str(retriever.path.parents[1]))
    assert r.exit_code == 0, r.output
    return spec


def test_load_is_idempotent(loaded, retriever, mini_corpus):
    from deepr.corpus.milvus import load_to_milvus

    again = load_to_milvus(str(mini_corpus), loaded, embedder=retriever.embedder, cache_dir=retriever.path.parents[1])
    assert again["passages"] == len(retriever.passages) and again["passages_written"] == 0
    assert again["documents_written"] == 0 and again["stale_deleted"] == 0


def test_search_matches_the_local_index(loaded, retriever):
    from deepr.corpus import open_retriever

    m = open_retriever(loaded, embedder=retriever.embedder)
    info = m.describe()
    assert info["passages"] == len(retriever.passages) and info["documents"] == len(retriever.documents)
    # dense: the same vectors under an exact inner-product index, so the same ranking
    got, want = m.search_many(QUERIES, k=5, mode="dense"), retriever.search_many(QUERIES, k=5, mode="dense")
    assert [[h.id for h in hs] for hs in got] == [[h.id for h in hs] for hs in want]
    # BM25 and hybrid: Milvus's own tokens, so close rather than equal; the top hit of a named subject agrees
    for mode in ("bm25", "hybrid"):
        got, want = m.search_many(QUERIES, k=5, mode=mode), retriever.search_many(QUERIES, k=5, mode=mode)
        overlap = sum(len({h.id for h in a} & {h.id for h in b}) for a, b in zip(got, want)) / (5 * len(QUERIES))
        assert overlap >= 0.7, (mode, overlap)
        assert [hs[0].doc_id for hs in got] == [hs[0].doc_id for hs in want]
    assert m.search("the of and", k=3, mode="bm25") == []  # stop words alone match nothing, as locally
    doc = retriever.documents[7]
    assert m.get_document(doc.id) == doc and m.get_passage(retriever.passages[2].id) == retriever.passages[2]
    quoted = next(d for d in retriever.documents if "'" in d.id)  # ids with quotes survive Milvus filters
    assert m.get_document(quoted.id) == quoted


def test_sharded_load_equals_a_whole_load(loaded, retriever, mini_corpus, tmp_path):
    from deepr.corpus import open_retriever

    spec = f"milvus:{tmp_path / 'sharded.db'}#parts"
    for k in (1, 2, 3):
        r = cli("index", "--corpus", str(mini_corpus), "--to", spec, "--shard", f"{k}/3",
                "--cache-dir", str(retriever.path.parents[1]))
        assert r.exit_code == 0, r.output
    sharded, whole = open_retriever(spec, embedder=retriever.embedder), open_retriever(loaded, embedder=retriever.embedder)
    assert sharded.describe()["passages"] == whole.describe()["passages"]
    assert sharded.describe()["documents"] == whole.describe()["documents"]
    ids = lambda r, mode: [[h.id for h in hs] for hs in r.search_many(QUERIES, k=5, mode=mode)]  # noqa: E731
    assert ids(sharded, "dense") == ids(whole, "dense")
    # Milvus Lite keeps BM25 statistics per segment, and each shard's load is its own segment: the
    # scores move a little, the best passage of a named subject does not
    for mode in ("bm25", "hybrid"):
        assert [r[0] for r in ids(sharded, mode)] == [r[0] for r in ids(whole, mode)]


def test_an_ivf_collection_probes_every_list_of_a_small_corpus(loaded, retriever, mini_corpus, tmp_path):
    """--dense ivf: Milvus IVF_FLAT with deepr's list count; 32 probes cover a small corpus's
    lists, so the ranking is the exact one."""
    from deepr.corpus import open_retriever

    spec = f"milvus:{tmp_path / 'ivf.db'}"
    r = cli("index", "--corpus", str(mini_corpus), "--to", spec, "--dense", "ivf",
            "--cache-dir", str(retriever.path.parents[1]))
    assert r.exit_code == 0, r.output
    ivf = open_retriever(spec, embedder=retriever.embedder)
    assert ivf.describe()["dense_index"]["kind"] == "milvus IVF_FLAT/IP"
    exact = open_retriever(loaded, embedder=retriever.embedder)
    assert ([[h.id for h in hs] for hs in ivf.search_many(QUERIES, k=5, mode="dense")]
            == [[h.id for h in hs] for hs in exact.search_many(QUERIES, k=5, mode="dense")])


def test_an_edited_corpus_rewrites_only_what_changed(retriever, mini_corpus, tmp_path):
    from deepr.corpus import open_retriever
    from deepr.corpus.milvus import load_to_milvus

    rows = [json.loads(line) for line in mini_corpus.read_text(encoding="utf-8").splitlines()]
    path = tmp_path / "edit.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    spec = f"milvus:{tmp_path / 'edit.db'}"
    first = load_to_milvus(str(path), spec, embedder=retriever.embedder, cache_dir=retriever.path.parents[1])
    rows[0]["text"] = "Zanzibarian quokkas juggle tangerines. " + rows[0]["text"]
    removed = rows.pop(1)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    second = load_to_milvus(str(path), spec, embedder=retriever.embedder, cache_dir=retriever.path.parents[1])
    assert second["stale_deleted"] >= 1 and 1 <= second["passages_written"] <= 3
    assert second["passages"] < first["passages"]
    m = open_retriever(spec, embedder=retriever.embedder)
    assert m.search("quokkas juggle tangerines", k=1, mode="bm25")[0].doc_id == rows[0]["id"]
    assert all(h.doc_id != removed["id"] for h in m.search(removed["title"], k=10))


def test_a_document_too_long_for_milvus_is_refused_before_any_write(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"id": "big", "title": "Big", "text": "word " * 20000}) + "\n", encoding="utf-8")
    spec = f"milvus:{tmp_path / 'long.db'}"
    r = cli("index", "--corpus", str(path), "--to", spec)
    assert r.exit_code == 2 and "document 'big' is longer than Milvus's 65535-byte text field" in r.output
    assert not (tmp_path / "long.db").exists()


def test_bad_specs_are_one_line_errors(tmp_path):
    r = cli("search", "x", "--corpus", f"milvus:{tmp_path / 'none.db'}")
    assert r.exit_code == 2 and "no collection 'deepr'" in r.output and "deepr index" in r.output
    r = cli("search", "x", "--corpus", "milvus:corpus.sqlite")
    assert r.exit_code == 2 and ".db" in r.output
    r = cli("index", "--corpus", "wiki", "--to", "milvus://host-only")
    assert r.exit_code == 2 and "milvus://HOST:PORT/COLLECTION" in r.output


def test_offline_run_on_milvus_cites_corpus_passages(loaded, retriever, tmp_path):
    out = tmp_path / "r" / "report.md"
    r = cli("run", "How did ancient Greek architecture influence later buildings?", "--out", str(out),
            "--corpus", loaded)
    assert r.exit_code == 0, r.output
    side = json.loads((tmp_path / "r" / "report.json").read_text(encoding="utf-8"))
    assert side["citations"]
    for cite in side["citations"].values():
        assert retriever.get_passage(cite["passage_id"]).text == cite["text"]
        assert cite["doc_id"] == retriever.get_passage(cite["passage_id"]).doc_id


def test_serve_index_in_front_of_milvus(retriever, mini_corpus, tmp_path):
    """The third shape: `deepr serve-index --corpus milvus:...` answers Search-R1's /retrieve with the
    passages Milvus ranks. Milvus Lite lets one process open a file: a second one gets a one-line
    error pointing at the server, and this test opens the file itself only after the server stops."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    spec = f"milvus:{tmp_path / 'served.db'}"
    subprocess.run([sys.executable, "-m", "deepr", "index", "--corpus", str(mini_corpus), "--to", spec,
                    "--cache-dir", str(retriever.path.parents[1])], check=True, capture_output=True, env=env)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "deepr", "serve-index", "--corpus", spec, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                httpx.get(url + "/health", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert proc.poll() is None, proc.stdout.read()
        body = httpx.post(url + "/retrieve", json={"queries": QUERIES, "topk": 3, "return_scores": True},
                          timeout=60).json()
        second = subprocess.run([sys.executable, "-m", "deepr", "search", "x", "--corpus", spec],
                                capture_output=True, text=True, env=env, timeout=120)
        assert second.returncode == 2 and "open in another process" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    from deepr.corpus import open_retriever

    direct = open_retriever(spec, embedder=retriever.embedder)
    assert ([[r["document"]["id"] for r in q] for q in body["result"]]
            == [[h.id for h in hs] for hs in direct.search_many(QUERIES, k=3)])
