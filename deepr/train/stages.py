"""The GRPO stage registry: every ``deepr grpo --stage X`` is one :class:`Stage` in :data:`STAGES`,
with its config class (a :class:`~deepr.train.stage.StageConfig`), its data reader and trainer.
Every stage trains through :func:`deepr.train.stage.train_stage`. Stage modules are imported on
demand, so naming a stage costs nothing until it runs.

    res, rows, config = run_from_settings({"stage": "planner", "model": M, "out": OUT}, "verified.jsonl")
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepr.rewards.judges import make_judge
from deepr.train.stage import GrpoResult, StageConfig

OpenSource = Callable[[StageConfig], Any]
Runner = Callable[[Any, Path, OpenSource], "tuple[GrpoResult, int]"]


@dataclass(frozen=True)
class Stage:
    """One GRPO stage: ``config`` and ``run`` are "module:name" paths, imported when used."""

    name: str
    config: str
    run: str
    help: str

    def config_cls(self) -> type[StageConfig]:
        return _load(self.config)

    def runner(self) -> Runner:
        return _load(self.run)


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _read(data: Path, record: Any) -> list[Any]:
    from deepr.io import read_jsonl

    return list(read_jsonl(data, record))


def _verified(data: Path) -> list[Any]:
    from deepr.records import QRPair

    return [p for p in _read(data, QRPair) if p.decision in (None, "KEEP", "REVISE")]


def run_planner(config: Any, data: Path, open_source: OpenSource, generate_for: Any = None) -> tuple[GrpoResult, int]:
    from deepr.train import grpo
    from deepr.train.environments import PlannerEnvironment

    rows, lookup = grpo.planner_dataset(_verified(data))
    env = PlannerEnvironment(open_source(config), k=config.k, fetch_limit=config.fetch_limit,
                             validity=config.plan_validity)
    return grpo.train_grpo(config, rows, lookup, env=env, generate_for=generate_for), len(rows)


def run_answerer(config: Any, data: Path, open_source: OpenSource) -> tuple[GrpoResult, int]:
    from deepr.train import grpo
    from deepr.train.prepare import Prepared

    rows, lookup = grpo.answerer_dataset(_read(data, Prepared))
    return grpo.train_grpo(config, rows, lookup), len(rows)


def run_rubric(config: Any, data: Path, open_source: OpenSource) -> tuple[GrpoResult, int]:
    from deepr.records import QRPair
    from deepr.train.rubric_stage import RubricRewardFn, rubric_dataset, train_rubric

    pairs = _read(data, QRPair)
    reward_fn = RubricRewardFn(make_judge(config.judge_llm, config.judge_gen))
    res = train_rubric(config, pairs, open_source(config), reward_fn=reward_fn)
    return res, len(rubric_dataset(pairs)[0])


def run_decor(config: Any, data: Path, open_source: OpenSource) -> tuple[GrpoResult, int]:
    from deepr.train.decor_stage import DecorRewardFn, QARecord, train_decor

    records = _read(data, QARecord)
    reward = DecorRewardFn(make_judge(config.judge_llm, config.judge_gen), alpha=config.alpha, lam=config.lam)
    return train_decor(config, records, open_source(config), reward_fn=reward), 3 * len(records)


def run_warp_atomic(config: Any, data: Path, open_source: OpenSource) -> tuple[GrpoResult, int]:
    from deepr.records import ChatExample
    from deepr.train.warp_stage import train_warp_atomic

    examples = _read(data, ChatExample)
    judge = make_judge(config.judge_llm, config.judge_gen) if config.judge_llm != "extractive" else None
    return train_warp_atomic(config, examples, open_source(config), judge=judge), len(examples)


def run_warp_report(config: Any, data: Path, open_source: OpenSource) -> tuple[GrpoResult, int]:
    from deepr.records import QRPair
    from deepr.train.warp_stage import train_warp_report

    pairs = _read(data, QRPair)
    judge = make_judge(config.judge_llm, config.judge_gen)
    return train_warp_report(config, pairs, open_source(config), judge=judge), len(pairs)


_HERE = "deepr.train.stages"
STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("planner", "deepr.train.grpo:GrpoConfig", f"{_HERE}:run_planner",
          "turn 1 → search → turn 2 on verified.jsonl, reward R_plan (DecomposeR §3.4.2)"),
    Stage("answerer", "deepr.train.grpo:GrpoConfig", f"{_HERE}:run_answerer",
          "waves + final answer on the prepared records of `grpo prepare`, reward R_ans (DecomposeR §3.4.3)"),
    Stage("rubric", "deepr.train.rubric_stage:RubricStageConfig", f"{_HERE}:run_rubric",
          "tool-calling agent on verified.jsonl, composite rubric reward (DeepRubric)"),
    Stage("decor", "deepr.train.decor_stage:DecorStageConfig", f"{_HERE}:run_decor",
          "planner/filter/answerer team on {id, question, answers} JSONL (DECOR)"),
    Stage("warp-atomic", "deepr.train.warp_stage:WarpAtomicConfig", f"{_HERE}:run_warp_atomic",
          "single-step RL on rl.jsonl WARP actions (AgentCPM-Report)"),
    Stage("warp-report", "deepr.train.warp_stage:WarpReportConfig", f"{_HERE}:run_warp_report",
          "whole WARP runs, report-level reward (AgentCPM-Report)"),
)}
EXTRA_STAGES = ("rubric", "decor", "warp-atomic", "warp-report")  # beyond DecomposeR's two


def stage_config(settings: dict[str, Any]) -> StageConfig:
    """The stage's config from settings (``stage`` names the registry entry)."""
    name = settings.get("stage")
    if name not in STAGES:
        raise ValueError(f"--stage {name}: unknown stage; choose one of {', '.join(STAGES)}")
    return STAGES[name].config_cls()(**settings)


def run_from_settings(settings: dict[str, Any], data: Any, open_source: OpenSource | None = None,
                      constrained: Any = None) -> tuple[GrpoResult, int, StageConfig]:
    """Build the stage's config, read ``data`` for it, open the corpus (or ``open_source(config)``:
    e.g. the web sources of ``--search``) and train; returns (result, rows, config).
    ``constrained``: the planner's rollout generator under a profile's formats, used when the
    config asks for ``rollout_formats="schema"``."""

    def default_source(config: StageConfig) -> Any:
        from deepr.corpus import open_retriever

        return open_retriever(config.corpus, retriever=config.retriever, progress=True)

    config = stage_config(settings)
    if config.stage == "planner":
        gen = constrained if config.rollout_formats == "schema" else None
        res, n_rows = STAGES[config.stage].runner()(config, Path(data), open_source or default_source, gen)
    else:
        res, n_rows = STAGES[config.stage].runner()(config, Path(data), open_source or default_source)
    return res, n_rows, config
