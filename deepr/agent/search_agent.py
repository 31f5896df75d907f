"""The inner search agent of ``--search-rounds R`` (DuMate §2.2.2, two-level execution).

A search node runs its query, then for up to R−1 more rounds reformulates (up to three
new queries per round, never repeating one) until its key points are covered, and returns
ONE consolidated evidence list: every distinct snippet found, ranked by similarity to the
node's query and key points, the best ``2k`` kept and catalogued under the node's id.
With R = 1 the node is a single top-k search.

Without a model: :mod:`deepr.extractive.search`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from deepr.records import Hit, PlanNode

from deepr.roles.acceptance import FREE_TEXT, query_words
from deepr.extractive import search as ex
from deepr.text.lang import in_question_language
from deepr.roles import JSONReply, Role

from deepr.evidence.env import Ctx
from deepr.evidence.extract import shorten

SEARCHER_SYSTEM = """You run the searches for one step of a research plan. Given the step's query, the \
points it must establish and what the searches found so far, decide whether the points are covered. If \
not, write up to 3 new search queries that target what is missing (never repeat an earlier query). \
Reply with the JSON object only: {"done": false, "queries": ["..."]} or {"done": true, "queries": []}."""

SEARCHER_USER = """Step {nid}: {query}
Points to establish:
{points}
Queries run so far: {queries}
Found so far:
{found}{guidance}"""


class Reformulation(BaseModel):
    done: bool = False
    queries: list[str] = Field(default_factory=list, max_length=3)


def _norm(q: str) -> str:
    return " ".join(q.lower().split())


def _check(value: Reformulation, asked: Sequence[str]) -> list[str]:
    if not value.done and not value.queries:
        return ["give at least one new query, or set done to true"]
    seen = {_norm(q) for q in asked}
    repeats = [q for q in value.queries if _norm(q) in seen]
    return [f"query {q!r} was already run; write a different one" for q in repeats]


@dataclass
class SearchAsk:
    ctx: Ctx
    node: PlanNode
    hits: Sequence[Hit]
    asked: list[str]
    guidance: Sequence[dict[str, Any]] = ()  # rubric criteria and gaps of the current planning cycle


@in_question_language(lambda a: a.ctx.tracer.query)  # its queries must match the corpus's language
def _messages(a: SearchAsk) -> list[dict[str, str]]:
    node = a.node
    found = "\n".join(f"- {h.title}: {shorten(h.text, 40)}" for h in a.hits) or "(nothing)"
    return [{"role": "system", "content": SEARCHER_SYSTEM},
            {"role": "user", "content": SEARCHER_USER.format(
                nid=node.id, query=node.query, points="\n".join(f"- {p}" for p in node.key_points) or "- (none)",
                queries="; ".join(a.asked), found=found, guidance=_guidance(a.guidance))}]


def _guidance(items: Sequence[dict[str, Any]]) -> str:
    if not items:
        return ""
    lines = "\n".join(f"- {g.get('name', '')}: {g.get('guidance') or g.get('description', '')}" for g in items)
    return "\nThe report's quality criteria and open evidence gaps (search for what serves them):\n" + lines


REFORMULATE = Role(
    name="searcher", action="search", messages=_messages, output=JSONReply(Reformulation),
    check=lambda a, v: _check(Reformulation.model_validate(v), a.asked), extractive=ex.reformulate_reply,
    result=lambda a, v: [] if v["done"] else list(v["queries"]), fallback=lambda a: {"done": True, "queries": []},
    accept=(*FREE_TEXT, query_words(lambda v: v.get("queries") or [])),
    max_tokens=256, on_fail="search agent of {node} stopped: its reformulation failed")


async def _reformulate(ctx: Ctx, node: PlanNode, hits: Sequence[Hit], asked: list[str],
                       round_no: int, guidance: Sequence[dict[str, Any]] = ()) -> list[str]:
    out = await ctx.perform(REFORMULATE, SearchAsk(ctx, node, hits, asked, guidance), node=node.id,
                            round=round_no)
    return out.value


def _consolidate(ctx: Ctx, node: PlanNode, pool: list[Hit], keep: int) -> list[Hit]:
    targets = [node.query or "", *node.key_points]
    sim = ctx.encode([h.text for h in pool]) @ ctx.encode(targets).T
    score = 0.5 * sim[:, 0] + 0.5 * sim.max(axis=1)
    return [pool[i] for i in np.argsort(-score, kind="stable")[:keep]]


async def run_search_node(ctx: Ctx, node: PlanNode, guidance: Sequence[dict[str, Any]] = ()) -> list[str]:
    """Evidence ids of one search node after up to ``search_rounds`` rounds; ``guidance`` (the
    rubric scaffold's criteria and gaps, DuMate §2.2.3) is shown to the inner search agent."""
    rounds, k = ctx.config.search_rounds, ctx.config.k
    if rounds == 1:
        return ctx.search(node.id, node.query or "", round=1)
    asked = [node.query or ""]
    pool: dict[str, Hit] = {}
    hits, _ = ctx.raw_search(asked[0], k, node=node.id, round=1)
    pool.update((h.id, h) for h in hits)
    used = 1
    for r in range(2, rounds + 1):
        queries = await _reformulate(ctx, node, list(pool.values()), asked, r, guidance)
        if not queries:
            break
        used = r
        for q in queries:
            asked.append(q)
            hits, _ = ctx.raw_search(q, k, node=node.id, round=r)
            for h in hits:
                pool.setdefault(h.id, h)
    best = _consolidate(ctx, node, list(pool.values()), 2 * k) if pool else []
    ids = ctx.catalog.add_hits(node.id, best, node.query or "")
    ctx.tracer.tool("consolidate", node=node.id, rounds=used, queries=asked, ids=ids,
                    passages=[h.id for h in best])
    return ids

