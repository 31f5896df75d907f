"""The research agent behind ``deepr run``: dag, warp and decor loops with code-owned citations.

    from deepr.agent import RunConfig, run_agent, write_report
    from deepr.corpus import open_retriever
    from deepr.corpus.tools import ResearchTools
    from deepr.llm import get_llm

    tools = ResearchTools(open_retriever("wiki"), k=5)
    result = run_agent("Why did the Bronze Age collapse?", tools=tools, llm=get_llm("extractive"),
                       config=RunConfig(mode="dag"))
    write_report(result, Path("report.md"))

Modules: ``dag`` / ``warp`` / ``decor`` (the loops), ``planner`` and ``answerer`` (dag roles),
``citations`` (id catalog and checks), ``trace`` (audit sidecar and trajectories),
``render`` (markdown and HTML), ``runner`` (the plain function above).
"""

from deepr.evidence.citations import Catalog, cited_ids
from deepr.evidence.env import Ctx, RunConfig
from deepr.agent.runner import RunResult, arun_agent, run_agent, sidecar_path, trajectory_id, write_report
from deepr.evidence.trace import Tracer, load_trace, replay_waves

__all__ = ["Catalog", "cited_ids", "Ctx", "RunConfig", "RunResult", "arun_agent", "run_agent", "sidecar_path",
           "trajectory_id", "write_report", "Tracer", "load_trace", "replay_waves"]
