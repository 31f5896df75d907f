"""DECOR's roles without a model (001 Alg. 1 roles, no language model).

- planner: first the whole question (all its constraints); then each sub-question of a
  multi-part request not yet searched, or, for a single question, its named entities plus
  the content words the memory lacks; STOP when nothing is left or a query would repeat;
- filter: the sentences of the results closest to the search query (within 70% of the
  best similarity, at most two per result, none already in memory), each with its id;
- condense: memory sentences, near-duplicates removed, ranked by similarity to the
  question and cut to a token budget;
- answerer: the memory sentence most similar to the question (one per sub-question), plus
  the sentence covering most question terms the first one misses.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deepr.evidence import writer
from deepr.evidence.citations import cited_ids
from deepr.evidence.env import Ctx
from deepr.evidence.extract import FRAMING, anchored_query, approx_tokens, content_terms, focus_query, sub_questions
from deepr.text import join_sentences, strip_citations


def plan_reply(a: Any) -> str:
    return next_query(a.ctx, a.query, a.memory, a.past) or "STOP"


def filter_reply(a: Any) -> str:
    return filter_evidence(a.ctx, a.query, a.ids, a.memory)


def condense_reply(a: Any) -> dict[str, Any]:
    return {"facts": condense_facts(a.ctx, a.query, a.memory, a.ctx.config.memory_limit // 2)}


def answer_reply(a: Any) -> str:
    return short_answer(a.ctx, a.query, a.memory)


def _norm(q: str) -> str:
    return " ".join(q.lower().split())


_PRONOUNS = frozenset("it its he his she her they their this these".split())
PART_COVERED = 0.75  # a sub-question counts as answered by memory only above this cosine


def memory_sentences(memory: list[Any]) -> list[str]:
    """The cited sentences of a memory's evidence paragraphs (``m.evidence``)."""
    return [s for m in memory for s in writer.cited_sentences(m.evidence)]


def next_query(ctx: Ctx, query: str, memory: list[Any], past: list[str]) -> str | None:
    seen = {_norm(p) for p in past}
    if not past:
        return focus_query(query, 48)
    parts = sub_questions(query)
    sents = [strip_citations(s) for s in memory_sentences(memory)]
    if len(parts) > 1:
        # Embeddings cannot tell "about the topic" from "answers this part" (a generic sentence
        # on vaccines scores 0.61 against "who developed the first vaccine", the answer 0.66),
        # so every part gets its own search unless the memory matches it very closely.
        cover = (ctx.encode(parts) @ ctx.encode(sents).T).max(axis=1) if sents else np.zeros(len(parts))
        for part, c in zip(parts, cover):
            q = focus_query(part, 32)
            if c < PART_COVERED and _norm(q) not in seen:
                return q
        return None
    have = set(content_terms(" ".join(sents)))
    missing = [t for t in content_terms(focus_query(query)) if t not in have and t not in FRAMING and not t.isdigit()]
    if not missing:
        return None
    q = anchored_query(query, missing)
    return None if _norm(q) in seen else q


def filter_evidence(ctx: Ctx, q: str, ids: list[str], memory: list[Any] = (), k: int = 4,
                    per_source: int = 2) -> str:
    known = {" ".join(strip_citations(s).split()) for s in memory_sentences(memory)}
    pairs = [(s, cid) for cid in ids for s in ctx.sentences(cid) if " ".join(s.split()) not in known]
    if not pairs:
        return ""
    sims = ctx.encode([s for s, _ in pairs]) @ ctx.encode([q])[0]
    order = np.argsort(-sims, kind="stable")
    floor = max(0.2, 0.7 * float(sims[order[0]]))  # relative: only the sentences close to the best
    taken: dict[str, int] = {}
    out = []
    for i in order:
        s, cid = pairs[i]
        if sims[i] < floor or len(out) == k:
            break
        if taken.get(cid, 0) < per_source:
            taken[cid] = taken.get(cid, 0) + 1
            out.append(writer.cite(s, cid))
    return join_sentences(out)


def condense_facts(ctx: Ctx, query: str, memory: list[Any], budget: int) -> list[str]:
    sents = list(dict.fromkeys(memory_sentences(memory)))
    if not sents:
        return []
    vecs = ctx.encode([strip_citations(s) for s in sents])
    order = np.argsort(-(vecs @ ctx.encode([query])[0]), kind="stable")
    kept: list[int] = []
    used = 0
    for i in order:
        if kept and float(np.max(vecs[kept] @ vecs[i])) > 0.9:
            continue
        cost = approx_tokens(sents[i])
        if kept and used + cost > budget:
            break
        kept.append(int(i))
        used += cost
    return [sents[i] for i in sorted(kept)]


def short_answer(ctx: Ctx, query: str, memory: list[Any]) -> str:
    """Best memory sentence per sub-question, plus one more if it covers question terms the
    first leaves out (e.g. the second half of "who ... and what ...")."""
    texts = [m.evidence for m in memory]
    cands = writer.candidates(ctx, [], cited_texts=texts)
    if not cands:
        return "No answer found: the searches returned no relevant evidence."
    parts = sub_questions(query)
    picked: list[int] = []
    for target in (parts if len(parts) > 1 else [query]):
        picked += writer.select(ctx, cands, [target], 1, chosen=picked, floor=0.0)  # memory is curated already
    missing = set(content_terms(query)) - set(content_terms(" ".join(cands[i][0] for i in picked)))
    gain = [(len(missing & set(content_terms(c[0]))), -i) for i, c in enumerate(cands) if i not in picked]
    if missing and gain and max(gain)[0] > 0:
        picked.append(-max(gain)[1])
    return join_sentences(_with_subject(ctx, cands[i][1]) for i in picked)


def _with_subject(ctx: Ctx, sentence: str) -> str:
    """Name the subject of a sentence that opens with a pronoun ("It is the longest river..."):
    a short answer stands alone, so prefix the title of the source it came from."""
    ids = [c for c in cited_ids(sentence) if c in ctx.catalog]
    first = sentence.split(" ", 1)[0].lower()
    if ids and first in _PRONOUNS and ctx.catalog[ids[0]].title.strip():  # some corpora have no titles
        return f"{ctx.catalog[ids[0]].title}: {sentence}"
    return sentence
