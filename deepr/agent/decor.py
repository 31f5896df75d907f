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

from deepr.agent.ask import ask_structured, ask_text, record_extractive
from deepr.agent.citations import cited_ids, normalize
from deepr.agent.env import Ctx
from deepr.agent.extract import approx_tokens
from deepr.agent import decor_extractive as ex

PLANNER_SYSTEM = """You plan the searches of a question-answering system. From the question, the facts \
gathered so far and the searches already made, name the single fact still missing and write one precise \
search query for it that keeps every constraint of the question (names, dates, categories, relations). \
Never repeat an earlier search. If the facts already answer the question, reply <search>STOP</search>.
Reply exactly as: <think>which fact is missing</think><search>the query</search>"""

FILTER_SYSTEM = """You filter search results. Keep every statement that helps answer the search query and \
drop everything else; keep names, dates, numbers and titles exactly as written; add no commentary. Write \
one paragraph and put the id of the result each statement comes from in brackets after it, e.g. [S1-R2].
Reply exactly as: <filter>the paragraph</filter>"""

ANSWER_SYSTEM = """You answer a question strictly from the facts given. Give a short, direct answer (a \
name, date, number or short phrase, then at most one sentence of support) and cite the ids of the facts \
you used in brackets, e.g. [S1-R2].
Reply exactly as: <answer>the answer</answer>"""

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


def _plan_check(body: str, past: list[str]) -> list[str]:
    if _STOP.match(body):
        return []
    if _norm(body) in {_norm(p) for p in past}:
        return [f"the search {body!r} was already made; write a different query or STOP"]
    return []


async def plan_step(ctx: Ctx, query: str, memory: list[MemoryItem], past: list[str], t: int) -> str | None:
    """The planner's next search query, or None for STOP."""
    user = (f"Question: {query}\nFacts so far:\n{memory_text(memory)}\nSearches made: "
            f"{'; '.join(past) or '(none)'}")
    messages = [{"role": "system", "content": PLANNER_SYSTEM}, {"role": "user", "content": user}]
    if ctx.extractive:
        q = ex.next_query(ctx, query, memory, past)
        record_extractive(ctx.tracer, "decor_planner", "plan", messages, f"<search>{q or 'STOP'}</search>", step=t)
        return q
    parsed = await ask_text(ctx.tracer, ctx.llm, messages, role="decor_planner", action="plan", tag="search",
                            check=lambda b: _plan_check(b, past), max_reasks=ctx.config.max_reasks,
                            turn_extra={"step": t}, **ctx.config.chat_kw())
    if not parsed.ok:
        ctx.tracer.decide(f"step {t}: planner failed, the loop stops", reason=parsed.error)
        return None
    return None if _STOP.match(parsed.value) else " ".join(parsed.value.split())


async def filter_step(ctx: Ctx, q: str, ids: list[str], t: int, memory: list[MemoryItem] = ()) -> str:
    """One evidence paragraph from the raw results of ``q`` (may be empty: nothing relevant)."""
    messages = [{"role": "system", "content": FILTER_SYSTEM},
                {"role": "user", "content": f"Search query: {q}\nResults:\n{ctx.catalog.evidence(ids) or '(none)'}"}]
    if not ctx.extractive:
        parsed = await ask_text(ctx.tracer, ctx.llm, messages, role="decor_filter", action="filter", tag="filter",
                                check=lambda b: ctx.catalog.check(normalize(b), ids, require=True),
                                max_reasks=ctx.config.max_reasks, turn_extra={"step": t}, **ctx.config.chat_kw())
        if parsed.ok:
            return normalize(parsed.value).strip()
        ctx.tracer.decide(f"step {t}: evidence filtered extractively after the model failed", reason=parsed.error)
    text = ex.filter_evidence(ctx, q, ids, memory)
    if ctx.extractive:
        record_extractive(ctx.tracer, "decor_filter", "filter", messages, f"<filter>{text}</filter>", step=t)
    return text


async def condense(ctx: Ctx, query: str, memory: list[MemoryItem]) -> list[MemoryItem]:
    """Memory over L_max: rewrite it as atomic facts (citations kept)."""
    allowed = _memory_ids(memory)
    messages = [{"role": "system", "content": CONDENSE_SYSTEM},
                {"role": "user", "content": f"Question: {query}\nMemory:\n{memory_text(memory)}"}]
    before = approx_tokens(memory_text(memory))
    if not ctx.extractive:
        parsed = await ask_structured(
            ctx.tracer, ctx.llm, messages, role="condenser", action="condense", schema=Facts,
            check=lambda v: [e for f in v.facts for e in ctx.catalog.check(normalize(f), allowed)],
            max_reasks=ctx.config.max_reasks, **ctx.config.chat_kw())
        facts = [normalize(f) for f in parsed.value.facts] if parsed.ok else None
        if facts is None:
            ctx.tracer.decide("memory condensed extractively after the model failed", reason=parsed.error)
    else:
        facts = None
    if facts is None:
        facts = ex.condense_facts(ctx, query, memory, ctx.config.memory_limit // 2)
        if ctx.extractive:
            record_extractive(ctx.tracer, "condenser", "condense", messages, {"facts": facts})
    condensed = [MemoryItem("condensed facts", " ".join(facts))]
    ctx.tracer.decide("memory condensed into atomic facts", tokens_before=before,
                      tokens_after=approx_tokens(memory_text(condensed)), facts=len(facts))
    return condensed


async def answer_step(ctx: Ctx, query: str, memory: list[MemoryItem]) -> str:
    allowed = _memory_ids(memory)
    messages = [{"role": "system", "content": ANSWER_SYSTEM},
                {"role": "user", "content": f"Question: {query}\nFacts:\n{memory_text(memory)}"}]
    if not ctx.extractive:
        parsed = await ask_text(ctx.tracer, ctx.llm, messages, role="decor_answerer", action="answer", tag="answer",
                                check=lambda b: ctx.catalog.check(normalize(b), allowed, require=True),
                                max_reasks=ctx.config.max_reasks, **ctx.config.chat_kw())
        if parsed.ok:
            return normalize(parsed.value).strip()
        ctx.tracer.decide("answer extracted from memory after the model failed", reason=parsed.error)
    text = ex.short_answer(ctx, query, memory)
    if ctx.extractive:
        record_extractive(ctx.tracer, "decor_answerer", "answer", messages, f"<answer>{text}</answer>")
    return text


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
            evidence = await filter_step(ctx, q, ids, t, memory)
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

