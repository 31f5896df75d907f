"""dag mode: DecomposeR two-turn planning and wave answering, with DuMate scheduling options.

Flow (DecomposeR §3.2; DuMate §2.2): planner turn 1 emits G0 → every search node runs
(top-k, or an inner search agent with ``--search-rounds``) → planner turn 2 sees the results
and emits G1 plus a fetch list → only new or modified search nodes re-run (unchanged ones
reuse their results) and the listed pages are fetched → with ``--rubric-scaffold`` a
persistent rubric conditions the writer and ephemeral gap rubrics trigger further planning
cycles up to ``--max-cycles`` (each re-planning turn sees both rubrics, each inner search agent
their guidance; the evidence of a dropped search node stays citable in the final answer) → the
answerer writes aggregate nodes by ready frontier (one
model turn per wave) and finally the answer node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from deepr.records import Plan, PlanNode

from deepr.agent.answerer import write_final, write_wave
from deepr.evidence.env import Ctx
from deepr.agent.planner import initial_plan, revise_plan
from deepr.agent.rubric import ephemeral_rubric, persistent_rubric
from deepr.agent.search_agent import run_search_node


@dataclass
class DagOutcome:
    plan: Plan
    outputs: dict[str, str]
    answer: str
    waves: list[list[str]]
    rubric: list[dict[str, Any]] = field(default_factory=list)


def ready_frontier(plan: Plan, done: set[str], kinds: tuple[str, ...] = ("search", "aggregate")) -> list[str]:
    """Unexecuted nodes of the given kinds whose inputs are all done (DuMate Eq. 3)."""
    return [n.id for n in plan.nodes if n.type in kinds and n.id not in done and all(p in done for p in n.inputs)]


def changed_search_nodes(old: Plan, new: Plan, *, key_points_matter: bool = False) -> tuple[list[str], dict[str, str]]:
    """(search nodes of ``new`` to run, {search node of ``new``: the node of ``old`` whose results it reuses}).

    A node reuses the results of an ``old`` search node with the same query (and, when an inner
    search agent uses them, the same key points): its own id first, else one no other node
    claimed. Node ids are positions (the planner's graph schema numbers them in order), so a
    revision that drops N2 renumbers N3 as N2, and so on; their searches are not run again.
    """
    def key(n: PlanNode) -> tuple[str, tuple[str, ...]]:
        return " ".join((n.query or "").split()), tuple(n.key_points or ()) if key_points_matter else ()

    before = {n.id: key(n) for n in old.nodes if n.type == "search"}
    news = [n for n in new.nodes if n.type == "search"]
    same_id = {n.id for n in news if before.get(n.id) == key(n)}
    free: dict[tuple, list[str]] = {}
    for oid, k in before.items():
        if oid not in same_id:
            free.setdefault(k, []).append(oid)
    run, reuse = [], {}
    for n in news:
        if n.id in same_id:
            reuse[n.id] = n.id
        elif free.get(key(n)):
            reuse[n.id] = free[key(n)].pop(0)
        else:
            run.append(n.id)
    return run, reuse


async def execute_searches(ctx: Ctx, plan: Plan, results: dict[str, list[str]], only: list[str] | None,
                           guidance: Sequence[dict[str, Any]] = ()) -> None:
    """Run the ready search nodes (all of them, or ``only`` these) concurrently; ``guidance`` (the
    rubric scaffold's criteria and gaps) goes to their inner search agents."""
    frontier = [nid for nid in ready_frontier(plan, set(), ("search",)) if only is None or nid in only]
    nodes = {n.id: n for n in plan.nodes}
    found = await asyncio.gather(*(run_search_node(ctx, nodes[nid], guidance) for nid in frontier))
    results.update(zip(frontier, found))


async def apply_revision(ctx: Ctx, old: Plan, new: Plan, fetch: list[str], results: dict[str, list[str]],
                         cycle: int, *, dropped: dict[str, list[str]] | None = None,
                         guidance: Sequence[dict[str, Any]] = ()) -> None:
    """Re-run new or modified search nodes, fetch the listed pages. The evidence of a search the
    revision no longer has moves to ``dropped``: still catalogued and citable in the final answer."""
    dropped = {} if dropped is None else dropped
    run, reuse = changed_search_nodes(old, new, key_points_matter=ctx.config.search_rounds > 1)
    run += [nid for nid, oid in reuse.items() if oid not in results]  # nothing kept to reuse
    reuse = {nid: oid for nid, oid in reuse.items() if oid in results}
    gone = _move_evidence(ctx, results, reuse, dropped)
    moved = {nid: oid for nid, oid in reuse.items() if nid != oid}
    ctx.tracer.decide(f"cycle {cycle}: re-run {len(run)} new or modified search nodes, reuse {len(reuse)}"
                      + (f" ({len(moved)} renumbered)" if moved else ""),
                      rerun=run, reused=list(reuse), moved=moved, dropped=gone)
    await execute_searches(ctx, new, results, only=run, guidance=guidance)
    holder = {cid: nid for nid, ids in results.items() for cid in ids}
    for ref in fetch[: ctx.config.fetch_limit]:
        entry = ctx.catalog.resolve(ref)
        # under the search that now holds the result (its id may have changed this revision)
        ids = ctx.fetch_all(ref, node=holder.get(entry.id) if entry else None)
        if entry is not None and entry.id not in holder and entry.node in gone and ids:
            # a page behind a dropped search's result: citable, but under no id a node may take
            ctx.catalog.move_pages({entry.node: f"{entry.node}~dropped"}, only=ids)
            _keep(dropped, entry.node, ids)


def _move_evidence(ctx: Ctx, results: dict[str, list[str]], reuse: dict[str, str],
                   dropped: dict[str, list[str]]) -> list[str]:
    """Re-key ``results`` from old to new node ids; the searches no node reuses are gone, their
    results and pages kept in ``dropped``. Pages follow their search: a gone search's leave its
    id, which a new node may take. Returns the gone ids."""
    before = dict(results)
    results.clear()
    results.update((nid, before[oid]) for nid, oid in reuse.items())
    gone = [oid for oid in before if oid not in reuse.values()]
    pages = ctx.catalog.move_pages({**{oid: f"{oid}~dropped" for oid in gone},
                                    **{oid: nid for nid, oid in reuse.items() if nid != oid}})
    for oid in gone:
        _keep(dropped, oid, before[oid] + pages.get(oid, []))
    return gone


def _keep(dropped: dict[str, list[str]], node: str, ids: list[str]) -> None:
    if ids:
        dropped[node] = list(dict.fromkeys([*dropped.get(node, []), *ids]))


async def answer_plan(ctx: Ctx, query: str, plan: Plan, results: dict[str, list[str]],
                      rubric: list[dict[str, Any]], dropped: dict[str, list[str]] | None = None
                      ) -> tuple[dict[str, str], list[list[str]], str]:
    """Write aggregates wave by wave (ready frontier), then the answer node."""
    done = {n.id for n in plan.nodes if n.type == "search"}
    outputs: dict[str, str] = {}
    executed: list[list[str]] = []
    while frontier := ready_frontier(plan, done, ("aggregate",)):
        executed.append(frontier)
        outputs.update(await write_wave(ctx, query, plan, frontier, results, outputs, rubric,
                                        wave_no=len(executed)))
        done.update(frontier)
    answer = await write_final(ctx, query, plan, outputs, rubric, dropped=dropped)
    return outputs, executed, answer


async def run_dag(ctx: Ctx, query: str) -> DagOutcome:
    cfg, tr = ctx.config, ctx.tracer
    results: dict[str, list[str]] = {}
    with tr.phase("plan"):
        plan = await initial_plan(ctx, query)
    with tr.phase("search"):
        await execute_searches(ctx, plan, results, only=None)
    dropped: dict[str, list[str]] = {}
    with tr.phase("revise"):
        revised, fetch = await revise_plan(ctx, query, plan, results, cycle=1)
        await apply_revision(ctx, plan, revised, fetch, results, cycle=1, dropped=dropped)
    plan, rubric, cycle = revised, [], 1
    if cfg.rubric_scaffold:
        with tr.phase("rubric"):
            rubric = await persistent_rubric(ctx, query, plan)
        while True:
            with tr.phase("rubric"):
                gaps = await ephemeral_rubric(ctx, query, plan, results, rubric, cycle)
            if not gaps:
                tr.decide(f"cycle {cycle}: no evidence gaps left, planning stops")
                break
            if cycle >= cfg.max_cycles:
                tr.decide(f"cycle {cycle}: {len(gaps)} gaps remain but --max-cycles {cfg.max_cycles} is reached",
                          gaps=[g["name"] for g in gaps])
                break
            cycle += 1
            with tr.phase("revise"):
                revised, fetch = await revise_plan(ctx, query, plan, results, gaps=gaps, rubric=rubric, cycle=cycle)
                await apply_revision(ctx, plan, revised, fetch, results, cycle=cycle, dropped=dropped,
                                     guidance=[*rubric, *gaps])
            plan = revised
    with tr.phase("answer"):
        outputs, executed, answer = await answer_plan(ctx, query, plan, results, rubric, dropped)
    tr.extra.update(waves=executed, cycles=cycle, results=results, node_outputs=outputs, dropped=dropped)
    return DagOutcome(plan, outputs, answer, executed, rubric)
