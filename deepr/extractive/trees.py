"""Extractive (no language model) algorithms for the tree-building roles.

Used by :mod:`deepr.data.tree_roles` as the roles' non-LLM implementation. Every function is
deterministic given the corpus, the retriever and the embedder:

- root query: the seed topic itself (Alg. 1 of the DeepRubric paper starts from it);
- decompose: child queries from the titles of retrieved documents that the branch has
  not used yet and from key phrases of the node's statements, shaped by facet templates
  (another document → comparison; a statement with figures → quantitative; with risk
  words → risks; with a year → timeline) and deduplicated by embedding;
- grounding: retrieval score (normalised by the best hit) plus lexical overlap;
- evidence extraction: the 1–3 sentences of the passage most similar to the query;
- atomic gating: no new documents found beyond those the branch already uses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deepr.records import Hit
from deepr.evidence.phrases import phrases_in
from deepr.text import STOP_WORDS, split_sentences, tok, word_count

Embed = Callable[[list[str]], np.ndarray]

# Words our own query templates add: they must not count as evidence overlap.
TEMPLATE_WORDS = frozenset({"compared", "versus", "risks", "failures", "figures", "timeline"})
_RISK = re.compile(r"\b(risk|danger|fail|failure|threat|disease|death|war|decline|crisis|damage|"
                   r"toxic|collapse|criticism|controvers|conflict|loss|injur|extinct|disaster)", re.I)
_YEAR = re.compile(r"\b(1[0-9]{3}|20[0-9]{2})s?\b")
_NUMBER = re.compile(r"\d")
# Words, plus the punctuation that ends a phrase ("Rome, Carthage" is two names, not one).
_WORD = re.compile(r"[A-Za-z0-9][\w'’.\-]*|[,;:()\[\]\"“”]")
_CONNECT = frozenset({"of", "de", "for", "la", "von", "van", "del", "du", "le", "da"})
# Capitalised words that, alone, name no facet worth a child query: dates and demonyms.
_NOT_TOPICS = frozenset("""january february march april may june july august september october
november december monday tuesday wednesday thursday friday saturday sunday along although
however today since despite american british english french german italian spanish russian
chinese japanese indian african european asian greek latin arab arabic jewish christian muslim
catholic canadian australian mexican brazilian dutch swedish norwegian danish polish irish
scottish korean persian egyptian turkish western eastern northern southern""".split())
_PRONOUN = re.compile(r"^(It|He|She|They|This)\b(?!\s+(?:is|was)\s+(?:also\s+)?(?:a|an|the)\s+(?:list|term))")


@dataclass
class Proposal:
    """One proposed child sub-query and the facet it is meant to cover."""

    query: str
    facet: str = ""
    phrase: str = ""  # the topic phrase the child is about (anchor for its own children)


@dataclass
class NodeCtx:
    """What the roles see of one node while the tree grows."""

    query: str
    depth: int
    phrase: str
    root_topic: str
    anchor: str = ""  # the parent's phrase, which this node's query connects to its own
    hits: list[Hit] = field(default_factory=list)
    support: list[int] = field(default_factory=list)  # indices into hits
    statements: list[str] = field(default_factory=list)
    path: list[str] = field(default_factory=list)  # ancestor queries, root first
    seen_docs: set[str] = field(default_factory=set)  # documents ancestors already use


def cut_words(text: str, max_words: int) -> str:
    words = text.split()
    return " ".join(words[:max_words])


def ground(query: str, hits: Sequence[Hit], *, min_overlap: float, threshold: float,
           max_docs: int, links: Sequence[str] = (), seen: set[str] | frozenset = frozenset()) -> list[int]:
    """Indices of hits that support ``query``: 0.5·(score / best score) + 0.5·overlap.

    ``links`` (the parent's phrase and the child's own) must each share a word with a
    supporting passage, so a child is grounded by text that connects it to its parent
    rather than by a document about the new phrase alone. One passage per document;
    documents the branch has not used yet (not in ``seen``) come first, so a child adds
    evidence instead of restating its ancestors'.
    """
    q = tok(query) - TEMPLATE_WORDS
    if not q or not hits:
        return []
    groups = [g for g in (tok(x) - TEMPLATE_WORDS for x in links) if g]
    best = max(h.score for h in hits)
    scored = []
    for i, h in enumerate(hits):
        words = tok(f"{h.title} {h.text}")
        overlap = len(q & words) / len(q)
        ret = h.score / best if best > 0 else 1.0 / (1 + i)
        s = 0.5 * ret + 0.5 * overlap
        if overlap >= min_overlap and s >= threshold and all(g & words for g in groups):
            scored.append((h.doc_id in seen, -s, i))
    picked, docs = [], set()
    for _, _, i in sorted(scored):
        if hits[i].doc_id not in docs:
            picked.append(i)
            docs.add(hits[i].doc_id)
    return picked[:max_docs]


def _self_contained(sentence: str, title: str) -> str:
    # A leading pronoun makes a statement useless out of context; the passage's title is
    # what the pronoun refers to in an encyclopedic summary.
    if title and _PRONOUN.match(sentence):
        return _PRONOUN.sub(title, sentence, count=1)
    return sentence


def extract(query: str, hit: Hit, embed: Embed, *, max_statements: int = 3,
            min_sim: float = 0.2, margin: float = 0.15) -> list[str]:
    """The 1–3 sentences of the passage closest to the query (at least the closest one); a
    sentence addressed to the reading model is never a statement (deepr.evidence.instructions)."""
    from deepr.evidence.instructions import instructs_reader

    # four words as the sentence's language counts them: a Chinese sentence is one space-separated part
    sents = [s for s in split_sentences(hit.text) if word_count(s) >= 4 and not instructs_reader(s)]
    if not sents:
        return []
    vecs = embed([query, *sents])
    sims = vecs[1:] @ vecs[0]
    order = [int(i) for i in np.argsort(-sims, kind="stable")]
    best = float(sims[order[0]])
    keep = [i for i in order[:max_statements] if sims[i] >= max(min_sim, best - margin)] or order[:1]
    return [_self_contained(sents[i], hit.title) for i in keep]


def gate(ctx: NodeCtx) -> tuple[bool, str]:
    """Atomic when the node's retrieval found no document beyond those the branch uses."""
    own = {ctx.hits[i].doc_id for i in ctx.support}
    new_here = own - ctx.seen_docs
    unseen = {h.doc_id for h in ctx.hits} - ctx.seen_docs - own
    if not new_here:
        return True, "its supporting documents are all used by its ancestors already"
    if not unseen:
        return True, "retrieval found no document the branch does not use yet"
    return False, f"{len(unseen)} retrieved documents are not used by the branch yet"


_NOT_TERM = re.compile(r"(ly|ed|ing)$")
_VERBS = frozenset("""refers refer includes include known called uses used became become becomes made makes
make considered based regarded began found located developed according described depends remains
remained took gave held born died played wrote written means contains consists gives takes leads
comes goes seen shown""".split())


def key_phrases(sentence: str) -> list[str]:
    """Capitalised spans (names, places, works) of a sentence.

    Leading stop words are dropped, and a lone capitalised word opening the sentence is
    skipped: it is capitalised by position, not because it names something.
    """
    out, span, start = [], [], 0
    words = _WORD.findall(sentence)
    for pos, w in enumerate([*words, ""]):
        joins = span and (w.lower() in _CONNECT or (w.lower() == "the" and span[-1].lower() in _CONNECT))
        if w[:1].isupper() or joins:
            if not span:
                start = pos
            w = re.sub(r"['’]s$", "", w.rstrip(",’'"))
            span.append(w[:-1] if w.endswith(".") and "." not in w[:-1] else w)  # sentence end, not "G.I."
            continue
        while span and span[-1].lower() in _CONNECT:
            span.pop()
        lead = next((i for i, x in enumerate(span) if x.lower() not in STOP_WORDS), None)
        if lead is not None:
            kept = span[lead:]
            lone = len(kept) == 1
            skip = lone and (start + lead == 0 or kept[0].lower() in _NOT_TOPICS or len(kept[0]) < 3)
            if not skip:
                out.append(" ".join(kept))
        span = []
    return out


def term_phrases(sentence: str) -> list[str]:
    """Runs of two or three lower-case content words ("specular reflection"): the concepts
    of abstract topics, which have few names to capitalise. Adverbs, participles and common
    verbs end a run: "commonly refers" names nothing."""
    out, run = [], []
    for w in [*_WORD.findall(sentence), ""]:
        if w.isalpha() and w.islower() and len(w) > 3 and w not in STOP_WORDS and not _NOT_TERM.search(w) \
                and w not in _VERBS:
            run.append(w)
            continue
        if 2 <= len(run) <= 3:
            out.append(" ".join(run))
        run = []
    return out


def _facet_of(sentence: str) -> str:
    if _RISK.search(sentence):
        return "risks"
    if _NUMBER.search(_YEAR.sub("", sentence)):
        return "quantitative"
    if _YEAR.search(sentence):
        return "timeline"
    return "related"


def _shape(phrase: str, facet: str, anchor: str, max_words: int, table: dict[str, Any] | None = None) -> str:
    # the query's own words in the corpus's language (deepr.evidence.phrases), never English around Chinese
    table = table or phrases_in("en")
    shape = table["tree_compared"] if facet == "comparison" else table["tree_facet"]
    return cut_words(shape.format(phrase=phrase, anchor=anchor), max_words)


def decompose(ctx: NodeCtx, limit: int, embed: Embed, *, max_words: int,
              redundancy: float, table: dict[str, Any] | None = None) -> list[Proposal]:
    """Up to 2×limit candidate children, facets interleaved, best first.

    The builder keeps the first ``limit`` that are grounded and non-redundant, so
    over-proposing here trades a few cheap retrievals for fuller trees.
    """
    covered = tok(" ".join([*ctx.path, ctx.query, ctx.root_topic]))
    used_docs = ctx.seen_docs | {ctx.hits[i].doc_id for i in ctx.support}
    by_facet: dict[str, list[Proposal]] = {}
    seen: set[str] = set()

    def add(phrase: str, facet: str) -> bool:
        key, words = phrase.lower(), tok(phrase)
        # Mostly-new words only: "Miles Dewey Davis" under "Miles Davis" is not a new facet.
        if key in seen or not words or len(words - covered) * 2 < len(words):
            return False
        seen.add(key)
        by_facet.setdefault(facet, []).append(
            Proposal(_shape(phrase, facet, ctx.phrase, max_words, table), facet, phrase))
        return True

    node_words = tok(ctx.query) - TEMPLATE_WORDS
    for h in ctx.hits:
        # Only documents that are about this node seed comparisons; the rest is retrieval noise.
        on_topic = node_words and len(node_words & tok(f"{h.title} {h.text}")) * 2 >= len(node_words)
        if h.doc_id not in used_docs and h.title and on_topic:
            add(h.title, "comparison")
    for s in ctx.statements:
        # One phrase per sentence: its other names would pull the same sentence back in.
        next((True for p in key_phrases(s) + term_phrases(s) if add(p, _facet_of(s))), None)
    order = ["comparison", "risks", "quantitative", "timeline", "related"]
    ranked: list[Proposal] = []
    while any(by_facet.get(f) for f in order):
        for f in order:
            if by_facet.get(f):
                ranked.append(by_facet[f].pop(0))
    # Single words ("American", "Paris") are the vaguest facets: try them last.
    ranked.sort(key=lambda p: len(p.phrase.split()) == 1)
    return dedup(ranked, [*ctx.path, ctx.query], embed, redundancy)[: 2 * limit]


def dedup(props: list[Proposal], context: list[str], embed: Embed, threshold: float) -> list[Proposal]:
    """Drop proposals whose embedding cosine with the context or an earlier kept one is above threshold."""
    if not props:
        return []
    vecs = embed([*context, *(p.query for p in props)])
    ctx_v, prop_v = vecs[: len(context)], vecs[len(context):]
    kept: list[int] = []
    for i in range(len(props)):
        others = [ctx_v] + ([prop_v[kept]] if kept else [])
        sims = np.concatenate([o @ prop_v[i] for o in others if len(o)]) if context or kept else np.zeros(0)
        if sims.size == 0 or float(sims.max()) < threshold:
            kept.append(i)
    return [props[i] for i in kept]


# --- the roles' replies (deepr.data.tree_roles): each takes the role's input, duck-typed ---------


def root_reply(a: Any) -> dict[str, Any]:
    return {"query": a.seed.title}


def gate_reply(a: Any) -> dict[str, Any]:
    return dict(zip(("atomic", "reason"), gate(a.ctx)))


def decompose_reply(a: Any) -> dict[str, Any]:
    r = a.roles
    props = decompose(a.ctx, a.limit, r.embed, max_words=r.max_words, redundancy=r.redundancy,
                      table=phrases_in(a.language))
    return {"queries": [{"query": p.query, "facet": p.facet, "phrase": p.phrase} for p in props]}


def ground_reply(a: Any) -> dict[str, Any]:
    ctx, r = a.ctx, a.roles
    links = [ctx.anchor, ctx.phrase] if ctx.anchor and ctx.phrase != ctx.query else []
    # The root is a bare title: most of its words must match, or "Domestic turkey"
    # would be grounded by documents about the country.
    overlap = max(r.min_overlap, r.root_overlap) if ctx.depth == 0 else r.min_overlap
    picked = ground(ctx.query, ctx.hits, min_overlap=overlap, threshold=r.ground_threshold,
                    max_docs=r.max_docs, links=links, seen=ctx.seen_docs)
    return {"supporting": [i + 1 for i in picked]}


def extract_reply(a: Any) -> dict[str, Any]:
    return {"statements": extract(a.query, a.hit, a.roles.embed, max_statements=a.roles.max_statements)}
