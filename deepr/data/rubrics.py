"""Stage ``synthesize-rubrics``: evidence trees → query–rubric pairs (DeepRubric §3.2).

Input: ``trees.jsonl`` (:class:`deepr.records.Tree`). Output: one
:class:`deepr.records.QRPair` per tree (id ``<tree id>-qr``) with the final question,
the selected leaves (copied with their statements, so ``verify`` needs no tree file),
selection and merge traces and ≥ 5 typed, weighted, leaf-grounded rubrics; or a
:class:`deepr.records.Reject` with the reason.

    deepr synthesize-rubrics trees.jsonl --out pairs.jsonl --llm openai:Qwen/Qwen3-32B

The model sees the tree serialised compactly (nodes: id, parent, depth, query,
children; leaves: id, root→leaf path, statements). Its reply is checked against every
constraint of :mod:`deepr.roles.rubric_checks`; a reply that breaks any is re-asked with the
list of violations (bounded), then rejected. The role's non-LLM implementation is
:mod:`deepr.extractive.rubrics`, and its output must pass the same checks.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deepr.llm.base import LLM, run_sync
from deepr.records import MergeStep, QRPair, Reject, RubricItem, Tree
from deepr.roles.acceptance import FREE_TEXT
from deepr.roles import NO_MODEL, CallPolicy, JSONReply, Recorder, Role, perform
from deepr.data.outcomes import Fallback, mark_fallback
from deepr.roles.rubric_checks import RubricLimits, leaf_statements, pair_problems
from deepr.extractive import rubrics as ex
from deepr.text.lang import ask_in_language, corpus_language

SYSTEM = (
    "You design one deep-research task from an evidence tree. The input is a compact JSON tree: \"nodes\" "
    "(id, parent, depth, query, children) and \"leaves\" (id, path of queries from the root, statements "
    "taken from retrieved documents). Some branches may be off-topic or wrong: leave them out, or, if a "
    "misleading claim has to be addressed, write a criterion with a negative weight and \"penalty\": true "
    "that penalises repeating it.\n\n"
    "1. Choose {min_sel} to {max_sel} leaves (about {n_sel}) that together cover distinct facets of the "
    "root topic, and give the reason for each in selection_trace.\n"
    "2. Merge bottom-up: group the chosen leaves into intermediate queries, then merge those upward until"
    " one final question remains. Record each step in merge_trace as {{\"id\": \"M1\", \"inputs\": [leaf ids or"
    " earlier step ids], \"output\": \"the merged query\", \"rationale\": \"why these belong together\"}}. Every "
    "chosen leaf is an input of some step, every step except the last feeds a later one, and the last "
    "step's output is the final question, word for word.\n"
    "3. Write {min_rub} to {max_rub} criteria R1, R2, ... for judging a long-form answer. Each has: \"id\";"
    " \"type\": \"factual\" (a specific fact the answer must state) or \"logical\" (how the answer must reason,"
    " compare, organise or qualify); \"description\": one atomic requirement a grader can check as met or "
    "not, at most {max_words} words; \"weight\": importance in (0, 1]; \"source_leaf_ids\": the chosen leaves"
    " it rests on; \"evidence\": for factual criteria, statements copied from those leaves (verbatim or "
    "nearly), for logical ones an empty list. No two criteria check the same thing, and each can be "
    "judged on its own.\n"
    "4. The final question is self-contained and brief (at most {max_q} words), needs research and "
    "synthesis beyond the material shown, does not list the criteria or give away their answers, and "
    "asserts nothing the leaves do not support.\n\n"
    "Reply with JSON only: {{\"question\": \"...\", \"selected_leaf_ids\": [...], \"selection_trace\": "
    "[{{\"leaf_id\": \"...\", \"reason\": \"...\"}}], \"merge_trace\": [...], \"rubrics\": [...]}}"
)


class SynthConfig(BaseModel):
    """Settings of ``synthesize-rubrics``; validated on construction."""

    model_config = ConfigDict(extra="forbid")

    limits: RubricLimits = Field(default_factory=RubricLimits, description="Constraints every pair must meet.")
    n_select: int = Field(5, ge=1, le=20, description="Leaves to select (the paper averages 5.0).")
    mmr_lambda: float = Field(0.7, ge=0, le=1, description=(
        "Extractive selection: weight of relevance against diversity."))
    min_relevance: float = Field(0.2, ge=-1, le=1, description=(
        "Extractive selection: least cosine between a leaf and the root's query + evidence (drops drifted leaves)."))
    statements_per_leaf: int = Field(6, ge=1, le=30, description="Statements per leaf shown to the model.")
    max_reasks: int = Field(2, ge=0, le=5, description="Re-asks after a reply that breaks a constraint.")
    concurrency: int = Field(8, ge=1, le=512, description="Trees synthesised at the same time.")
    max_tokens: int | None = Field(None, ge=64, description=(
        "Reply length limit sent to the model (None: backend default)."))
    fallback: Fallback = Field("none", description=(
        "extractive: a tree whose model synthesis fails is synthesised by the extractive engine "
        "(recorded in the pair's 'fallback' field); none: it is rejected."))


class _Selection(BaseModel):
    leaf_id: str
    reason: str = ""


class _Merge(BaseModel):
    id: str
    inputs: list[str]
    output: str
    rationale: str = ""


class SynthReply(BaseModel):
    """The JSON a synthesis reply must hold."""

    question: str = Field(min_length=1)
    selected_leaf_ids: list[str]
    selection_trace: list[_Selection]
    merge_trace: list[_Merge]
    rubrics: list[RubricItem]

    @model_validator(mode="before")
    @classmethod
    def _last_step_is_the_question(cls, v: Any) -> Any:
        # The last merge step's output is the final question by definition; a reply may leave it
        # out (the strict format does, since a format cannot make two fields equal).
        steps = v.get("merge_trace") if isinstance(v, dict) else None
        if isinstance(steps, list) and steps and isinstance(steps[-1], dict) and "output" not in steps[-1]:
            v = {**v, "merge_trace": [*steps[:-1], {**steps[-1], "output": v.get("question", "")}]}
        return v


def pair_id(tree_id: str) -> str:
    return f"{tree_id}-qr"


def serialize_tree(tree: Tree, statements_per_leaf: int = 6) -> dict[str, Any]:
    """Compact form: nodes (id, parent, depth, query, children) and leaves (id, path, statements)."""
    by_id = {n.id: n for n in tree.nodes}

    def path(node_id: str) -> list[str]:
        out, cur = [], by_id.get(node_id)
        while cur is not None:
            out.append(cur.query)
            cur = by_id.get(cur.parent) if cur.parent else None
        return out[::-1]

    leaves = leaf_statements(tree)
    return {"topic": tree.topic,
            "nodes": [{"id": n.id, "parent": n.parent, "depth": n.depth, "query": n.query,
                       "children": n.children} for n in tree.nodes],
            "leaves": [{"id": lid, "path": path(lid), "statements": st[:statements_per_leaf]}
                       for lid, st in leaves.items()]}


def _system(cfg: SynthConfig) -> str:
    lim = cfg.limits
    return SYSTEM.format(min_sel=lim.min_selected, max_sel=lim.max_selected, n_sel=cfg.n_select,
                         min_rub=lim.min_rubrics, max_rub=lim.max_rubrics, max_words=lim.max_rubric_words,
                         max_q=lim.max_question_words)


@dataclass
class SynthAsk:
    tree: Tree
    cfg: SynthConfig
    embed: Callable[[list[str]], Any] | None
    leaves: dict[str, list[str]]
    compact: dict[str, Any]

    @functools.cached_property  # read by every attempt's prompt and the extractive engine
    def language(self) -> str:
        """The tree's language: the one most of its topic and evidence statements are written in."""
        return corpus_language([self.tree.topic, *(s for st in self.leaves.values() for s in st)])

    def problems(self, value: dict[str, Any]) -> list[str]:
        return _synth_check(self, value)


def _synth_messages(a: SynthAsk) -> list[dict[str, str]]:
    # the question and criteria are written in the tree's language (English prompts unchanged)
    tree = json.dumps(a.compact, ensure_ascii=False, separators=(",", ":"))
    return ask_in_language([{"role": "system", "content": _system(a.cfg)}, {"role": "user", "content": tree}],
                           language=a.language)


def _synth_check(a: SynthAsk, value: dict[str, Any]) -> list[str]:
    return pair_problems(SynthReply.model_validate(value), a.leaves, a.cfg.limits)


def _synth_shrink(a: SynthAsk, step: int) -> SynthAsk | None:
    # A tree over the model's context shows fewer statements per leaf (its evidence) first.
    shown = max((len(leaf["statements"]) for leaf in a.compact["leaves"]), default=0)
    if shown <= 1:
        return None
    return replace(a, compact=serialize_tree(a.tree, shown // 2))


SYNTHESIZE = Role(
    name="synthesize", action="pair", output=JSONReply(SynthReply), check=_synth_check,
    messages=_synth_messages, extractive=ex.synth_reply, result=lambda a, v: SynthReply.model_validate(v),
    fallback=None, max_tokens=4096, accept=FREE_TEXT, shrink=_synth_shrink)


async def synthesize_one(tree: Tree, llm: LLM | None, cfg: SynthConfig, embed: Callable[[list[str]], Any] | None,
                         profile: CallPolicy | None = None) -> QRPair | Reject:
    """One tree → one pair, or a Reject with the reason (never raises on a bad reply). ``llm=None``:
    the extractive synthesiser (it selects leaves by embedding, so ``embed`` is needed)."""
    leaves = leaf_statements(tree)
    compact = serialize_tree(tree, cfg.statements_per_leaf)
    if llm is not None and len(leaves) < cfg.limits.min_selected:
        # No reply could pass the selection check: say so instead of spending a long generation
        # (the extractive synthesiser checks its own selection).
        return Reject(id=pair_id(tree.id), stage="synthesize-rubrics", record={"tree_id": tree.id, "attempts": 0},
                      reason=f"the tree has {len(leaves)} leaf/leaves with statements; a pair selects at "
                             f"least {cfg.limits.min_selected} (limits.min_selected)")
    out = await perform(SYNTHESIZE, SynthAsk(tree, cfg, embed, leaves, compact), llm=llm, rec=Recorder(),
                        max_reasks=cfg.max_reasks, max_tokens=cfg.max_tokens, profile=profile)
    if out.value is None:
        return Reject(id=pair_id(tree.id), stage="synthesize-rubrics", reason=out.error or "no reply",
                      record={"tree_id": tree.id, "attempts": out.attempts})
    return _to_pair(tree, out.value, compact, leaves, NO_MODEL if llm is None else llm.name, out.attempts)


def _to_pair(tree: Tree, reply: SynthReply, compact: dict[str, Any], leaves: dict[str, list[str]],
             backend: str, attempts: int) -> QRPair:
    # Selected leaves travel with the pair, with all their statements (the prompt may have
    # shown fewer), so verify checks evidence against what synthesis was checked against.
    by_id = {leaf["id"]: {**leaf, "statements": leaves[leaf["id"]]} for leaf in compact["leaves"]}
    return QRPair(
        id=pair_id(tree.id), tree_id=tree.id, question=reply.question.strip(),
        selected_leaf_ids=reply.selected_leaf_ids,
        selection_trace=[s.model_dump() for s in reply.selection_trace],
        merge_trace=[MergeStep(**m.model_dump()) for m in reply.merge_trace],
        rubrics=reply.rubrics, backend=backend, topic=tree.topic, attempts=attempts,
        selected_leaves=[by_id[lid] for lid in reply.selected_leaf_ids])


async def asynthesize_rubrics(trees: Sequence[Tree], llm: LLM | None, config: SynthConfig, *,
                              embed: Callable[[list[str]], Any] | None = None, profile: CallPolicy | None = None,
                              on_result: Callable[[QRPair | Reject], None] | None = None
                              ) -> list[QRPair | Reject]:
    """All trees, ``config.concurrency`` at once; ``on_result`` sees each result as it ends."""
    sem = asyncio.Semaphore(config.concurrency)
    results: list[QRPair | Reject] = []
    rescue = llm is not None and config.fallback == "extractive"  # what the engine failed, it would fail again

    async def one(tree: Tree) -> None:
        nonlocal embed
        async with sem:
            result = await synthesize_one(tree, llm, config, embed, profile)
            if isinstance(result, Reject) and rescue:
                if embed is None:
                    from deepr.corpus.embed import get_embedder

                    embed = get_embedder().encode
                result = await _rescue(tree, result, config, embed)
        results.append(result)
        if on_result is not None:
            on_result(result)

    await asyncio.gather(*(one(t) for t in trees))
    return results


async def _rescue(tree: Tree, failed: Reject, cfg: SynthConfig, embed: Callable[[list[str]], Any]
                  ) -> QRPair | Reject:
    """``--fallback extractive``: the extractive synthesiser makes the pair the model could not."""
    again = await synthesize_one(tree, None, cfg, embed)
    if isinstance(again, Reject):
        return failed.model_copy(update={"reason": f"{failed.reason}; the extractive fallback failed too: "
                                                   f"{again.reason}"})
    return mark_fallback(again, f"model path: {failed.reason}")


def synthesize_rubrics(trees: Sequence[Tree], llm: LLM | None, config: SynthConfig, **kw: Any) -> list[QRPair | Reject]:
    """Sync wrapper of :func:`asynthesize_rubrics` (records in, records out)."""
    return run_sync(asynthesize_rubrics(trees, llm, config, **kw))


def pair_summary(pairs: Sequence[QRPair]) -> dict[str, float]:
    """Rubric count, factual / logical split, selected leaves: for tables and sidecars."""
    n = len(pairs) or 1
    rubrics = [r for p in pairs for r in p.rubrics]
    factual = sum(r.type == "factual" for r in rubrics)
    return {"pairs": len(pairs), "mean rubrics/pair": round(len(rubrics) / n, 2),
            "factual share": round(factual / (len(rubrics) or 1), 3),
            "logical share": round(1 - factual / len(rubrics), 3) if rubrics else 0.0,
            "mean selected leaves": round(sum(len(p.selected_leaf_ids) for p in pairs) / n, 2)}
