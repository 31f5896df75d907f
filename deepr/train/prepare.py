"""grpo prepare: fix the answerer stage's inputs by running the trained planner once per query.

Input: ``verified.jsonl`` (QRPair), a planner (a ``grpo``/``sft`` planner output folder, a
model folder, or any ``--llm`` spec) and a retriever. Per query: planner turn 1 → every
search node searched → planner turn 2 (revised plan + fetch list) → new or changed search
nodes re-run, listed pages fetched: exactly ``deepr run``'s dag planning phase
(:mod:`deepr.agent.dag`). Output: one :class:`Prepared` record per query (the revised
plan, search results per node, the citation catalog with snippets and fetched pages, the
waves), appended and fsynced as it goes so a re-run skips finished ids; queries whose
plan never validated go to the rejects file with the reason.

    deepr grpo prepare --planner runs/rl-planner --data verified.jsonl --out prepared.jsonl
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deepr.records import QRPair, Reject

STAGE = "grpo-prepare"


class PrepareConfig(BaseModel):
    """Settings of ``deepr grpo prepare``; validated on construction."""

    model_config = ConfigDict(extra="forbid")

    k: int = Field(5, ge=1, le=50, description="Results per search node (Table 5: up to five).")
    fetch_limit: int = Field(4, ge=0, le=10, description="Pages the revision may fetch (Table 5: up to four).")
    max_reasks: int = Field(2, ge=0, le=5, description="Re-asks after a planner reply that is not a valid plan.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Planner sampling temperature "
                                      "(None: greedy / backend default).")
    max_tokens: int | None = Field(None, ge=16, description="Planner completion cap per turn.")


class Prepared(BaseModel):
    """One answerer-stage training input (a line of prepared.jsonl)."""

    model_config = ConfigDict(extra="allow")

    id: str
    query: str
    rubrics: list[dict[str, Any]]
    plan: dict[str, Any] = Field(description="The revised plan graph, with 'fetch'.")
    results: dict[str, list[str]] = Field(description="Catalog ids of each search node's results.")
    catalog: dict[str, dict[str, Any]] = Field(description="Every snippet and fetched page by catalog id.")
    waves: list[list[str]]
    dropped: dict[str, list[str]] = Field(default_factory=dict, description="Evidence ids of search nodes "
                                          "the revision dropped (shown to and citable by the final answer).")
    planner: str = Field(description="Who wrote each plan turn, e.g. llm/llm, llm/previous-plan, "
                         "extractive/extractive.")


def planner_spec(planner: str) -> str:
    """``--planner`` as an ``--llm`` spec: an adapter folder gets its base from deepr_meta.json
    (or adapter_config.json) and runs as the planner role."""
    p = Path(planner)
    if (p / "adapter_config.json").is_file():
        from deepr.llm.hf_adapters import adapter_base

        return f"hf:{adapter_base(p, fix='pass --planner hf:<base>,adapter=planner:<folder>')},adapter=planner:{p}"
    if (p / "config.json").is_file():
        return f"hf:{p}"
    if p.exists():
        raise FileNotFoundError(f"{p} is neither an adapter folder (adapter_config.json) nor a model folder "
                                "(config.json)")
    return planner


def catalog_dump(catalog: Any) -> dict[str, dict[str, Any]]:
    return {cid: {k: v for k, v in vars(e).items() if k != "id"} for cid, e in catalog.entries.items()}


async def prepare_one(pair: QRPair, llm: Any, retriever: Any, config: PrepareConfig) -> Prepared:
    """Plan, search, revise, re-search and fetch for one query (the dag planning phase)."""
    from deepr.agent.dag import apply_revision, execute_searches
    from deepr.evidence.env import Ctx, RunConfig
    from deepr.agent.planner import initial_plan, plan_json, revise_plan
    from deepr.evidence.trace import Tracer
    from deepr.corpus.tools import ResearchTools
    from deepr.evidence.plan import waves

    run = RunConfig(k=config.k, fetch_limit=config.fetch_limit, max_reasks=config.max_reasks,
                    temperature=config.temperature, max_tokens=config.max_tokens)
    ctx = Ctx(llm, ResearchTools(retriever, k=config.k), run, Tracer(pair.question, "dag"))
    results: dict[str, list[str]] = {}
    dropped: dict[str, list[str]] = {}
    plan = await initial_plan(ctx, pair.question)
    await execute_searches(ctx, plan, results, only=None)
    revised, fetch = await revise_plan(ctx, pair.question, plan, results, cycle=1)
    await apply_revision(ctx, plan, revised, fetch, results, cycle=1, dropped=dropped)
    by = "/".join(str(p.get("by", "")) for p in ctx.tracer.plans)  # e.g. llm/llm or llm/previous-plan
    return Prepared(id=pair.id, query=pair.question, rubrics=[r.model_dump(mode="json") for r in pair.rubrics],
                    plan={**json.loads(plan_json(revised)), "fetch": fetch}, results=results,
                    catalog=catalog_dump(ctx.catalog), waves=waves(revised), planner=by, dropped=dropped)


def prepare_records(pairs: Iterable[QRPair], llm: Any, retriever: Any,
                    config: PrepareConfig) -> Iterator[Prepared | Reject]:
    """:func:`prepare_one` per pair, in order (one at a time: the planner model is the bottleneck)."""
    from deepr.llm.base import run_sync

    for pair in pairs:
        try:
            yield run_sync(prepare_one(pair, llm, retriever, config))
        except (ValueError, KeyError, RuntimeError) as e:  # e.g. LLMError: recorded, the batch goes on
            yield Reject(id=pair.id, stage=STAGE, reason=f"{type(e).__name__}: {e}")
