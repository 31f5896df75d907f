"""Stage ``build-trees``: seed topics → evidence trees (DeepRubric §3.1, Alg. 1).

Input: seed topics (:mod:`deepr.data.topics`), a retriever (``deepr.corpus``), an LLM (or None,
the extractive engine). Output: one :class:`deepr.records.Tree` per topic, or a
:class:`deepr.records.Reject` with the reason the tree could not be built.

    deepr build-trees --corpus wiki --n-trees 20 --max-depth 3 --branching 6,4,3 --out trees.jsonl

Per tree: the root query is retrieved and grounded; then each node either stops (depth
limit, or judged atomic) or proposes child sub-queries; each child is retrieved,
grounded (kept only if some document supports it and it is not redundant by embedding
with its ancestors and earlier siblings) and gets 1–3 statements per supporting
document. The tree grows breadth-first in effect: every node of a level proceeds at
once, and a node starts as soon as its own parent is ready rather than when the whole
level is, so a tree's wall time follows its chain of dependent model calls
(ground → extract ‖ gate → decompose, per level), not the sum of its calls.
Retrieval and embedding run on one worker thread: model round-trips overlap with them,
and the index and embedder are never used from two threads at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deepr.llm.base import LLM, run_sync
from deepr.records import Hit, Reject, SupportingDoc, Tree, TreeNode, TreeStats
from deepr.data.outcomes import Fallback, mark_fallback
from deepr.data.topics import SeedTopic
from deepr.extractive.trees import NodeCtx, Proposal, dedup
from deepr.data.tree_roles import TreeRoles
from deepr.roles import Recorder


class TreeConfig(BaseModel):
    """Settings of ``build-trees``; validated on construction."""

    model_config = ConfigDict(extra="forbid")

    max_depth: int = Field(3, ge=1, le=6, description="Depth of the deepest nodes (root = 0); nodes there are leaves.")
    branching: list[int] = Field(default_factory=lambda: [6, 4, 3], description=(
        "Most children per node by its depth: root, next level, ...; the last value repeats deeper."))
    retrieve_k: int = Field(8, ge=1, le=50, description=(
        "Passages retrieved per sub-query (grounding keeps the supporting ones; the rest seed new facets)."))
    max_support_docs: int = Field(3, ge=1, le=10, description="Most supporting documents kept per node.")
    max_statements: int = Field(3, ge=1, le=3, description="Most statements extracted per supporting document (1–3).")
    max_query_words: int = Field(11, ge=3, le=40, description=(
        "Longest child sub-query in words (DeepRubric: under 12 tokens)."))
    redundancy_threshold: float = Field(0.85, gt=0, le=1, description=(
        "Embedding cosine at or above which a child counts as redundant with an ancestor or earlier sibling."))
    ground_min_overlap: float = Field(0.5, ge=0, le=1, description=(
        "Extractive grounding: least share of the sub-query's content words a supporting passage must contain."))
    ground_root_overlap: float = Field(0.66, ge=0, le=1, description=(
        "Extractive grounding of the root (a bare topic title): least share of its words a passage must contain."))
    ground_threshold: float = Field(0.5, ge=0, le=1, description=(
        "Extractive grounding: least 0.5·(score / best score) + 0.5·overlap of a supporting passage."))
    statement_support: float = Field(0.5, ge=0, le=1, description=(
        "LLM extraction: least share of a statement's content words that must occur in its document."))
    min_leaves: int = Field(2, ge=1, description=(
        "Trees with fewer leaves are rejected (too little to synthesise from)."))
    concurrency: int = Field(8, ge=1, le=512, description=(
        "Trees built at the same time (model calls are bounded by the LLM backend)."))
    max_reasks: int = Field(2, ge=0, le=5, description="Re-asks after an unusable model reply, per call.")
    seed: int = Field(0, description="Seed of topic sampling; part of every tree id.")
    fallback: Fallback = Field("none", description=(
        "extractive: a tree the model path cannot build is rebuilt by the extractive engine (recorded "
        "in the tree's 'fallback' field); none: it is rejected."))

    @field_validator("branching")
    @classmethod
    def _branching_ok(cls, v: list[int]) -> list[int]:
        if not v or any(not 1 <= b <= 12 for b in v):
            raise ValueError(f"branching {v}: give 1 to 12 children per level, e.g. 6,4,3")
        return v

    def limit(self, depth: int) -> int:
        return self.branching[min(depth, len(self.branching) - 1)]


class TreeFailed(Exception):
    """A tree that cannot be built; the message is the reject reason."""


@dataclass
class _Node:
    ctx: NodeCtx
    parent: _Node | None
    facet: str = ""
    id: str = ""
    statements_by_doc: list[list[str]] = field(default_factory=list)
    atomic: tuple[bool, str] = (False, "")
    children: list[_Node] = field(default_factory=list)
    stop: str | None = None

    def child_ctx(self, query: str, phrase: str, hits: list[Hit]) -> NodeCtx:
        c = self.ctx
        used = {c.hits[i].doc_id for i in c.support}
        return NodeCtx(query=query, depth=c.depth + 1, phrase=phrase or query, root_topic=c.root_topic,
                       anchor=c.phrase, hits=hits, path=[*c.path, c.query], seen_docs=c.seen_docs | used)

    def record(self) -> TreeNode:
        c = self.ctx
        docs = [SupportingDoc(doc_id=c.hits[i].doc_id, snippet_id=c.hits[i].id, title=c.hits[i].title,
                              statements=st) for i, st in zip(c.support, self.statements_by_doc)]
        extra: dict[str, Any] = {"facet": self.facet, "phrase": c.phrase}
        if self.stop == "atomic":
            extra["gate_reason"] = self.atomic[1]
        return TreeNode(id=self.id, parent=self.parent.id if self.parent else None, depth=c.depth,
                        query=c.query, supporting_docs=docs, statements=c.statements,
                        children=[ch.id for ch in self.children], stop_reason=self.stop, **extra)


class SearchBatcher:
    """One ``search_many`` call for every search asked for while the previous one ran.

    Each node of a level searches for its children's queries right after its decompose
    reply; one at a time on the CPU worker, those searches queued behind each other and the
    last node's children started late (a full tree took 1.33x its critical path against a
    fixed-latency endpoint, docs/experiments.md). Batched, a level's searches cost
    about one call: the query vectors are encoded together and faiss/BM25 run once.
    The first request goes out at once, so a lone search waits for nothing.
    """

    def __init__(self, retriever: Any, cpu: Callable[..., Any]):
        self.retriever, self.cpu = retriever, cpu
        self.pending: list[tuple[list[str], int, asyncio.Future]] = []
        self.task: asyncio.Task | None = None
        self.calls = 0  # search_many calls made (tests read it)

    async def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((queries, k, fut))
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self.pending:
            batch, self.pending = self.pending, []
            for k in dict.fromkeys(kk for _, kk, _ in batch):  # one call per k (trees use one k)
                group = [(qs, fut) for qs, kk, fut in batch if kk == k]
                try:
                    self.calls += 1
                    found = await self.cpu(self.retriever.search_many, [q for qs, _ in group for q in qs], k)
                except Exception as e:  # noqa: BLE001  every waiting node sees the failure
                    for _, fut in group:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                start = 0
                for qs, fut in group:
                    if not fut.done():
                        fut.set_result(found[start:start + len(qs)])
                    start += len(qs)


class _TreeBuilder:
    """Grows one tree; ``cpu`` runs retrieval/embedding work off the event loop when useful."""

    def __init__(self, seed: SeedTopic, retriever: Any, roles: TreeRoles, config: TreeConfig,
                 cpu: Callable[..., Any], searcher: SearchBatcher | None = None):
        self.seed, self.retriever, self.roles, self.cfg, self.cpu = seed, retriever, roles, config, cpu
        self.searcher = searcher
        self.rec = Recorder()
        self.retrieval_calls = 0
        self.dropped = Counter()

    async def search(self, queries: Sequence[str]) -> list[list[Hit]]:
        if not queries:
            return []
        self.retrieval_calls += len(queries)
        k = self.cfg.retrieve_k
        # Twice as many passages, then the best one per document: a node's evidence should
        # span documents, not be eight chunks of one long article.
        if self.searcher is not None:
            found = await self.searcher.search(list(queries), 2 * k)
        elif hasattr(self.retriever, "search_many"):
            found = await self.cpu(self.retriever.search_many, list(queries), 2 * k)
        else:
            found = [await self.cpu(self.retriever.search, q, 2 * k) for q in queries]
        return [_per_document(hits, k) for hits in found]

    async def build(self) -> Tree:
        t0 = time.perf_counter()
        q0 = await self.roles.root_query(self.seed, self.rec)
        if q0.value is None:
            raise TreeFailed(f"root query failed: {q0.error}")
        [hits0] = await self.search([q0.value])
        root = _Node(NodeCtx(query=q0.value, depth=0, phrase=self.seed.title, root_topic=self.seed.title,
                             hits=hits0), None, id="n0")
        if not await self._ground(root) or not await self._evidence(root):
            raise TreeFailed(f"no retrieved document supports the root query {q0.value!r}; "
                             "pick another topic or corpus")
        await self._expand(root)
        return self._record(root, time.perf_counter() - t0)

    async def _ground(self, node: _Node) -> bool:
        out = await self.roles.ground(node.ctx, self.rec)
        node.ctx.support = out.value
        return bool(out.value)

    async def _evidence(self, node: _Node) -> bool:
        """Statements for each supporting document, with the gate call alongside."""
        c = self.ctx_note(node)
        calls = [self.roles.extract(node.ctx.query, c, node.ctx.hits[i], self.rec) for i in node.ctx.support]
        gate = node.ctx.depth < self.cfg.max_depth
        results = await asyncio.gather(*calls, *([self.roles.gate(node.ctx, self.rec)] if gate else []))
        if gate:
            node.atomic = results[-1].value
            results = results[:-1]
        kept = [(i, r.value) for i, r in zip(node.ctx.support, results) if r.value]
        node.ctx.support = [i for i, _ in kept]
        node.statements_by_doc = [st for _, st in kept]
        node.ctx.statements = [s for st in node.statements_by_doc for s in st]
        return bool(kept)

    @staticmethod
    def ctx_note(node: _Node) -> str:
        return " > ".join([*node.ctx.path, node.ctx.query])

    async def _expand(self, node: _Node) -> None:
        if node.ctx.depth >= self.cfg.max_depth:
            node.stop = "max_depth"
            return
        if node.atomic[0]:
            node.stop = "atomic"
            return
        limit = self.cfg.limit(node.ctx.depth)
        out = await self.roles.decompose(node.ctx, limit, self.rec)
        if out.error:
            node.stop = "decompose_failed"
            return
        props = [p for p in out.value if p.query.strip()]
        fresh = await self.cpu(dedup, props, [*node.ctx.path, node.ctx.query], self.roles.embed,
                               self.cfg.redundancy_threshold)
        self.dropped["redundant"] += len(props) - len(fresh)
        children = await self._children(node, fresh, limit)
        if not children:
            node.stop = "no_children" if not props else "children_dropped"  # redundant, ungrounded or nothing new
            return
        node.children = children  # grown by now; ids are given once the tree is whole (_record)

    async def _children(self, node: _Node, props: list[Proposal], limit: int) -> list[_Node]:
        """The kept children of ``node``, each with its subtree grown."""
        hits = await self.search([p.query for p in props])
        cands = [_Node(node.child_ctx(p.query, p.phrase, h), node, facet=p.facet) for p, h in zip(props, hits)]
        known = {s for a in _ancestry(node) for s in a.ctx.statements}
        if len(cands) <= limit:
            # every grounded child is kept, so each one decomposes as soon as its own evidence is
            # in: waiting for the slowest sibling at every level added up along the tree's depth
            return [c for c in await asyncio.gather(*(self._grow_child(c, known) for c in cands)) if c]
        grounded = await asyncio.gather(*(self._ground(c) for c in cands))
        queue = [c for c, ok in zip(cands, grounded) if ok]
        self.dropped["ungrounded"] += len(cands) - len(queue)
        kept: list[_Node] = []
        while queue and len(kept) < limit:  # refill from spare candidates (extractive over-proposes)
            batch, queue = queue[: limit - len(kept)], queue[limit - len(kept):]
            evidenced = await asyncio.gather(*(self._evidence(c) for c in batch))
            kept += [c for c, ok in zip(batch, evidenced) if self._useful(c, ok, known)]
        await asyncio.gather(*(self._expand(ch) for ch in kept))
        return kept

    async def _grow_child(self, child: _Node, known: set[str]) -> _Node | None:
        if not await self._ground(child):
            self.dropped["ungrounded"] += 1
            return None
        if not self._useful(child, await self._evidence(child), known):
            return None
        await self._expand(child)
        return child

    def _useful(self, child: _Node, has_statements: bool, known: set[str]) -> bool:
        if not has_statements:
            self.dropped["no_statements"] += 1
            return False
        if set(child.ctx.statements) <= known:  # nothing its ancestors do not already hold
            self.dropped["no_new_evidence"] += 1
            return False
        return True

    def _record(self, root: _Node, seconds: float) -> Tree:
        nodes, queue = [], [root]
        while queue:  # breadth-first order; ids n0, n0.1, n0.1.2 ... follow the kept children
            n = queue.pop(0)
            for i, ch in enumerate(n.children, start=1):
                ch.id = f"{n.id}.{i}"
            nodes.append(n.record())
            queue.extend(n.children)
        leaves = [n for n in nodes if not n.children]
        stats = TreeStats(
            nodes=len(nodes), leaves=len(leaves), depth=max(n.depth for n in nodes),
            llm_calls=len(self.rec.calls), retrieval_calls=self.retrieval_calls,
            seconds=round(seconds, 3), calls_by_role=dict(Counter(c.role for c in self.rec.calls)),
            failures=len(self.rec.failures), dropped=dict(self.dropped),
            stop_reasons=dict(Counter(n.stop_reason for n in leaves)),
            passages_per_leaf=round(sum(len(n.supporting_docs) for n in leaves) / len(leaves), 3))
        tree = Tree(id=self.seed.id, topic=self.seed.title, root_id=root.id, nodes=nodes, stats=stats,
                    backend=self.roles.backend, category=self.seed.category, seed_doc_id=self.seed.doc_id,
                    failures=self.rec.failures)
        if stats.leaves < self.cfg.min_leaves:
            raise TreeFailed(f"tree too small: {stats.leaves} leaf(s), at least {self.cfg.min_leaves} needed "
                             f"(leaves stopped by: {_tally(stats.stop_reasons)}; children dropped: "
                             f"{_tally(self.dropped)}; model failures: {len(self.rec.failures)})")
        return tree


def _per_document(hits: Sequence[Hit], k: int) -> list[Hit]:
    out, seen = [], set()
    for h in hits:
        if h.doc_id not in seen:
            seen.add(h.doc_id)
            out.append(h)
    return out[:k]


def _ancestry(node: _Node | None) -> list[_Node]:
    out = []
    while node is not None:
        out.append(node)
        node = node.parent
    return out


def make_roles(llm: LLM | None, embed: Callable[[list[str]], Any], config: TreeConfig,
               judge: LLM | None | Literal["writer"] = "writer", profile: Any = None, judge_profile: Any = None,
               language: str | None = None) -> TreeRoles:
    c = config
    return TreeRoles(llm, embed, judge=judge, max_words=c.max_query_words, max_statements=c.max_statements,
                     max_docs=c.max_support_docs, min_overlap=c.ground_min_overlap,
                     ground_threshold=c.ground_threshold, statement_support=c.statement_support,
                     root_overlap=c.ground_root_overlap, redundancy=c.redundancy_threshold,
                     max_reasks=c.max_reasks, min_leaves=c.min_leaves, profile=profile, judge_profile=judge_profile,
                     language=language)


def _tally(counts: dict[str, int]) -> str:
    """``{'no_children': 2}`` as "no children 2" (a reason read by people, not a Python dict)."""
    parts = [f"{k.replace('_', ' ')} {v}" for k, v in counts.items() if v]
    return ", ".join(parts) or "none"


async def abuild_trees(topics: Sequence[SeedTopic], retriever: Any, llm: LLM | None, config: TreeConfig, *,
                       embed: Callable[[list[str]], Any] | None = None,
                       judge: LLM | None | Literal["writer"] = "writer",
                       on_result: Callable[[Tree | Reject], None] | None = None, profile: Any = None,
                       judge_profile: Any = None) -> list[Tree | Reject]:
    """Build trees concurrently (``config.concurrency`` at once); ``on_result`` sees each as it ends.
    ``profile`` / ``judge_profile``: each model's profile (:mod:`deepr.profiles`). ``judge``: the
    gate and ground roles' model (``"writer"``: ``llm``). ``None`` for either: the extractive engine."""
    embed = embed or _embedder_of(retriever).encode
    language = corpus_language_of(retriever)
    roles = make_roles(llm, embed, config, judge, profile, judge_profile, language)
    # With a model, CPU work moves to one worker thread so round-trips overlap it; the
    # extractive engine is all CPU, so a thread would only add hand-offs.
    pool = None if llm is None else ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepr-cpu")

    async def cpu(fn: Callable[..., Any], *args: Any) -> Any:
        if pool is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    # batching pays where searches wait on a worker thread; extractive runs them inline, in order
    searcher = SearchBatcher(retriever, cpu) if pool is not None and hasattr(retriever, "search_many") else None
    sem = asyncio.Semaphore(config.concurrency)
    results: list[Tree | Reject] = []
    backup = None
    if llm is not None and config.fallback == "extractive":  # what the engine failed, it would fail again
        backup = make_roles(None, embed, config, language=language)

    async def one(seed: SeedTopic) -> None:
        async with sem:
            result = await _build_one(seed, retriever, roles, config, cpu, searcher)
            if isinstance(result, Reject) and backup is not None:
                result = await _rebuild(seed, result, retriever, backup, config, cpu, searcher)
        results.append(result)
        if on_result is not None:
            on_result(result)

    try:
        await asyncio.gather(*(one(s) for s in topics))
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
    return results


async def _build_one(seed: SeedTopic, retriever: Any, roles: TreeRoles, config: TreeConfig,
                     cpu: Callable[..., Any], searcher: SearchBatcher | None = None) -> Tree | Reject:
    builder = _TreeBuilder(seed, retriever, roles, config, cpu, searcher)
    try:
        return await builder.build()
    except TreeFailed as e:  # the turns' own failures travel with the reject: they say why
        return Reject(id=seed.id, stage="build-trees", reason=str(e),
                      record={**seed.model_dump(), "failures": builder.rec.failures})


async def _rebuild(seed: SeedTopic, failed: Reject, retriever: Any, roles: TreeRoles, config: TreeConfig,
                   cpu: Callable[..., Any], searcher: SearchBatcher | None = None) -> Tree | Reject:
    """``--fallback extractive``: the extractive engine builds the tree the model path could not."""
    again = await _build_one(seed, retriever, roles, config, cpu, searcher)
    model_failures = (failed.record or {}).get("failures", [])
    if isinstance(again, Reject):
        return failed.model_copy(update={"reason": f"{failed.reason}; the extractive fallback failed too: "
                                                   f"{again.reason}"})
    return mark_fallback(again, f"model path: {failed.reason}", model_failures)


def build_trees(topics: Sequence[SeedTopic], retriever: Any, llm: LLM | None, config: TreeConfig, **kw: Any
                ) -> list[Tree | Reject]:
    """Sync wrapper of :func:`abuild_trees` (records in, records out)."""
    return run_sync(abuild_trees(topics, retriever, llm, config, **kw))


def corpus_language_of(retriever: Any) -> str | None:
    """The language the retriever's BM25 reads its corpus in (the local index and Milvus say);
    None for one that does not say, whose trees' roles read it from their text instead."""
    from deepr.text.lang import NAMES

    language = getattr(retriever, "language", None)
    return language if language in NAMES else None


def _embedder_of(retriever: Any) -> Any:
    emb = getattr(retriever, "embedder", None)
    if emb is None:
        from deepr.corpus.embed import get_embedder

        emb = get_embedder()
    return emb


def tree_summary(trees: Sequence[Tree]) -> dict[str, float]:
    """Mean structure of built trees, for the summary table and the sidecar."""
    n = len(trees) or 1
    mean = lambda f: round(sum(f(t) for t in trees) / n, 2)  # noqa: E731
    return {"trees": len(trees), "mean nodes": mean(lambda t: t.stats.nodes),
            "mean leaves": mean(lambda t: t.stats.leaves), "mean depth": mean(lambda t: t.stats.depth),
            "mean passages/leaf": mean(lambda t: getattr(t.stats, "passages_per_leaf", 0.0)),
            "mean LLM calls": mean(lambda t: t.stats.llm_calls),
            "mean retrievals": mean(lambda t: t.stats.retrieval_calls),
            "mean seconds": mean(lambda t: t.stats.seconds)}
