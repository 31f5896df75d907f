"""What every engine shares while it researches, model or not: the run context (``env.Ctx``,
``env.RunConfig``), the citation catalog (``citations``), evidence extraction (``extract``), the
per-language scaffolding (``phrases``), the section writer (``writer``), the plan validator
(``plan``), outlines, page-instruction screening (``instructions``) and the trace (``trace``).

It sits below both the agent's loops (``deepr.agent``) and the no-model engine
(``deepr.extractive``), so neither has to import the other's helpers.
"""
