"""The agent's environment: run settings, tools, citation catalog and trace in one context.

Every loop (dag, warp, decor) and role receives one :class:`Ctx`. Searches go through
:class:`deepr.corpus.tools.ResearchTools` so ``browse`` can only open documents a search
returned; their results are registered in the :class:`Catalog` (ids such as ``N1-R3``)
and logged in the trace with the ids they produced.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from deepr.text.lang import HAS_UNSPACED
from deepr.llm.base import LLM
from deepr.records import Document, Hit
from deepr.roles import Outcome, Role, perform
from deepr.text import tok

from deepr.evidence.citations import Catalog
from deepr.evidence.extract import split_sentences
from deepr.evidence.trace import Tracer

Mode = Literal["dag", "warp", "decor", "tools"]


class RunConfig(BaseModel):
    """Settings of ``deepr run``; validated on construction."""

    model_config = ConfigDict(extra="forbid")

    mode: Mode = Field("dag", description="Agent loop: dag (DecomposeR planner + waves), warp (AgentCPM "
                       "draft/deepen), decor (DECOR planner/filter/answerer for short answers), "
                       "tools (DeepRubric tool-calling agent, ≤ 10 tool turns).")
    answer: Literal["report", "short"] = Field("report", description="report: the long-form cited report; "
                                              "short: a fact-seeking question's Explanation / Exact Answer / "
                                              "Confidence (BrowseComp's response form), from dag, decor or tools.")
    k: int = Field(5, ge=1, le=50, description="Results per search call (top-k snippets).")
    explore_k: int = Field(15, ge=2, le=100, description="Results the extractive planner clusters into "
                           "search nodes (and warp's into sections).")
    search_rounds: int = Field(1, ge=1, le=10, description="dag: rounds of the inner search agent per "
                               "search node (1 = one plain search).")
    rubric_scaffold: bool = Field(False, description="dag: persistent rubric for the writer plus ephemeral "
                                  "gap rubrics that trigger re-planning.")
    max_cycles: int = Field(3, ge=1, le=10, description="dag with rubric scaffold: most planning cycles "
                            "(the first is the two-turn plan/revise).")
    fetch_limit: int = Field(4, ge=0, le=10, description="dag: most pages fetched per revision turn.")
    max_levels: int = Field(3, ge=1, le=3, description="warp: deepest outline level.")
    max_expansions: int = Field(12, ge=0, le=12, description="warp: most deepening expansions.")
    force_expand: int = Field(0, ge=0, le=12, description="warp: expand exactly this many times, never "
                              "terminating earlier (teacher over-expansion for trajectory pruning).")
    decor_steps: int = Field(4, ge=1, le=10, description="decor: T_max, most planner/filter steps.")
    memory_limit: int = Field(4096, ge=64, description="decor: L_max, approximate tokens of curated memory "
                              "before it is condensed into atomic facts.")
    max_reasks: int = Field(2, ge=0, le=5, description="Re-asks per model turn after a bad reply.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Sampling temperature (unset: greedy "
                                      "on local models and self-hosted servers, the API's default on "
                                      "api.openai.com; re-asks sample).")
    max_tokens: int | None = Field(None, ge=16, description="Completion token cap per call (backend default "
                                   "if unset).")
    gap_threshold: float = Field(0.45, ge=0.0, le=1.0, description="Extractive roles: a target (key point, "
                                 "sub-question) counts as covered when some evidence sentence reaches this "
                                 "cosine similarity.")
    section_sentences: int = Field(4, ge=1, le=20, description="Extractive writer: sentences per section.")
    answer_sentences: int = Field(8, ge=1, le=30, description="Extractive writer: sentences in the answer.")

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.answer == "short" and self.mode == "warp":
            raise ValueError("--answer short: warp writes a long report section by section; use --mode dag, "
                             "decor or tools for a short answer")
        if self.force_expand > self.max_expansions:
            raise ValueError(f"--force-expand {self.force_expand} exceeds the expansion limit "
                             f"{self.max_expansions}; lower it")
        return self


def shares_words(texts: Sequence[str], targets: Sequence[str], *, fallback: bool = True) -> list[bool] | None:
    """For targets written without spaces (Chinese, Japanese, Thai): which texts share a content
    word with them; None for other targets, or (``fallback``) when no text shares one, so a
    sparse corpus still yields material to explore. An English encoder such as MiniLM scores
    every Chinese passage about alike, so there a topic needs a word of the question as well
    as the cosine."""
    if not any(HAS_UNSPACED.search(t or "") for t in targets):
        return None
    want = set().union(*(tok(t) for t in targets))
    shared = [bool(want & tok(t)) for t in texts]
    return shared if any(shared) or not fallback else None


@dataclass
class Ctx:
    """Everything a role needs: model, tools, catalog, trace and settings.

    ``tools`` is a :class:`deepr.corpus.tools.ResearchTools` (fixed top-k). Searches with a
    different k use sibling tools over the same retriever, and ``fetch`` asks each of them,
    so a page still opens only if one of this run's searches returned it.
    """

    llm: LLM | None  # None: the extractive engine (``--llm extractive``), every role's own implementation
    tools: Any  # deepr.corpus.tools.ResearchTools
    config: RunConfig
    tracer: Tracer
    catalog: Catalog = field(default_factory=Catalog)
    profile: Any = None  # the model's profile (deepr.profiles.Profile); None: the default
    _sent_cache: dict[str, list[str]] = field(default_factory=dict)
    _by_k: dict[int, Any] = field(default_factory=dict)

    async def perform(self, role: Role, inp: Any, **extra: Any) -> Outcome:
        """Perform one model role with this run's model, trace and limits (see :mod:`deepr.roles`)."""
        return await perform(role, inp, llm=self.llm, rec=self.tracer, max_reasks=self.config.max_reasks,
                             profile=self.profile,
                             temperature=self.config.temperature, max_tokens=self.config.max_tokens, **extra)

    @property
    def retriever(self) -> Any:
        return self.tools.retriever

    def encode(self, texts: list[str]) -> np.ndarray:
        """L2-normalised embeddings (the retriever's embedder caches per text)."""
        if not texts:
            return np.zeros((0, 1), dtype=np.float32)
        mat = np.asarray(self.retriever.embedder.encode(list(texts)), dtype=np.float32)
        return mat / np.maximum(np.linalg.norm(mat, axis=1, keepdims=True), 1e-9)

    def on_topic(self, texts: list[str], query: str, floor: float = 0.4, keep: int = 3,
                 rel: float = 0.65) -> list[bool]:
        """Which texts are on the topic of ``query``: cosine ≥ ``floor`` and ≥ ``rel`` times the
        best one's (the first ``keep`` always count, so a sparse corpus still yields material).

        With MiniLM, passages about the asked subject score about 0.55–0.8 against the
        question and neighbouring subjects 0.35–0.47; the relative cut follows the best."""
        if not texts:
            return []
        sims = self.encode(list(texts)) @ self.encode([query])[0]
        cut = max(floor, rel * float(sims.max()))
        ok = [i < keep or bool(sims[i] >= cut) for i in range(len(texts))]
        shared = shares_words(texts, [query])
        return ok if shared is None else [o and s for o, s in zip(ok, shared)]

    def relevant(self, hits: list[Hit], query: str, **kw: Any) -> list[Hit]:
        return [h for h, ok in zip(hits, self.on_topic([h.text for h in hits], query, **kw)) if ok]

    def _tools(self, k: int) -> Any:
        if k == self.tools.k:
            return self.tools
        if k not in self._by_k:
            self._by_k[k] = type(self.tools)(self.retriever, k=k)
        return self._by_k[k]

    def search(self, node: str, query: str, *, k: int | None = None, **log: Any) -> list[str]:
        """Run one search for ``node``; results are catalogued, their ids returned."""
        return self.raw_search(query, k or self.config.k, node=node, register=True, **log)[1]

    def raw_search(self, query: str, k: int, *, node: str, register: bool = False,
                   **log: Any) -> tuple[list[Hit], list[str]]:
        """One logged search; ``register`` catalogues the hits (citable), else they are only
        looked at (e.g. by the extractive planner) and logged without ids."""
        t0 = time.perf_counter()
        found = list(self._tools(k).search(query)) if query.strip() else []
        hits = self.catalog.screen(found)  # what no reader may take as evidence is gone from here on
        ids = self.catalog.add_hits(node, hits, query) if register else []
        self.tracer.tool("search", node=node, query=query, k=k, ids=ids, passages=[h.id for h in found],
                         doc_ids=[h.doc_id for h in found], seconds=round(time.perf_counter() - t0, 4), **log)
        return hits, ids

    def _browse(self, doc_id: str, need: str = "") -> list[Hit] | str:
        """The passages of a web page (a list) or the full text of a corpus document."""
        refusal: Exception | None = None
        for tools in [self.tools, *self._by_k.values()]:
            try:
                passages = tools.browse_passages(doc_id, need) if hasattr(tools, "browse_passages") else None
                return tools.browse(doc_id) if passages is None else passages
            except PermissionError as e:  # BrowseRefused: this tools object never returned it
                refusal = e
        raise refusal or PermissionError(f"browse refused: {doc_id!r}")

    def fetch(self, ref: str, *, node: str | None = None, need: str | None = None) -> str | None:
        """Open the page behind ``ref``; its first catalog id, or None (see :meth:`fetch_all`)."""
        ids = self.fetch_all(ref, node=node, need=need)
        return ids[0] if ids else None

    def fetch_all(self, ref: str, *, node: str | None = None, need: str | None = None) -> list[str]:
        """Open the page behind ``ref`` (an id, doc id or URL a search returned).

        A web page is chunked and its passages most relevant to ``need`` (default: the search
        that returned it) are catalogued, each with its own id; a corpus document gets one id.
        Returns the ids, best passage first, or [] (refusal recorded) when ``ref`` was never
        returned by a search or the page cannot be opened.
        """
        entry = self.catalog.resolve(ref)
        if entry is None:
            self.tracer.tool("browse", requested=ref, refused=True,
                             reason="not returned by any search in this run")
            return []
        t0, node = time.perf_counter(), node or entry.node
        need = need or entry.query or entry.title
        try:
            got = self._browse(entry.doc_id, need)
            if isinstance(got, str):
                doc = self.retriever.get_document(entry.doc_id)
                ids = [self.catalog.add_page(node, doc.model_copy(update={"text": got}))]
            else:
                ids = [self.catalog.add_page(node, Document(id=h.doc_id, title=h.title, text=h.text, url=h.url,
                                                            retrieved_at=getattr(h, "retrieved_at", "")),
                                             passage_id=h.id) for h in got]
        except (KeyError, ValueError, PermissionError) as e:
            self.tracer.tool("browse", requested=ref, doc_id=entry.doc_id, refused=True, reason=str(e))
            return []
        self.tracer.tool("browse", requested=ref, doc_id=entry.doc_id, id=ids[0] if ids else None, ids=ids,
                         passages=[] if isinstance(got, str) else [h.id for h in got], need=need, node=node,
                         seconds=round(time.perf_counter() - t0, 4))
        return ids

    def sentences(self, cid: str) -> list[str]:
        """Sentences of one catalogued source (cached)."""
        if cid not in self._sent_cache:
            text = self.catalog[cid].text
            self._sent_cache[cid] = split_sentences(text) or ([text.strip()] if text.strip() else [])
        return self._sent_cache[cid]
