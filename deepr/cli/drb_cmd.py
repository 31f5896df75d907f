"""``deepr drb-export``: turn ``deepr run`` output into a DeepResearch Bench submission.

Input: report sidecars (``report.json``), folders of them, or a batch ``reports.jsonl`` index.
Output: JSONL ``{"id", "prompt", "article"}`` per report (integer ids stay integers), where the
article cites ``[n]`` and ends with a numbered reference list of URLs, so the benchmark's own
scripts (and ``deepr eval --metric fact``) can score it.

    deepr drb-export reports/ --out submission.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from deepr.cli.app import app, console, user_errors


def _rows(path: Path) -> list[dict]:
    if path.is_dir():
        index = path / "reports.jsonl"
        if index.exists():
            return _rows(index)
        return [r for p in sorted(path.glob("*.json")) if not p.name.endswith(".meta.json") for r in _rows(p)]
    if path.suffix == ".jsonl":
        out = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
                trace_path = Path(rec["trace_path"])
                if not trace_path.is_absolute() and not trace_path.exists():  # an index written elsewhere
                    trace_path = path.parent / trace_path.name
                trace = json.loads(trace_path.read_text(encoding="utf-8"))
                out.append({**trace, "id": rec.get("id", trace.get("query"))})
        return out
    try:
        trace = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not a deepr run sidecar ({e.msg})") from None
    if not isinstance(trace, dict) or "report" not in trace:
        raise ValueError(f"{path}: not a deepr run sidecar (no 'report' field)")
    return [{**trace, "id": trace.get("id") or trace.get("query_id") or path.stem}]


@app.command("drb-export")
def drb_export_command(
    inputs: list[Path] = typer.Argument(..., help="report.json sidecars, folders of them, or reports.jsonl."),
    out: Path = typer.Option(..., "--out", "-o", help="Submission JSONL {id, prompt, article}."),
) -> None:
    """Export deepr run reports as a DeepResearch Bench submission."""
    from deepr.io import write_text
    from deepr.search.drb import to_submission

    with user_errors():
        rows = []
        for p in inputs:
            if not p.exists():
                raise FileNotFoundError(f"{p}: no such file or folder")
            rows.extend(_rows(p))
        subs = to_submission(rows)
        write_text(out, "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in subs))
    console.print(f"drb-export: {len(subs)} reports -> {out}", markup=False)
