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

from pydantic import BaseModel, Field

from deepr.roles.acceptance import FREE_TEXT, query_words
from deepr.extractive import decor as ex
from deepr.text.lang import ask_in_language
from deepr.roles import JSONReply, Role, TaggedReply

from deepr.evidence.citations import cited_ids, normalize
from deepr.evidence.env import Ctx
from deepr.evidence.extract import approx_tokens

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


def memory_ids(memory: list[MemoryItem]) -> list[str]:
    return list(dict.fromkeys(c for m in memory for c in cited_ids(m.evidence)))


def _norm(q: str) -> str:
    return " ".join(q.lower().split())


def _plan_check(body: str, past: list[str], memory: list[MemoryItem] = ()) -> list[str]:
    if _STOP.match(body):
        # with no facts gathered, STOP would leave the answer nothing to cite
        return [] if memory_ids(list(memory)) else ["no facts were gathered yet, so STOP is not possible; write a "
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
    return ask_in_language([{"role": "system", "content": PLANNER_SYSTEM}, {"role": "user", "content": user}], a.query)


def _filter_messages(a: DecorAsk) -> list[dict[str, str]]:
    results = a.ctx.catalog.evidence(a.ids) or "(none)"
    # The question keeps the filter on topic when the planner's query drifts ("the question about …").
    asked = f"Question: {a.question}\n" if a.question else ""
    return ask_in_language([{"role": "system", "content": FILTER_SYSTEM},
                            {"role": "user", "content": f"{asked}Search query: {a.query}\nResults:\n{results}"}],
                           a.question or a.query)


def _condense_messages(a: DecorAsk) -> list[dict[str, str]]:
    user = f"Question: {a.query}\nMemory:\n{memory_text(a.memory)}"
    return ask_in_language([{"role": "system", "content": CONDENSE_SYSTEM}, {"role": "user", "content": user}], a.query)


def _answer_messages(a: DecorAsk) -> list[dict[str, str]]:
    user = f"Question: {a.query}\nFacts:\n{memory_text(a.memory)}"
    return ask_in_language([{"role": "system", "content": ANSWER_SYSTEM}, {"role": "user", "content": user}], a.query)


def _planned(a: DecorAsk, body: str) -> str | None:
    return None if _STOP.match(body) else " ".join(body.split())


PLAN = Role(
    name="decor_planner", action="plan", messages=_planner_messages, output=TaggedReply("search", required=True),
    accept=(*FREE_TEXT, query_words(lambda b: [] if _STOP.match(b) else [b])),
    check=lambda a, b: _plan_check(b, a.past, a.memory),
    extractive=ex.plan_reply,
    result=_planned, fallback=lambda a: "STOP", max_tokens=256,
    on_fail="step {step}: planner failed, the loop stops")

FILTER = Role(
    name="decor_filter", action="filter", messages=_filter_messages, output=TaggedReply("filter", required=True),
    accept=FREE_TEXT,
    check=lambda a, b: a.ctx.catalog.check(normalize(b), a.ids, require=True),
    extractive=ex.filter_reply,
    result=lambda a, b: normalize(b).strip(), max_tokens=768, parts=lambda a: ["evidence filter"],
    on_fail="step {step}: evidence filtered extractively after the model failed")

CONDENSE = Role(
    name="condenser", action="condense", messages=_condense_messages, output=JSONReply(Facts),
    accept=FREE_TEXT,
    check=lambda a, v: [e for f in v["facts"] for e in a.ctx.catalog.check(normalize(f), memory_ids(a.memory))],
    extractive=ex.condense_reply,
    result=lambda a, v: [normalize(f) for f in v["facts"]], max_tokens=1024, parts=lambda a: ["condensed memory"],
    on_fail="memory condensed extractively after the model failed")

ANSWER = Role(
    name="decor_answerer", action="answer", messages=_answer_messages, output=TaggedReply("answer", required=True),
    accept=FREE_TEXT,
    check=lambda a, b: _answer_check(a, b),
    extractive=ex.answer_reply,
    result=lambda a, b: normalize(b).strip(), max_tokens=640,  # room for the small profile's longest answer
    parts=lambda a: ["answer"], on_fail="answer extracted from memory after the model failed")


def _answer_check(a: DecorAsk, body: str) -> list[str]:
    ids = memory_ids(a.memory)
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
