"""decor mode: DECOR's planner / filter / answerer loop with curated memory (001 Alg. 1).

For t = 1..T_max: the planner sees the query, the memory and the past queries (never raw
documents) and emits one search query or STOP; the environment retrieves the top-k; the
filter turns query + raw documents into one evidence paragraph (cited by id); when the
memory would exceed L_max tokens it is first condensed into atomic facts; the entry is
added. The answerer sees only the query and the memory and writes a short cited answer.
Results of step t are catalogued as ``S<t>-R<k>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from deepr.acceptance import FREE_TEXT, query_words
from deepr.roles import JSONReply, Role, TaggedReply
from deepr.text import strip_citations

from deepr.agent.citations import cited_ids, normalize
from deepr.agent.env import Ctx
from deepr.agent.extract import (FRAMING, anchored_query, approx_tokens, content_terms, focus_query,
                                 sub_questions)
from deepr.agent import writer

PLANNER_SYSTEM = """You plan the searches of a question-answering system. From the question, the facts \
gathered so far and the searches already made, name the single fact still missing and write one precise \
search query for it that keeps every constraint of the question (names, dates, categories, relations). \
Never repeat an earlier search. If the facts already answer the question, reply <search>STOP</search>.
Reply exactly as: <think>which fact is missing</think><search>the query</search>"""

FILTER_SYSTEM = """You filter search results. Keep every statement that helps answer the question through \
the search query and drop everything else; copy each kept statement exactly as written (names, dates, \
numbers, titles); add no commentary. Write one paragraph and put the id of the result each statement comes \
from in brackets after it, e.g. [S1-R2].
Reply exactly as: <think>what matters</think><filter>the paragraph</filter>"""

ANSWER_SYSTEM = """You answer a question strictly from the facts given. Start with a short, direct answer \
(a name, date, number or short phrase) in one sentence, then support it in three or four sentences taken \
from the facts. After each sentence cite, in brackets, the ids of the facts you used, e.g. [S1-R2].
Reply exactly as: <think>your reasoning</think><answer>the answer</answer>"""

CONDENSE_SYSTEM = """You condense a memory of search findings into short atomic facts, one fact per item, \
without adding reasoning. Keep the bracketed source ids of each fact. Reply with the JSON object only: \
{"facts": ["fact [S1-R2]", ...]}"""

_STOP = re.compile(r"^\s*(stop|none|null|n/?a|done)\s*\.?$", re.I)


@dataclass
class MemoryItem:
    query: str
    evidence: str


@dataclass
class DecorOutcome:
    answer: str
    memory: list[MemoryItem]
    queries: list[str] = field(default_factory=list)


class Facts(BaseModel):
    facts: list[str] = Field(min_length=1)


def memory_text(memory: list[MemoryItem]) -> str:
    return "\n".join(f"- ({m.query}) {m.evidence}" for m in memory) or "(empty)"


def _memory_ids(memory: list[MemoryItem]) -> list[str]:
    return list(dict.fromkeys(c for m in memory for c in cited_ids(m.evidence)))


def _norm(q: str) -> str:
    return " ".join(q.lower().split())


def _plan_check(body: str, past: list[str], memory: list[MemoryItem] = ()) -> list[str]:
    if _STOP.match(body):
        # with no facts gathered, STOP would leave the answer nothing to cite
        return [] if _memory_ids(list(memory)) else ["no facts were gathered yet, so STOP is not possible; write a "
                                                     "search query for the question"]
    if _norm(body) in {_norm(p) for p in past}:
        return [f"the search {body!r} was already made; write a different query or STOP"]
    return []


@dataclass
class DecorAsk:
    ctx: Ctx
    query: str = ""
    memory: list[MemoryItem] = field(default_factory=list)
    past: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    question: str = ""  # the user's question, when ``query`` is a search query (the filter)


def _planner_messages(a: DecorAsk) -> list[dict[str, str]]:
    user = (f"Question: {a.query}\nFacts so far:\n{memory_text(a.memory)}\nSearches made: "
            f"{'; '.join(a.past) or '(none)'}")
    return [{"role": "system", "content": PLANNER_SYSTEM}, {"role": "user", "content": user}]


def _filter_messages(a: DecorAsk) -> list[dict[str, str]]:
    results = a.ctx.catalog.evidence(a.ids) or "(none)"
    # The question keeps the filter on topic when the planner's query drifts ("the question about …").
    asked = f"Question: {a.question}\n" if a.question else ""
    return [{"role": "system", "content": FILTER_SYSTEM},
            {"role": "user", "content": f"{asked}Search query: {a.query}\nResults:\n{results}"}]


def _condense_messages(a: DecorAsk) -> list[dict[str, str]]:
    return [{"role": "system", "content": CONDENSE_SYSTEM},
            {"role": "user", "content": f"Question: {a.query}\nMemory:\n{memory_text(a.memory)}"}]


def _answer_messages(a: DecorAsk) -> list[dict[str, str]]:
    return [{"role": "system", "content": ANSWER_SYSTEM},
            {"role": "user", "content": f"Question: {a.query}\nFacts:\n{memory_text(a.memory)}"}]


def _planned(a: DecorAsk, body: str) -> str | None:
    return None if _STOP.match(body) else " ".join(body.split())


PLAN = Role(
    name="decor_planner", action="plan", messages=_planner_messages, output=TaggedReply("search", required=True),
    accept=(*FREE_TEXT, query_words(lambda b: [] if _STOP.match(b) else [b])),
    check=lambda a, b: _plan_check(b, a.past, a.memory),
    extractive=lambda a: next_query(a.ctx, a.query, a.memory, a.past) or "STOP",
    result=_planned, fallback=lambda a: "STOP", max_tokens=256,
    on_fail="step {step}: planner failed, the loop stops")

FILTER = Role(
    name="decor_filter", action="filter", messages=_filter_messages, output=TaggedReply("filter", required=True),
    accept=FREE_TEXT,
    check=lambda a, b: a.ctx.catalog.check(normalize(b), a.ids, require=True),
    extractive=lambda a: filter_evidence(a.ctx, a.query, a.ids, a.memory),
    result=lambda a, b: normalize(b).strip(), max_tokens=768,
    on_fail="step {step}: evidence filtered extractively after the model failed")

CONDENSE = Role(
    name="condenser", action="condense", messages=_condense_messages, output=JSONReply(Facts),
    accept=FREE_TEXT,
    check=lambda a, v: [e for f in v["facts"] for e in a.ctx.catalog.check(normalize(f), _memory_ids(a.memory))],
    extractive=lambda a: {"facts": condense_facts(a.ctx, a.query, a.memory, a.ctx.config.memory_limit // 2)},
    result=lambda a, v: [normalize(f) for f in v["facts"]], max_tokens=1024,
    on_fail="memory condensed extractively after the model failed")

ANSWER = Role(
    name="decor_answerer", action="answer", messages=_answer_messages, output=TaggedReply("answer", required=True),
    accept=FREE_TEXT,
    check=lambda a, b: _answer_check(a, b),
    extractive=lambda a: short_answer(a.ctx, a.query, a.memory),
    result=lambda a, b: normalize(b).strip(), max_tokens=640,  # room for the small profile's longest answer
    on_fail="answer extracted from memory after the model failed")


def _answer_check(a: DecorAsk, body: str) -> list[str]:
    ids = _memory_ids(a.memory)
    if not ids:  # an answer from no evidence cites nothing: refused, the recorded fallback says so
        return ["no evidence was gathered, so the answer has nothing to cite"]
    return a.ctx.catalog.check(normalize(body), ids, require=True)


async def plan_step(ctx: Ctx, query: str, memory: list[MemoryItem], past: list[str], t: int) -> str | None:
    """The planner's next search query, or None for STOP."""
    return (await ctx.perform(PLAN, DecorAsk(ctx, query, memory, past), step=t)).value


async def filter_step(ctx: Ctx, q: str, ids: list[str], t: int, memory: list[MemoryItem] = (),
                      question: str = "") -> str:
    """One evidence paragraph from the raw results of ``q`` (may be empty: nothing relevant)."""
    return (await ctx.perform(FILTER, DecorAsk(ctx, q, list(memory), ids=ids, question=question), step=t)).value


async def condense(ctx: Ctx, query: str, memory: list[MemoryItem]) -> list[MemoryItem]:
    """Memory over L_max: rewrite it as atomic facts (citations kept)."""
    before = approx_tokens(memory_text(memory))
    facts = (await ctx.perform(CONDENSE, DecorAsk(ctx, query, memory))).value
    condensed = [MemoryItem("condensed facts", " ".join(facts))]
    ctx.tracer.decide("memory condensed into atomic facts", tokens_before=before,
                      tokens_after=approx_tokens(memory_text(condensed)), facts=len(facts))
    return condensed


async def answer_step(ctx: Ctx, query: str, memory: list[MemoryItem]) -> str:
    return (await ctx.perform(ANSWER, DecorAsk(ctx, query, memory))).value


async def run_decor(ctx: Ctx, query: str) -> DecorOutcome:
    cfg, tr = ctx.config, ctx.tracer
    memory: list[MemoryItem] = []
    past: list[str] = []
    for t in range(1, cfg.decor_steps + 1):
        with tr.phase("plan"):
            q = await plan_step(ctx, query, memory, past, t)
        if q is None:
            tr.decide(f"step {t}: planner says STOP", step=t)
            break
        past.append(q)
        with tr.phase("search"):
            ids = ctx.search(f"S{t}", q, step=t)
        with tr.phase("filter"):
            evidence = await filter_step(ctx, q, ids, t, memory, question=query)
        if not evidence:
            tr.decide(f"step {t}: nothing relevant in the results of {q!r}", step=t)
            continue
        if memory and approx_tokens(memory_text(memory)) + approx_tokens(evidence) > cfg.memory_limit:
            with tr.phase("condense"):
                memory = await condense(ctx, query, memory)
        memory.append(MemoryItem(q, evidence))
    else:
        tr.decide(f"reached T_max = {cfg.decor_steps} steps")
    with tr.phase("answer"):
        answer = await answer_step(ctx, query, memory)
    tr.extra.update(memory=[m.__dict__ for m in memory], queries=past)
    return DecorOutcome(answer, memory, past)

# --- the non-LLM implementation of these roles (SPEC §9) --------------------
#
# Extractive DECOR roles (SPEC §9).
#
# - planner: first the whole question (all its constraints); then each sub-question of a
#   multi-part request not yet searched, or, for a single question, its named entities plus
#   the content words the memory lacks; STOP when nothing is left or a query would repeat;
# - filter: the sentences of the results closest to the search query (within 70% of the
#   best similarity, at most two per result, none already in memory), each with its id;
# - condense: memory sentences, near-duplicates removed, ranked by similarity to the
#   question and cut to a token budget;
# - answerer: the memory sentence most similar to the question (one per sub-question), plus
#   the sentence covering most question terms the first one misses.


_PRONOUNS = frozenset("it its he his she her they their this these".split())
PART_COVERED = 0.75  # a sub-question counts as answered by memory only above this cosine


def _memory_sentences(memory: list[Any]) -> list[str]:
    return [s for m in memory for s in writer.cited_sentences(m.evidence)]


def next_query(ctx: Ctx, query: str, memory: list[Any], past: list[str]) -> str | None:
    seen = {_norm(p) for p in past}
    if not past:
        return focus_query(query, 48)
    parts = sub_questions(query)
    sents = [strip_citations(s) for s in _memory_sentences(memory)]
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
    known = {" ".join(strip_citations(s).split()) for s in _memory_sentences(memory)}
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
    return " ".join(out)


def condense_facts(ctx: Ctx, query: str, memory: list[Any], budget: int) -> list[str]:
    sents = list(dict.fromkeys(_memory_sentences(memory)))
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
    return " ".join(_with_subject(ctx, cands[i][1]) for i in picked)


def _with_subject(ctx: Ctx, sentence: str) -> str:
    """Name the subject of a sentence that opens with a pronoun ("It is the longest river..."):
    a short answer stands alone, so prefix the title of the source it came from."""
    ids = [c for c in cited_ids(sentence) if c in ctx.catalog]
    first = sentence.split(" ", 1)[0].lower()
    if ids and first in _PRONOUNS:
        return f"{ctx.catalog[ids[0]].title}: {sentence}"
    return sentence
