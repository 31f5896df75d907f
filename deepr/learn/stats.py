"""The parts of the learning experiment (`make learn`) that decide what its numbers mean: the by-topic split, the
per-run metrics read from a ``deepr run`` trace and its ``deepr eval`` scores, the bootstrap
intervals, and the two figures. No model, no CLI: tests import this module directly.

    from deepr.learn.stats import split_by_topic, bootstrap_ci
    train, heldout, split = split_by_topic(pairs, trees, heldout_topics=3, seed=0)
    mean, lo, hi = bootstrap_ci([[0.2, 0.3], [0.5, 0.4]])      # rows: questions, columns: seeds
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Held-out metrics, in the order tables and the bar chart show them; True: higher is better.
METRICS = {"plan_valid": True, "r_plan": True, "answer_by_model": True, "rubric": True, "cite_precision": True,
           "format_fail": False}
LABELS = {"plan_valid": "plan validity", "r_plan": "R_plan (model's plan)", "answer_by_model": "answer by the model",
          "rubric": "rubric score", "cite_precision": "citation precision", "format_fail": "format-failure rate"}
STAGES = ("base", "sft", "grpo")
STAGE_LABELS = {"base": "base", "sft": "SFT", "grpo": "SFT+GRPO"}


def topic_of(tree: Mapping[str, Any]) -> str:
    """The topic a tree belongs to: the corpus category its seed came from, else its seed topic."""
    return str(tree.get("category") or tree.get("topic") or "")


def split_by_topic(pairs: Sequence[Mapping[str, Any]], trees: Sequence[Mapping[str, Any]], *,
                   heldout_topics: int, seed: int = 0, max_heldout: int | None = None,
                   max_train: int | None = None) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """(train pairs, held-out pairs, the split record). Whole topics are held out, so no held-out
    topic has a single pair in training; pairs whose tree is unknown are refused, not guessed."""
    topic = {t["id"]: topic_of(t) for t in trees}
    missing = sorted({p["tree_id"] for p in pairs if p["tree_id"] not in topic})
    if missing:
        raise ValueError(f"{len(missing)} pairs name trees not in the trees file (first: {missing[0]})")
    topics = sorted({topic[p["tree_id"]] for p in pairs})
    if heldout_topics < 1 or heldout_topics >= len(topics):
        raise ValueError(f"--heldout-topics {heldout_topics}: the verified pairs cover {len(topics)} topics; "
                         f"hold out at least 1 and leave at least 1 for training")
    held = sorted(random.Random(seed).sample(topics, heldout_topics))
    train = [dict(p) for p in pairs if topic[p["tree_id"]] not in held]
    heldout = [dict(p) for p in pairs if topic[p["tree_id"]] in held]
    train, heldout = train[:max_train] if max_train else train, heldout[:max_heldout] if max_heldout else heldout
    record = {"seed": seed, "topic_field": "tree category (corpus topic), else the seed topic",
              "heldout_topics": held, "train_topics": [t for t in topics if t not in held],
              "train_ids": [p["id"] for p in train], "heldout_ids": [p["id"] for p in heldout],
              "topic_of": {p["id"]: topic[p["tree_id"]] for p in train + heldout}}
    return train, heldout, record


# --- per-run metrics ---------------------------------------------------------------------------


def _plan_turns(trace: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [p for p in trace.get("plans") or [] if isinstance(p, Mapping)]


def _author(turns: list[Mapping[str, Any]]) -> str | None:
    """Who wrote the plan the run executed last: a refused revision keeps the plan before it
    (``by == "previous-plan"``), so the author is that earlier plan's."""
    for turn in reversed(turns):
        if turn.get("by") != "previous-plan":
            return turn.get("by")
    return None


def run_metrics(trace: Mapping[str, Any], score: Mapping[str, Any] | None) -> dict[str, float]:
    """Held-out metrics of one ``deepr run`` (its report.json) and its ``deepr eval`` row.

    plan_valid: the model's first plan validated (``by == "llm"``; a plan the extractive fallback
    wrote does not count). r_plan: ``deepr eval``'s plan_reward of the last plan when the model
    wrote it, else 0 (the same rule GRPO's reward uses: no valid plan, no reward). answer_by_model:
    the final answer is the model's (no ``answerer/final`` failure: else the extractive writer
    wrote it). rubric / cite_precision: that answer's rubric score and mean per-claim citation
    precision; 0 when the fallback wrote the answer, when it cites nothing, or when eval could not
    score it. format_fail: share of model calls whose reply was refused (unparseable, failing its
    checks, or cut at max_tokens)."""
    score = score or {}
    turns = _plan_turns(trace)
    first = next((p for p in turns if p.get("turn") == "initial"), turns[0] if turns else {})
    plan_valid = float(first.get("by") == "llm")
    model_plan = _author(turns) == "llm"
    r_plan = float(score.get("plan_reward") or 0.0) if model_plan else 0.0
    failed = {str(f.get("where")) for f in trace.get("failures") or [] if isinstance(f, Mapping)}
    by_model = "answerer/final" not in failed
    claims = [c for c in score.get("citation_claims") or [] if isinstance(c, Mapping) and c.get("ids")]
    precision = sum(float(c.get("precision") or 0) for c in claims) / len(claims) if claims and by_model else 0.0
    calls = [c for c in trace.get("calls") or [] if isinstance(c, Mapping)]
    bad = sum(1 for c in calls if not c.get("ok", True) or c.get("truncated"))
    rubric = float(score.get("rubric") or 0.0)
    return {"plan_valid": plan_valid, "r_plan": r_plan, "answer_by_model": float(by_model),
            "rubric": rubric if by_model else 0.0, "cite_precision": precision,
            "format_fail": bad / len(calls) if calls else 0.0,
            # whoever wrote the answer (the extractive writer when the model's failed): the
            # reference the model's own answers are compared with, not a held-out metric
            "rubric_any_writer": rubric}


# --- bootstrap ---------------------------------------------------------------------------------


def _grid(values: Sequence[Sequence[float]]) -> list[list[float]]:
    rows = [list(map(float, r)) for r in values]
    if not rows or not rows[0] or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError("bootstrap needs a non-empty questions × seeds grid with one value per cell")
    return rows


def bootstrap_ci(values: Sequence[Sequence[float]], *, n_boot: int = 4000, alpha: float = 0.05,
                 seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile interval of the grid mean, resampling questions (rows) and
    seeds (columns) with replacement, independently, so both sources of variation count."""
    rows = _grid(values)
    nq, ns = len(rows), len(rows[0])
    mean = sum(map(sum, rows)) / (nq * ns)
    rng, stats = random.Random(seed), []
    for _ in range(n_boot):
        qs = [rng.randrange(nq) for _ in range(nq)]
        ss = [rng.randrange(ns) for _ in range(ns)]
        stats.append(sum(rows[q][s] for q in qs for s in ss) / (nq * ns))
    stats.sort()
    lo = stats[int(alpha / 2 * (n_boot - 1))]
    hi = stats[int(round((1 - alpha / 2) * (n_boot - 1)))]
    return mean, lo, hi


def paired_ci(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], **kw: Any) -> tuple[float, float, float]:
    """Interval of mean(a − b) over the same questions × seeds (paired: each cell minus its twin)."""
    ra, rb = _grid(a), _grid(b)
    if len(ra) != len(rb) or len(ra[0]) != len(rb[0]):
        raise ValueError("paired bootstrap needs two grids of the same questions × seeds")
    return bootstrap_ci([[x - y for x, y in zip(r, s)] for r, s in zip(ra, rb)], **kw)


def grid(per_run: Mapping[str, Mapping[int, Mapping[str, Mapping[str, float]]]], stage: str, metric: str,
         qids: Sequence[str], seeds: Sequence[int]) -> list[list[float]]:
    """questions × seeds values of one metric at one stage."""
    return [[float(per_run[stage][s][q][metric]) for s in seeds] for q in qids]


def summarize(per_run: Mapping[str, Mapping[int, Mapping[str, Mapping[str, float]]]], qids: Sequence[str],
              **kw: Any) -> dict[str, Any]:
    """{stage: {metric: {mean, ci95, seeds}}} over the seeds each stage finished, plus the paired
    differences the issue asks for over the seeds both stages finished. ``per_run``:
    {stage: {seed: {question id: {metric: value}}}}."""
    out: dict[str, Any] = {"stages": {}, "differences": {}}
    done = {st: sorted(by_seed) for st, by_seed in per_run.items() if by_seed}
    for st, seeds in done.items():
        out["stages"][st] = {m: {**_ci_row(bootstrap_ci(grid(per_run, st, m, qids, seeds), **kw)), "seeds": seeds}
                             for m in METRICS}
    for name, (x, y) in {"grpo_minus_base": ("grpo", "base"), "grpo_minus_sft": ("grpo", "sft"),
                         "sft_minus_base": ("sft", "base")}.items():
        common = sorted(set(done.get(x, [])) & set(done.get(y, [])))
        if common:
            out["differences"][name] = {m: {**_ci_row(paired_ci(grid(per_run, x, m, qids, common),
                                                                grid(per_run, y, m, qids, common), **kw)),
                                            "seeds": common} for m in METRICS}
    return out


def answer_writers(per_run: Mapping[str, Mapping[int, Mapping[str, Mapping[str, float]]]],
                   qids: Sequence[str]) -> dict[str, Any]:
    """Per stage: how many final answers the model wrote and their mean rubric score, next to the
    answers the extractive writer wrote in its place and theirs (rows without ``rubric_any_writer``,
    from before it was recorded, count as unknown)."""
    out: dict[str, Any] = {}
    for st, by_seed in per_run.items():
        cells = [by_seed[s][q] for s in sorted(by_seed) for q in qids]
        model = [c["rubric_any_writer"] for c in cells if c.get("answer_by_model") and "rubric_any_writer" in c]
        extractive = [c["rubric_any_writer"] for c in cells if not c.get("answer_by_model") and "rubric_any_writer" in c]

        def mean(xs: list[float]) -> float | None:
            return round(sum(xs) / len(xs), 4) if xs else None

        out[st] = {"runs": len(cells), "model_written": len(model), "model_share": mean([1.0] * len(model) + [0.0] * len(extractive)),
                   "model_rubric_mean": mean(model), "extractive_written": len(extractive),
                   "extractive_rubric_mean": mean(extractive)}
    return out


def grpo_step_stats(logs: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Per seed, one row per GRPO step of what decides whether the step teaches anything (reward
    mean and within-group std, share of zero-advantage groups, KL, entropy, seconds per phase), and
    the zero-advantage share averaged over every step of every seed."""
    keep = ("step", "kl", "entropy", "reward_std", "frac_reward_zero_std", "zero_advantage_frac",
            "time/step", "time/generate", "time/environment", "time/reward", "time/forward", "time/backward",
            "time/outside_model_share")
    per_seed, zero = {}, []
    for name, rows in logs.items():
        steps = [r for r in rows if "step" in r and any(k.startswith("rewards/") for k in r)]
        per_seed[name] = [{**{k: r[k] for k in keep if k in r}, "reward": r.get(reward_key([r]))} for r in steps]
        # deepr's zero_advantage_frac where written, else TRL's frac_reward_zero_std (the same share)
        zero += [float(z) for r in steps
                 if isinstance(z := r.get("zero_advantage_frac", r.get("frac_reward_zero_std")), (int, float))]
    return {"per_seed": per_seed, "zero_advantage_mean": round(sum(zero) / len(zero), 4) if zero else None,
            "steps": len(zero)}


def _ci_row(t: tuple[float, float, float]) -> dict[str, Any]:
    return {"mean": round(t[0], 4), "ci95": [round(t[1], 4), round(t[2], 4)]}


# --- figures -----------------------------------------------------------------------------------


def read_metrics_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a grpo metrics.jsonl; a bad line is an error naming the file and line."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
    return rows


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def reward_key(rows: Sequence[Mapping[str, Any]]) -> str:
    keys = sorted({k for r in rows for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    return keys[0] if keys else "reward"


def plot_grpo(runs: Mapping[str, Sequence[Mapping[str, Any]]], out: str | Path) -> Path:
    """PNG of mean reward, KL and the share of zero-advantage groups per GRPO step, one line per
    run (seed). A group whose rollouts all score the same teaches nothing: the third panel shows it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_k, ax_z) = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, rows in runs.items():
        ax_r.plot(*_series(rows, reward_key(rows)), marker="o", label=name)
        ax_k.plot(*_series(rows, "kl"), marker="o", label=name)
        ax_z.plot(*_series(rows, "zero_advantage_frac"), marker="o", label=name)
    ax_r.set(title="GRPO planner: mean reward (R_plan)", xlabel="step", ylabel="reward")
    ax_k.set(title="KL to the starting (SFT) model", xlabel="step", ylabel="KL")
    ax_z.set(title="groups with zero advantage", xlabel="step", ylabel="share", ylim=(-0.05, 1.05))
    for ax in (ax_r, ax_k, ax_z):
        ax.grid(alpha=0.3)
    # One legend under the panels: inside them, several runs' names cover the points.
    handles, labels = ax_r.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 2), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 * ((len(labels) + 1) // 2), 1, 1))
    return _save(fig, out)


def plot_stages(summary: Mapping[str, Any], out: str | Path) -> Path:
    """Bar chart: each held-out metric per stage, with its 95 % bootstrap interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [s for s in STAGES if s in summary["stages"]]
    metrics = [m for m in METRICS if all(m in summary["stages"][s] for s in stages)]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(len(stages), 1)
    for i, s in enumerate(stages):
        rows = [summary["stages"][s][m] for m in metrics]
        means = [r["mean"] for r in rows]
        err = [[r["mean"] - r["ci95"][0] for r in rows], [r["ci95"][1] - r["mean"] for r in rows]]
        ax.bar([j + (i - (len(stages) - 1) / 2) * width for j in range(len(metrics))], means, width,
               yerr=err, capsize=3, label=STAGE_LABELS.get(s, s))
    ax.set_xticks(range(len(metrics)), [LABELS[m].replace(" ", "\n", 1) + ("" if METRICS[m] else "\n(lower is better)")
                                        for m in metrics], fontsize=8)
    ax.set(ylabel="mean over held-out questions × seeds", title="Held-out metrics per stage (95 % bootstrap CI)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, out)


def _save(fig: Any, out: str | Path) -> Path:
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def markdown_table(summary: Mapping[str, Any]) -> str:
    """The summary as a markdown table: one row per metric, one column per stage, then the
    paired differences (mean [95 % CI])."""
    stages = [s for s in STAGES if s in summary.get("stages", {})]
    diffs = [d for d in ("sft_minus_base", "grpo_minus_sft", "grpo_minus_base") if d in summary.get("differences", {})]
    names = {"sft_minus_base": "SFT − base", "grpo_minus_sft": "SFT+GRPO − SFT", "grpo_minus_base": "SFT+GRPO − base"}

    def cell(row: Mapping[str, Any] | None) -> str:
        return "–" if not row else f"{row['mean']:.3f} [{row['ci95'][0]:.3f}, {row['ci95'][1]:.3f}]"

    head = ["metric", *(STAGE_LABELS[s] for s in stages), *(names[d] for d in diffs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in METRICS:
        row = [LABELS[m], *(cell(summary["stages"][s].get(m)) for s in stages),
               *(cell(summary["differences"][d].get(m)) for d in diffs)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
