"""`deepr grpo --stage rubric|decor|warp-atomic|warp-report`: the registry from CLI settings to a
stage's data reader and trainer. Imports each stage module on demand (stages import only downward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepr.train.grpo import GrpoResult
from deepr.train.stage import StageConfig, make_judge

EXTRA_STAGES = ("rubric", "decor", "warp-atomic", "warp-report")


def run_from_settings(settings: dict[str, Any], data: Any,
                      open_source: Callable[[Any], Any] | None = None) -> tuple[GrpoResult, int, StageConfig]:
    """Read ``data`` for the stage, open the corpus (or ``open_source(config)``: e.g. the web
    sources of ``--search``), train; returns (result, rows, config)."""
    from deepr.corpus import open_retriever as _open_corpus
    from deepr.io import read_jsonl

    def open_retriever(corpus: Any, **kw: Any) -> Any:
        return open_source(config) if open_source is not None else _open_corpus(corpus, **kw)

    from deepr.records import QRPair

    stage = settings["stage"]
    if stage == "rubric":
        from deepr.train.rubric_stage import RubricRewardFn, RubricStageConfig, rubric_dataset, train_rubric

        config: StageConfig = RubricStageConfig(**settings)
        pairs = list(read_jsonl(data, QRPair))
        retriever = open_retriever(config.corpus, retriever=config.retriever, progress=True)
        reward_fn = RubricRewardFn(make_judge(config.judge_llm, config.judge_gen))
        res = train_rubric(config, pairs, retriever, reward_fn=reward_fn)
        return res, len(rubric_dataset(pairs)[0]), config
    if stage == "decor":
        from deepr.train.decor_stage import DecorRewardFn, DecorStageConfig, QARecord, train_decor

        config = DecorStageConfig(**settings)
        records = list(read_jsonl(data, QARecord))
        retriever = open_retriever(config.corpus, retriever=config.retriever, progress=True)
        reward = DecorRewardFn(make_judge(config.judge_llm, config.judge_gen), alpha=config.alpha, lam=config.lam)
        return train_decor(config, records, retriever, reward_fn=reward), 3 * len(records), config
    if stage == "warp-atomic":
        from deepr.records import ChatExample
        from deepr.train.warp_stage import WarpAtomicConfig, train_warp_atomic

        config = WarpAtomicConfig(**settings)
        examples = list(read_jsonl(data, ChatExample))
        retriever = open_retriever(config.corpus, retriever=config.retriever, progress=True)
        judge = make_judge(config.judge_llm, config.judge_gen) if config.judge_llm != "extractive" else None
        return train_warp_atomic(config, examples, retriever, judge=judge), len(examples), config
    from deepr.train.warp_stage import WarpReportConfig, train_warp_report

    config = WarpReportConfig(**settings)
    pairs = list(read_jsonl(data, QRPair))
    retriever = open_retriever(config.corpus, retriever=config.retriever, progress=True)
    judge = make_judge(config.judge_llm, config.judge_gen)
    return train_warp_report(config, pairs, retriever, judge=judge), len(pairs), config
