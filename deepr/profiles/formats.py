"""Output formats built per call from what the prompt actually shows (the small profile's).

A role's static format (a pydantic schema, ``<tag>[^<]+</tag>``) only fixes the shape; a weak
model then fills it with dots, the prompt's example id or a one-word query, and the acceptance
checks reject the turn. The formats here are built by code from the call's input, so decoding
itself excludes those replies:

- cited prose: sentences of real words, each ending in a citation whose ids are an alternation
  of exactly the evidence ids the writer was shown (no other id, no ``...``, no ``[1]``);
- search queries: two to eight words of at least three characters; in tools and warp mode one
  of them a word of the question (or of a section, or a result title), and every word one the
  prompt showed, so a query cannot be invented or glued together ("onearth's's");
- warp outlines: titles and plans carrying a word of the question, in the words of the question,
  the background shown and a few glue words (no numbers, no "Section 1.1, Section 2.1, ...");
- the dag plan: a fixed skeleton (search nodes → one aggregate → the answer) whose ids and edges
  are constants, so the model writes only queries, needs and key points.

The acceptance checks still run on every reply: a format cannot tell a real query from a
repeated one, nor an echo from an answer.

    # deepr/profiles/small/agent.py: the final answer's format, from the ids the prompt shows
    answerer.FINAL: lambda a: tagged("answer", cited_prose(a.ids, sentences=(3, 5))) if a.ids else None
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Sequence
from typing import Any

from deepr.llm.base import OutputFormat
from deepr.text import STOP_WORDS

# Words are bounded: an unbounded class lets a small model chain one hyphenated "word" until
# max_tokens runs out (seen: "vaccine-training-immune-system-vaccine-…"). Letters and digits never
# mix inside a word, so id-like tokens ("N4-N4", "S1", "n0.2") can only appear where a format
# places an id on purpose (a citation, an enum); acronyms are capitals only, numbers digits only.
_APOS = r"(?:'(?:s|t|d|m|re|ve|ll))?"  # one English clitic: SmolLM2 wrote "onearth's's's's'" and "but'mleeeeerrrrm"
# One-letter words are "a", "A" and "I" only: SmolLM2 counted "N 1, N 2, N 3, ..." in a plan's key
# points, then opened its answer with the same count.
_ALPHA = rf"(?:[A-Za-z][a-z]{{1,15}}{_APOS}(?:-[A-Za-z][a-z]{{1,11}})?|[aAI])"
_CAPS = r"[A-Z]{2,6}"
_NUMBER = r"[0-9]{1,4}(?:[.,][0-9]{1,3})?(?:s|%)?"
WORD = rf"(?:{_ALPHA}|{_CAPS}|{_NUMBER})"
FIRST = rf"(?:[A-Z][a-z]{{1,15}}{_APOS}(?:-[A-Za-z][a-z]{{1,11}})?|[AI]|{_CAPS})"  # a sentence's first word
# 3+ characters: no "a", "of", "…"
QUERY_WORD = rf"(?:[A-Za-z][a-z]{{2,15}}{_APOS}(?:-[A-Za-z][a-z]{{1,11}})?|{_CAPS}|[0-9]{{3,4}}s?)"


_SHOWN_CAPS = re.compile(rf"(?<![A-Za-z0-9]){_CAPS}(?![A-Za-z0-9])")
_SHOWN_NUMBER = re.compile(rf"(?<![A-Za-z0-9.,]){_NUMBER}(?![A-Za-z0-9]|[.,][0-9])")


def ground(fmt: OutputFormat | None, texts: Sequence[str]) -> OutputFormat | None:
    """``fmt`` with its acronyms and numbers limited to those ``texts`` (the prompt) show.

    Any capitals or digits were SmolLM2's favourite loops: "NXI, NXII, NXIII, …" in a plan's key
    point, "LONDON, LONDON, …" and "NTRAM, NTRAM, …" in an answer about volcanoes, none of them in
    the prompt. A cited answer has no business with an acronym or a figure its evidence lacks.
    Only the word patterns of this module are rewritten; a format that uses none is unchanged."""
    if fmt is None:
        return None
    caps = sorted({m for t in texts for m in _SHOWN_CAPS.findall(t or "")}, key=lambda w: (-len(w), w))
    numbers = sorted({m for t in texts for m in _SHOWN_NUMBER.findall(t or "")}, key=lambda w: (-len(w), w))
    caps_alt = "|".join(caps)
    num_alt = "|".join(re.escape(n).replace("\\%", "%") for n in numbers)
    subs = {  # longest first: no pattern here is a substring of another
        WORD: "(?:" + "|".join(x for x in (_ALPHA, caps_alt, num_alt) if x) + ")",
        FIRST: FIRST.replace(f"|{_CAPS})", f"|{caps_alt})" if caps else ")"),
        LABEL_WORD: "(?:" + "|".join(x for x in (_ALPHA, caps_alt) if x) + ")",
        QUERY_WORD: QUERY_WORD.replace(f"|{_CAPS}|", f"|{caps_alt}|" if caps else "|"),
    }

    def rewrite(pattern: str) -> str:
        for old in sorted(subs, key=len, reverse=True):
            pattern = pattern.replace(old, subs[old])
        return pattern

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: rewrite(v) if k == "pattern" and isinstance(v, str) else walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return dataclasses.replace(fmt, json_schema=walk(fmt.json_schema) if fmt.json_schema is not None else None,
                               regex=rewrite(fmt.regex) if fmt.regex is not None else None)


def id_choice(ids: Sequence[str]) -> str:
    """A regex alternation of exactly ``ids`` (longest first, so a prefix never wins early)."""
    unique = sorted(dict.fromkeys(i for i in ids if i), key=lambda i: (-len(i), i))
    if not unique:
        raise ValueError("a cited format needs at least one evidence id")
    return "(?:" + "|".join(re.escape(i) for i in unique) + ")"


def id_list(ids: Sequence[str], most: int = 2) -> str:
    """One to ``most`` (1 or 2) distinct ids from ``ids``, comma-separated: no "[N2-R1, N2-R1]"
    (seen from SmolLM2), and no id outside ``ids``. Pairs are spelled out, n·(n-1) of them."""
    unique = list(dict.fromkeys(i for i in ids if i))
    if not unique:
        raise ValueError("a cited format needs at least one evidence id")
    if most not in (1, 2):
        raise ValueError(f"id_list: most={most}; 1 or 2 ids per citation")
    if most == 1 or len(unique) == 1:
        return id_choice(unique)
    return "(?:" + "|".join(re.escape(i) + "(?:, " + id_choice([x for x in unique if x != i]) + ")?"
                            for i in unique) + ")"


def cited_sentence(ids: Sequence[str], words: tuple[int, int] = (8, 30), per_cite: int = 2) -> str:
    """One sentence of ``words`` real words (a capital first) closed by ``[id]`` or ``[id, id]``
    (distinct ids, see :func:`id_list`)."""
    lo, hi = words
    return rf"{FIRST}(?:,? {WORD}){{{lo - 1},{hi - 1}}} \[{id_list(ids, per_cite)}\]\."


def cited_prose(ids: Sequence[str], *, sentences: tuple[int, int] = (2, 6), words: tuple[int, int] = (8, 30)) -> str:
    """``sentences`` cited sentences separated by single spaces (see :func:`cited_sentence`)."""
    s = cited_sentence(ids, words)
    lo, hi = sentences
    return rf"{s}(?: {s}){{{lo - 1},{hi - 1}}}"


# words, and years or other 3-4 digit numbers standing alone: not the "000" of "10,000", which
# SmolLM2 put in tree queries ("Controversy over Domestic turkey 000")
_TEXT_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*|(?<![0-9,.])[0-9]{3,4}s?(?![0-9]|[,.][0-9])")


def content_words(texts: Sequence[str], *, most: int = 60, part: tuple[int, int] = (0, 1),
                  skip: Collection[str] = ()) -> list[str]:
    """The content words of ``texts`` a query may hold (:data:`QUERY_WORD`; no stop words, none
    of ``skip``, in any case), first seen first, at most ``most``. ``part=(k, n)``: only every
    n-th of them from the k-th on, so n sibling queries draw on words none of the others has."""
    seen: dict[str, str] = {w.lower(): "" for w in skip}
    for t in texts:
        for w in _TEXT_WORD.findall(t or ""):
            w = w.strip("'-")
            if w.lower() not in STOP_WORDS and w.lower() not in seen and re.fullmatch(QUERY_WORD, w):
                seen[w.lower()] = w
    k, n = part
    return [w for w in seen.values() if w][:most][k::n]


def word_alternation(words: Sequence[str]) -> str:
    """A regex alternation of ``words`` as written and in lower case ("Volcano" opens a title; a
    query says "volcano"), longest first."""
    forms = {v for w in words for v in (w, w.lower()) if re.fullmatch(QUERY_WORD, v)}
    return "(?:" + "|".join(sorted(forms, key=lambda w: (-len(w), w))) + ")"


def word_choice(texts: Sequence[str], *, most: int = 60, least: int = 3,
                part: tuple[int, int] = (0, 1)) -> str | None:
    """:func:`word_alternation` of the :func:`content_words` of ``texts``; None when there are
    fewer than ``least``. A query drawn from the words of its evidence cannot invent words:
    SmolLM2 wrote "Statistics on dejadores dejadores", and grounding then found an article on
    statistics."""
    kept = content_words(texts, most=most, part=part)
    return word_alternation(kept) if len(kept) >= least else None


def literal(text: str) -> str:
    """``text`` as a regex that matches it exactly: the few metacharacters escaped one by one (unlike
    re.escape, spaces and '-' stay bare), so the pattern stays in the subset xgrammar and the GBNF
    converter read without warnings."""
    return "".join(f"\\{c}" if c in ".^$*+?()[]{}|\\/" else c for c in text)


_TERM = re.compile(r"[A-Za-z][a-z]{3,15}")


def term_words(texts: Sequence[str]) -> list[str]:
    """Content words of ``texts`` a query can name (4 to 16 letters, not stop words), first seen first."""
    words = (w for t in texts for w in re.findall(r"[A-Za-z]+", t or ""))
    return [w for w in dict.fromkeys(words) if _TERM.fullmatch(w) and w.lower() not in STOP_WORDS]


def query_with(terms: Sequence[str], words: tuple[int, int] = (2, 6), word: str = QUERY_WORD) -> str:
    """A search query of ``words`` words in all (see :func:`search_query`) carrying one of
    ``terms``: one branch per position of the term, so the total stays bounded (SmolLM2 copied a
    long earlier query and appended a new word, 13 words, when only the two sides were).
    ``word`` is the pattern of the other words (:data:`LABEL_WORD` for a title). When ``word`` is
    a list of words (:func:`word_choice`, :func:`label_vocab`), the other words leave the term out:
    SmolLM2 searched "Brady Brady" and "Algiers Algiers" (each branch then holds its own list; 22
    terms over a 60-word list compile in about 0.2 s)."""
    lo, most = words
    listed = _listed(word)
    if listed and most > 8:
        return _term_early(terms, words, listed, word)
    groups = ([(t, "(?:" + "|".join(w for w in listed if w.lower() != t.lower()) + ")") for t in dict.fromkeys(terms)]
              if listed else [("|".join(re.escape(t) for t in dict.fromkeys(terms)), word)])
    branches = []
    for term, other in groups:
        # the term and each other word once at most (vocab_size)
        hi = max(lo, min(most, 1 + (vocab_size(other) or most))) if listed else most
        for before in range(hi):
            after_lo, after_hi = max(0, lo - 1 - before), hi - 1 - before
            head = rf"(?:{other} ){{{before}}}" if before else ""
            tail = rf"(?: {other}){{{after_lo},{after_hi}}}" if after_hi else ""
            branches.append(f"{head}(?:{term}){tail}" if listed is None else f"{head}{re.escape(term)}{tail}")
    return "(?:" + "|".join(branches) + ")"


def _term_early(terms: Sequence[str], words: tuple[int, int], listed: list[str], word: str) -> str:
    """:func:`query_with` for titles and plan sentences over a word list: one of ``terms`` within
    the first five words, then words of the list. The exact form (one branch per term and
    position, each with its own list) grows with terms x positions^2 x list size: a warp outline's
    plan (4 to 15 words, ~20 terms, ~130 listed words) took xgrammar minutes to compile, longer
    than the run. This one is linear in each; a repeated word is left to the decoder's
    distinct-word ban, which the outline formats ask for."""
    lo, hi = words
    low = {t.lower() for t in terms}
    others = [w for w in listed if w.lower() not in low]
    head = min(4, hi - 1) if others else 0
    first = "(?:" + "|".join(re.escape(t) for t in dict.fromkeys(terms)) + ")"
    other, rest = "(?:" + "|".join(others) + ")", hi - 1 - head
    # a branch per count of leading words below lo - 1 (its tail makes up the minimum), one for the rest
    branches = [rf"(?:{other} ){{{b}}}{first}(?: {word}){{{lo - 1 - b},{rest}}}" if b else
                rf"{first}(?: {word}){{{lo - 1},{rest}}}" for b in range(min(lo - 1, head + 1))]
    if head >= lo - 1:
        branches.append(rf"(?:{other} ){{{max(0, lo - 1)},{head}}}{first}(?: {word}){{0,{rest}}}")
    return "(?:" + "|".join(branches) + ")"


def _listed(word: str) -> list[str] | None:
    """The words of an alternation of plain words ("(?:Volcano|volcano|(?:a|the))"), else None."""
    if not re.fullmatch(r"[()?:A-Za-z0-9'|\-]+", word) or not ("|" in word or word.startswith("(?:")):
        return None  # a list of one word is "(?:rock)"
    return [w for w in word.replace("(?:", "").replace(")", "").split("|") if w]


def vocab_size(word: str) -> int | None:
    """How many different words a list pattern (:func:`word_choice`) offers, or None: for any
    other pattern, or a list holding stop words, which may repeat. A string may name each of the
    others once (the decoder's distinct-word ban), so a format asking for more than there are
    leaves the grammar nothing but banned words, and the ban gives way: SmolLM2's plans searched
    "Appeal appeal Appeal Appeal Appeal Exponential distribution"."""
    listed = _listed(word)
    low = {w.lower() for w in listed or ()}
    return len(low) if low and not low & STOP_WORDS else None


def search_query(words: tuple[int, int] = (2, 8), word: str = QUERY_WORD) -> str:
    """``words`` words of the pattern ``word`` (any real word, or a :func:`word_choice`: then no
    more than it offers, see :func:`vocab_size`)."""
    lo, hi = words
    hi = max(lo, min(hi, vocab_size(word) or hi))
    return rf"{word}(?: {word}){{{lo - 1},{hi - 1}}}"


def tagged(tag: str, body: str, name: str | None = None) -> OutputFormat:
    return OutputFormat(name or tag, regex=rf"<{tag}>{body}</{tag}>")


def text(pattern: str) -> dict[str, Any]:
    """A JSON string matching ``pattern`` whole."""
    return {"type": "string", "pattern": f"^{pattern}$"}




PHRASE = rf"{FIRST}(?:,? {WORD}){{3,14}}"  # a need or key point: 4 to 15 words


def _search_node(nid: str, query: str, phrase: str) -> dict[str, Any]:
    return {"type": "object", "properties": {
        "id": {"const": nid}, "type": {"const": "search"}, "query": text(query),
        "key_points": {"type": "array", "minItems": 1, "maxItems": 1, "items": text(phrase)}},
        "required": ["id", "type", "query", "key_points"], "additionalProperties": False}


def _reader_node(nid: str, kind: str, inputs: list[str], phrase: str) -> dict[str, Any]:
    return {"type": "object", "properties": {
        "id": {"const": nid}, "type": {"const": kind}, "need": text(phrase),
        "inputs": {"const": inputs}},
        "required": ["id", "type", "need", "inputs"], "additionalProperties": False}


def plan_schema(n_search: int = 3, fetch_ids: Sequence[str] | None = None, fetch_limit: int = 2,
                texts: Sequence[str] = ()) -> dict[str, Any]:
    """The dag plan skeleton: ``n_search`` search nodes N1.., one aggregate reading all of them,
    the answer node reading the aggregate; with ``fetch_ids`` a ``fetch`` list drawn from them.
    With ``texts`` (the question, the result titles) a query uses only their words: SmolLM2 planned
    "How dovolcanoes form and whydotheyreject". No more of them than there are: the planner's
    formats ask for distinct words, and once a query had used every one the ban gave way
    ("Appeal appeal Appeal Appeal Appeal Exponential distribution")."""
    vocab = word_choice(texts)
    query, phrase = search_query(word=vocab) if vocab else search_query(), PHRASE
    searches = [f"N{k}" for k in range(1, n_search + 1)]
    agg, ans = f"N{n_search + 1}", f"N{n_search + 2}"
    nodes = [*(_search_node(s, query, phrase) for s in searches), _reader_node(agg, "aggregate", searches, phrase),
             _reader_node(ans, "answer", [agg], phrase)]
    props: dict[str, Any] = {"nodes": {"type": "array", "prefixItems": nodes, "items": False,
                                       "minItems": len(nodes), "maxItems": len(nodes)}}
    if fetch_ids:
        props["fetch"] = {"type": "array", "maxItems": fetch_limit,
                          "items": {"enum": list(dict.fromkeys(fetch_ids))}}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def cited_map_schema(allowed: dict[str, Sequence[str]], sentences: tuple[int, int] = (2, 4)) -> dict[str, Any]:
    """A JSON object with one cited text per key, each citing only its own allowed ids."""
    props = {k: text(cited_prose(ids, sentences=sentences)) for k, ids in allowed.items()}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


TITLE = rf"{FIRST}(?: {WORD}){{1,9}}"  # 2 to 10 words
# Words without digits, for outline titles and plans: SmolLM2 numbered its way through warp
# outlines ("Section 1.1, Section 2.1, Section 3.1, ...") until the budget ran out.
LABEL_WORD = rf"(?:{_ALPHA}|{_CAPS})"


GLUE = ("a", "an", "the", "of", "and", "or", "in", "on", "at", "to", "for", "with", "by", "from", "as", "is",
        "are", "its", "their", "how", "why", "what", "when", "which")


def label_vocab(texts: Sequence[str], most: int = 80) -> str | None:
    """The words an outline title or plan may use: the content words of ``texts`` (see
    :func:`word_choice`) and the glue words between them; None when ``texts`` have too few."""
    content = word_choice(texts, most=most)
    if content is None:
        return None
    glue = sorted({v for g in GLUE for v in (g, g.capitalize())}, key=lambda w: (-len(w), w))
    return f"(?:{content}|{'|'.join(glue)})"


def items_schema(lo: int, hi: int, terms: Sequence[str] = (), vocab: str | None = None) -> dict[str, Any]:
    """Outline items (warp): a title and a one-sentence plan each. With ``terms`` (the question's
    content words) each part carries one of them and holds no number; with ``vocab`` (a
    :func:`label_vocab`) every word comes from it."""
    if terms:
        word = vocab or LABEL_WORD
        title, plan = query_with(terms, (2, 10), word), query_with(terms, (4, 15), word)
    else:
        title, plan = TITLE, PHRASE
    return {"type": "array", "minItems": lo, "maxItems": hi, "items": {
        "type": "object", "properties": {"title": text(title), "plan": text(plan)},
        "required": ["title", "plan"], "additionalProperties": False}}


def action_schema(name: str, **props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, **props},
            "required": ["name", *props], "additionalProperties": False}


def queries_schema(key: str, lo: int = 1, hi: int = 3, name: str | None = None,
                   terms: Sequence[str] = (), vocab: str | None = None,
                   before: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{key: [2–8 word queries]}`` (with ``name`` constant when given: a warp action; with
    ``before``, those properties first, e.g. the searcher's ``done`` flag); with ``terms`` each
    query carries one of them (see :func:`query_with`), with ``vocab`` (a :func:`word_choice`)
    every word comes from it."""
    word = vocab or QUERY_WORD
    query = query_with(terms, (2, 6), word) if terms else search_query(word=word)
    props = {**(before or {}), key: {"type": "array", "minItems": lo, "maxItems": hi, "items": text(query)}}
    return action_schema(name, **props) if name else {
        "type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def cite_spans(ids: Sequence[str], *, sentences: tuple[int, int] = (3, 6), words: tuple[int, int] = (8, 30)) -> str:
    """tools mode's answer body: ``<cite id="S1-R2">a sentence.</cite>`` spans over real ids."""
    lo, hi = words
    span = rf'<cite id="{id_list(ids)}">{FIRST}(?:,? {WORD}){{{lo - 1},{hi - 1}}}\.</cite>'
    return rf"{span}(?: {span}){{{sentences[0] - 1},{sentences[1] - 1}}}"


def tool_step(shown: Sequence[str], *, may_call: bool = True, may_browse: bool = True, query: str | None = None) -> str:
    """One tools-mode turn: a search call (a real query, or one matching ``query``), a browse of
    a document an earlier search showed, or, once something was shown, the cited answer."""
    options = []
    if may_call:
        options.append(rf'<tool_call>\{{"name": "search", "arguments": \{{"query": "{query or search_query()}"\}}\}}</tool_call>')
        if may_browse and shown:
            options.append(rf'<tool_call>\{{"name": "browse", "arguments": \{{"doc_id": "{id_choice(shown)}"\}}\}}'
                           r"</tool_call>")
    if shown:
        options.append(rf"<answer>{cite_spans(shown)}</answer>")
    return "|".join(f"(?:{o})" for o in options)
