"""The extractive engine: every role done without a language model, beside the model path.

A role module (:mod:`deepr.agent.planner`, :mod:`deepr.data.tree_roles`, ...) declares what a
model is asked and how its reply is judged; its ``extractive=`` names a function here that
returns the reply a model should have given. One module per role family:

    planner     the dag planner's plan and revision        answerer  the dag answerer's waves and answer
    search      the search agent's reformulations          rubric    the agent's persistent criteria and gaps
    decor       DECOR's planner, filter, condenser, answer  warp      WARP's search, outline, write, deepen
    tools       the tools agent's policy                   support   the overlap check of cited claims
    trees       the tree builder's five roles               rubrics   query-rubric synthesis
    verify      the verify stage's audit

The functions take the role's input object (duck-typed: ``a.ctx``, ``a.query``, ...) or plain
arguments, and never import a role module.

Where the engine is chosen. The executor (:func:`deepr.roles.perform`) reads
``llm.is_extractive`` and then records the role's own ``extractive(inp)``. Everything else deepr
needs to know about the engine is a decision named below, so no code outside :mod:`deepr.llm`,
:mod:`deepr.roles` and this package tests for the extractive backend.
"""

from __future__ import annotations

from typing import Any


def _engine(llm: Any) -> bool:
    return bool(getattr(llm, "is_extractive", False))


def can_rescue(llm: Any, fallback: str | None) -> bool:
    """Whether an item ``llm`` failed is redone by this engine (``--fallback extractive``): only
    for a model; what the engine itself failed it would fail again."""
    return fallback == "extractive" and not _engine(llm)


def offload_cpu(llm: Any) -> bool:
    """Whether a stage should move its CPU work (retrieval, embedding) to a worker thread: only
    while model round-trips can overlap it. This engine is all CPU on the event loop, and it
    embeds there too, so a second thread would only add hand-offs and share the embedder."""
    return not _engine(llm)


def needs_embedder(llm: Any) -> bool:
    """Whether query-rubric synthesis with ``llm`` needs an embedder (this engine selects leaves
    by embedding; a model reads the tree)."""
    return _engine(llm)


def adds_judgement(llm: Any) -> bool:
    """Whether ``llm`` as a judge adds a judgement of its own: this engine would only grade with
    the heuristics the code already applies (the overlap check, the reward's own terms). Something
    that is not a backend (None) judges nothing."""
    return not getattr(llm, "is_extractive", True)


def prechecks(llm: Any) -> bool:
    """Whether a role's input is checked before the call for a reply no model could give (a
    tree with fewer leaves than a pair selects): this engine checks its own output instead."""
    return not _engine(llm)


def turns_ok(llm: Any) -> bool:
    """Whether a run's turns all count as done by design (this engine never falls back)."""
    return _engine(llm)
