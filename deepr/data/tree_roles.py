"""The five roles that grow an evidence tree (SPEC §1; DeepRubric §3.1, App. C.2).

root query · gate (is the sub-query atomic?) · decompose (child sub-queries) ·
ground (which retrieved documents support a sub-query) · extract (1–3 statements per
supporting document). Each role has an LLM implementation (our prompts, answered as JSON
through :func:`deepr.llm.parse.ask_json`, with the SPEC constraints checked in code and
re-asked on violation) and the extractive one of :mod:`deepr.data.tree_extractive`, chosen
by ``llm.is_extractive``. A role never raises on a bad reply: it returns an
:class:`Outcome` with the reason, and the builder records it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, Field

from deepr.data import tree_extractive as ex
from deepr.llm.base import LLM
from deepr.llm.parse import ask_json
from deepr.records import Hit
from deepr.text import coverage
from deepr.data.topics import SeedTopic
from deepr.data.tree_extractive import NodeCtx, Proposal

T = TypeVar("T")
ROLES = ("root_query", "gate", "decompose", "ground", "extract")
REQUIRED_FACETS = {"comparison": ("compar", "alternativ", "versus"),
                   "risks": ("risk", "fail", "danger", "threat"),
                   "quantitative": ("quantit", "statistic", "number", "figure", "data", "metric")}

PROMPTS = {
    "root_query": (
        "You open a research tree. Turn the seed topic into one broad research sub-query that "
        "encyclopedic documents could help answer: neutral, factual, fewer than {max_words} words, "
        "about the topic as a whole rather than one detail.\n"
        'Reply with JSON only: {{"query": "..."}}'),
    "gate": (
        "You decide whether a research sub-query is atomic. It is atomic when splitting it into "
        "narrower sub-queries would not surface new evidence that matters: it already asks for "
        "one specific fact, or the evidence shown answers it completely. It is not atomic when "
        "distinct aspects remain that other documents could inform.\n"
        'Reply with JSON only: {"atomic": true or false, "reason": "one short sentence"}'),
    "decompose": (
        "You expand one node of a research tree into child sub-queries.\n"
        "- Propose at most {limit}. Each covers a different facet of the parent: stakeholders, "
        "timeline, mechanisms, outcomes, risks/failures, comparison/alternatives, quantitative "
        "data, geography, policy, controversy.\n"
        "- With three or more children, include at least one comparison/alternatives facet, one "
        "risks/failures facet and one quantitative facet.\n"
        "- Children are parallel facets at the parent's level of detail, not follow-ups of each other.\n"
        "- Favour facets the evidence below does not cover yet; never restate the parent or an ancestor.\n"
        "- Each sub-query is factual, has fewer than {max_words} words and says what information it seeks.\n"
        "- If the parent cannot be split meaningfully, return an empty list.\n"
        'Reply with JSON only: {{"queries": [{{"query": "...", "facet": "..."}}]}}'),
    "ground": (
        "You check which retrieved documents support a research sub-query. A document supports "
        "it when it states facts that help answer the sub-query directly; sharing the topic is "
        "not enough.\n"
        'Reply with JSON only: {"supporting": [numbers of the supporting documents]} '
        "(an empty list when none does)."),
    "extract": (
        "You pull evidence out of one document for a research sub-query. Write up to {k} short "
        "factual statements that the document itself makes and that help answer the sub-query. "
        "Each is one self-contained sentence that names its subject (no 'it' or 'this'). Use "
        "only the document, add nothing from memory; return an empty list if it holds nothing "
        "relevant.\n"
        'Reply with JSON only: {{"statements": ["...", "..."]}}'),
}


@dataclass
class Outcome(Generic[T]):
    """A role's result, or the reason it has none."""

    value: T
    error: str | None = None


@dataclass
class Tally:
    """Per-tree accounting: calls by role, retrievals, and every recorded failure."""

    llm_calls: int = 0
    retrieval_calls: int = 0
    by_role: Counter = field(default_factory=Counter)
    failures: list[dict[str, str]] = field(default_factory=list)

    def fail(self, role: str, where: str, reason: str) -> None:
        self.failures.append({"role": role, "where": where, "reason": reason})


class _Query(BaseModel):
    query: str = Field(min_length=1)


class _Gate(BaseModel):
    atomic: bool
    reason: str = ""


class _Child(BaseModel):
    query: str = Field(min_length=1)
    facet: str = ""


class _Children(BaseModel):
    queries: list[_Child]


class _Support(BaseModel):
    supporting: list[int]


class _Statements(BaseModel):
    statements: list[str]


def facet_group(facet: str) -> str | None:
    low = facet.lower()
    return next((g for g, keys in REQUIRED_FACETS.items() if any(k in low for k in keys)), None)


def _snippets(hits: Sequence[Hit], chars: int) -> str:
    return "\n".join(f"[{i}] {h.title} — {h.text[:chars]}" for i, h in enumerate(hits, start=1))


class TreeRoles:
    """The roles, bound to their models, embedder and limits.

    ``judge`` (default: ``llm``) answers the judging roles, gate and ground; ``llm`` the
    writing ones. ``embed`` maps texts to L2-normalised rows.
    """

    def __init__(self, llm: LLM, embed: ex.Embed, *, judge: LLM | None = None, max_words: int = 11,
                 max_statements: int = 3, max_docs: int = 3, min_overlap: float = 0.5,
                 ground_threshold: float = 0.5, statement_support: float = 0.5, root_overlap: float = 0.66,
                 redundancy: float = 0.85, max_reasks: int = 2, snippet_chars: int = 700):
        self.llm, self.judge, self.embed = llm, judge or llm, embed
        self.extractive = llm.is_extractive
        self.max_words, self.max_statements, self.max_docs = max_words, max_statements, max_docs
        self.min_overlap, self.ground_threshold, self.root_overlap = min_overlap, ground_threshold, root_overlap
        self.statement_support, self.redundancy = statement_support, redundancy
        self.max_reasks, self.snippet_chars = max_reasks, snippet_chars

    @property
    def backend(self) -> str:
        return "extractive" if self.extractive else self.llm.name

    async def _ask(self, llm: LLM, role: str, system: str, user: str, schema: type[BaseModel],
                   tally: Tally, check: Callable[[Any], list[str]] | None = None) -> Outcome[Any]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        parsed = await ask_json(llm, msgs, schema, role=role, check=check, max_reasks=self.max_reasks)
        tally.llm_calls += parsed.attempts
        tally.by_role[role] += parsed.attempts
        return Outcome(parsed.value if parsed.ok else None, None if parsed.ok else parsed.error)

    # -- root query ------------------------------------------------------------------
    async def root_query(self, seed: SeedTopic, tally: Tally) -> Outcome[str | None]:
        if self.extractive:
            return Outcome(seed.title)
        limit = self.max_words + 5  # the root may be a little broader than its children

        def check(v: _Query) -> list[str]:
            n = len(v.query.split())
            return [f"the query has {n} words; use fewer than {limit}"] if n >= limit else []

        user = f"Seed topic: {seed.title}\nCategory: {seed.category or 'unknown'}\n" + (
            f"Short description: {seed.description}\n" if seed.description else "")
        out = await self._ask(self.llm, "root_query", PROMPTS["root_query"].format(max_words=limit),
                              user, _Query, tally, check)
        return Outcome(out.value.query.strip() if out.value else None, out.error)

    # -- gate ------------------------------------------------------------------------
    async def gate(self, ctx: NodeCtx, tally: Tally) -> Outcome[tuple[bool, str]]:
        if self.extractive:
            return Outcome(ex.gate(ctx))
        support = [ctx.hits[i] for i in ctx.support]
        user = (f"Path from the root: {' > '.join(ctx.path) or '(this is the root)'}\n"
                f"Sub-query (depth {ctx.depth}): {ctx.query}\n"
                f"Evidence found for it:\n{_snippets(support, self.snippet_chars // 2)}")
        if ctx.statements:  # the gate usually runs beside extraction, before statements exist
            user += f"\nStatements: {json.dumps(ctx.statements[:8], ensure_ascii=False)}"
        out = await self._ask(self.judge, "gate", PROMPTS["gate"], user, _Gate, tally)
        return Outcome((out.value.atomic, out.value.reason) if out.value else (False, ""), out.error)

    # -- decompose -------------------------------------------------------------------
    def _check_children(self, ctx: NodeCtx, limit: int) -> Callable[[_Children], list[str]]:
        taken = {q.lower().strip() for q in [*ctx.path, ctx.query]}

        def check(v: _Children) -> list[str]:
            errs = []
            if len(v.queries) > limit:
                errs.append(f"{len(v.queries)} queries proposed; at most {limit} are allowed")
            seen: set[str] = set()
            for i, c in enumerate(v.queries, start=1):
                key = c.query.lower().strip()
                if len(c.query.split()) > self.max_words:
                    errs.append(f"query {i} has {len(c.query.split())} words; use at most {self.max_words}")
                if key in taken:
                    errs.append(f"query {i} repeats the parent or an ancestor query")
                if key in seen:
                    errs.append(f"query {i} duplicates an earlier query")
                seen.add(key)
            if len(v.queries) >= 3:
                have = {facet_group(c.facet) for c in v.queries}
                missing = [g for g in REQUIRED_FACETS if g not in have]
                if missing:
                    errs.append("no child covers the facet(s): " + ", ".join(missing))
            return errs

        return check

    async def decompose(self, ctx: NodeCtx, limit: int, tally: Tally) -> Outcome[list[Proposal]]:
        if self.extractive:
            return Outcome(ex.decompose(ctx, limit, self.embed, max_words=self.max_words,
                                        redundancy=self.redundancy))
        support = [ctx.hits[i] for i in ctx.support]
        user = (f"Ancestor path (root first): {' > '.join(ctx.path) or '(none: this is the root)'}\n"
                f"Parent query (depth {ctx.depth}): {ctx.query}\n"
                f"Evidence snippets:\n{_snippets(support, self.snippet_chars // 2)}\n"
                f"Statements found so far: {json.dumps(ctx.statements[:8], ensure_ascii=False)}")
        system = PROMPTS["decompose"].format(limit=limit, max_words=self.max_words + 1)
        out = await self._ask(self.llm, "decompose", system, user, _Children, tally,
                              self._check_children(ctx, limit))
        if out.value is None:
            return Outcome([], out.error)
        return Outcome([Proposal(c.query.strip(), c.facet.strip(), c.query.strip()) for c in out.value.queries])

    # -- ground ----------------------------------------------------------------------
    async def ground(self, ctx: NodeCtx, tally: Tally) -> Outcome[list[int]]:
        query, hits = ctx.query, ctx.hits
        if self.extractive or not hits:
            links = [ctx.anchor, ctx.phrase] if ctx.anchor and ctx.phrase != query else []
            # The root is a bare title: most of its words must match, or "Domestic turkey"
            # would be grounded by documents about the country.
            overlap = max(self.min_overlap, self.root_overlap) if ctx.depth == 0 else self.min_overlap
            return Outcome(ex.ground(query, hits, min_overlap=overlap, threshold=self.ground_threshold,
                                     max_docs=self.max_docs, links=links, seen=ctx.seen_docs))

        def check(v: _Support) -> list[str]:
            bad = [n for n in v.supporting if not 1 <= n <= len(hits)]
            return [f"document numbers {bad} do not exist; use 1..{len(hits)}"] if bad else []

        user = f"Sub-query: {query}\nDocuments:\n{_snippets(hits, self.snippet_chars)}"
        out = await self._ask(self.judge, "ground", PROMPTS["ground"], user, _Support, tally, check)
        if out.value is None:
            return Outcome([], out.error)
        picked = list(dict.fromkeys(n - 1 for n in out.value.supporting))
        return Outcome(picked[: self.max_docs])

    # -- extract ---------------------------------------------------------------------
    async def extract(self, query: str, note: str, hit: Hit, tally: Tally) -> Outcome[list[str]]:
        if self.extractive:
            return Outcome(ex.extract(query, hit, self.embed, max_statements=self.max_statements))
        source = f"{hit.title} {hit.text}"

        def check(v: _Statements) -> list[str]:
            errs = []
            if len(v.statements) > self.max_statements:
                errs.append(f"{len(v.statements)} statements; give at most {self.max_statements}")
            for i, s in enumerate(v.statements, start=1):
                cov = coverage(s, source)
                if not s.strip() or cov is None:
                    errs.append(f"statement {i} is empty")
                elif cov < self.statement_support:
                    errs.append(f"statement {i} is not supported by the document (only {cov:.0%} of "
                                "its content words occur there); quote or closely paraphrase it")
            return errs

        user = (f"Goal of this research branch: {note}\nSub-query: {query}\n"
                f"Document: {hit.title}\n{hit.text}")
        out = await self._ask(self.llm, "extract", PROMPTS["extract"].format(k=self.max_statements),
                              user, _Statements, tally, check)
        if out.value is None:
            return Outcome([], out.error)
        return Outcome([s.strip() for s in out.value.statements if s.strip()])
