"""The small profile's per-call formats of the agent roles (dag answerer, decor, search agent,
tools agent, warp): each built from what the call's prompt shows, so a 135M model cannot write a
placeholder, an id it was not shown or a query in words the prompt never used."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import ConfigDict, Field, RootModel

from deepr.evidence import writer
from deepr.agent import answerer, decor, search_agent, tools_agent, warp
from deepr.agent.decor import DecorAsk, memory_ids
from deepr.agent.tools_agent import StepAsk, ToolSession, searched_queries
from deepr.agent.warp import WarpAsk
from deepr.extractive.decor import memory_sentences as _memory_sentences
from deepr.llm.base import OutputFormat
from deepr.profiles.formats import (LABEL_WORD, QUERY_WORD, TITLE, action_schema, cite_spans as answer_spans,
                                    cited_map_schema, cited_prose, cited_sentence, id_choice, items_schema,
                                    label_vocab, literal, queries_schema, query_with, search_query, tagged,
                                    term_words, text, tool_step, word_choice)
from deepr.text import strip_citations

# -- dag answerer ---------------------------------------------------------------------------


# What `--formats schema` decodes a wave under: an object of non-empty texts. A bare object let
# SmolLM2 write lists and empty strings. The keys stay free: patternProperties would pin them to
# id-like names under xgrammar, but llama-cpp-python's converter turns it into "{}" only. Which
# ids belong to the wave is the check's job.
class _WaveShape(RootModel[dict[str, Annotated[str, Field(min_length=20)]]]):
    model_config = ConfigDict(json_schema_extra={"minProperties": 1})


def _wave(a: Any) -> OutputFormat | None:
    return OutputFormat("wave", json_schema=cited_map_schema(a.allowed)) if all(a.allowed.get(n) for n in a.wave) else None


def _final(a: Any) -> OutputFormat | None:
    return tagged("answer", cited_prose(a.ids, sentences=(3, 5), words=(8, 25))) if a.ids else None


# -- decor ----------------------------------------------------------------------------------

def _plan_query(a: DecorAsk) -> str:
    """A query that names at least one content word of the question: SmolLM2's first query was
    "The question has nofetched facts sofar", which retrieved Westminster and literary theory."""
    terms = term_words([a.query])
    return query_with(terms, (2, 8)) if terms else search_query()




def kept_statements(a: DecorAsk, most: int = 12) -> list[str]:
    """The statements the filter may keep: the first sentences of the results (5 to 45 words, not
    in memory yet), each with its result's id, as the memory stores them."""
    known = {" ".join(strip_citations(s).split()) for s in _memory_sentences(a.memory)}
    out = [writer.cite(flat, cid) for cid in a.ids for s in a.ctx.sentences(cid)[:3]
           if (flat := " ".join(s.split())) not in known and 5 <= len(flat.split()) <= 45]
    return list(dict.fromkeys(out))[:most]


def _filter_format(a: DecorAsk) -> OutputFormat | None:
    """One to four statements of the results, copied exactly with their ids (the filter's task
    as DECOR states it). Free prose let SmolLM2 fill the memory with text about "the process of
    scientific inquiry" behind real ids, and the answer followed it off topic."""
    statements = kept_statements(a)
    if not statements:
        return tagged("filter", cited_prose(a.ids, sentences=(1, 4), words=(6, 30))) if a.ids else None
    # In the results' order, each at most once: SmolLM2 otherwise kept one statement twice, and
    # the degenerate-text check refused the whole paragraph (three times, then the fallback).
    # At least one: the role refuses an empty filter, so the format must not offer one.
    parts = [f"{literal(s)} " for s in statements[:-1]] + [literal(statements[-1])]
    return tagged("filter", "(?:" + "|".join(parts[k] + "".join(f"(?:{p})?" for p in parts[k + 1:])
                                             for k in range(len(parts))) + ")")




def _decor_plan(a: DecorAsk) -> OutputFormat:
    # STOP only once there is something to answer from: an empty memory ends in a fallback answer.
    return tagged("search", f"(?:STOP|{_plan_query(a)})" if a.memory else _plan_query(a))


def _condense(a: DecorAsk) -> OutputFormat | None:
    ids = memory_ids(a.memory)
    return OutputFormat("facts", json_schema={
        "type": "object", "required": ["facts"], "additionalProperties": False, "properties": {"facts": {
            "type": "array", "minItems": 1, "maxItems": 8,
            "items": {"type": "string", "pattern": f"^{cited_sentence(ids, (4, 30))}$"}}}}) if ids else None


def _decor_answer(a: DecorAsk) -> OutputFormat | None:
    ids = memory_ids(a.memory)
    return tagged("answer", cited_prose(ids, sentences=(4, 5), words=(10, 25))) if ids else None


# -- dag search agent -----------------------------------------------------------------------

def _searcher(a: Any) -> OutputFormat:
    """Real queries in the words of the step and its evidence, each naming a word of the step:
    unconstrained, SmolLM2 wrote ``"queries": ["..."]`` in 12 of 18 searcher replies. The hf
    backend's distinct-word ban catches some repeats ("galaxy exponential galaxy"), not all
    ("Appeal appeal"); the acceptance check refuses the rest."""
    vocab = word_choice([a.node.query, *a.node.key_points, *(h.title for h in a.hits)])
    return OutputFormat("reformulation", distinct_words=True, json_schema=queries_schema(
        "queries", lo=0, terms=term_words([a.node.query, *a.node.key_points]), vocab=vocab,
        before={"done": {"type": "boolean"}}))



# -- tools agent ----------------------------------------------------------------------------

def _step_format(a: StepAsk, *, may_call: bool) -> OutputFormat | None:
    """A search or browse call, or (once results were shown) an answer citing only shown ids.
    Browsing stops after two pages: a weak model would otherwise browse until its turns run out.
    A search after the first must name a term no earlier query had (see :func:`new_terms`), and
    a browse opens only a search result whose document was not opened yet: a small model,
    decoding greedily, otherwise repeats its first search and its first browse."""
    shown = a.session.shown
    if not may_call and not shown:
        return None
    browsed = sum(1 for i in shown if "-F" in i)
    openable = _openable(a.session)
    may_browse = browsed < 2 and bool(openable)
    if a.no_search and shown:
        answer = rf"<answer>{answer_spans(shown)}</answer>"
        if may_call and may_browse:
            return OutputFormat("step", regex=rf'(?:<tool_call>\{{"name": "browse", "arguments": \{{"doc_id": '
                                rf'"{id_choice(openable)}"\}}\}}</tool_call>)|(?:{answer})')
        return OutputFormat("step", regex=answer)
    searched = searched_queries(a.convo)
    question = a.convo[1]["content"] if len(a.convo) > 1 else ""
    terms = new_terms(question, a.session, searched) if searched else None
    if searched and not terms and not shown:
        return None  # nothing new to search for and nothing to cite: the acceptance checks decide
    return OutputFormat("step", regex=_step_regex(shown, may_call=may_call, browse=openable if may_browse else [],
                                                  terms=terms, vocab=query_vocab(question, a.session)))


def _step_regex(shown: Sequence[str], *, may_call: bool, browse: Sequence[str], terms: Sequence[str] | None,
                vocab: str | None = None) -> str:
    """:func:`~deepr.profiles.formats.tool_step` with the follow-up rules: a search carries one of
    ``terms`` (when given) and draws its words from ``vocab`` (when given), a browse opens one of
    ``browse``."""
    word = vocab or QUERY_WORD
    query = query_with(terms, word=word) if terms else search_query(word=word)
    if not (terms or browse) or not may_call:
        return tool_step(shown, may_call=may_call, may_browse=bool(browse), query=query)
    options = [rf'<tool_call>\{{"name": "search", "arguments": \{{"query": "{query}"\}}\}}</tool_call>']
    if browse:
        options.append(rf'<tool_call>\{{"name": "browse", "arguments": \{{"doc_id": "{id_choice(browse)}"\}}\}}'
                       r"</tool_call>")
    if shown:
        options.append(rf"<answer>{answer_spans(shown)}</answer>")
    return "|".join(f"(?:{o})" for o in options)


def new_terms(question: str, session: ToolSession, searched: set[str], most: int = 40) -> list[str]:
    """Words a follow-up search may add: those of the question and of the titles of the results
    shown so far (4+ letters, not stop words) that no earlier query used. A query that carries
    one of them cannot repeat an earlier query, and it follows a lead the results gave."""
    used = {w for q in searched for w in re.findall(r"[a-z0-9']+", q)}
    cat = session.ctx.catalog
    titles = [cat[c].title or "" for c in session.shown if c in cat]
    return [w for w in term_words([question, *titles]) if w.lower() not in used][:most]


def query_vocab(question: str, session: ToolSession) -> str | None:
    """The words a search may use (:func:`~deepr.profiles.formats.word_choice`): those of the
    question and of the titles shown so far. SmolLM2 searched "What causes the seasons
    onearth's's's's' Autumn" and then "... onearth'ss'ss-soulunetrode Trojan"."""
    cat = session.ctx.catalog
    return word_choice([question, *(cat[c].title or "" for c in session.shown if c in cat)])


def _openable(session: ToolSession) -> list[str]:
    """Search results whose document no browse has opened yet (one id per document)."""
    cat = session.ctx.catalog
    opened = {cat[c].doc_id for c in session.shown if "-F" in c and c in cat}
    out: dict[str, str] = {}
    for c in session.shown:
        if "-F" not in c and c in cat and cat[c].doc_id not in opened:
            out.setdefault(cat[c].doc_id, c)
    return list(out.values())



# -- warp ---------------------------------------------------------------------------------

def _terms(a: WarpAsk, *texts: str) -> list[str]:
    """Content words of the question and ``texts`` that a query or title must carry one of
    (see formats.query_with): SmolLM2's warp searches were "SOLICY 101" and "1234s 1234s"."""
    return term_words([a.run.query, *texts])


def _init_format(a: WarpAsk) -> OutputFormat:
    """The report title and sections, in the question's and the background's words: SmolLM2
    titled its outline "Initialize the report" and its sections "Sender's note to the report
    writer's request", and the searches that followed looked for those words."""
    terms = _terms(a)
    vocab = label_vocab([a.run.query, a.run.ctx.catalog.evidence(a.ids, 300)]) if terms else None
    title = query_with(terms, (2, 10), vocab or LABEL_WORD) if terms else TITLE
    return OutputFormat("initialize", json_schema=action_schema(
        "initialize", title=text(title), sections=items_schema(2, 3, terms, vocab)), distinct_words=True)


def _deepen_format(a: WarpAsk) -> OutputFormat | None:
    """expand one of the expandable sections (by its real position) or, unless forced, terminate."""
    sections = a.run.outline.expandable(a.run.ctx.config.max_levels)
    can = [f"section-{s.pos}" for s in sections]
    texts = [f"{s.title}. {s.plan}" for s in sections]
    items = items_schema(2, 3, _terms(a, *texts), label_vocab([a.run.query, *texts]))
    options = [action_schema("expand", position={"enum": can}, subsections=items)] if can else []
    if not a.forced:
        options.append(action_schema("terminate"))
    if not options:
        return None
    return OutputFormat("expand", json_schema=options[0] if len(options) == 1 else {"anyOf": options},
                        distinct_words=True)



def _warp_search(a: Any) -> OutputFormat:
    return OutputFormat("search", json_schema=queries_schema(
        "keywords", name="search", terms=_terms(a, *a.default), vocab=word_choice([a.run.query, *a.default])))


def _warp_write(a: Any) -> OutputFormat | None:
    return tagged("content", cited_prose(a.sec.ids, sentences=(2, 5))) if a.sec.ids else None


STRICT = {
    answerer.WAVE: _wave, answerer.FINAL: _final,
    decor.PLAN: _decor_plan, decor.FILTER: _filter_format, decor.CONDENSE: _condense, decor.ANSWER: _decor_answer,
    search_agent.REFORMULATE: _searcher,
    tools_agent.STEP: lambda a: _step_format(a, may_call=True),
    tools_agent.ANSWER: lambda a: _step_format(a, may_call=False),
    warp.SEARCH: _warp_search, warp.INITIALIZE: _init_format, warp.WRITE: _warp_write, warp.DEEPEN: _deepen_format,
}
SCHEMA = {answerer.WAVE: lambda: OutputFormat("wave", json_schema=_WaveShape.model_json_schema())}
