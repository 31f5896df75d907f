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

Where the engine is chosen. ``--llm extractive`` (``get_llm("extractive")``) builds no model: a
run, a data stage or a trainer then holds ``llm=None`` and passes it down, and the executor
(:func:`deepr.roles.perform`) runs the role's own ``extractive(inp)`` for it. A stage that treats
the engine differently (a ``--fallback extractive`` rescue, a CPU worker thread, the extractive
judge adding nothing to the overlap check) says so where it holds the model.
"""
