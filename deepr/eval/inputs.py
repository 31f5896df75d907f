"""What ``deepr eval`` and :func:`deepr.evaluate` read: items to score (a JSONL file, a run
sidecar or a folder of sidecars) and the ``--rubrics`` / ``--gold`` references; a bad row names
its file and line."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_items(path: Path) -> list[Any]:
    """Items from a JSONL file, one run sidecar (.json), or a folder of sidecars or of
    BrowseComp-Plus run files."""
    import json

    from pydantic import ValidationError

    from deepr.eval.benchmarks import browsecomp_item_fields, is_browsecomp_run
    from deepr.eval.evaluate import EvalRecord, item_from_record, item_from_trace
    from deepr.io import RecordError, read_jsonl
    from deepr.records import RunTrace

    if not path.exists():
        raise FileNotFoundError(f"{path}: no such input (give a .jsonl, a report.json or a folder of them)")
    if path.is_dir() or path.suffix == ".json":
        files = sorted(p for p in path.rglob("*.json") if not p.name.endswith(".meta.json")) \
            if path.is_dir() else [path]
        if not files:
            raise ValueError(f"{path}: the folder holds no report.json sidecars (deepr run --out X.md writes X.json)")
        items = []
        for p in files:
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
                if is_browsecomp_run(data):  # a BrowseComp-Plus run file, deepr's export or another agent's
                    items.append(item_from_record(browsecomp_item_fields(data), str(p)))
                    continue
                trace = RunTrace.model_validate(data)
            except (json.JSONDecodeError, ValidationError) as e:
                raise ValueError(f"{p}: not a deepr run sidecar: {str(e).splitlines()[0]}") from None
            md = p.with_suffix(".md")
            item_id = str(p.relative_to(path).with_suffix("")) if path.is_dir() else p.stem
            items.append(item_from_trace(trace, item_id, md.read_text(encoding="utf-8") if md.exists() else "",
                                         where=str(p)))
        return items
    items, seen = [], set()
    for n, rec in enumerate(read_jsonl(path, EvalRecord), start=1):
        if rec.id in seen:
            raise RecordError(path, n, f"id {rec.id!r} appears twice; ids must be unique", field="id")
        seen.add(rec.id)
        items.append(item_from_record(rec.model_dump(), f"{path}:{n}"))
    return items


def load_references(path: Path, kind: str) -> tuple[dict, dict]:
    """--rubrics / --gold rows by id and by normalised question; bad rows name file:line."""
    from deepr.eval.evaluate import EvalRecord
    from deepr.io import RecordError, read_jsonl
    from deepr.rewards.judges import RewardInputError, coerce_rubrics
    from deepr.text import squad_normalize

    by_id, by_q = {}, {}
    for n, raw in enumerate(read_jsonl(path), start=1):
        row = _with_id(raw, path, n, EvalRecord)
        if kind == "rubrics":
            try:
                coerce_rubrics(row.get("rubrics"), where=f"rubrics of {row['id']}")
            except RewardInputError as e:
                raise RecordError(path, n, str(e), field="rubrics") from None
        elif not (row.get("answers") or row.get("answer")):
            raise RecordError(path, n, "a gold row needs 'answers' (a list) or 'answer'", field="answers")
        by_id[row["id"]] = row
        q = row.get("question") or row.get("query") or row.get("prompt")
        if isinstance(q, str) and q.strip():
            by_q[squad_normalize(q)] = row
    return by_id, by_q


def _with_id(raw: dict, path: Path, n: int, model: Any) -> dict:
    """A reference row validated with its id, taken from a benchmark's own id field when it has
    no ``id`` (BrowseComp-Plus ``query_id``, ResearchRubrics ``sample_id``)."""
    from pydantic import ValidationError

    from deepr.io import RecordError

    alias = next((k for k in ("id", "query_id", "sample_id") if raw.get(k) is not None), None)
    row = {**raw, "id": raw[alias]} if alias else raw
    try:
        return model.model_validate(row).model_dump()
    except ValidationError as e:
        err = e.errors()[0]
        raise RecordError(path, n, err.get("msg", str(e)), ".".join(map(str, err.get("loc", ()))) or None) from None
