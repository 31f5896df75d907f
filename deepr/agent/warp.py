"""warp mode: AgentCPM-Report's Writing As Reasoning Policy (003 §2.2, App. A.1).

initialize (search keywords → retrieve → sparse level-1 outline with a plan per section)
→ evidence-based drafting (per section: search from the query, the outline, the section plan
and the current draft, then write with citations, again seeing the whole current draft: the
state (Q, O, D, C) of 003 §2.2) → reasoning-driven deepening (given the whole
draft: expand exactly one section into subsections, or terminate) → draft the new
subsections → ... at most ``max_levels`` levels and ``max_expansions`` expansions.
``force_expand N`` expands exactly N times, never terminating earlier: the over-expanded
teacher runs whose drafts ``prune-trajectories`` cuts at the best one. Every draft is
recorded in order (Trajectory.drafts); each deepening turn names the draft it saw.

Search results are catalogued as ``S<n>-R<k>`` (result k of search action n).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from deepr.roles.acceptance import FREE_TEXT, query_words
from deepr.extractive import warp as ex
from deepr.text.lang import in_question_language
from deepr.roles import JSONReply, Role, TaggedReply

from deepr.evidence.citations import normalize
from deepr.evidence.env import Ctx
from deepr.evidence.extract import focus_query, shorten, sub_questions
from deepr.evidence.outline import Outline, Section

WARP_SYSTEM = """You are a report writer who works in small actions: plan a sparse outline, search, write \
one section at a time with citations, and deepen the outline where the draft is thin. Always write in the \
language of the user's question. Reply exactly in the format each action asks for."""

SEARCH_USER = """User question:
{query}

Current outline:
{outline}

Current draft:
{draft}

Instruction: {instruction}

Look for what the draft does not cover yet.
Give 1 to 5 search keywords or short queries for this instruction, each of two or more words.
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

Current outline:
{outline}

Current draft:
{draft}

Instruction: write section-{pos} "{title}": {plan}

Retrieved information:
{evidence}

Write only this section's body (no heading) in markdown: analysis and comparison, not a list of facts. \
Every claim must be supported by the retrieved information and cite its id in brackets, e.g. [{example}]. \
Build on the draft and do not repeat what it already says. Put the body inside <content>...</content>."""

DEEPEN_USER = """User question:
{query}

Current full report:
{draft}

Sections that may be expanded: {expandable}

Decide whether one section should be split into subsections to make the report deeper or more complete. \
Expand only one section, one level down, into 2 to 7 subsections that do not repeat other sections. {force}
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


@dataclass
class WarpAsk:
    run: WarpRun
    instruction: str = ""
    default: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    sec: Section | None = None
    forced: bool = False


@in_question_language(lambda a: a.run.query)
def _search_messages(a: WarpAsk) -> list[dict[str, str]]:
    return [{"role": "system", "content": WARP_SYSTEM},
            {"role": "user", "content": SEARCH_USER.format(query=a.run.query, outline=a.run.outline.listing(),
                                                           draft=a.run.outline.markdown(),
                                                           instruction=a.instruction)}]


@in_question_language(lambda a: a.run.query)
def _init_messages(a: WarpAsk) -> list[dict[str, str]]:
    evidence = a.run.ctx.catalog.evidence(a.ids, 300) or "(none)"
    return [{"role": "system", "content": WARP_SYSTEM},
            {"role": "user", "content": INIT_USER.format(query=a.run.query, evidence=evidence)}]


@in_question_language(lambda a: a.run.query)
def _write_messages(a: WarpAsk) -> list[dict[str, str]]:
    sec, run = a.sec, a.run
    return [{"role": "system", "content": WARP_SYSTEM},
            {"role": "user", "content": WRITE_USER.format(
                query=run.query, outline=run.outline.listing(), draft=run.outline.markdown(), pos=sec.pos,
                title=sec.title,
                plan=sec.plan, evidence=run.ctx.catalog.evidence(sec.ids) or "(none)",
                example=sec.ids[0] if sec.ids else "S1-R1")}]


@in_question_language(lambda a: a.run.query)
def _deepen_messages(a: WarpAsk) -> list[dict[str, str]]:
    run = a.run
    can = run.outline.expandable(run.ctx.config.max_levels)
    return [{"role": "system", "content": WARP_SYSTEM},
            {"role": "user", "content": DEEPEN_USER.format(
                query=run.query, draft=run.outline.markdown(),
                expandable=", ".join(f"section-{s.pos}" for s in can), force=FORCED if a.forced else "")}]


_NUMBERED = re.compile(r"^\s*(?:section[-\s_]*)?\d{1,2}(?:\.\d{1,2})*[.)]?\s")
_ODD = re.compile(r"[^\w\s,:;()'’&/?!.\-–—\"]")


def title_problems(titles: list[str]) -> list[str]:
    """Headings that are not headings: numbered by the model (the code numbers sections), with
    symbols, no word of three letters or digits, or a content word twice ("1 chamber rises
    volcanic press volcanic @", "1 p"). Names count whole: "AT&T", "Wi-Fi" and "3C 273" are titles."""
    out = []
    for t in titles:
        flat = " ".join(str(t).split())
        ws = re.findall(r"[^\W\d_]+", flat.lower())
        content = [w for w in ws if len(w) > 3]
        named = any(sum(c.isalnum() for c in w) >= 3 for w in flat.split())
        why = ("starts with a section number (the report numbers sections itself)" if _NUMBERED.match(flat)
               else f"holds {_ODD.search(flat).group(0)!r}" if _ODD.search(flat)
               else "has no word of three letters or digits" if not named
               else "repeats a word" if len(set(content)) < len(content) else None)
        if why:
            out.append(f"the title {flat[:80]!r} {why}; give each section a short descriptive title")
    return out


def _decision(a: WarpAsk, v: dict[str, Any]) -> dict[str, Any]:
    if v.get("name") == "terminate":
        return {"name": "terminate"}
    return v


SEARCH = Role(
    name="warp", action="search", messages=_search_messages, output=JSONReply(SearchAction),
    extractive=ex.search_reply,
    result=lambda a, v: [k.strip() for k in v["keywords"] if k.strip()] or a.default, max_tokens=256,
    accept=(*FREE_TEXT, query_words(lambda v: v.get("keywords") or [])),
    on_fail="searched with default keywords after the model's search action failed")

INITIALIZE = Role(
    name="warp", action="initialize", messages=_init_messages, output=JSONReply(InitAction),
    extractive=ex.initialize_reply, max_tokens=1024, accept=FREE_TEXT,
    check=lambda a, v: title_problems([v["title"], *(s["title"] for s in v["sections"])]),
    on_fail="outline built extractively after the model's initialize action failed")

WRITE = Role(
    name="warp", action="write", messages=_write_messages, output=TaggedReply("content", required=True),
    accept=FREE_TEXT,
    check=lambda a, t: a.run.ctx.catalog.check(normalize(t), a.sec.ids, require=True), extractive=ex.write_reply,
    result=lambda a, t: normalize(t).strip(), max_tokens=1536,
    on_fail="{position} written by the extractive writer after the model failed",
    parts=lambda a: [f"section-{a.sec.pos}"])

DEEPEN = Role(
    name="warp", action="expand", messages=_deepen_messages, output=JSONReply(DeepenAction),
    check=lambda a, v: a.run.deepen_check(DeepenAction.model_validate(v), a.forced),
    extractive=ex.deepen_reply,
    result=_decision, turn_action=lambda v: v["name"], max_tokens=1024, accept=FREE_TEXT,
    on_fail="deepening decided extractively after the model's action failed")


class WarpRun:
    """One warp run: the outline, the search counter and the actions."""

    def __init__(self, ctx: Ctx, query: str):
        self.ctx, self.query = ctx, query
        self.outline = Outline(title=shorten(focus_query(query, 16), 16).rstrip(" …"))
        self.n_search = 0

    async def search(self, instruction: str, default: list[str], k: int) -> list[str]:
        """Search action: keywords (model or ``default``), then one retrieval per keyword."""
        ctx = self.ctx
        keywords = (await ctx.perform(SEARCH, WarpAsk(self, instruction, default))).value
        self.n_search += 1
        prefix, ids = f"S{self.n_search}", []
        for i, kw in enumerate(keywords):
            ids += ctx.search(prefix, kw, k=k if i == 0 else ctx.config.k)
        return list(dict.fromkeys(ids))[: max(k, 2 * ctx.config.k)]

    async def initialize(self, ids: list[str]) -> None:
        value = (await self.ctx.perform(INITIALIZE, WarpAsk(self, ids=ids))).value
        self.outline.title = value["title"].strip()
        self.outline.add_sections([dict(s) for s in value["sections"]])

    async def write(self, sec: Section) -> None:
        ctx = self.ctx
        instruction = f"find evidence for section-{sec.pos} \"{sec.title}\": {sec.plan}"
        sec.ids = await self.search(instruction, [focus_query(f"{sec.title} {sec.plan}", 16)], ctx.config.k)
        out = await ctx.perform(WRITE, WarpAsk(self, sec=sec), position=f"section-{sec.pos}")
        sec.content = out.value

    def deepen_check(self, value: DeepenAction, forced: bool) -> list[str]:
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
        return errors + title_problems([s.title for s in value.subsections])

    async def deepen(self, forced: bool, draft_no: int) -> dict[str, Any]:
        """One deepening decision: {"name": "expand", "position", "subsections"} or terminate."""
        out = await self.ctx.perform(DEEPEN, WarpAsk(self, forced=forced), draft=draft_no, forced=forced)
        return out.value

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
