"""Print the demo's summary: artefact counts, scores before/after training, step timings.

    python examples/demo_summary.py demo
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from deepr.io import read_jsonl

METRICS = ("plan_reward", "answer_reward", "rubric", "R_cite")


def count(path: Path) -> int | str:
    return sum(1 for _ in read_jsonl(path, tolerate_torn_tail=True)) if path.exists() else "-"


def mean_of(path: Path, field: str) -> str:
    if not path.exists():
        return "-"
    vals = [r[field] for r in read_jsonl(path) if isinstance(r.get(field), (int, float))]
    return f"{statistics.fmean(vals):.3f} (n={len(vals)})" if vals else "no scores"


def main(demo: Path) -> None:
    console = Console()
    counts = Table(title="deepr demo: artefacts", header_style="bold")
    counts.add_column("artefact")
    counts.add_column("records", justify="right")
    for name in ("trees.jsonl", "pairs.jsonl", "verified.jsonl", "verified.rejects.jsonl", "verified.dropped.jsonl",
                 "trajectories.jsonl", "data/sft.jsonl", "data/rl.jsonl", "prepared.jsonl",
                 "runs-teacher/reports.jsonl", "runs-trained/reports.jsonl"):
        counts.add_row(name, str(count(demo / name)))
    console.print(counts)

    scores = Table(title="scores: extractive teacher vs trained tiny agent", header_style="bold")
    scores.add_column("metric")
    scores.add_column("teacher (extractive)", justify="right")
    scores.add_column("trained tiny model", justify="right")
    for m in METRICS:
        scores.add_row(m, mean_of(demo / "scores-teacher.jsonl", m), mean_of(demo / "scores-trained.jsonl", m))
    console.print(scores)
    runs = demo / "runs-trained" / "reports.jsonl"
    if runs.exists():
        rows = list(read_jsonl(runs))
        failed = sum(int(r.get("failures") or 0) for r in rows)
        console.print(f"trained-agent runs: {len(rows)}; model turns that failed to parse and fell back to the "
                      f"extractive role: {failed} (see each run's report.json for the reasons)")

    timing = Table(title="wall time per step", header_style="bold")
    timing.add_column("step")
    timing.add_column("seconds", justify="right")
    total = 0.0
    tsv = demo / "timings.tsv"
    for line in tsv.read_text().splitlines() if tsv.exists() else []:
        name, secs = line.split("\t")
        total += float(secs)
        timing.add_row(name, secs)
    timing.add_row("[bold]total[/]", f"{total:.1f}")
    console.print(timing)
    console.print("The teacher and the demo's judges are extractive: no language model wrote or scored these "
                  "reports. The tiny model is randomly initialised and trained for a few steps, so its "
                  "scores show the pipeline works end to end, not a good agent.")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "demo"))
