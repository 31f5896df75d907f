"""The word classes of the strict formats (deepr.profiles.formats): prose is made of real words, and
ids can appear only where a format places one (issue 14: SmolLM2 wrote "N4-N4" as a word)."""

from __future__ import annotations

import re

import pytest

from deepr.profiles.formats import PHRASE, QUERY_WORD, WORD, cited_prose, search_query


@pytest.mark.parametrize("word", ["the", "don't", "Pompeii", "well-known", "Indo-European", "NATO", "1991",
                                  "1990s", "45%", "0.5", "1,200", "Earth's", "they're",
                                  "we'll"])
def test_ordinary_words_numbers_and_acronyms_are_words(word):
    assert re.fullmatch(WORD, word)


@pytest.mark.parametrize("token", ["N4-N4", "N4", "S1-R2", "n0.1.1", "R12", "M1", "4N", "...", "…", "[1]",
                                   "vaccine-training-immune", "abcdefghijklmnopqrstu",
                                   "onearth's's's", "s'ss'ss", "but'mleeeeerrrrm", "N", "b"])
def test_ids_placeholders_and_runaway_tokens_are_not_words(token):
    assert not re.fullmatch(WORD, token)


def test_ids_appear_only_in_the_citation_slot():
    rx = cited_prose(["N4-R1", "N2-R3"], sentences=(1, 2))
    ok = "Pompeii was buried under volcanic ash during the eruption of 79 [N4-R1]."
    assert re.fullmatch(rx, ok)
    for bad in ("N4-N4 Pompeii was buried under volcanic ash during the eruption of 79 [N4-R1].",
                "Pompeii was buried under N4-R1 volcanic ash during the eruption of 79 [N4-R1].",
                "Pompeii was buried under volcanic ash during the eruption of 79 [N4-N4]."):
        assert not re.fullmatch(rx, bad), bad
    assert not re.fullmatch(PHRASE, "Find the N2 facts about lava")
    assert re.fullmatch(search_query(), "Vesuvius 79 eruption") is None  # "79": under three characters
    assert re.fullmatch(search_query(), "Vesuvius eruption 1631") and not re.fullmatch(QUERY_WORD, "S1R1")


def test_a_citation_names_distinct_shown_ids():
    from deepr.profiles.formats import cite_spans, id_list

    rx = id_list(["N1-R1", "N2-R1", "N1-R10"])
    for ok in ("N1-R1", "N1-R10", "N2-R1, N1-R1", "N1-R1, N1-R10"):
        assert re.fullmatch(rx, ok), ok
    for bad in ("N2-R1, N2-R1", "N1-R1, N1-R1", "N1-R1, N2-R1, N1-R10", "N3-R1", ""):
        assert not re.fullmatch(rx, bad), bad
    span = cite_spans(["S1-R1", "S1-R2"], sentences=(1, 1))
    assert re.fullmatch(span, '<cite id="S1-R2, S1-R1">Honey bees live in colonies of many thousand workers.</cite>')
    assert not re.fullmatch(span, '<cite id="S1-R2, S1-R2">Honey bees live in colonies of many thousand workers.</cite>')


def test_grounded_warp_queries_and_outline_items_carry_a_question_word_and_no_numbers():
    """SmolLM2's warp searches were "SOLICY 101" and "1234s 1234s ..." and its outline plans
    "Section 1.1, Section 2.1, ..."; with the question's terms neither can be decoded."""
    from deepr.profiles.formats import items_schema, queries_schema, term_words

    terms = term_words(["How did the printing press change Europe?"])
    assert terms == ["printing", "press", "change", "Europe"]
    query = queries_schema("keywords", name="search", terms=terms)["properties"]["keywords"]["items"]["pattern"]
    for ok in ("printing press Europe", "Gutenberg printing", "printing spread 1450s"):
        assert re.fullmatch(query.strip("^$"), ok), ok
    for bad in ("SOLICY 101", "1234s 1234s 1234s", "SECTOR 111", "press"):
        assert not re.fullmatch(query.strip("^$"), bad), bad
    item = items_schema(2, 3, terms)["items"]["properties"]
    title, plan = item["title"]["pattern"].strip("^$"), item["plan"]["pattern"].strip("^$")
    assert re.fullmatch(title, "Printing in early modern Europe")
    assert not re.fullmatch(title, "Section One") and not re.fullmatch(title, "Europe 1500")
    assert re.fullmatch(plan, "Describe how presses spread across Europe")
    assert not re.fullmatch(plan, "Section 1.1, Section 2.1, Section 3.1, Section 4.1")
    assert not re.fullmatch(plan, "The report is to be prepared for the next day")  # no word of the question
    # with a vocabulary, every word comes from the question, the background or the glue words
    from deepr.profiles.formats import label_vocab

    vocab = label_vocab(["How did the printing press change Europe?",
                         "Johannes Gutenberg introduced movable type printing to Europe around 1440."])
    grounded = items_schema(2, 3, terms, vocab)["items"]["properties"]
    title, plan = grounded["title"]["pattern"].strip("^$"), grounded["plan"]["pattern"].strip("^$")
    assert re.fullmatch(title, "Gutenberg and the printing press")
    assert re.fullmatch(plan, "How movable type printing changed Europe") is None  # "changed": not in the texts
    assert re.fullmatch(plan, "How movable type printing change Europe")
    assert not re.fullmatch(title, "Sender's note to the printing press")
    # without terms (a question with no content word) the plain formats stand
    assert items_schema(2, 3)["items"]["properties"]["title"]["pattern"] != item["title"]["pattern"]


def test_a_strict_dag_plan_searches_with_the_words_of_the_question_and_the_results():
    """SmolLM2's strict dag plans searched "How dovolcanoes form and whydotheyreject"."""
    from deepr.profiles.formats import plan_schema

    schema = plan_schema(texts=["How do volcanoes form and why do they erupt?", "Mount Vesuvius"])
    query = schema["properties"]["nodes"]["prefixItems"][0]["properties"]["query"]["pattern"].strip("^$")
    for ok in ("volcanoes form", "volcanoes erupt Vesuvius", "Mount Vesuvius"):
        assert re.fullmatch(query, ok), ok
    # glued words, a word no text holds, and stop words (a query names things)
    for bad in ("How dovolcanoes form", "whydotheyreject volcanoes", "volcanoes lava", "why volcanoes erupt"):
        assert not re.fullmatch(query, bad), bad
    # five words to choose from, five at most: a plan's words are distinct, and past the last one
    # the ban gave way ("Appeal appeal Appeal Appeal Appeal Exponential distribution")
    assert re.fullmatch(query, "volcanoes form erupt Mount Vesuvius")
    assert not re.fullmatch(query, "volcanoes form erupt Mount Vesuvius volcanoes")


def test_grounding_leaves_words_and_ids_alone_and_reaches_json_patterns():
    """ground() rewrites only the acronym and number alternatives: plain words, the id slot and a
    schema's patterns keep working, and a format without those patterns is unchanged."""
    from deepr.profiles.formats import ground, plan_schema, tagged
    from deepr.llm.base import OutputFormat

    shown = ["How did NATO form in 1949?"]
    plan = ground(OutputFormat("plan", json_schema=plan_schema(texts=shown)), shown)
    point = plan.json_schema["properties"]["nodes"]["prefixItems"][0]["properties"]["key_points"]["items"]["pattern"]
    assert re.fullmatch(point.strip("^$"), "NATO formed in 1949 after the war")
    assert not re.fullmatch(point.strip("^$"), "NATO formed in 1950 after the war")
    assert not re.fullmatch(point.strip("^$"), "SEATO formed in 1949 after the war")
    prose = ground(tagged("answer", cited_prose(["N1-R2"], sentences=(1, 1))), [])
    assert re.fullmatch(prose.regex, "<answer>The alliance formed after the war in the west [N1-R2].</answer>")
    assert not re.fullmatch(prose.regex, "<answer>The alliance formed after the war in 1949 [N1-R2].</answer>")
    fixed = OutputFormat("yes", regex="(?:yes|no)")
    assert ground(fixed, shown) == fixed and ground(None, shown) is None


def test_a_query_names_its_term_once():
    """SmolLM2 searched "Brady Brady" and "Algiers Algiers": over a word list, the query's other
    words leave its term out in any case, while two different terms still combine."""
    from deepr.profiles.formats import query_with, word_choice

    vocab = word_choice(["What causes the seasons on Earth?", "Tom Brady", "Algiers"])
    rx = query_with(["seasons", "Brady", "Algiers"], (2, 6), vocab)
    for repeated in ("Brady Brady", "Algiers algiers", "seasons Earth seasons"):
        assert not re.fullmatch(rx, repeated), repeated
    for fine in ("seasons Earth", "Earth seasons causes", "Brady seasons"):
        assert re.fullmatch(rx, fine), fine


def test_a_word_list_bounds_a_query_to_the_words_it_offers():
    """The decoder lets a string name each content word once; a format asking for more words
    than its list offers leaves the grammar only banned words, and the ban gives way: SmolLM2's
    plans searched "Appeal appeal Appeal Appeal Appeal Exponential distribution"."""
    from deepr.profiles.formats import QUERY_WORD, label_vocab, query_with, search_query, vocab_size, word_choice

    vocab = word_choice(["Appeal", "Exponential distribution"])
    assert vocab_size(vocab) == 3 and vocab_size(QUERY_WORD) is None
    assert vocab_size(label_vocab(["Appeal", "Exponential distribution"])) is None  # glue words repeat
    plain = search_query(word=vocab)
    assert re.fullmatch(plain, "Appeal exponential distribution")
    assert not re.fullmatch(plain, "Appeal exponential distribution appeal")
    termed = query_with(["volcano"], (2, 6), vocab)
    assert re.fullmatch(termed, "volcano Appeal exponential distribution")
    assert not re.fullmatch(termed, "volcano Appeal exponential distribution appeal")


def test_content_words_keep_years_not_the_pieces_of_bigger_numbers():
    from deepr.profiles.formats import content_words

    words = content_words(["Flocks of 10,000 turkeys since the 1970s, 2.5 million by 2024."])
    assert words == ["Flocks", "turkeys", "since", "1970s", "million", "2024"]  # no "000"


def test_outline_patterns_stay_small_with_many_terms_and_a_long_word_list():
    """A warp outline's title and plan over a word list once had one branch per term and position,
    each with its own list: ~20 terms and ~130 words made a pattern xgrammar compiled for longer than
    the run (make demo-llm hung in warp). The term now comes within the first five words, so the
    pattern grows with terms plus words, and a repeated word is the decoder's distinct-word ban."""
    from deepr.profiles.formats import items_schema, label_vocab, term_words
    from deepr.agent import warp
    from deepr.profiles.small.agent import STRICT

    texts = [f"Why did the {w}ian empire trade {w}ite and {w}ium with its neighbours in the {w} valley?"
             for w in ("Dor", "Kal", "Mer", "Tos", "Vel", "Zan")]
    terms, vocab = term_words(texts), label_vocab(texts, most=80)
    assert len(terms) >= 20
    item = items_schema(2, 3, terms, vocab)["items"]["properties"]
    title, plan = item["title"]["pattern"].strip("^$"), item["plan"]["pattern"].strip("^$")
    assert len(plan) < 4 * len(vocab) + 200 * len(terms) and len(title) < 4 * len(vocab) + 200 * len(terms)
    assert re.fullmatch(plan, "How the Dorian empire traded") is None  # "traded": not in the texts
    assert re.fullmatch(plan, "How the Dorian empire trade Dorite")
    assert re.fullmatch(title, "Dorite trade") and not re.fullmatch(title, "in the with")  # no term
    assert not re.fullmatch(plan, " ".join(["the"] * 5 + ["Dorian"]))  # the term within the first five words
    assert STRICT[warp.DEEPEN] and STRICT[warp.INITIALIZE]  # the outline formats (they ask for distinct words)
