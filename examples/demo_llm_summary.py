"""The real-model demo's table: per stage, model calls, format-failure %, records produced, and
the share written by the model vs the extractive fallback.

    python examples/demo_llm_summary.py demo-llm      (also writes demo-llm/summary.md)

Data stages (build-trees, synthesize-rubrics, verify) read their ``<out>.meta.json``: ``usage``
(calls, replies rejected by format/acceptance checks, failed calls) and the stage tally (records
by the model / rebuilt by the fallback / rejected). Agent runs read the recorded
trajectories: each turn's attempts are its model calls; a turn is the model's when a reply was
accepted, the fallback's otherwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

DATA = (("build-trees", "trees.jsonl"), ("rubrics", "pairs.jsonl"), ("verify", "verified.jsonl"))


def _lines(path: Path) -> int:
    return sum(1 for x in path.read_text().splitlines() if x.strip()) if path.exists() else 0


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f} %" if whole else "-"


def data_row(demo: Path, name: str, out: str) -> list[str]:
    meta_path = demo / f"{out}.meta.json"
    if not meta_path.exists():
        return [name, "-", "-", "-", "not run"]
    meta = json.loads(meta_path.read_text())
    usage, counts = meta.get("usage") or {}, meta.get("counts") or {}
    calls, failed = usage.get("calls", 0), usage.get("failures", 0)
    # A failure can be a request refused before it was sent (a re-ask past the context), so it is
    # not always a call: the share counts at most every call, and the failures are named beside it.
    bad = min(calls, usage.get("rejected", 0) + failed)
    ok, fb = counts.get("ok", 0), counts.get("fallback", 0)
    share = _pct(bad, calls) + (f" ({failed} failed)" if failed else "")
    return [name, str(calls), share, str(_lines(demo / out)),
            f"model {ok} / fallback {fb} / rejected {counts.get('failed', 0)}"]


def run_rows(demo: Path) -> list[list[str]]:
    """One row per agent mode, from the recorded trajectories (every turn with its attempts)."""
    path = demo / "trajectories.jsonl"
    runs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        turns = [t for r in runs if r["mode"] == mode for t in r["turns"] if not t.get("extractive")]
        calls = sum(int(t.get("attempts") or 0) for t in turns)
        ok = sum(1 for t in turns if t.get("ok"))
        rows.append([f"run --mode {mode}", str(calls), _pct(calls - ok, calls),
                     str(sum(r["mode"] == mode for r in runs)), f"turns: model {ok} / fallback {len(turns) - ok}"])
    return rows


def rows(demo: Path) -> list[list[str]]:
    out = [data_row(demo, name, file) for name, file in DATA] + run_rows(demo)
    out.append(["prune → sft.jsonl", "-", "-", str(_lines(demo / "data" / "sft.jsonl")), "-"])
    for name, ckpt in (("sft", "ckpt/sft"), ("grpo-planner", "ckpt/planner")):
        done = (demo / ckpt / "deepr_meta.json").exists()
        out.append([name, "-", "-", "1 checkpoint" if done else "0", "-"])
    out.append(["eval (dag runs)", "-", "-", str(_lines(demo / "scores-dag.jsonl")), "-"])
    return out


def _tsv(path: Path) -> dict[str, float]:
    return {n: float(v) for n, v in (line.split("\t")[:2] for line in
                                     (path.read_text().splitlines() if path.exists() else []) if "\t" in line)}


def wall_times(demo: Path) -> str | None:
    """Each step's wall seconds (and CPU seconds of its processes, from ``cpu.tsv``; above the wall
    time when a step uses both cores), then the totals."""
    wall, cpu = _tsv(demo / "timings.tsv"), _tsv(demo / "cpu.tsv")
    if not wall:
        return None
    total, index = sum(wall.values()), wall.get("index", 0.0)
    return (", ".join(f"{n} {s:.1f} s" + (f" (CPU {cpu[n]:.0f} s)" if n in cpu else "") for n, s in wall.items())
            + f"; total {total:.0f} s ({total / 60:.1f} min; {(total - index) / 60:.1f} min without the index step)")


COLUMNS = ("stage", "model calls", "format failures", "records", "written by")
NOTE = ("Format failures: replies that failed their format or acceptance checks (or calls that failed), as a "
        "share of model calls. A 135M model shows the mechanics, not good research.")


def markdown(table: list[list[str]], times: str | None) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in table]
    return "\n".join(lines + ([""] + [f"Wall time: {times}"] if times else []) + ["", NOTE, ""])


def main(demo: Path) -> None:
    table = Table(title=f"deepr demo-llm ({demo}): SmolLM2-135M-Instruct per stage", header_style="bold")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("stage", "written by") else "right")
    body = rows(demo)
    for row in body:
        table.add_row(*row)
    console = Console()
    console.print(table)
    times = wall_times(demo)
    if times:
        console.print("wall time: " + times)
    console.print(NOTE)
    (demo / "summary.md").write_text(markdown(body, times))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "demo-llm"))
