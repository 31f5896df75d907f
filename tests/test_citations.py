"""Citations are owned by code: stable ids, checks that list bad ids, references from cited ids."""

from __future__ import annotations

import pytest

from deepr.evidence.citations import Catalog, cited_ids, normalize, strip_ids
from deepr.agent.render import ReportDoc, Section, render_markdown
from deepr.records import Document, Hit
from deepr.text import strip_citations


def hit(pid: str, text: str = "Some text about it.", url: str | None = None) -> Hit:
    doc = pid.split("#")[0]
    return Hit(id=pid, doc_id=doc, title=doc.replace("_", " "), text=text, url=url)


def catalog() -> Catalog:
    c = Catalog()
    c.add_hits("N1", [hit("Paris#0"), hit("Lyon#0", url="https://example.org/lyon")], "cities")
    c.add_hits("N2", [hit("Paris#0"), hit("Nice#1")], "coast")
    return c


def test_ids_are_node_and_rank_and_stay_stable():
    c = catalog()
    assert list(c.entries) == ["N1-R1", "N1-R2", "N2-R1", "N2-R2"]
    # A re-run node continues its numbering; a snippet it already had keeps its id.
    again = c.add_hits("N1", [hit("Marseille#0"), hit("Paris#0")], "cities again")
    assert again == ["N1-R3", "N1-R1"]
    assert c["N1-R1"].passage_id == "Paris#0" and c["N1-R3"].passage_id == "Marseille#0"


def test_fetch_ids_count_over_the_run():
    c = catalog()
    f1 = c.add_page("N2", Document(id="Nice", title="Nice", text="Full page of Nice."))
    f2 = c.add_page("N1", Document(id="Lyon", title="Lyon", text="Full page of Lyon."))
    assert (f1, f2) == ("N2-F1", "N1-F2")
    assert c.add_page("N2", Document(id="Nice", title="Nice", text="x")) == "N2-F1"
    assert c["N1-F2"].kind == "fetch"


def test_evidence_shows_a_sources_own_brackets_as_parentheses_so_only_ids_are_bracketed():
    """A quote's editorial bracket in the source text would read as a citation in the prompt, and
    a sentence copied from the evidence with it would be refused as a stray bracket."""
    from deepr.evidence.citations import stray_brackets

    c = Catalog()
    quote = 'Music "rocking, jazz based ... [with a] heavy, insistent beat" and a note【1】 [N9-R9].'
    [cid] = c.add_hits("N1", [hit("RnB#0", text=quote)])
    ev = c.evidence([cid])
    assert ev.startswith(f"[{cid}] ") and "(with a) heavy" in ev and "(1)" in ev and "(N9-R9)" in ev
    assert cited_ids(ev) == [cid] and stray_brackets(ev.split(" ", 1)[1]) == []
    copied = ev.split(": ", 1)[1] + f" [{cid}]"
    assert c.check(copied, [cid], require=True) == []
    assert c[cid].text == quote  # the source itself (references, judges) is unchanged


def test_cited_ids_reads_every_marker_form():
    text = "A [N1-R1]. B [N1-R2, N2-F1]; C [N2-R1][N3-R10]. Not ids: [1], [see above], [x](http://a.b)."
    assert cited_ids(text) == ["N1-R1", "N1-R2", "N2-F1", "N2-R1", "N3-R10"]
    assert cited_ids("Search node ids like N1 or [N1] are not citations.") == []


def test_check_lists_unknown_ids_for_a_reask():
    c = catalog()
    errors = c.check("Paris is big [N1-R1]. Nice is warm [N2-R9, N7-R1].")
    assert len(errors) == 1
    assert "unknown citation ids N2-R9, N7-R1" in errors[0]
    # issue 14: no example id in a re-ask: a model echoes it, and a real id echoed would pass
    assert "N1-R1" not in errors[0]
    assert c.check("Paris [N1-R1] and Lyon [N1-R2].") == []


def test_check_treats_ids_not_shown_to_the_writer_as_unknown():
    c = catalog()
    errors = c.check("Nice [N2-R2].", allowed=["N1-R1", "N1-R2"])
    assert errors and "N2-R2" in errors[0]


def test_check_requires_a_citation_and_rejects_numbers_and_links():
    c = catalog()
    assert "no citation" in c.check("An unsupported claim.", require=True)[0]
    errors = " ".join(c.check("Claim [1]. See [here](https://x.org)."))
    assert "numbered citation" in errors and "markdown links" in errors


def test_normalize_accepts_latex_tags_and_fullwidth_brackets():
    assert cited_ids(normalize(r"Claim \cite{N1-R1, N2-R2}.")) == ["N1-R1", "N2-R2"]
    assert normalize('<cite id="N1-R2">Lyon is old</cite>') == "Lyon is old [N1-R2]"
    assert cited_ids(normalize("Claim【N1-R1】.")) == ["N1-R1"]


def test_strip_ids_removes_only_the_bad_ids():
    assert strip_ids("A [N1-R1, N9-R9]. B [N9-R9].", ["N9-R9"]) == "A [N1-R1]. B."


def test_resolve_only_finds_what_a_search_returned():
    c = catalog()
    assert c.resolve("N1-R2").doc_id == "Lyon"
    assert c.resolve("Nice").id == "N2-R2"  # by doc id
    assert c.resolve("https://example.org/lyon").id == "N1-R2"  # by a URL a search showed
    assert c.resolve("https://evil.example/secret") is None
    assert c.resolve("/etc/passwd") is None


def test_reference_list_holds_exactly_the_cited_ids():
    c = catalog()
    doc = ReportDoc("T", [Section("Answer", "Paris is big [N1-R1]. Nice is warm [N2-R2]."),
                          Section("More", "Again Paris [N1-R1].")])
    md, citations, dropped = render_markdown(doc, c)
    refs = md.split("## References", 1)[1]
    assert set(citations) == {"N1-R1", "N2-R2"} == set(cited_ids(refs))
    assert set(cited_ids(md)) == set(citations)
    assert "N1-R2" not in md  # catalogued but never cited: not listed
    assert citations["N2-R2"].doc_id == "Nice" and dropped == []


def test_render_drops_ids_the_catalog_never_issued():
    md, citations, dropped = render_markdown(ReportDoc("T", [Section("A", "Claim [N1-R1]. Bad [Z9-R9].")]),
                                             catalog())
    assert dropped == ["Z9-R9"] and "Z9-R9" not in md and list(citations) == ["N1-R1"]


@pytest.mark.parametrize("text, plain", [
    ("Paris is the capital [N1-R2, N3].", "Paris is the capital."),
    ("See <cite id='N1'>the claim</cite> here", "See the claim here"),
    ("A [report](http://x.org/a) says so [N2]", "A report says so"),
    ("Tabs\tand  doubled   spaces , before punctuation !", "Tabs and doubled spaces, before punctuation!"),
    ("  line one [N1]\n\tline two <b>bold</b> .  ", "line one\nline two bold."),
    ("Plain text with no markup.", "Plain text with no markup."),
    ("[not an id] stays", "[not an id] stays"),
    ("", ""),
])
def test_strip_citations_keeps_the_words_and_drops_markers_tags_and_link_targets(text, plain):
    """What the rewards' tokens and the report's repeated-sentence check read: each kind of markup
    removed, and a text without any (most of them, which skip the patterns) left as it was."""
    assert strip_citations(text) == plain
