"""FACT as DeepResearch Bench runs it: DRB articles with [n] markers and a numbered URL list,
pages read through the search layer (loopback only), replay, and the DRB export."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from typer.testing import CliRunner

import search_fakes as F
from deepr.cli import app
from deepr.rewards.fact import fact_check_web
from deepr.rewards.judges import Judge
from deepr.search import SearchConfig, open_reader
from deepr.search.drb import cited_statements, group_statements, parse_references, to_submission


def test_markers_belong_to_the_sentence_before_them() -> None:
    body = ("Lava is hot and flows downhill. [1] Ice is cold and very hard.[2] Glaciers move very slowly "
            "[2][3].\n\nCoral reefs bleach in warm water.\n\n[4]\n\nNo citation in this sentence at all.")
    assert cited_statements(body) == [("Lava is hot and flows downhill.", [1]),
                                      ("Ice is cold and very hard.", [2]),
                                      ("Glaciers move very slowly.", [2, 3]),
                                      ("Coral reefs bleach in warm water.", [4])]
    assert cited_statements("Ranges are expanded here today [1-3] and lists too [5, 6].") == [
        ("Ranges are expanded here today and lists too.", [1, 2, 3, 5, 6])]


@pytest.mark.parametrize("heading", ["## References", "## 参考文献", "**Quellen**", "### Fuentes", "Источники:"])
def test_reference_lists_in_any_language_are_never_statements(heading: str) -> None:
    art = (f"# Report\n\nVolcanoes erupt lava from magma chambers [1].\n\n{heading}\n\n"
           "[1] Volcano page https://a.example/v\n2. Glacier page. https://b.example/g\n- [3]: <https://c.example/x>\n")
    refs, body = parse_references(art)
    assert {n: r["url"] for n, r in refs.items()} == {1: "https://a.example/v", 2: "https://b.example/g",
                                                      3: "https://c.example/x"}
    assert heading not in body and "https://" not in body
    assert [s for s, _ in cited_statements(body)] == ["Volcanoes erupt lava from magma chambers."]


def test_same_url_statements_deduplicated_by_meaning(embedder) -> None:
    refs = {1: {"url": "https://a.example/v", "title": ""}, 2: {"url": "https://b.example/g", "title": ""}}
    pairs = [("Mount Etna is one of the most active volcanoes in the world.", [1]),
             ("Mount Etna is one of the world's most active volcanoes.", [1]),
             ("Mount Etna is one of the most active volcanoes in the world.", [2]),
             ("Glaciers store two thirds of fresh water.", [1]), ("Orphan claim with a missing entry.", [9])]
    groups, missing = group_statements(pairs, refs, embed=embedder.encode)
    assert len(groups["https://a.example/v"]) == 2 and len(groups["https://b.example/g"]) == 1
    assert missing == [9]


@pytest.fixture(scope="module")
def web():
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(4)
    site = F.site(trap.getsockname()[1])
    yield site
    site.close()
    trap.close()


def _article(site: str) -> str:
    return (f"# Volcano report\n\nMount Etna in Sicily is one of the most active volcanoes in the world. [1] "
            f"Volcanoes are common where tectonic plates diverge or converge [1].\n\n"
            f"Glaciers carve valleys and deposit moraines.[2] The moon is made of green cheese [1].\n\n"
            f"Coral reefs are built by polyps [3].\n\n## 参考资料\n\n[1] Volcanoes {site}/page/volcano\n"
            f"[2] Glaciers {site}/page/glacier\n[3] Gone {site}/missing-page\n")


def test_fact_on_urls_unfetchable_page_only_its_group_unknown(web, embedder, tmp_path) -> None:
    pages = open_reader(SearchConfig(allow_hosts=[f"127.0.0.1:{web.port}"], cache_dir=tmp_path, timeout=3))
    try:
        r = asyncio.run(fact_check_web(_article(web.url), Judge(None, embedder.encode), pages))
    finally:
        pages.close()
    by = {(p.source.rsplit("/", 1)[-1], p.statement[:20]): p.verdict for p in r.pairs}
    assert by[("volcano", "Mount Etna in Sicily")] == "supported"
    assert by[("glacier", "Glaciers carve valle")] == "supported"
    assert by[("volcano", "The moon is made of ")] == "unsupported"
    assert by[("missing-page", "Coral reefs are buil")] == "unknown"
    assert r.unknown == 1 and list(r.unfetched) == [f"{web.url}/missing-page"] and "404" in r.unfetched[f"{web.url}/missing-page"]
    assert r.accuracy == pytest.approx(r.supported / (r.supported + r.unsupported))


def test_eval_fact_cli_on_drb_submission_then_replay(web, tmp_path) -> None:
    sub = tmp_path / "sub.jsonl"
    sub.write_text(json.dumps({"id": 7, "prompt": "Tell me about volcanoes", "article": _article(web.url)}) + "\n",
                   encoding="utf-8")
    args = ["eval", str(sub), "--metric", "fact", "--allow-host", f"127.0.0.1:{web.port}"]
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a.jsonl")])
    assert r.exit_code == 0, r.output
    row = json.loads((tmp_path / "a.jsonl").read_text().splitlines()[0])
    assert row["id"] == "7" and row["fact_supported"] >= 2 and row["fact_unknown"] == 1
    n = len(web.requests)
    r2 = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b.jsonl"), "--search-cache", "replay"])
    assert r2.exit_code == 0, r2.output
    row2 = json.loads((tmp_path / "b.jsonl").read_text().splitlines()[0])
    assert len(web.requests) == n  # replay fetched nothing
    assert {k: row2[k] for k in ("fact_supported", "fact_unsupported", "fact_unknown")} == \
        {k: row[k] for k in ("fact_supported", "fact_unsupported", "fact_unknown")}


def test_drb_export_keeps_integer_ids_and_numbers_urls() -> None:
    cites = {"N1-R1": {"doc_id": "https://a.example/v", "title": "Volcanoes", "url": "https://a.example/v"},
             "N1-F1": {"doc_id": "https://a.example/v", "title": "Volcanoes", "url": "https://a.example/v"},
             "N2-R1": {"doc_id": "https://b.example/g", "title": "Glaciers", "url": "https://b.example/g"}}
    report = "# Q\n\nLava flows [N1-R1]. Etna erupts [N1-F1, N2-R1].\n\n## References\n\n- [N1-R1] ...\n"
    [row] = to_submission([{"id": "12", "query": "Q?", "report": report, "citations": cites}])
    assert row["id"] == 12 and row["prompt"] == "Q?"
    assert "Lava flows [1]. Etna erupts [1][2]." in row["article"]
    refs, _ = parse_references(row["article"])
    assert {n: r["url"] for n, r in refs.items()} == {1: "https://a.example/v", 2: "https://b.example/g"}
    assert to_submission([{"id": "q-1", "report": "", "citations": {}}])[0]["id"] == "q-1"
