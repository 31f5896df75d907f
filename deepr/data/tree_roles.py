"""The five roles that grow an evidence tree (DeepRubric §3.1, App. C.2).

root query · gate (is the sub-query atomic?) · decompose (child sub-queries) ·
ground (which retrieved documents support a sub-query) · extract (1–3 statements per
supporting document). Each is a :class:`deepr.roles.Role`: our prompt, a JSON reply with the
constraints checked in code and re-asked on violation, and its non-LLM implementation
from :mod:`deepr.extractive.trees`; :func:`deepr.roles.perform` picks the engine. A role
never raises on a bad reply: its :class:`~deepr.roles.Outcome` carries the reason, and the
failure is recorded on the tree's :class:`~deepr.roles.Recorder`. Every prompt asks for the
corpus's language (deepr.text.lang.ask_in_language; English prompts unchanged), and the
extractive engine's queries use that language's words (deepr.evidence.phrases).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from deepr.extractive import trees as ex
from deepr.llm.base import LLM
from deepr.records import Hit
from deepr.roles.acceptance import FREE_TEXT, query_words
from deepr.roles import NO_MODEL, CallPolicy, JSONReply, Outcome, Recorder, Role, perform
from deepr.text import coverage
from deepr.text.lang import detect_language, in_question_language
from deepr.data.topics import SeedTopic
from deepr.extractive.trees import NodeCtx, Proposal

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


@dataclass
class TreeAsk:
    """What one tree role sees: the bound roles (limits, embedder) and its subject."""

    roles: TreeRoles
    ctx: NodeCtx | None = None
    seed: SeedTopic | None = None
    limit: int = 0
    query: str = ""
    note: str = ""
    hit: Hit | None = None

    @property
    def language(self) -> str:
        """The corpus's language: the retriever's where it names one, else the language of what
        this role reads (the seed, the node and its documents), so a tree speaks one language."""
        return self.roles.language or detect_language(self._subject())

    def _subject(self) -> str:
        if self.seed is not None:
            return f"{self.seed.title} {self.seed.description or ''}"
        if self.ctx is not None:
            return " ".join([self.ctx.root_topic, *self.ctx.path, self.ctx.query, *(h.text for h in self.ctx.hits)])
        return " ".join([self.query, self.note, self.hit.text if self.hit else ""])


# every tree role's prompt closes with the sentence that asks for the corpus's language
_in_language = in_question_language(lambda a: "", lambda a: a.language)


def _msgs(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# -- root query -----------------------------------------------------------------------

def _root_limit(a: TreeAsk) -> int:
    return a.roles.max_words + 5  # the root may be a little broader than its children


@_in_language
def _root_messages(a: TreeAsk) -> list[dict[str, str]]:
    seed = a.seed
    user = f"Seed topic: {seed.title}\nCategory: {seed.category or 'unknown'}\n" + (
        f"Short description: {seed.description}\n" if seed.description else "")
    return _msgs(PROMPTS["root_query"].format(max_words=_root_limit(a)), user)


def _root_check(a: TreeAsk, v: dict[str, Any]) -> list[str]:
    n, limit = len(v["query"].split()), _root_limit(a)
    return [f"the query has {n} words; use fewer than {limit}"] if n >= limit else []


ROOT_QUERY = Role(
    name="root_query", action="write", messages=_root_messages, output=JSONReply(_Query), check=_root_check,
    extractive=ex.root_reply, result=lambda a, v: v["query"].strip(), fallback=None,
    max_tokens=128, accept=FREE_TEXT)


# -- gate -----------------------------------------------------------------------------

@_in_language
def _gate_messages(a: TreeAsk) -> list[dict[str, str]]:
    ctx, r = a.ctx, a.roles
    support = [ctx.hits[i] for i in ctx.support]
    user = (f"Path from the root: {' > '.join(ctx.path) or '(this is the root)'}\n"
            f"Sub-query (depth {ctx.depth}): {ctx.query}\n"
            f"Evidence found for it:\n{_snippets(support, r.snippet_chars // 2)}")
    if ctx.statements:  # the gate usually runs beside extraction, before statements exist
        user += f"\nStatements: {json.dumps(ctx.statements[:8], ensure_ascii=False)}"
    return _msgs(PROMPTS["gate"], user)


GATE = Role(
    name="gate", action="judge", messages=_gate_messages, output=JSONReply(_Gate),
    extractive=ex.gate_reply,
    result=lambda a, v: (v["atomic"], v["reason"]), fallback=lambda a: {"atomic": False, "reason": ""},
    max_tokens=256, accept=FREE_TEXT, on_fail="gate failed on {query!r}: the node is expanded anyway")


# -- decompose ------------------------------------------------------------------------

@_in_language
def _decompose_messages(a: TreeAsk) -> list[dict[str, str]]:
    ctx, r = a.ctx, a.roles
    support = [ctx.hits[i] for i in ctx.support]
    user = (f"Ancestor path (root first): {' > '.join(ctx.path) or '(none: this is the root)'}\n"
            f"Parent query (depth {ctx.depth}): {ctx.query}\n"
            f"Evidence snippets:\n{_snippets(support, r.snippet_chars // 2)}\n"
            f"Statements found so far: {json.dumps(ctx.statements[:8], ensure_ascii=False)}")
    return _msgs(PROMPTS["decompose"].format(limit=a.limit, max_words=r.max_words + 1), user)


def _decompose_check(a: TreeAsk, v: dict[str, Any]) -> list[str]:
    taken = {q.lower().strip() for q in [*a.ctx.path, a.ctx.query]}
    queries, errs, seen = v["queries"], [], set()
    if len(queries) > a.limit:
        errs.append(f"{len(queries)} queries proposed; at most {a.limit} are allowed")
    for i, c in enumerate(queries, start=1):
        key, n = c["query"].lower().strip(), len(c["query"].split())
        if n > a.roles.max_words:
            errs.append(f"query {i} has {n} words; use at most {a.roles.max_words}")
        if key in taken:
            errs.append(f"query {i} repeats the parent or an ancestor query")
        if key in seen:
            errs.append(f"query {i} duplicates an earlier query")
        seen.add(key)
    if len(queries) >= 3:
        have = {facet_group(c.get("facet", "")) for c in queries}
        missing = [g for g in REQUIRED_FACETS if g not in have]
        if missing:
            errs.append("no child covers the facet(s): " + ", ".join(missing))
    return errs


def _proposals(a: TreeAsk, v: dict[str, Any]) -> list[Proposal]:
    return [Proposal(c["query"].strip(), c.get("facet", "").strip(), c.get("phrase") or c["query"].strip())
            for c in v["queries"]]


# How a query on each facet opens: children of one parent then differ from it and from each other
# (SmolLM2 repeated the parent query three times), and the facet is visible in the query.
OPENERS = {"stakeholders": ("People involved in", "Groups affected by"), "timeline": ("History of", "Timeline of"),
           "mechanisms": ("How", "Causes of"), "outcomes": ("Effects of", "Outcomes of"),
           "risks": ("Risks of", "Dangers of"), "failures": ("Failures of", "Problems with"),
           "comparison": ("Comparison of", "Differences between"), "alternatives": ("Alternatives to",),
           "quantitative data": ("Numbers on", "Figures on"), "statistics": ("Statistics on",),
           "geography": ("Geography of", "Regions of"), "policy": ("Policy on", "Laws on"),
           "controversy": ("Controversy over", "Criticism of")}
FACETS = tuple(OPENERS)


DECOMPOSE = Role(
    name="decompose", action="split", messages=_decompose_messages, output=JSONReply(_Children),
    check=_decompose_check, extractive=ex.decompose_reply, result=_proposals,
    fallback=lambda a: {"queries": []}, max_tokens=768,
    accept=(*FREE_TEXT, query_words(lambda v: [c.get("query", "") for c in v.get("queries") or []])),
    on_fail="decompose failed on {query!r}: the node stops here")


# -- ground ---------------------------------------------------------------------------

def _ground_check(a: TreeAsk, v: dict[str, Any]) -> list[str]:
    n = len(a.ctx.hits)
    bad = [k for k in v["supporting"] if not 1 <= k <= n]
    return [f"document numbers {bad} do not exist; use 1..{n}"] if bad else []


GROUND = Role(
    name="ground", action="judge", output=JSONReply(_Support), check=_ground_check,
    messages=_in_language(lambda a: _msgs(PROMPTS["ground"], f"Sub-query: {a.ctx.query}\nDocuments:\n"
                                          f"{_snippets(a.ctx.hits, a.roles.snippet_chars)}")),
    extractive=ex.ground_reply, fallback=lambda a: {"supporting": []}, max_tokens=256,
    result=lambda a, v: list(dict.fromkeys(k - 1 for k in v["supporting"]))[: a.roles.max_docs],
    on_fail="grounding failed on {query!r}: no supporting documents")


# -- extract --------------------------------------------------------------------------

def _extract_check(a: TreeAsk, v: dict[str, Any]) -> list[str]:
    source, r = f"{a.hit.title} {a.hit.text}", a.roles
    errs = []
    if len(v["statements"]) > r.max_statements:
        errs.append(f"{len(v['statements'])} statements; give at most {r.max_statements}")
    for i, s in enumerate(v["statements"], start=1):
        cov = coverage(s, source)
        if not s.strip() or cov is None:
            errs.append(f"statement {i} is empty")
        elif cov < r.statement_support:
            errs.append(f"statement {i} is not supported by the document (only {cov:.0%} of "
                        "its content words occur there); quote or closely paraphrase it")
    return errs


EXTRACT = Role(
    name="extract", action="quote", output=JSONReply(_Statements), check=_extract_check,
    messages=_in_language(lambda a: _msgs(PROMPTS["extract"].format(k=a.roles.max_statements),
                                          f"Goal of this research branch: {a.note}\nSub-query: {a.query}\n"
                                          f"Document: {a.hit.title}\n{a.hit.text}")),
    extractive=ex.extract_reply,
    result=lambda a, v: list(dict.fromkeys(s.strip() for s in v["statements"] if s.strip())),
    fallback=lambda a: {"statements": []}, max_tokens=768, accept=FREE_TEXT,
    on_fail="no statements taken from {hit} after the model failed")


class TreeRoles:
    """The roles, bound to their models, embedder and limits.

    ``judge`` answers the judging roles, gate and ground (``"writer"``: ``llm``); ``llm`` the
    writing ones. ``None`` for either is the extractive engine. With ``min_leaves`` ≥ 2 the root is always expanded (its gate is not asked).
    ``language`` is the corpus's, which every prompt asks for (None: detected per role). ``embed`` maps texts to L2-normalised rows. Each method performs one
    role declared above and records it on ``rec``.
    """

    def __init__(self, llm: LLM | None, embed: ex.Embed, *, judge: LLM | None | Literal["writer"] = "writer", max_words: int = 11,
                 max_statements: int = 3, max_docs: int = 3, min_overlap: float = 0.5,
                 ground_threshold: float = 0.5, statement_support: float = 0.5, root_overlap: float = 0.66,
                 redundancy: float = 0.85, max_reasks: int = 2, snippet_chars: int = 700, min_leaves: int = 2,
                 profile: CallPolicy | None = None, judge_profile: CallPolicy | None = None,
                 language: str | None = None):
        self.llm, self.judge, self.embed = llm, llm if judge == "writer" else judge, embed
        # each model with its own profile (deepr.profiles): a small writer may sit beside a capable judge
        self.profile, self.judge_profile = profile, judge_profile if judge is not None else profile
        self.max_words, self.max_statements, self.max_docs = max_words, max_statements, max_docs
        self.min_overlap, self.ground_threshold, self.root_overlap = min_overlap, ground_threshold, root_overlap
        self.statement_support, self.redundancy = statement_support, redundancy
        self.max_reasks, self.snippet_chars, self.min_leaves = max_reasks, snippet_chars, min_leaves
        self.language = language  # the corpus's (its retriever's BM25 language); None: read from the text

    @property
    def backend(self) -> str:
        return NO_MODEL if self.llm is None else self.llm.name

    async def _do(self, role: Role, llm: LLM | None, rec: Recorder, ask: TreeAsk, **extra: Any) -> Outcome:
        profile = self.judge_profile if llm is self.judge and llm is not self.llm else self.profile
        return await perform(role, ask, llm=llm, rec=rec, max_reasks=self.max_reasks, profile=profile, **extra)

    async def root_query(self, seed: SeedTopic, rec: Recorder) -> Outcome[str]:
        return await self._do(ROOT_QUERY, self.llm, rec, TreeAsk(self, seed=seed), query=seed.title)

    async def gate(self, ctx: NodeCtx, rec: Recorder) -> Outcome[tuple[bool, str]]:
        if ctx.depth == 0 and self.min_leaves >= 2:
            # An atomic root would leave a one-leaf tree, which is rejected: never ask (a small
            # model judged the root atomic and the tree failed, issue 14).
            return Outcome((False, ""), "none")
        return await self._do(GATE, self.judge, rec, TreeAsk(self, ctx), query=ctx.query)

    async def decompose(self, ctx: NodeCtx, limit: int, rec: Recorder) -> Outcome[list[Proposal]]:
        return await self._do(DECOMPOSE, self.llm, rec, TreeAsk(self, ctx, limit=limit), query=ctx.query)

    async def ground(self, ctx: NodeCtx, rec: Recorder) -> Outcome[list[int]]:
        if not ctx.hits:  # nothing retrieved: nothing to judge, by any engine
            return Outcome([], "none")
        return await self._do(GROUND, self.judge, rec, TreeAsk(self, ctx), query=ctx.query)

    async def extract(self, query: str, note: str, hit: Hit, rec: Recorder) -> Outcome[list[str]]:
        return await self._do(EXTRACT, self.llm, rec, TreeAsk(self, query=query, note=note, hit=hit), hit=hit.id)
