"""``deepr bench-export``: write ``deepr run`` output in the layout a benchmark's own grader reads.

Input: report sidecars (``report.json``), folders of them, or a batch ``reports.jsonl`` index
(its ``reports.rejects.jsonl`` adds the rejected questions). ``--format``:

- ``browsecomp-plus``: ``--out`` folder of ``run_<query_id>.json`` for its ``evaluate_run.py``;
- ``researchrubrics``: ``--out`` folder of ``<sample_id>.md`` for ``evaluate_reports_batch.py``;
- ``drb``: ``--out`` JSONL ``{"id", "prompt", "article"}`` for DeepResearch Bench (``drb-export``
  is this format's old name and still works).

    deepr bench-export runs/ --format browsecomp-plus --out bcp_runs/
    deepr drb-export reports/ --out submission.jsonl
"""

from __future__ import annotations

from pathlib import Path

import typer

from deepr.cli.app import app, console, user_errors

INPUTS = typer.Argument(..., help="report.json sidecars, folders of them, or reports.jsonl.")


def _export(inputs: list[Path], fmt: str, out: Path) -> None:
    from deepr.eval.benchmarks import FORMATS, export, load_runs

    with user_errors():
        if fmt not in FORMATS:
            raise ValueError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
        if fmt == "drb" and out.is_dir():
            raise ValueError(f"--out {out}: a DeepResearch Bench submission is one JSONL file, not a folder")
        if fmt != "drb" and out.suffix:
            raise ValueError(f"--out {out}: {fmt} reads a folder of files; give a folder (e.g. {out.stem}/)")
        runs = []
        for p in inputs:
            if not p.exists():
                raise FileNotFoundError(f"{p}: no such file or folder")
            if out.resolve() == p.resolve() or (p.is_dir() and p.resolve() in out.resolve().parents):
                raise ValueError(f"--out {out}: inside the input {p}, its files would be read as runs; "
                                 "write it elsewhere")
            runs.extend(load_runs(p))
        if not runs:
            raise ValueError(f"{', '.join(map(str, inputs))}: no deepr runs found")
        written = export(runs, fmt, out)
    n = len(written) if fmt != "drb" else sum(1 for r in runs if not r.get("rejected"))
    console.print(f"bench-export {fmt}: {n} of {len(runs)} runs -> {out}", markup=False)


@app.command("bench-export")
def bench_export_command(
    inputs: list[Path] = INPUTS,
    fmt: str = typer.Option(..., "--format", "-f", help="browsecomp-plus, researchrubrics or drb."),
    out: Path = typer.Option(..., "--out", "-o", help="A folder (browsecomp-plus, researchrubrics) or a "
                             ".jsonl file (drb)."),
) -> None:
    """Export deepr run reports for BrowseComp-Plus, ResearchRubrics or DeepResearch Bench."""
    _export(inputs, fmt, out)


@app.command("drb-export")
def drb_export_command(
    inputs: list[Path] = INPUTS,
    out: Path = typer.Option(..., "--out", "-o", help="Submission JSONL {id, prompt, article}."),
) -> None:
    """Export deepr run reports as a DeepResearch Bench submission (bench-export --format drb)."""
    _export(inputs, "drb", out)
