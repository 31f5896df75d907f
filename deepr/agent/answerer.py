"""dag answerer (DecomposeR §3.3): aggregate nodes in topological waves, then the answer node.

All aggregates of one wave are written in ONE model turn, a JSON object mapping node id to
text; then the answer node is written from its parent branches and the cumulative cited
evidence. Every text must cite only ids of the evidence it was shown (checked in code; an
unknown id is re-asked with the list of bad ids). Two roles (:mod:`deepr.roles`), ``WAVE`` and
``FINAL``; a turn that never passes its checks is recorded as a failure and its nodes are
written by the non-LLM implementation instead, :mod:`deepr.extractive.answerer` (MMR over cited
evidence), which the report then says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


from deepr.evidence.plan import answer_node
from deepr.text.lang import ask_in_language
from deepr.records import Plan, PlanNode
from deepr.roles.acceptance import FREE_TEXT
from deepr.extractive import answerer as ex
from deepr.roles import JSONReply, Role, TaggedReply

from deepr.evidence.citations import cited_ids, normalize
from deepr.evidence.env import Ctx

ANSWER_SYSTEM = """You write parts of a research report strictly from the evidence you are given.
Every evidence item starts with an id in square brackets. After each claim, cite the ids that support \
it, like [N1-R2] or [N1-R2, N3-F1]. Cite only ids that appear in the evidence you were given: never \
invent ids, never cite URLs or numbers such as [1], and do not add a reference list (the system adds \
it). Be analytical: compare sources, point out agreement and conflict, and say where the evidence is thin."""

WAVE_USER = """Research question:
{query}
{rubric}
Write the plan nodes below. Each lists what it must conclude, the points to cover, and its evidence.

{nodes}

Reply with one JSON object mapping each node id to its text (one or two paragraphs of markdown with \
citations), for example {{{example}}}."""

FINAL_USER = """Research question:
{query}
{rubric}
You are writing the answer node {nid}. Need: {need}
{points}
Findings of the branches it reads:
{branches}

Cited evidence collected so far:
{evidence}

Write the final report: an integrated, well-organised markdown answer to the question that builds on \
the branch findings, cites evidence ids after each claim and states what remains uncertain. No \
reference list. Put the report inside <answer>...</answer>."""


def rubric_block(rubric: Sequence[dict[str, Any]]) -> str:
    if not rubric:
        return ""
    lines = [f"- {r.get('name', '')}: {r.get('guidance') or r.get('description', '')}" for r in rubric]
    return "\nQuality criteria the text must satisfy:\n" + "\n".join(lines) + "\n"


def node_evidence(ctx: Ctx, plan: Plan, node: PlanNode, results: dict[str, list[str]],
                  outputs: dict[str, str]) -> tuple[list[str], list[str]]:
    """(evidence ids shown to the writer of ``node``, ids it may cite).

    Evidence: results and fetched pages of its search inputs; it may also cite whatever its
    aggregate inputs cited.
    """
    by_id = {n.id: n for n in plan.nodes}
    ids: list[str] = []
    for src in node.inputs:
        if by_id[src].type == "search":
            ids += results.get(src, [])
            ids += [e.id for e in ctx.catalog.entries.values() if e.kind == "fetch" and e.node == src]
    inherited = [c for src in node.inputs if by_id[src].type != "search" for c in cited_ids(outputs.get(src, ""))]
    return list(dict.fromkeys(ids)), list(dict.fromkeys(ids + inherited))


def _node_block(ctx: Ctx, plan: Plan, node: PlanNode, ids: list[str], outputs: dict[str, str]) -> str:
    by_id = {n.id: n for n in plan.nodes}
    points = "\n".join(f"- {p}" for p in node.key_points) or "- (none given)"
    parts = [f"## Node {node.id}\nNeed: {node.need}\nKey points:\n{points}",
             "Evidence:\n" + (ctx.catalog.evidence(ids) if ids else "(none)")]
    earlier = [f"From {s} ({by_id[s].need}):\n{outputs.get(s, '')}" for s in node.inputs if by_id[s].type != "search"]
    if earlier:
        parts.append("Findings of earlier steps:\n" + "\n\n".join(earlier))
    return "\n".join(parts)


def _wave_check(ctx: Ctx, wave: list[str], allowed: dict[str, list[str]], value: Any) -> list[str]:
    if not isinstance(value, dict):
        return ["reply must be a JSON object mapping node ids to text"]
    errors = [f"missing node {nid}: write it under the key \"{nid}\"" for nid in wave if nid not in value]
    errors += [f"{nid} is not a node of this wave; write only {', '.join(wave)}" for nid in value if nid not in wave]
    for nid in wave:
        text = value.get(nid)
        if nid not in value:
            continue
        if not isinstance(text, str) or not text.strip():
            errors.append(f"node {nid}: text must be a non-empty string")
            continue
        errors += [f"node {nid}: {e}" for e in ctx.catalog.check(normalize(text), allowed[nid], require=True)]
    return errors


@dataclass
class WaveAsk:
    ctx: Ctx
    query: str
    plan: Plan
    wave: list[str]
    outputs: dict[str, str]
    rubric: Sequence[dict[str, Any]]
    shown: dict[str, list[str]]
    allowed: dict[str, list[str]]


def _wave_messages(a: WaveAsk) -> list[dict[str, str]]:
    by_id = {n.id: n for n in a.plan.nodes}
    example = ", ".join(f'"{nid}": "..."' for nid in a.wave)
    blocks = "\n\n".join(_node_block(a.ctx, a.plan, by_id[nid], a.shown[nid], a.outputs) for nid in a.wave)
    return ask_in_language([{"role": "system", "content": ANSWER_SYSTEM},
                            {"role": "user", "content": WAVE_USER.format(query=a.query, rubric=rubric_block(a.rubric),
                                                                         nodes=blocks, example=example)}], a.query)


def _wave_shape(a: WaveAsk) -> dict[str, Any]:
    """The wave's reply: one text per node of the wave, keyed by its id."""
    return {"type": "object", "properties": {nid: {"type": "string"} for nid in a.wave}, "required": list(a.wave),
            "additionalProperties": False}


WAVE = Role(
    name="answerer", action="wave", messages=_wave_messages, output=JSONReply(shape=_wave_shape),
    check=lambda a, v: _wave_check(a.ctx, a.wave, a.allowed, v), extractive=ex.wave_reply,
    result=lambda a, v: {nid: normalize(v[nid]).strip() for nid in a.wave}, max_tokens=2048,
    accept=FREE_TEXT,
    on_fail="wave {wave} written by the extractive writer after the model's replies failed",
    parts=lambda a: list(a.wave))


async def write_wave(ctx: Ctx, query: str, plan: Plan, wave: list[str], results: dict[str, list[str]],
                     outputs: dict[str, str], rubric: Sequence[dict[str, Any]] = (),
                     wave_no: int = 1) -> dict[str, str]:
    """Write every aggregate of one wave in one turn; returns {node id: cited text}."""
    by_id = {n.id: n for n in plan.nodes}
    shown, allowed = {}, {}
    for nid in wave:
        shown[nid], allowed[nid] = node_evidence(ctx, plan, by_id[nid], results, outputs)
    out = await ctx.perform(WAVE, WaveAsk(ctx, query, plan, wave, outputs, rubric, shown, allowed), wave=wave_no)
    return out.value


def final_inputs(ctx: Ctx, plan: Plan, outputs: dict[str, str],
                 dropped: dict[str, list[str]] | None = None) -> tuple[PlanNode, list[str]]:
    """The answer node and the cumulative cited evidence: ids cited by any aggregate, then the
    evidence of search nodes a revision dropped (kept, DuMate's audit trail: still citable)."""
    ans = answer_node(plan)
    ids = [c for n in plan.nodes if n.type == "aggregate" for c in cited_ids(outputs.get(n.id, ""))]
    ids += [c for nid in sorted(dropped or {}) for c in dropped[nid]]
    return ans, [c for c in dict.fromkeys(ids) if c in ctx.catalog]


@dataclass
class FinalAsk:
    ctx: Ctx
    query: str
    plan: Plan
    outputs: dict[str, str]
    rubric: Sequence[dict[str, Any]]
    node: PlanNode
    ids: list[str]


def _final_messages(a: FinalAsk) -> list[dict[str, str]]:
    by_id = {n.id: n for n in a.plan.nodes}
    ans = a.node
    branches = "\n\n".join(f"### {s}: {by_id[s].need}\n{a.outputs.get(s, '')}" for s in ans.inputs)
    points = ("Key points:\n" + "\n".join(f"- {p}" for p in ans.key_points)) if ans.key_points else ""
    return ask_in_language([{"role": "system", "content": ANSWER_SYSTEM},
                            {"role": "user", "content": FINAL_USER.format(
                                query=a.query, rubric=rubric_block(a.rubric), nid=ans.id, need=ans.need, points=points,
                                branches=branches, evidence=a.ctx.catalog.evidence(a.ids) or "(none)")}], a.query)


FINAL = Role(
    name="answerer", action="final", messages=_final_messages, output=TaggedReply("answer", required=True),
    accept=FREE_TEXT,
    check=lambda a, t: a.ctx.catalog.check(normalize(t), a.ids, require=True), extractive=ex.final_reply,
    result=lambda a, t: normalize(t).strip(), max_tokens=2048,
    on_fail="final answer written by the extractive writer after the model's replies failed",
    parts=lambda a: [a.node.id])


async def write_final(ctx: Ctx, query: str, plan: Plan, outputs: dict[str, str],
                      rubric: Sequence[dict[str, Any]] = (), *, dropped: dict[str, list[str]] | None = None) -> str:
    """The answer node: integrated report text from the branches and cumulative evidence
    (including the evidence of dropped search nodes)."""
    ans, ids = final_inputs(ctx, plan, outputs, dropped)
    return (await ctx.perform(FINAL, FinalAsk(ctx, query, plan, outputs, rubric, ans, ids))).value
