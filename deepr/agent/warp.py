"""warp mode: AgentCPM-Report's Writing As Reasoning Policy (003 §2.2, App. A.1).

initialize (search keywords → retrieve → sparse level-1 outline with a plan per section)
→ evidence-based drafting (per section: search from the query, the section plan and the
draft so far, then write with citations) → reasoning-driven deepening (given the whole
draft: expand exactly one section into subsections, or terminate) → draft the new
subsections → ... at most ``max_levels`` levels and ``max_expansions`` expansions.
``force_expand N`` expands exactly N times, never terminating earlier: the over-expanded
teacher runs whose drafts ``prune-trajectories`` cuts at the best one. Every draft is
recorded in order (Trajectory.drafts); each deepening turn names the draft it saw.

Search results are catalogued as ``S<n>-R<k>`` (result k of search action n).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from deepr.agent.ask import ask_structured, ask_text, record_extractive
from deepr.agent.citations import normalize
from deepr.agent.env import Ctx
from deepr.agent.extract import focus_query, shorten, sub_questions
from deepr.agent.outline import Outline, Section
from deepr.agent import warp_extractive as ex
from deepr.agent import writer

WARP_SYSTEM = """You are a report writer who works in small actions: plan a sparse outline, search, write \
one section at a time with citations, and deepen the outline where the draft is thin. Always write in the \
language of the user's question. Reply exactly in the format each action asks for."""

SEARCH_USER = """User question:
{query}

Current outline:
{outline}

Instruction: {instruction}

Give 1 to 5 search keywords or short queries for this instruction.
Reply with the action as JSON: {{"name": "search", "keywords": ["...", "..."]}}"""

INIT_USER = """User question:
{query}

Retrieved background:
{evidence}

Write a sparse first outline: a report title and 3 to 7 top-level sections, each with a one-sentence \
writing plan. Reply with the action as JSON: {{"name": "initialize", "title": "...", "sections": \
[{{"title": "...", "plan": "..."}}]}}"""

WRITE_USER = """User question:
{query}

Report so far (outline with the start of each written section):
{draft}

Instruction: write section-{pos} "{title}": {plan}

Retrieved information:
{evidence}

Write only this section's body (no heading) in markdown: analysis and comparison, not a list of facts. \
Every claim must be supported by the retrieved information and cite its id in brackets, e.g. [{example}]. \
Do not repeat other sections. Put the body inside <content>...</content>."""

DEEPEN_USER = """User question:
{query}

Current full report:
{draft}

Sections that may be expanded: {expandable}

Decide whether one section should be split into subsections to make the report deeper or more complete. \
Expand only one section, one level down, into 2 to 5 subsections that do not repeat other sections. {force}
Reply with the action as JSON: {{"name": "expand", "position": "section-2", "subsections": \
[{{"title": "...", "plan": "..."}}]}} or {{"name": "terminate"}}"""

FORCED = "In this step you must expand a section; terminating is not allowed."


class Item(BaseModel):
    title: str = Field(min_length=1)
    plan: str = ""


class SearchAction(BaseModel):
    name: str = "search"
    keywords: list[str] = Field(min_length=1, max_length=5)


class InitAction(BaseModel):
    name: str = "initialize"
    title: str = Field(min_length=1)
    sections: list[Item] = Field(min_length=2, max_length=8)


class DeepenAction(BaseModel):
    name: str
    position: str = ""
    subsections: list[Item] = Field(default_factory=list)


@dataclass
class WarpOutcome:
    outline: Outline
    drafts: list[str]
    expansions: int


class WarpRun:
    """One warp run: the outline, the search counter and the actions."""

    def __init__(self, ctx: Ctx, query: str):
        self.ctx, self.query = ctx, query
        self.outline = Outline(title=shorten(focus_query(query, 16), 16).rstrip(" …"))
        self.n_search = 0

    async def search(self, instruction: str, default: list[str], k: int) -> list[str]:
        """Search action: keywords (model or ``default``), then one retrieval per keyword."""
        ctx = self.ctx
        messages = [{"role": "system", "content": WARP_SYSTEM},
                    {"role": "user", "content": SEARCH_USER.format(query=self.query, outline=self.outline.listing(),
                                                                   instruction=instruction)}]
        keywords = default
        if ctx.extractive:
            record_extractive(ctx.tracer, "warp", "search", messages, {"name": "search", "keywords": default})
        else:
            parsed = await ask_structured(ctx.tracer, ctx.llm, messages, role="warp", action="search",
                                          schema=SearchAction, max_reasks=ctx.config.max_reasks, **ctx.config.chat_kw())
            if parsed.ok:
                keywords = [k.strip() for k in parsed.value.keywords if k.strip()] or default
            else:
                ctx.tracer.decide("searched with default keywords after the model's search action failed",
                                  reason=parsed.error, keywords=default)
        self.n_search += 1
        prefix, ids = f"S{self.n_search}", []
        for i, kw in enumerate(keywords):
            ids += ctx.search(prefix, kw, k=k if i == 0 else ctx.config.k)
        return list(dict.fromkeys(ids))[: max(k, 2 * ctx.config.k)]

    async def initialize(self, ids: list[str]) -> None:
        ctx = self.ctx
        messages = [{"role": "system", "content": WARP_SYSTEM},
                    {"role": "user", "content": INIT_USER.format(query=self.query,
                                                                 evidence=ctx.catalog.evidence(ids, 300) or "(none)")}]
        if not ctx.extractive:
            parsed = await ask_structured(ctx.tracer, ctx.llm, messages, role="warp", action="initialize",
                                          schema=InitAction, max_reasks=ctx.config.max_reasks, **ctx.config.chat_kw())
            if parsed.ok:
                self.outline.title = parsed.value.title.strip()
                self.outline.add_sections([s.model_dump() for s in parsed.value.sections])
                return
            ctx.tracer.decide("outline built extractively after the model's initialize action failed",
                              reason=parsed.error)
        title, items = ex.initial_outline(ctx, self.query, ids)
        self.outline.title = title
        if ctx.extractive:
            record_extractive(ctx.tracer, "warp", "initialize", messages,
                              {"name": "initialize", "title": title, "sections": items})
        self.outline.add_sections(items)

    async def write(self, sec: Section) -> None:
        ctx = self.ctx
        instruction = f"find evidence for section-{sec.pos} \"{sec.title}\": {sec.plan}"
        sec.ids = await self.search(instruction, [focus_query(f"{sec.title} {sec.plan}", 16)], ctx.config.k)
        messages = [{"role": "system", "content": WARP_SYSTEM},
                    {"role": "user", "content": WRITE_USER.format(
                        query=self.query, draft=self.outline.listing(with_content=40), pos=sec.pos, title=sec.title,
                        plan=sec.plan, evidence=ctx.catalog.evidence(sec.ids) or "(none)",
                        example=sec.ids[0] if sec.ids else "S1-R1")}]
        if not ctx.extractive:
            parsed = await ask_text(ctx.tracer, ctx.llm, messages, role="warp", action="write", tag="content",
                                    check=lambda t: ctx.catalog.check(normalize(t), sec.ids, require=True),
                                    max_reasks=ctx.config.max_reasks, turn_extra={"position": f"section-{sec.pos}"},
                                    **ctx.config.chat_kw())
            if parsed.ok:
                sec.content = normalize(parsed.value).strip()
                return
            ctx.tracer.decide(f"section-{sec.pos} written by the extractive writer after the model failed",
                              reason=parsed.error, fallback=[f"section-{sec.pos}"])
        sec.content = writer.write(ctx, [f"{sec.title}. {sec.plan}", self.query], sec.ids,
                                   ctx.config.section_sentences, avoid=self.outline.used_text())
        if ctx.extractive:
            record_extractive(ctx.tracer, "warp", "write", messages, f"<content>\n{sec.content}\n</content>",
                              position=f"section-{sec.pos}")

    def _deepen_check(self, value: DeepenAction, forced: bool) -> list[str]:
        can = [f"section-{s.pos}" for s in self.outline.expandable(self.ctx.config.max_levels)]
        if value.name == "terminate":
            return [f"terminate is not allowed in this step; expand one of {', '.join(can)}"] if forced else []
        if value.name != "expand":
            return [f"action name must be 'expand' or 'terminate', not {value.name!r}"]
        sec = self.outline.find(value.position)
        errors = []
        if sec is None or f"section-{sec.pos}" not in can:
            errors.append(f"position {value.position!r} cannot be expanded; choose one of {', '.join(can)}")
        if not 2 <= len(value.subsections) <= 7:
            errors.append(f"give 2 to 7 subsections, not {len(value.subsections)}")
        return errors

    async def deepen(self, forced: bool, draft_no: int) -> dict[str, Any]:
        """One deepening decision: {"name": "expand", "position", "subsections"} or terminate."""
        ctx = self.ctx
        can = self.outline.expandable(ctx.config.max_levels)
        messages = [{"role": "system", "content": WARP_SYSTEM},
                    {"role": "user", "content": DEEPEN_USER.format(
                        query=self.query, draft=self.outline.markdown(),
                        expandable=", ".join(f"section-{s.pos}" for s in can), force=FORCED if forced else "")}]
        if not ctx.extractive:
            parsed = await ask_structured(ctx.tracer, ctx.llm, messages, role="warp", action="expand",
                                          schema=DeepenAction, check=lambda v: self._deepen_check(v, forced),
                                          max_reasks=ctx.config.max_reasks, turn_action=lambda v: v.name,
                                          turn_extra={"draft": draft_no, "forced": forced}, **ctx.config.chat_kw())
            if parsed.ok:
                return parsed.value.model_dump(exclude_defaults=parsed.value.name == "terminate")
            ctx.tracer.decide("deepening decided extractively after the model's action failed", reason=parsed.error)
        decision = ex.deepen_choice(ctx, self.query, self.outline, forced)
        if ctx.extractive:
            record_extractive(ctx.tracer, "warp", decision["name"], messages, decision, draft=draft_no, forced=forced)
        return decision

    def snapshot(self) -> None:
        self.ctx.tracer.drafts.append(self.outline.markdown())


async def run_warp(ctx: Ctx, query: str) -> WarpOutcome:
    cfg, tr = ctx.config, ctx.tracer
    run = WarpRun(ctx, query)
    with tr.phase("initialize"):
        parts = sub_questions(query)
        default = [focus_query(p, 24) for p in parts[:4]] if len(parts) > 1 else [focus_query(query, 24)]
        ids = await run.search("find broad background to outline the report", default, cfg.explore_k)
        await run.initialize(ids)
    with tr.phase("draft"):
        for sec in list(run.outline.walk()):
            await run.write(sec)
    run.snapshot()
    expansions = 0
    while expansions < cfg.max_expansions:
        forced = expansions < cfg.force_expand
        if cfg.force_expand and not forced:
            tr.decide(f"stopped after the {cfg.force_expand} forced expansions (--force-expand)")
            break
        if not run.outline.expandable(cfg.max_levels):
            tr.decide(f"no section can be expanded within {cfg.max_levels} levels; deepening ends")
            break
        with tr.phase("deepen"):
            decision = await run.deepen(forced, draft_no=len(tr.drafts) - 1)
        if decision["name"] != "expand":
            tr.decide("deepening terminated", draft=len(tr.drafts) - 1)
            break
        parent = run.outline.find(decision["position"])
        new = run.outline.add_sections([dict(s) for s in decision["subsections"]], parent)
        expansions += 1
        tr.decide(f"expanded section-{parent.pos} into {len(new)} subsections", expansion=expansions)
        with tr.phase("draft"):
            for sec in new:
                await run.write(sec)
        run.snapshot()
    else:
        tr.decide(f"reached the limit of {cfg.max_expansions} expansions")
    tr.extra.update(outline=[s.as_dict() for s in run.outline.sections], expansions=expansions)
    return WarpOutcome(run.outline, list(tr.drafts), expansions)
