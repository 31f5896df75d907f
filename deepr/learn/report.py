"""Scoring and reporting for the learning experiment (`make learn`): per-question metrics of each evaluated stage,
the summary with bootstrap intervals (learning.json, learning_runs.json, learning.md) and the
figures, and ``--report-only`` (rescore what a stopped run left).

    make learn LEARN_ARGS=--report-only              # rewrite the results from learn-work/
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from deepr.learn.config import ROOT, Budget, LearnConfig, deepr, done, read_jsonl, write_atomic
from deepr.learn.stats import (METRICS, STAGES, answer_writers, grpo_step_stats, markdown_table, plot_grpo,
                                  plot_stages, read_metrics_rows, run_metrics, summarize)


def collect(cfg: LearnConfig, name: str, held_ids: list[str], *, pending_ok: bool = False) -> dict[str, dict[str, Any]]:
    """{question id: metrics (+ note)} of one evaluated stage; a question whose run was rejected
    scores 0 on every metric and counts as a format failure, with the reason kept. With
    ``pending_ok`` (a stage stopped part-way) questions not run yet are left out, not zeroed."""
    runs = cfg.work / "runs" / name
    scores = {r["id"]: r for r in read_jsonl(cfg.work / "scores" / f"{name}.jsonl")}
    index = {r["id"]: r for r in read_jsonl(runs / "reports.jsonl")}
    rejects = {r["id"]: r.get("reason", "") for r in read_jsonl(runs / "reports.rejects.jsonl")}
    out = {}
    for qid in held_ids:
        if qid not in index:
            if pending_ok and qid not in rejects:
                continue
            why = rejects.get(qid) or "no run recorded"
            out[qid] = {**{m: 0.0 for m in METRICS}, "format_fail": 1.0, "note": f"run failed: {why}"[:300]}
            continue
        trace_path = Path(index[qid]["trace_path"])
        if not trace_path.is_absolute() and not trace_path.exists():  # written relative to another directory
            trace_path = runs / trace_path.name
        trace = json.loads(trace_path.read_text(encoding="utf-8"))
        key = str(trace_path.relative_to(runs).with_suffix("")) if trace_path.is_relative_to(runs) else trace_path.stem
        score = scores.get(key)
        row = run_metrics(trace, score)
        if score is None or score.get("failures"):
            row["note"] = f"eval: {(score or {}).get('failures') or 'no score row'}"[:300]
        row["seconds"] = index[qid].get("seconds")
        out[qid] = row
    return out


def report(cfg: LearnConfig, per_run: dict, held_ids: list[str], budget: Budget | None, status: str) -> dict[str, Any]:
    """Write learning.json, learning_runs.json, learning.md and the figures; returns the summary.
    Only questions every reported stage and seed ran are summarised (all of them, once complete)."""
    per_run = {st: by_seed for st, by_seed in per_run.items() if by_seed}
    qids = [q for q in held_ids if all(q in rows for by_seed in per_run.values() for rows in by_seed.values())]
    summary = summarize(per_run, qids) if qids else {"stages": {}, "differences": {}}
    grpo_logs = {f"seed {s}": read_metrics_rows(p) for s in cfg.seeds
                 if (p := cfg.work / f"seed{s}" / "grpo" / "metrics.jsonl").is_file()}
    figures = {}
    if grpo_logs:
        figures["grpo"] = _rel(plot_grpo(grpo_logs, cfg.img / "learning_grpo.png"))
    if summary["stages"]:
        figures["stages"] = _rel(plot_stages(summary, cfg.img / "learning_stages.png"))
    split = json.loads((cfg.work / "split.json").read_text(encoding="utf-8"))
    load = os.getloadavg()
    result = {
        "status": status, "command": " ".join(["python", *sys.argv]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "heldout_questions": len(held_ids), "questions_in_summary": qids,
        "train_questions": len(split["train_ids"]), "heldout_topics": split["heldout_topics"],
        "train_topics": split["train_topics"], "wall_seconds": round(budget.elapsed(), 1) if budget else None,
        "load_average_at_end": [round(x, 2) for x in load], "cpus": os.cpu_count(),
        "base_is_seed_independent": "greedy decoding: the base model is run once and its runs count for every seed",
        "grpo_reward_per_step": {k: [[r["step"], r.get(_reward(r))] for r in v if _reward(r)]
                                 for k, v in grpo_logs.items()},
        "grpo_steps": grpo_step_stats(grpo_logs),
        "answer_writers": answer_writers(per_run, qids),
        "figures": figures, **summary}
    write_atomic(cfg.results / "learning.json", result)
    write_atomic(cfg.results / "learning_runs.json", {"split": split, "runs": per_run})
    table = cfg.results / "learning.md"
    table.write_text(f"Status: {status}\n\n" + markdown_table(summary), encoding="utf-8")
    return result


def _rel(path: Path) -> str:
    return os.path.relpath(path, ROOT) if path.resolve().is_relative_to(ROOT) else str(path)


def _reward(row: dict[str, Any]) -> str | None:
    return next((k for k in row if k.startswith("rewards/") and k.endswith("/mean")), None)


def rescore(cfg: LearnConfig) -> dict[str, Any]:
    """--report-only: score every evaluation run under --work (finished or stopped part-way) and
    rewrite the results; a stage stopped part-way counts the questions it finished."""
    held_ids = [r["id"] for r in read_jsonl(cfg.work / "heldout.jsonl")]
    if not held_ids:
        raise ValueError(f"{cfg.work}/heldout.jsonl: missing or empty; run the experiment first")
    log, per_run, open_runs = cfg.work / "learning-report.log", {st: {} for st in STAGES}, []
    runs = [("base", "base", cfg.seeds)] + [(f"{st}-s{s}", st, [s]) for s in cfg.seeds for st in ("sft", "grpo")]
    for name, stage, seeds in runs:
        folder = cfg.work / "runs" / name
        finished = [f for f in folder.glob("*.json") if not f.name.endswith(".meta.json")]
        if not finished:  # not started, or no question finished yet: nothing to score
            continue
        if not done(folder):
            open_runs.append(name)
            (cfg.work / "scores").mkdir(parents=True, exist_ok=True)
            deepr(["eval", str(folder), "--metric", "plan_reward,rubric,citation", "--rubrics",
                   str(cfg.work / "heldout.jsonl"), "--out", str(cfg.work / "scores" / f"{name}.jsonl"),
                   "--allow-fallback"], log, threads=cfg.threads)
        rows = collect(cfg, name, held_ids, pending_ok=not done(folder))
        for s in seeds if rows else ():
            per_run[stage][s] = rows
    missing = [n for n, _, _ in runs if not done(cfg.work / "runs" / n)]
    status = "complete" if not missing else (f"partial (--report-only): evaluations not finished: {missing}; "
                                             f"stopped part-way: {open_runs}")
    return report(cfg, per_run, held_ids, None, status)  # no wall time: this only rescored
