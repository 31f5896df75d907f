"""`--search` end to end on loopback: dag and warp reports from a fake SearXNG and website,
replay without network, API keys never written anywhere, prompt injection inert, MCP over stdio."""

from __future__ import annotations

import json
import re
import socket
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import search_fakes as F
from deepr.agent import cited_ids
from deepr.cli import app

SENTINEL = "sk-SENTINEL-7f3a9c-DO-NOT-LEAK"


@pytest.fixture(scope="module")
def web():
    with F.fake_web() as w:
        yield w


def run(args: list[str], env: dict | None = None):
    return CliRunner().invoke(app, ["run", *args], env=env)


def references(md: str) -> list[str]:
    return re.findall(r"<(https?://[^>]+)>", md.split("## References", 1)[1])


@pytest.mark.parametrize("mode", ["dag", "warp", "decor", "tools"])
def test_web_report_cites_fetched_pages_and_replays_offline(web, tmp_path, mode: str) -> None:
    cache = tmp_path / "cache"
    base = ["How do volcanoes and glaciers shape the land?", "--mode", mode, "--search",
            f"searxng:{web['prov'].url}/searxng", "--allow-host", f"127.0.0.1:{web['site'].port}",
            "--cache-dir", str(cache), "--html"]
    before = len(web["site"].requests)
    r = run([*base, "--out", str(tmp_path / "a" / "report.md")])
    assert r.exit_code == 0, r.output
    md = (tmp_path / "a" / "report.md").read_text(encoding="utf-8")
    side = json.loads((tmp_path / "a" / "report.json").read_text(encoding="utf-8"))
    served = {web["site"].url + q["path"] for q in web["site"].requests[before:]}
    refs = references(md)
    assert refs and all(u.startswith(web["site"].url + "/page/") for u in refs)
    assert set(refs) <= served, "every referenced URL was fetched by this run"
    assert re.search(r"accessed \d{4}-\d\d-\d\d", md)
    assert side["search"]["searches"] > 0 and side["search"]["fetches"] > 0
    meta = json.loads((tmp_path / "a" / "report.md.meta.json").read_text(encoding="utf-8"))
    assert meta["config"]["search"]["counts"]["searches"] == side["search"]["searches"]
    # prompt injection on a page changes nothing code owns
    assert "[S99]" not in md and set(cited_ids(md)) <= set(side["citations"])
    html = (tmp_path / "a" / "report.html").read_text(encoding="utf-8")
    assert "<script>" not in html and f'href="{refs[0]}"' in html
    # replay: zero requests anywhere, identical report
    n_site, n_prov = len(web["site"].requests), len(web["prov"].requests)
    r2 = run([*base, "--out", str(tmp_path / "b" / "report.md"), "--search-cache", "replay"])
    assert r2.exit_code == 0, r2.output
    assert (len(web["site"].requests), len(web["prov"].requests)) == (n_site, n_prov)
    assert (tmp_path / "b" / "report.md").read_text(encoding="utf-8") == md
    side2 = json.loads((tmp_path / "b" / "report.json").read_text(encoding="utf-8"))
    assert side2["search"]["network_requests"] == 0 and side2["search"]["cache_hits"] > 0


def test_replay_miss_fails_clearly(tmp_path) -> None:
    r = run(["never asked", "--out", str(tmp_path / "r.md"), "--search", "searxng:http://127.0.0.1:9/x",
             "--search-cache", "replay", "--cache-dir", str(tmp_path)])
    assert r.exit_code == 2 and "replay" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("query", ["BREAK-html volcano", "BREAK-truncated volcano", "BREAK-missing volcano"])
def test_all_searches_failing_exits_nonzero(web, tmp_path, query: str) -> None:
    r = run([query, "--out", str(tmp_path / "r.md"), "--search", "serper", "--cache-dir", str(tmp_path)],
            env={"SERPER_API_KEY": SENTINEL, "DEEPR_SERPER_URL": f"{web['prov'].url}/serper"})
    # The broken queries' searches fail; the planner's fallback searches may reach the provider but
    # their pages are not allowed here: either way nothing readable came back (exit 4, no report).
    assert r.exit_code == 4, r.output
    assert "every web search failed" in r.output or "no search returned a readable page" in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert not (tmp_path / "r.md").exists()


def test_keys_never_reach_trace_cache_sidecar_or_log(web, tmp_path) -> None:
    env = {f"{p.upper()}_API_KEY": SENTINEL for p in ("serper", "tavily", "brave", "jina")}
    env.update({f"DEEPR_{p.upper()}_URL": f"{web['prov'].url}/{p}" for p in ("serper", "tavily", "brave", "jina")})
    start = len(web["prov"].requests)
    out = tmp_path / "out" / "report.md"
    r = run(["Why are coral reefs bleaching?", "--out", str(out), "--search", "serper+tavily+brave+jina",
             "--allow-host", f"127.0.0.1:{web['site'].port}", "--cache-dir", str(tmp_path / "cache"),
             "--html", "--record", str(tmp_path / "traj.jsonl")], env=env)
    assert r.exit_code == 0, r.output
    sent = web["prov"].requests[start:]
    got = {q["path"].split("?")[0].split("/")[1]: q["headers"] for q in sent}
    assert got["serper"]["X-API-KEY"] == SENTINEL and got["brave"]["X-Subscription-Token"] == SENTINEL
    assert got["tavily"]["Authorization"] == got["jina"]["Authorization"] == f"Bearer {SENTINEL}"
    assert all(SENTINEL not in q["path"] for q in sent)  # never in a URL
    assert SENTINEL not in r.output
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 5
    for p in files:
        assert SENTINEL not in p.read_text(encoding="utf-8", errors="replace"), p
    side = json.loads((out.parent / "report.json").read_text(encoding="utf-8"))
    assert {h for h in side["search"]["search"].split("+")} == {"serper", "tavily", "brave", "jina"}
    assert side["search"]["cost_usd"] > 0


def test_mcp_server_over_stdio(tmp_path) -> None:
    corpus = tmp_path / "docs.jsonl"
    rows = [{"id": "d1", "title": "Volcanoes", "text": "A volcano vents lava and ash from a magma chamber."},
            {"id": "d2", "title": "Glaciers", "text": "Glaciers are rivers of ice that carve valleys."}]
    corpus.write_text("\n".join(json.dumps(x) for x in rows), encoding="utf-8")
    server = Path(__file__).with_name("mcp_search_server.py")
    spec = f"mcp:{sys.executable} {server} {corpus}"
    r = CliRunner().invoke(app, ["search", "glaciers carve valleys", "--search", spec, "--json",
                                 "--cache-dir", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    hits = json.loads(r.stdout[r.stdout.index("["):])
    assert hits[0]["title"] == "Glaciers" and hits[0]["provider"] == "mcp" and hits[0]["doc_id"] == "mcp:d2"


def test_grpo_planner_rollouts_use_web_tools_and_replay(web, tmp_path) -> None:
    from deepr.search import SearchConfig
    from deepr.search.source import SourceRetriever
    from deepr.train.environments import PlannerEnvironment

    turn1 = json.dumps({"nodes": [
        {"id": "N1", "type": "search", "query": "volcano eruptions and lava", "key_points": ["eruptions"]},
        {"id": "N2", "type": "search", "query": "glacier ice movement", "key_points": ["ice"]},
        {"id": "N3", "type": "aggregate", "need": "how land is shaped", "key_points": ["shape"], "inputs": ["N1", "N2"]},
        {"id": "N4", "type": "answer", "need": "How do volcanoes and glaciers shape land?", "inputs": ["N3"]}]})

    def env(mode: str) -> PlannerEnvironment:
        cfg = SearchConfig(spec=f"searxng:{web['prov'].url}/searxng", cache=mode, cache_dir=tmp_path,
                           allow_hosts=[f"127.0.0.1:{web['site'].port}"])
        return PlannerEnvironment(SourceRetriever(cfg), k=3)

    first = env("use")
    msgs, stats = first.next_messages("How do volcanoes and glaciers shape land?", turn1)
    msg = msgs[-1]["content"]
    first.retriever.close()
    assert (stats["valid0"], stats["searches"]) == (1.0, 2.0)
    assert "[N1-R1] Volcanoes (web page text, untrusted): <<<" in msg and "[N2-R1] Glaciers" in msg
    assert "magma chamber" in msg and "moraines" in msg  # passages of the fetched pages
    n = (len(web["site"].requests), len(web["prov"].requests))
    again = env("replay")
    msgs2, _ = again.next_messages("How do volcanoes and glaciers shape land?", turn1)
    msg2 = msgs2[-1]["content"]
    again.retriever.close()
    assert msg2 == msg and (len(web["site"].requests), len(web["prov"].requests)) == n


def test_build_trees_grows_from_web_results(web, tmp_path) -> None:
    topics = tmp_path / "topics.txt"
    topics.write_text("Volcano\nGlacier\n", encoding="utf-8")
    out = tmp_path / "trees.jsonl"
    n = len(web["prov"].requests)
    r = CliRunner().invoke(app, ["build-trees", "--topics", str(topics), "--out", str(out), "--max-depth", "1",
                                 "--search", f"searxng:{web['prov'].url}/searxng", "--cache-dir", str(tmp_path),
                                 "--allow-host", f"127.0.0.1:{web['site'].port}"])
    # The fake site is too small for a full tree, so the trees are rejected (exit 4, nothing built);
    # what this checks is that tree building searched the web and counted it.
    assert r.exit_code == 4, r.output
    asked = [q["path"] for q in web["prov"].requests[n:]]
    assert any("Volcano" in q for q in asked) and any("Glacier" in q for q in asked)
    meta = json.loads((tmp_path / "trees.jsonl.meta.json").read_text(encoding="utf-8"))
    assert meta["search"]["searches"] >= 2 and meta["search"]["fetches"] >= 2


def test_mcp_server_over_streamable_http(tmp_path) -> None:
    import subprocess
    import time

    from deepr.search import SearchConfig
    from deepr.search.source import SourceRetriever

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text(json.dumps({"id": "d2", "title": "Glaciers", "text": "Glaciers carve valleys in rock.",
                                  "url": "http://127.0.0.1:9/glaciers"}) + "\n", encoding="utf-8")
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    server = Path(__file__).with_name("mcp_search_server.py")
    proc = subprocess.Popen([sys.executable, str(server), str(corpus), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        src = SourceRetriever(SearchConfig(spec=f"mcp:http://127.0.0.1:{port}/mcp", cache_dir=tmp_path,
                                           verify_pages=False), embedder=object())
        try:
            hits = src.search("glaciers carve valleys", 3)
        finally:
            src.close()
        assert [(h.title, h.url, h.provider) for h in hits] == [("Glaciers", "http://127.0.0.1:9/glaciers", "mcp")]
    finally:
        proc.terminate()
        proc.wait(10)


def test_fetch_limits_from_environment_and_no_readable_page_fails(web, tmp_path) -> None:
    r = run(["How do volcanoes shape the land?", "--out", str(tmp_path / "r.md"), "--search",
             f"searxng:{web['prov'].url}/searxng", "--allow-host", f"127.0.0.1:{web['site'].port}",
             "--cache-dir", str(tmp_path)], env={"DEEPR_FETCH_TYPES": "application/pdf"})
    assert r.exit_code == 4 and "no search returned a readable page" in r.output, r.output
    assert "content type 'text/html'" in r.output and not (tmp_path / "r.md").exists()
    bad = run(["q", "--out", str(tmp_path / "r.md"), "--search", "searxng:http://127.0.0.1:9/x"],
              env={"DEEPR_FETCH_TIMEOUT": "-1"})
    assert bad.exit_code == 2 and "DEEPR_FETCH_TIMEOUT" in bad.output


def test_page_markup_never_reaches_the_html_report_unescaped(web, tmp_path) -> None:
    q = "How do volcanoes erupt lava?"
    evil = {"results": [{"url": f"{web['site'].url}/page/volcano", "title": '<img src=x onerror="alert(1)">Lava',
                         "content": "<script>alert(2)</script> [S99] volcano"},
                        {"url": f"{web['site'].url}/page/inject", "title": "<b>Safety</b>", "content": "x"}]}
    prov = F.providers(web["site"].url, fixtures={q: evil})
    try:
        r = run([q, "--out", str(tmp_path / "r.md"), "--search", f"searxng:{prov.url}/searxng", "--html",
                 "--allow-host", f"127.0.0.1:{web['site'].port}", "--cache-dir", str(tmp_path)])
    finally:
        prov.close()
    assert r.exit_code == 0, r.output
    html = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "<img" not in html and "<script>" not in html and "<b>Safety" not in html
    assert "&lt;img" in html or "&lt;b&gt;" in html  # the titles are shown, escaped
    md = (tmp_path / "r.md").read_text(encoding="utf-8")
    side = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert "[S99]" not in md and set(cited_ids(md)) <= set(side["citations"])  # page text stays inert
