"""Web pages never break deepr (issue 39, items 12-14, 17, 18): extraction is serialised, blocks
join without cutting sentences or stamping code, titles are decoded once and escaped once, the
CLI counts every fetched page, and a web --search that cannot work fails before any work."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from typer.testing import CliRunner

import search_fakes as F
from deepr.cli import app


def _text(body: str, title: str = "T") -> tuple[str, str]:
    from deepr.search.reader import extract

    html = f"<html><head><title>{title}</title></head><body><nav>Home | About</nav><article>{body}</article></body></html>"
    return extract(html.encode(), "text/html; charset=utf-8")


FILLER = "<p>Lava flows cool slowly and form new rock on the slopes of the mountain every year.</p>"


def test_a_sentence_cut_by_markup_stays_one_sentence() -> None:
    from deepr.text import split_sentences

    _, text = _text(FILLER + "<p>Version 1.0 came out<br>in March 2008.</p>"
                    "<p>The release was called</p><p>the lava build, after the mountain.</p>" + FILLER)
    assert "Version 1.0 came out in March 2008." in text
    assert "The release was called the lava build, after the mountain." in text
    assert "out." not in text and "called." not in text
    sentences = split_sentences(" ".join(text.splitlines()))
    assert "Version 1.0 came out in March 2008." in sentences


def test_source_line_wraps_are_not_sentence_ends() -> None:
    _, text = _text(FILLER + "<p>Perhaps the most well-known statement type is the <code>if</code> statement.  For\n"
                    "example, it tests a condition\nand runs a block.</p>" + FILLER)
    assert "statement. For example, it tests a condition and runs a block." in text


def test_code_lines_get_no_full_stops_and_headings_still_end() -> None:
    _, text = _text("<h2>Loops</h2>" + FILLER + "<p>For example:</p><pre><code>for w in words:\n    print(w, len(w))\n"
                    "x = 1</code></pre>" + FILLER + "<ul><li>It exists, and</li><li>its size is over 512 bytes</li></ul>")
    lines = text.splitlines()
    assert "for w in words:" in lines and "    print(w, len(w))" in lines and "x = 1" in lines
    assert not any(ln.rstrip().endswith(("print(w, len(w)).", "x = 1.", "words:.")) for ln in lines)
    assert "Loops." in lines  # a heading ends its own sentence before the paragraph
    assert "It exists, and" in lines and "its size is over 512 bytes." in lines


def test_page_titles_are_decoded_once() -> None:
    title, _ = _text(FILLER * 2, "Why lava doesn&#x27;t stop &amp; cools &lt;fast&gt; &#8212; notes")
    assert title == "Why lava doesn't stop & cools <fast> — notes"


def test_report_html_escapes_a_decoded_title_once() -> None:
    from deepr.agent.render import markdown_html

    html = markdown_html("- [N1-R1] Why lava doesn't stop & cools <https://a.org/x>", {"N1-R1"})
    assert re.search(r"doesn(?:'|&#x27;)t stop &amp; cools", html)
    assert "&amp;#x27;" not in html and "&amp;amp;" not in html


def test_extractions_never_overlap_under_concurrent_reads(monkeypatch) -> None:
    """libxml2/trafilatura crash natively when several threads extract at once: deepr's reads,
    however concurrent, must enter trafilatura one at a time."""
    import trafilatura

    real, inside, most = trafilatura.extract, [0], [0]
    lock = threading.Lock()

    def counting(*a, **kw):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.02)  # hold the extraction long enough for others to arrive
            return real(*a, **kw)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(trafilatura, "extract", counting)
    pages = {f"p{i}": (f"Page {i}", [f"Lava field number {i} cooled over many long years into black rock."] * 3)
             for i in range(12)}
    site = F.pages_site(pages)
    from page_set import reader

    try:
        src = reader(site.port, None)
        try:
            recs = src.fetch_many([f"{site.url}/wiki/p{i}" for i in range(12)])
        finally:
            src.close()
    finally:
        site.close()
    assert all(r["ok"] for r in recs) and most[0] == 1, most


@pytest.fixture()
def lava_web(tmp_path):
    pages = {"lava": ("Why lava doesn&#x27;t stop &amp; cools", [
        "Lava is molten rock that erupts from a volcano and cools into basalt.",
        "Lava cools fastest where it meets the sea, forming pillow shapes."]),
             "basalt": ("Basalt", ["Basalt is a dark volcanic rock formed when lava cools quickly.",
                                   "Most of the ocean floor is basalt made from cooled lava."]),
             "magma": ("Magma", ["Magma is molten rock below the surface that becomes lava when it erupts.",
                                 "Magma chambers feed volcanoes with lava over long periods."])}
    site = F.pages_site(pages)
    prov = F.providers(site.url, results=F.overlap_engine(pages, site.url))
    yield site, prov
    site.close()
    prov.close()


def test_run_counts_every_fetched_page_and_renders_titles_once(lava_web, tmp_path) -> None:
    site, prov = lava_web
    out = tmp_path / "r.md"
    r = CliRunner().invoke(app, ["run", "Why does lava cool into basalt?", "--out", str(out), "--html",
                                 "--search", f"searxng:{prov.url}/searxng", "--allow-host", f"127.0.0.1:{site.port}",
                                 "--cache-dir", str(tmp_path), "--retriever", "bm25"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    trace = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    shown = int(re.search(r"pages fetched\s*│\s*(\d+)", r.output).group(1))
    browsed = sum(1 for t in trace["tools"] if t["tool"] == "browse" and not t.get("refused"))
    assert shown == trace["search"]["fetches"] and shown >= 3 and shown > browsed
    md, page = out.read_text(encoding="utf-8"), out.with_suffix(".html").read_text(encoding="utf-8")
    if "Why lava" in md:  # the lava page is cited: its title, decoded, escaped once for HTML
        assert "Why lava doesn't stop & cools" in md and "&#x27;" not in md and "&amp;" not in md
        assert re.search(r"doesn(?:'|&#x27;)t stop &amp; cools", page) and "&amp;#x27;" not in page
    assert all("&#x27;" not in c["title"] and "&amp;" not in c["title"] for c in trace["citations"].values())


@pytest.mark.parametrize("provider,env", [("serper", "SERPER_API_KEY"), ("tavily", "TAVILY_API_KEY"),
                                          ("brave", "BRAVE_API_KEY"), ("jina", "JINA_API_KEY")])
def test_a_keyed_provider_without_its_key_fails_before_any_work(provider, env, tmp_path, monkeypatch) -> None:
    for var in ("SERPER_API_KEY", "TAVILY_API_KEY", "BRAVE_API_KEY", "JINA_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    opened = []
    monkeypatch.setattr("deepr.corpus.open_retriever", lambda *a, **k: opened.append(a))
    r = CliRunner().invoke(app, ["run", "Why does lava cool?", "--out", str(tmp_path / "r.md"),
                                 "--search", f"corpus+{provider}", "--cache-dir", str(tmp_path)])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2, r.output
    assert len(lines) == 1 and env in lines[0] and provider in lines[0], r.output
    assert not opened and not (tmp_path / "r.md").exists()


def test_web_search_without_the_web_extra_fails_before_any_work(tmp_path, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trafilatura" else real(name, *a))
    r = CliRunner().invoke(app, ["build-trees", "--topics", str(tmp_path / "t.txt"), "--out", str(tmp_path / "o.jsonl"),
                                 "--search", "searxng:http://127.0.0.1:9"])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "web" in lines[0] and "trafilatura" in lines[0] and "pip install" in lines[0]


@pytest.mark.parametrize("ctype,meta", [("text/html; charset=ISO-8859-1", ""),
                                        ("text/html", '<meta charset="windows-1252">'),
                                        ("text/html", '<meta http-equiv="Content-Type" content="text/html; charset=latin-1">')])
def test_pages_in_other_encodings_are_decoded_by_their_charset(ctype: str, meta: str) -> None:
    from deepr.search.reader import extract

    html = (f"<html><head>{meta}<title>Caf\xe9 cr\xe8me</title></head><body><article>" + FILLER
            + "<p>The caf\xe9 serves cr\xe8me br\xfbl\xe9e every day of the week to its guests.</p>"
            + FILLER + "</article></body></html>").encode("latin-1")
    title, text = extract(html, ctype)
    assert title == "Café crème" and "café serves crème brûlée" in text and "\ufffd" not in text
