"""Benchmark interop: deepr run traces (``report.json``) in the layouts that BrowseComp-Plus,
ResearchRubrics and DeepResearch Bench grade, TREC qrels, and retrieval recall against them.

Layouts (as the benchmarks' own code reads them):

- **BrowseComp-Plus** (texttron/BrowseComp-Plus, ``scripts_evaluation/evaluate_run.py``): a
  folder of ``run_*.json``, one per question, written as ``json.dump(..., indent=2)``:
  ``metadata`` ({model, output_dir}), ``query_id``, ``tool_call_counts`` ({tool: n}), ``usage``,
  ``status`` ("completed" is graded), ``retrieved_docids`` (recall is computed from these) and
  ``result``: the tool calls (``{"type": "tool_call", "tool_name", "arguments", "output"}``) and
  last ``{"type": "output_text", "tool_name": null, "arguments": null, "output": response}``. The
  response is BrowseComp's ``Explanation: … [docid]`` / ``Exact Answer: …`` / ``Confidence: N%``.
- **ResearchRubrics** (scaleapi/researchrubrics): one ``<sample_id>.md`` report per prompt in
  a folder (the grader takes the sample id from the file name).
- **DeepResearch Bench**: JSONL ``{id, prompt, article}`` (:mod:`deepr.search.drb`).

Here ``retrieved_docids`` are the document ids of every passage the run's searches returned
(in first-seen order), ``tool_call_counts`` count the trace's search / browse calls (browse is
BrowseComp-Plus's ``get_document``), and ``status`` is "completed" unless the final answer came
from a fallback or the run was rejected ("incomplete" / "failed").

    python -c "from deepr.eval.benchmarks import load_qrels; print(load_qrels('qrel_evidence.txt'))"
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from deepr.evidence.citations import cited_ids

FORMATS = ("browsecomp-plus", "researchrubrics", "drb")
TOOL_NAMES = {"search": "search", "browse": "get_document", "scholar": "scholar"}
_SHORT = re.compile(r"Explanation:\s*(?P<e>.*?)\s*Exact Answer:\s*(?P<a>.*?)\s*Confidence:\s*(?P<c>\d{1,3})\s*%",
                    re.S)


# --- reading deepr runs ----------------------------------------------------------------------


def load_runs(path: Path) -> list[dict[str, Any]]:
    """Run traces with their ``id`` from a report.json, a folder of them, or a ``reports.jsonl``
    index; a folder's or index's ``reports.rejects.jsonl`` adds its rejected queries
    (``{"id", "query", "rejected": reason}``)."""
    if path.is_dir():
        index = path / "reports.jsonl"
        if index.exists():
            return load_runs(index)
        return [r for p in sorted(path.glob("*.json")) if not p.name.endswith(".meta.json") for r in load_runs(p)]
    if path.suffix == ".jsonl":
        done = _from_index(path)
        ids = {r["id"] for r in done}
        # a question rejected once and answered on a re-run counts as answered; rejected twice, once
        rejected = {r["id"]: r for r in _rejected(path.with_name(path.stem + ".rejects.jsonl")) if r["id"] not in ids}
        return done + list(rejected.values())
    try:
        trace = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not a deepr run sidecar ({e.msg})") from None
    if not isinstance(trace, dict) or "report" not in trace:
        raise ValueError(f"{path}: not a deepr run sidecar (no 'report' field)")
    return [{**trace, "id": str(trace.get("query_id") or trace.get("id") or path.stem)}]


def _from_index(path: Path) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or "trace_path" not in rec:
            raise ValueError(f"{path}:{n} field 'trace_path': missing; not a deepr run index")
        trace_path = Path(rec["trace_path"])
        if not trace_path.is_absolute() and not trace_path.exists():  # an index written elsewhere
            trace_path = path.parent / trace_path.name
        if not trace_path.exists():
            raise FileNotFoundError(f"{path}:{n}: the trace {trace_path} is missing")
        trace = json.loads(trace_path.read_text(encoding="utf-8"))
        out.append({**trace, "id": str(rec.get("id", trace.get("query")))})
    return out


def _rejected(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return [{"id": str(r["id"]), "query": (r.get("record") or {}).get("query", ""), "report": "",
             "rejected": r.get("reason") or "rejected"} for r in rows if isinstance(r, dict) and "id" in r]


# --- what a trace says ---------------------------------------------------------------------


def searched_docids(trace: dict[str, Any]) -> list[str]:
    """Document ids of the passages the run's searches returned, first seen first."""
    ids = (d for t in trace.get("tools") or [] if t.get("tool") in ("search", "scholar")
           for d in t.get("doc_ids") or [])
    return list(dict.fromkeys(str(d) for d in ids))


def cited_docids(trace: dict[str, Any]) -> list[str]:
    """Document ids of the sources the report cites."""
    cites = trace.get("citations") or {}
    return list(dict.fromkeys(str(cites[c]["doc_id"]) for c in cited_ids(trace.get("report") or "") if c in cites))


def tool_call_counts(trace: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in trace.get("tools") or []:
        name = TOOL_NAMES.get(t.get("tool"))
        if name:
            counts[name] = counts.get(name, 0) + 1
    return counts


def run_status(trace: dict[str, Any]) -> str:
    if trace.get("rejected"):
        return "failed"
    short = trace.get("short_answer")
    if isinstance(short, dict) and short.get("by") in ("fallback", "failed"):
        return "incomplete"
    return "completed" if (trace.get("report") or "").strip() else "incomplete"


def _docid_citations(text: str, citations: dict[str, Any]) -> str:
    """``text`` with each bracket of citation ids rewritten as the cited documents' ids."""
    def swap(m: re.Match) -> str:
        ids = cited_ids(m.group(0))
        if not ids or not all(i in citations for i in ids):
            return m.group(0)
        return "[" + ", ".join(dict.fromkeys(str(citations[i]["doc_id"]) for i in ids)) + "]"

    return re.sub(r"\[[^\[\]\n]{1,400}\]", swap, text)


def browsecomp_response(trace: dict[str, Any]) -> str:
    """The final response: the short answer's three fields (or, without one, the report), its
    citations naming corpus document ids as BrowseComp-Plus's citation metrics read them."""
    cites = trace.get("citations") or {}
    short = trace.get("short_answer")
    if isinstance(short, dict) and short.get("exact_answer"):
        return (f"Explanation: {_docid_citations(short['explanation'], cites)}\n"
                f"Exact Answer: {short['exact_answer']}\nConfidence: {int(short['confidence'])}%")
    body = re.split(r"^## References\s*$", trace.get("report") or "", maxsplit=1, flags=re.M)[0].strip()
    return _docid_citations(body, cites)


# --- BrowseComp-Plus -------------------------------------------------------------------------


def _tool_items(trace: dict[str, Any]) -> list[dict[str, Any]]:
    items = []
    for t in trace.get("tools") or []:
        name = TOOL_NAMES.get(t.get("tool"))
        if name == "get_document":
            args, output = {"docid": str(t.get("doc_id") or t.get("requested") or "")}, \
                "" if t.get("refused") else json.dumps({"docid": str(t.get("doc_id"))})
        elif name:
            args = {"query": t.get("query", "")}
            output = json.dumps([{"docid": str(d)} for d in t.get("doc_ids") or []])
        else:
            continue
        items.append({"type": "tool_call", "tool_name": name, "arguments": json.dumps(args), "output": output})
    return items


def browsecomp_run(trace: dict[str, Any], query_id: str, output_dir: str = "") -> dict[str, Any]:
    """One BrowseComp-Plus run file's content (key order as its search agents write it)."""
    calls = trace.get("calls") or []
    prompt = sum(int(c.get("prompt_tokens") or 0) for c in calls)
    completion = sum(int(c.get("completion_tokens") or 0) for c in calls)
    response = browsecomp_response(trace) if not trace.get("rejected") else ""
    result = _tool_items(trace) + ([{"type": "output_text", "tool_name": None, "arguments": None,
                                     "output": response}] if response else [])
    backend = trace.get("backend") or {}
    return {"metadata": {"model": backend.get("model") or backend.get("backend") or "deepr",
                         "reasoning": None, "output_dir": output_dir, "max_tokens": None},
            "query_id": str(query_id), "tool_call_counts": tool_call_counts(trace),
            "usage": {"input_tokens": prompt, "input_tokens_cached": 0, "output_tokens": completion,
                      "included_reasoning_tokens": 0, "total_tokens": prompt + completion},
            "status": run_status(trace), "retrieved_docids": searched_docids(trace), "result": result}


def run_file_name(query_id: str) -> str:
    """``run_<query id>.json`` (the grader globs ``run_*.json``); odd characters are hashed."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(query_id)).strip("._")[:80]
    if safe != str(query_id):
        safe = f"{safe}-{hashlib.sha1(str(query_id).encode()).hexdigest()[:6]}"
    return f"run_{safe}.json"


def read_browsecomp_run(path: Path) -> dict[str, Any]:
    """A BrowseComp-Plus run file, checked as the grader reads it, with the response's three
    fields parsed (``explanation``, ``exact_answer``, ``confidence``; None when absent)."""
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e.msg})") from None
    for key, kind in (("query_id", str), ("tool_call_counts", dict), ("status", str),
                      ("retrieved_docids", list), ("result", list)):
        if not isinstance(run.get(key), kind):
            raise ValueError(f"{path} field '{key}': expected {kind.__name__}")
    last = run["result"][-1] if run["result"] else {}
    response = last.get("output", "") if last.get("type") == "output_text" else ""
    m = _SHORT.search(response)
    return {**run, "response": response, "explanation": m.group("e") if m else None,
            "exact_answer": m.group("a") if m else None, "confidence": int(m.group("c")) if m else None}


# --- export ----------------------------------------------------------------------------------


def _unique_ids(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    runs = list(runs)
    seen: dict[str, int] = {}
    for r in runs:
        seen[r["id"]] = seen.get(r["id"], 0) + 1
    twice = [i for i, n in seen.items() if n > 1]
    if twice:
        raise ValueError(f"run id {twice[0]!r} appears {seen[twice[0]]} times; each question needs one run")
    return runs


def export(runs: list[dict[str, Any]], fmt: str, out: Path) -> list[Path]:
    """Write ``runs`` in ``fmt``'s layout under ``out`` (a folder; for drb a .jsonl file)."""
    from deepr.io import write_text

    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    runs = _unique_ids(runs)
    if fmt == "drb":
        from deepr.search.drb import to_submission

        subs = to_submission(r for r in runs if not r.get("rejected"))
        write_text(out, "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in subs))
        return [out]
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for r in runs:
        if fmt == "browsecomp-plus":
            path = out / run_file_name(r["id"])
            write_text(path, json.dumps(browsecomp_run(r, r["id"], str(out.resolve())), indent=2))
        elif not r.get("rejected"):
            path = out / f"{r['id']}.md"
            if path.parent != out or not r["id"].strip():
                raise ValueError(f"sample id {r['id']!r} cannot name a file in {out}")
            write_text(path, r.get("report") or "")
        else:
            continue
        written.append(path)
    return written


# --- TREC qrels and recall -------------------------------------------------------------------


def load_qrels(path: Path) -> dict[str, dict[str, int]]:
    """TREC qrels ``query-id iteration doc-id relevance`` (whitespace separated, one judgement
    a line) as {query id: {doc id: relevance}}; a bad line names file and line."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such qrels file")
    out: dict[str, dict[str, int]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 4 or not re.fullmatch(r"-?\d+", parts[3]):
            raise ValueError(f"{path}:{n}: expected 'query-id iteration doc-id relevance' (4 columns, an "
                             f"integer relevance), got {line.strip()[:80]!r}")
        out.setdefault(parts[0], {})[parts[2]] = int(parts[3])
    if not out:
        raise ValueError(f"{path}: holds no judgements")
    return out


def recall(docs: Iterable[str], judged: dict[str, int]) -> float:
    """Share of the relevant documents (relevance > 0) among ``docs``."""
    relevant = {d for d, rel in judged.items() if rel > 0}
    return len(relevant & set(docs)) / len(relevant)


def cited_docs(citations: dict[str, Any], report: str) -> set[str]:
    """Documents of the citation keys ``report`` names in brackets (deepr ids or, in a
    BrowseComp-Plus response, the docids themselves)."""
    names = {t for m in re.finditer(r"\[([^\[\]\n]{1,400})\]", report or "")
             for t in re.split(r"[\s,;]+", m.group(1)) if t}
    return {str(c["doc_id"]) for k, c in citations.items() if k in names and isinstance(c, dict) and "doc_id" in c}


def recall_scores(qrels: dict[str, dict[str, int]], qid: str, citations: dict[str, Any], report: str,
                  searched: list[str] | None) -> dict[str, float]:
    """Recall of ``qid``'s relevant documents among the documents ``report`` cites
    (``recall_cited``) and, when known, among those the run's searches returned
    (``recall_searched``); LookupError when the qrels judge none of them relevant."""
    judged = qrels.get(str(qid))
    if not judged or not any(r > 0 for r in judged.values()):
        raise LookupError(f"no relevant documents for query {qid!r} in the qrels")
    out = {"recall_cited": recall(cited_docs(citations, report), judged)}
    if searched is not None:
        out["recall_searched"] = recall(searched, judged)
    return out


def is_browsecomp_run(data: Any) -> bool:
    return isinstance(data, dict) and all(k in data for k in ("query_id", "retrieved_docids", "result", "status"))


def browsecomp_item_fields(run: dict[str, Any]) -> dict[str, Any]:
    """What ``deepr eval`` scores in a BrowseComp-Plus run file (deepr's or another agent's): the
    final response as the report, its ``[docid]`` citations, the retrieved documents."""
    last = run["result"][-1] if run["result"] else {}
    response = last.get("output", "") if isinstance(last, dict) and last.get("type") == "output_text" else ""
    docs = {t for m in re.finditer(r"\[([^\[\]\n]{1,400})\]", response) for t in re.findall(r"\d+", m.group(1))}
    return {"id": str(run["query_id"]), "query_id": str(run["query_id"]), "report": response,
            "citations": {d: {"doc_id": d, "text": ""} for d in sorted(docs)},
            "retrieved_docids": [str(d) for d in run["retrieved_docids"]]}
