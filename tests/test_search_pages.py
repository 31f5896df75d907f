"""Issue 19 remainder: browsed pages give one citable id per passage, fetch limits are flags,
build-trees reads whole pages. Everything runs against the loopback fake web."""

from __future__ import annotations

import json
import re

import pytest
import typer
from typer.testing import CliRunner

import search_fakes as F
from deepr.evidence.citations import cited_ids
from deepr.cli import app


@pytest.fixture(scope="module")
def web():
    with F.fake_web() as w:
        yield w


ATLAS_Q = "earth atlas landforms"


@pytest.fixture()
def atlas_ctx(web, tmp_path, embedder):
    """A Ctx whose only search result is the long atlas page of the fake site."""
    from deepr.evidence.env import Ctx, RunConfig
    from deepr.evidence.trace import Tracer
    from deepr.corpus.tools import ResearchTools
    from deepr.search import SearchConfig
    from deepr.search.source import SourceRetriever

    url = f"{web['site'].url}/page/atlas"
    prov = F.providers(web["site"].url, fixtures={ATLAS_Q: {"results": [
        {"url": url, "title": "Earth atlas", "content": "An atlas of landforms."}]}})
    src = SourceRetriever(SearchConfig(spec=f"searxng:{prov.url}/searxng", cache_dir=tmp_path,
                                       allow_hosts=[f"127.0.0.1:{web['site'].port}"]), embedder=embedder)
    ctx = Ctx(llm=None, tools=ResearchTools(src, k=3), config=RunConfig(), tracer=Tracer("q", "dag"))
    try:
        yield ctx, url
    finally:
        src.close()
        prov.close()


def test_browsed_page_gives_each_passage_its_own_id(atlas_ctx) -> None:
    from deepr.agent.render import ReportDoc, Section, markdown_html, render_markdown

    ctx, url = atlas_ctx
    [rid] = ctx.search("N1", ATLAS_Q)
    caves = ctx.fetch_all(rid, need="limestone caves stalactites stalagmites")
    reefs = ctx.fetch_all(rid, node="N2", need="coral reef bleaching heat waves")
    assert len(caves) == 4 and len(set(caves)) == 4  # RunConfig passages default: 4 of the 5 chunks
    entries = [ctx.catalog[c] for c in caves]
    assert all(e.kind == "fetch" and e.doc_id == url and e.url == url and e.accessed for e in entries)
    assert len({e.passage_id for e in entries}) == 4 and all(e.passage_id.startswith(url + "#") for e in entries)
    # ranked against the need: the best passage of each reading is the matching section
    assert "Stalactites" in entries[0].text and "bleaching" in ctx.catalog[reefs[0]].text
    assert "bleaching" not in entries[0].text
    # every passage id is a valid citation; the trace records which passages each id is
    for cid in caves + reefs:
        assert ctx.catalog.check(f"A claim [{cid}].") == []
    browse = [t for t in ctx.tracer.tools if t["tool"] == "browse"]
    assert [t["ids"] for t in browse] == [caves, reefs]
    assert browse[0]["passages"] == [ctx.catalog[c].passage_id for c in caves]
    # the reference list: one line for the URL with title, URL, access date and every cited id
    doc = ReportDoc("T", [Section("Answer", f"Caves [{caves[0]}]. Reefs [{reefs[0]}]. Atlas [{rid}].")])
    md, citations, _ = render_markdown(doc, ctx.catalog)
    refs = md.split("## References", 1)[1].strip().splitlines()
    assert len(refs) == 1 and f"<{url}>" in refs[0] and "Earth atlas" in refs[0]
    assert re.search(r"accessed \d{4}-\d\d-\d\d", refs[0])
    assert set(cited_ids(refs[0])) == {caves[0], reefs[0], rid} == set(citations)
    html = markdown_html(md, set(citations))
    assert all(f'id="ref-{c}"' in html for c in citations)  # every cited id links to its reference


def test_browse_refuses_pages_no_search_returned(atlas_ctx) -> None:
    ctx, url = atlas_ctx
    assert ctx.fetch_all(url) == [] and ctx.fetch(url) is None
    assert ctx.tracer.tools[-1]["refused"] and len(ctx.catalog) == 0


def test_tools_agent_browse_shows_every_passage(atlas_ctx) -> None:
    from deepr.agent.tools_agent import ToolSession

    ctx, _ = atlas_ctx
    session = ToolSession(ctx)
    session.execute("search", {"query": ATLAS_Q})
    text = session.execute("browse", {"doc_id": "S1-R1", "need": "caves"})
    fetched = [c for c in session.shown if ctx.catalog[c].kind == "fetch"]
    assert len(fetched) == 4 and all(f"[{c}]" in text for c in fetched)


# -- fetch limits as flags ---------------------------------------------------------------

COMMANDS = [["run"], ["build-trees"], ["grpo"], ["grpo", "prepare"], ["search"], ["eval"]]


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_every_searching_command_documents_the_fetch_limit_flags(cmd: list[str]) -> None:
    r = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    for flag in ("--fetch-timeout", "--fetch-max-bytes", "--fetch-types", "--fetch-per-host",
                 "--fetch-concurrency", "--search-rate"):
        assert flag in r.output, (cmd, flag)
    assert "DEEPR_FETCH_TIMEOUT" in r.output


def test_fetch_limit_flags_reach_the_search_config(monkeypatch) -> None:
    from deepr.cli.search_opts import fetch_limit_options, search_config

    monkeypatch.setenv("DEEPR_FETCH_TIMEOUT", "7")
    monkeypatch.setenv("DEEPR_FETCH_PER_HOST", "3")
    seen = {}
    tiny = typer.Typer()

    @tiny.command()
    @fetch_limit_options
    def cmd(timeout: int = typer.Option(1, "--timeout")) -> None:  # a command's own --timeout stays its own
        seen["own"] = timeout
        seen["cfg"] = search_config("corpus", None, "use", None)

    r = CliRunner().invoke(tiny, ["--timeout", "9", "--fetch-per-host", "2", "--fetch-max-bytes", "20000",
                                  "--fetch-types", "text/html, application/pdf", "--search-rate", "5",
                                  "--fetch-concurrency", "3"])
    assert r.exit_code == 0, r.output
    cfg = seen["cfg"]
    assert seen["own"] == 9 and cfg.timeout == 7.0  # no flag: the environment variable is the default
    assert (cfg.per_host, cfg.max_bytes, cfg.rate, cfg.concurrency) == (2, 20000, 5.0, 3)  # flag beats env
    assert cfg.content_types == ("text/html", "application/pdf")
    assert search_config("corpus", None, "use", None).per_host == 3  # after the command: env again


@pytest.mark.parametrize("args,env,needle", [
    (["--fetch-timeout", "-1"], {}, "--fetch-timeout -1.0: Input should be greater than 0"),
    (["--fetch-types", "html"], {}, "--fetch-types html: 'html' is not a content type"),
    (["--fetch-per-host", "0"], {}, "--fetch-per-host 0: Input should be greater than or equal to 1"),
    (["--search-rate", "0"], {}, "--search-rate 0.0: Input should be greater than 0"),
    (["--fetch-max-bytes", "10"], {}, "--fetch-max-bytes 10: Input should be greater than or equal to 1000"),
    ([], {"DEEPR_FETCH_CONCURRENCY": "0"}, "DEEPR_FETCH_CONCURRENCY (default of --fetch-concurrency) 0"),
    ([], {"DEEPR_FETCH_TIMEOUT": "soon"}, "DEEPR_FETCH_TIMEOUT='soon': not a valid value"),
])
def test_bad_fetch_limits_are_one_line_errors(args: list[str], env: dict, needle: str) -> None:
    r = CliRunner().invoke(app, ["search", "anything", "--search", "searxng:http://127.0.0.1:9/x", *args], env=env)
    assert r.exit_code == 2 and needle in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output


def test_fetch_limit_flags_apply_to_page_reads(web, tmp_path) -> None:
    base = ["search", "volcano", "--search", f"searxng:{web['prov'].url}/searxng", "--cache-dir",
            str(tmp_path), "--allow-host", f"127.0.0.1:{web['site'].port}", "--json", "--search-cache", "off"]
    types = CliRunner().invoke(app, [*base, "--fetch-types", "application/pdf"])
    said = " ".join(types.output.split())
    assert types.exit_code == 4 and "content type 'text/html' is not allowed" in said, said
    assert said.count("error:") == 1
    small = CliRunner().invoke(app, [*base, "--fetch-max-bytes", "1000"])
    assert small.exit_code == 4 and "exceeds the 1000-byte cap" in " ".join(small.output.split()), small.output
    # the flag overrides a contrary environment default
    ok = CliRunner().invoke(app, [*base, "--fetch-types", "text/html"], env={"DEEPR_FETCH_TYPES": "application/pdf"})
    assert ok.exit_code == 0, ok.output
    hits = json.loads(ok.stdout)
    assert hits and all(h["url"].startswith(web["site"].url + "/page/") for h in hits)


# -- build-trees reads whole pages ------------------------------------------------------------

def _norm(text: str) -> str:
    return " ".join(text.split())


def test_tree_nodes_rest_on_read_page_passages(web, tmp_path, embedder) -> None:
    from deepr.data.topics import SeedTopic
    from deepr.data.trees import TreeConfig, build_trees
    from deepr.search import SearchConfig
    from deepr.search.passages import page_chunks
    from deepr.search.reading import PageReadingRetriever
    from deepr.search.source import SourceRetriever

    url = f"{web['site'].url}/page/atlas"
    atlas = {"results": [{"url": url, "title": "Earth atlas", "content": "An atlas of landforms."}]}
    needs = ["limestone caves stalactites", "coral reef bleaching"]
    prov = F.providers(web["site"].url, fixtures={q: atlas for q in ["Earth atlas", *needs]})
    src = SourceRetriever(SearchConfig(spec=f"searxng:{prov.url}/searxng", cache_dir=tmp_path,
                                       allow_hosts=[f"127.0.0.1:{web['site'].port}"]), embedder=embedder)
    try:
        [snippet] = src.search("Earth atlas", 3)
        reading = PageReadingRetriever(src)
        [read] = reading.search("Earth atlas", 3)
        [[caves], [reefs]] = reading.search_many(needs, 3)
        [tree] = build_trees([SeedTopic(id="t1", title="Earth atlas")], reading, None,
                             TreeConfig(max_depth=1, min_leaves=1))
        page = src.pages[url]
    finally:
        src.close()
        prov.close()
    chunks = page_chunks(url, page["title"], page["text"])

    def chunk_of(passage_id: str) -> str:
        assert passage_id.startswith(url + "#")
        return _norm(chunks[int(passage_id.rsplit("#", 1)[1])])

    # A read hit is the one passage of the page that best matches its query, under that passage's
    # own id (several passages joined under one id left statements citing the wrong passage).
    assert sum(_norm(c) in _norm(snippet.text) for c in chunks) == 1
    for hit, word in ((read, "atlas"), (caves, "Stalactites"), (reefs, "bleaching")):
        assert _norm(hit.text) == chunk_of(hit.id) and word in hit.text and hit.doc_id == url
    assert caves.id != reefs.id  # the same page answers each need with its own passage
    assert read.snippet == snippet.snippet == "An atlas of landforms."  # the provider's text is kept aside
    root = tree.nodes[0]
    assert root.supporting_docs and all(d.doc_id == url for d in root.supporting_docs)
    for d in root.supporting_docs:  # every statement lies in the fetched passage its id names
        assert d.statements and all(_norm(s) in chunk_of(d.snippet_id) for s in d.statements)
    assert tree.stats.retrieval_calls >= 1 and src.stats["pages_read"] >= 3


def test_build_trees_reads_result_pages_through_the_cache(web, tmp_path) -> None:
    topics = tmp_path / "topics.txt"
    topics.write_text("Volcano\nGlacier\n", encoding="utf-8")

    def build(out: str, *extra: str):
        r = CliRunner().invoke(app, ["build-trees", "--topics", str(topics), "--out", str(tmp_path / out),
                                     "--max-depth", "1", "--search", f"searxng:{web['prov'].url}/searxng",
                                     "--cache-dir", str(tmp_path), "--allow-host", f"127.0.0.1:{web['site'].port}",
                                     *extra])
        assert r.exit_code == 4, r.output  # the fake site is too small for a two-leaf tree
        return json.loads((tmp_path / f"{out}.meta.json").read_text(encoding="utf-8"))["search"]

    first = build("a.jsonl")
    assert first["pages_read"] >= 2 and first["fetches"] >= 2 and first["network_requests"] >= 2
    n = len(web["site"].requests), len(web["prov"].requests)
    again = build("b.jsonl", "--search-cache", "replay")  # the same reads, from the cache only
    assert again["pages_read"] == first["pages_read"] and again["network_requests"] == 0
    assert (len(web["site"].requests), len(web["prov"].requests)) == n
    assert "pages_read" not in build("c.jsonl", "--snippets-only")


@pytest.mark.parametrize("query", ["volcano BREAK-html", "volcano BREAK-500"])
def test_web_run_citing_nothing_fails_instead_of_an_empty_report(web, tmp_path, query: str) -> None:
    # The broken query's own searches fail; the planner's reworded searches find pages the writer
    # cannot use. A report citing nothing must not be written with exit status 0.
    r = CliRunner().invoke(app, ["run", query, "--out", str(tmp_path / "r.md"), "--search", "serper",
                                 "--allow-host", f"127.0.0.1:{web['site'].port}", "--cache-dir", str(tmp_path)],
                           env={"SERPER_API_KEY": "sk-test-key", "DEEPR_SERPER_URL": f"{web['prov'].url}/serper"})
    said = " ".join(r.output.split())
    assert r.exit_code == 4 and "the report cites no source" in said and "serper:" in said, said
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert not (tmp_path / "r.md").exists() and "sk-test-key" not in r.output


def test_only_real_name_lookups_leave_the_event_loop() -> None:
    from deepr.search.guard import needs_resolution, parse_allow

    allow = parse_allow(["intranet.example:8080"])
    assert needs_resolution("https://example.org/a", set())  # a name: resolved on a worker thread
    assert not needs_resolution("http://127.0.0.1:9/x", set())  # literals are checked in place
    assert not needs_resolution("http://[::1]:9/x", set())
    assert not needs_resolution("http://intranet.example:8080/", allow)  # allowed: nothing to resolve
    assert needs_resolution("http://intranet.example:9090/", allow)
    assert not needs_resolution("file:///etc/passwd", set())  # refused at once by check_url
