"""Issue 19 item 4: ``deepr build-trees --search searxng:URL`` grows evidence trees from the web
pages it reads, as DeepRubric does, and ``--search-cache replay`` rebuilds the same trees offline.

The website and the search engine run on loopback: a handful of pages on one subject (honey
bees), each with its own facts and sub-topics, and a SearXNG-shaped provider that returns every
page sharing a word with the query, so the tree's overlapping sub-queries find related pages.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import search_fakes as F
from deepr.cli import app

BEES = {
    "honey-bee": ("Honey bee", [
        "The western honey bee, Apis mellifera, lives in colonies of up to sixty thousand workers, a few "
        "hundred drones and a single queen.",
        "Honey bees were kept in clay hives in Ancient Egypt about four thousand five hundred years ago, and "
        "beekeeping spread across the Mediterranean.",
        "A colony stores honey in wax combs to survive the winter; one hive can produce more than twenty "
        "kilograms of surplus honey in a good summer.",
        "Drones are male honey bees; they do not sting and die after mating with a queen.",
        "Workers live about six weeks in summer, while winter bees born in autumn survive for several months.",
        "Africanized honey bees, a hybrid spread from Brazil since 1957, defend their nest far more fiercely."]),
    "waggle-dance": ("Waggle dance", [
        "Honey bee foragers perform the waggle dance on the comb to show nestmates the direction and distance "
        "of a patch of flowers.",
        "Karl von Frisch decoded the meaning of the waggle dance and shared the Nobel Prize in Physiology or "
        "Medicine in 1973.",
        "The angle of the waggle run against vertical matches the angle between the flowers and the sun; a "
        "longer run means the flowers are farther away.",
        "For flowers close to the hive the foragers perform a round dance instead, which gives no direction.",
        "Thomas Seeley showed that scouts use a similar dance to choose a new nest site when a swarm leaves.",
        "Dancers also hand out samples of nectar, so recruits learn the scent of the flowers to look for."]),
    "varroa": ("Varroa mite", [
        "Varroa destructor is a parasitic mite that feeds on the fat body of honey bee larvae and adults and "
        "spreads deformed wing virus.",
        "The Varroa mite jumped from the Asian honey bee to the western honey bee in the twentieth century and "
        "now infests colonies on every inhabited continent except Australia.",
        "Untreated colonies with heavy Varroa loads usually collapse within two or three years, which makes "
        "the mite the worst threat to beekeeping.",
        "Beekeepers treat colonies against Varroa with oxalic acid, formic acid or thymol, often in late summer.",
        "Breeders in Minnesota selected hygienic honey bees that uncap and remove infested brood cells.",
        "New Zealand found the mite in 2000, and its beekeepers lost many feral colonies in the next years."]),
    "queen": ("Queen bee", [
        "The queen honey bee lays up to two thousand eggs a day during the spring build-up of the colony.",
        "Worker honey bees raise a new queen by feeding a young larva only royal jelly, a protein-rich "
        "secretion of their hypopharyngeal glands.",
        "A virgin queen leaves the hive on mating flights and mates with a dozen or more drones in a drone "
        "congregation area.",
        "Beekeepers mark the queen with a dot of paint whose colour tells the year she hatched.",
        "A strong colony with an old queen may build swarm cells and leave with half of its workers in June.",
        "Queen pheromone spreads through the colony and stops the workers from raising rival queens."]),
    "beeswax": ("Beeswax and honeycomb", [
        "Worker honey bees secrete beeswax from eight wax glands on the underside of the abdomen and chew the "
        "flakes into comb.",
        "Honeycomb cells are hexagonal, a shape that holds the most honey for the least wax, as Charles Darwin "
        "admired.",
        "Beeswax melts at about sixty-three degrees Celsius and is used for candles, cosmetics and the "
        "lost-wax casting of bronze.",
        "A colony eats about eight kilograms of honey to secrete one kilogram of beeswax.",
        "Lorenzo Langstroth designed movable frames in 1851, so beekeepers could lift combs without breaking them.",
        "Old brood comb darkens with cocoons and pollen and is melted down and renewed every few years."]),
    "pollination": ("Pollination by honey bees", [
        "Honey bees pollinate about a third of the crops people eat, and migratory beekeepers truck hives from "
        "farm to farm.",
        "Every February more than two million honey bee colonies are moved to the almond orchards of the "
        "Central Valley of California.",
        "Apples, blueberries and cherries yield far more fruit when honey bee hives stand in the orchard "
        "during bloom.",
        "The almond bloom in California lasts only about three weeks, so growers rent hives for a short season.",
        "Wild bumblebees and solitary bees pollinate tomatoes and squash better than honey bees do.",
        "Pesticides such as neonicotinoids harm foraging honey bees, and the European Union restricted three "
        "of them in 2013."]),
}


@pytest.fixture(scope="module")
def bee_web():
    site = F.pages_site(BEES)
    prov = F.providers(site.url, results=F.overlap_engine(BEES, site.url))
    try:
        yield site, prov
    finally:
        site.close()
        prov.close()


def _norm(text: str) -> str:
    return " ".join(text.split())


def _chunks(url: str) -> list[str]:
    """The passages of a fake page as the reader and the corpus chunker cut them (passage k of
    the page is id ``<url>#k``)."""
    from deepr.search.passages import page_chunks
    from deepr.search.reader import extract

    title, text = extract(F.page_html(*BEES[url.rsplit("/", 1)[1]]), "text/html")
    return page_chunks(url, title, text)


def _without_timings(tree: dict) -> dict:
    return {**tree, "stats": {k: v for k, v in tree["stats"].items() if k != "seconds"}}


def test_build_trees_grows_a_tree_from_read_pages_and_replays_it(bee_web, tmp_path) -> None:
    site, prov = bee_web
    topics = tmp_path / "topics.txt"
    topics.write_text("Honey bees\n", encoding="utf-8")

    def build(out: str, *extra: str) -> tuple[list[dict], dict]:
        # the CLI's default tree budgets (depth 3, branching 6,4,3, min_leaves 2, extractive engine)
        r = CliRunner().invoke(app, ["build-trees", "--topics", str(topics), "--out", str(tmp_path / out),
                                     "--search", f"searxng:{prov.url}/searxng", "--cache-dir", str(tmp_path),
                                     "--allow-host", f"127.0.0.1:{site.port}", *extra])
        assert r.exit_code == 0, r.output
        trees = [json.loads(line) for line in (tmp_path / out).read_text(encoding="utf-8").splitlines()]
        meta = json.loads((tmp_path / f"{out}.meta.json").read_text(encoding="utf-8"))
        return trees, meta["search"]

    [tree], first = build("a.jsonl")
    fetched = {site.url + r["path"] for r in site.requests if r["method"] == "GET"}
    nodes = tree["nodes"]
    leaves = [n for n in nodes if not n["children"]]
    assert len(leaves) >= 2 and tree["stats"]["depth"] >= 2 and tree["topic"] == "Honey bees"
    support = [d for n in nodes for d in n["supporting_docs"]]
    assert all(n["supporting_docs"] and n["statements"] for n in nodes)
    for d in support:  # every statement lies in the fetched passage its id names
        url, k = d["snippet_id"].rsplit("#", 1)
        assert url == d["doc_id"] and url in fetched, d
        passage = _norm(_chunks(url)[int(k)])
        assert d["statements"] and all(_norm(s) in passage for s in d["statements"]), d
        # ...and is one of the page's own sentences (or its heading), whole: no heading glued to a sentence
        title, paragraphs = BEES[url.rsplit("/", 1)[1]]
        assert set(d["statements"]) <= {*paragraphs, f"{title}."}, d
    assert len({d["doc_id"] for d in support}) >= 3  # the sub-topics come from several pages
    assert any(not d["snippet_id"].endswith("#0") for d in support)  # a page's passage chosen by the need
    assert first["pages_read"] >= len(nodes) and first["network_requests"] >= len(fetched) >= 3
    assert first["failed"] == 0 and first["search"] == f"searxng:{prov.url}/searxng"

    seen = len(site.requests), len(prov.requests)
    [again], replay = build("b.jsonl", "--search-cache", "replay")
    assert replay["network_requests"] == 0 and replay["cache_hits"] > 0 and replay["failed"] == 0
    assert (len(site.requests), len(prov.requests)) == seen  # nothing reached either server
    assert _without_timings(again) == _without_timings(tree)


def test_replay_of_an_uncached_web_tree_fails_clearly(bee_web, tmp_path) -> None:
    site, prov = bee_web
    topics = tmp_path / "topics.txt"
    topics.write_text("Honey bees\n", encoding="utf-8")
    seen = len(site.requests), len(prov.requests)
    r = CliRunner().invoke(app, ["build-trees", "--topics", str(topics), "--out", str(tmp_path / "t.jsonl"),
                                 "--search", f"searxng:{prov.url}/searxng", "--cache-dir", str(tmp_path / "empty"),
                                 "--allow-host", f"127.0.0.1:{site.port}", "--search-cache", "replay"])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "--search-cache replay: no cached search for 'Honey bees'" in said, said
    out = tmp_path / "t.jsonl"
    assert "Traceback" not in r.output and (not out.exists() or not out.read_text(encoding="utf-8").strip())
    assert (len(site.requests), len(prov.requests)) == seen


def test_page_headings_stay_out_of_the_next_sentence() -> None:
    from deepr.search.passages import page_chunks
    from deepr.search.reader import extract
    from deepr.text import split_sentences

    title, text = extract(F.page_html("Queen bee", BEES["queen"][1][:2]), "text/html")
    [passage] = page_chunks("http://127.0.0.1:9/wiki/queen", title, text)
    # the chunker joins lines with spaces: the heading must end its own sentence first
    assert split_sentences(passage) == ["Queen bee.", *BEES["queen"][1][:2]]
