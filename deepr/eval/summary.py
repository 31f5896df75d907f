"""Summaries of `deepr eval` scores: the per-metric table (mean, std, n, failures) and the
corpus-level totals that are not means of per-item values.

Input: Score rows (dicts) and the metric names; output: table rows and totals.

    python -c "from deepr.eval.summary import summarize; print(summarize([{'em': 1.0}], ['em']))"
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

# The fields the summary table and the HTML page report for each metric (first = headline).
SUMMARY_FIELDS = {
    "rubric": ["rubric"], "citation": ["R_cite", "F1_mean", "R_fmt", "cite_v", "cite_m", "cite_d", "cite_n"],
    "format": ["R_format", "I_answer", "I_cite", "I_tool", "I_think"], "search": ["R_search"],
    "composite": ["composite", "rubric", "R_format", "R_cite", "R_search"],
    "plan_reward": ["plan_reward", "C_rub", "Q_search", "C_search", "D_search", "E_graph", "B_synth",
                    "I_cross", "B_search"],
    "answer_reward": ["answer_reward", "R_exec", "R_synth", "J_rub", "U_branch"],
    "em": ["em"], "f1": ["f1"], "lj": ["lj"], "team": ["R_team"],
    "structure": ["nodes", "edges", "waves", "sections", "citations", "unique_sources", "cited_id_validity"],
    "race": ["race", "race_comprehensiveness", "race_insight", "race_instruction_following",
             "race_readability"],
    "fact": ["fact_accuracy", "fact_supported", "fact_unsupported"],
    "support": ["support", "support_unsupported", "support_partial", "support_claims"],
    "recall": ["recall_cited", "recall_searched"],
}

# What each summary field means, printed under the table for the fields it shows (the
# papers' names: DeepRubric App. A for the citation parts, DecomposeR App. A.5 for the rewards).
LEGEND = {
    "rubric": "share of rubric weight the report satisfies (judged per rubric item)",
    "R_cite": "citation reward: 0.6 F1_mean + 0.4 R_fmt",
    "F1_mean": "mean per-claim F1 of cited sources (recall: sources support the claim; precision: each is needed)",
    "R_fmt": "citation format: v·m·(0.7 + 0.1 cite_d + 0.2 cite_n)",
    "cite_v": "share of cited ids that exist in the run's sources",
    "cite_m": "share of cited claims long enough to check (4+ words)",
    "cite_d": "how evenly citations spread over the report (span, uniformity, centre)",
    "cite_n": "distinct valid sources cited, over 6 (capped at 1)",
    "R_format": "agent output format (answer, cite, tool and think tags well formed)",
    "R_search": "search reward from the number of tool calls",
    "composite": "0.5 rubric + 0.2 R_format + 0.2 R_cite + 0.1 R_search",
    "plan_reward": "R_plan: planner reward of the plan graph",
    "answer_reward": "R_ans: answerer reward (execution, synthesis, rubric judge, branch use)",
    "em": "exact match with a gold answer", "f1": "token F1 with the best gold answer",
    "lj": "LLM-judged correctness against the gold answers", "R_team": "DECOR team reward from f1 and lj",
    "nodes": "plan nodes", "waves": "waves of nodes answered side by side", "sections": "report sections",
    "citations": "citation markers in the report", "unique_sources": "distinct sources cited",
    "cited_id_validity": "share of cited ids that resolve to a source",
    "race": "RACE score against the reference report (DeepResearch Bench)",
    "fact_accuracy": "FACT: share of judged citations whose page supports the claim",
    "support": "share of cited claims the cited text backs",
    "recall_cited": "share of the qrels' relevant documents that the report cites",
    "recall_searched": "share of the qrels' relevant documents that the run's searches returned",
}


def legend(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(field, meaning) for the fields of summary ``rows`` that have one."""
    fields = dict.fromkeys(r["field"] for r in rows)
    return [(f, LEGEND[f]) for f in fields if f in LEGEND]


def metric_done(row: Mapping[str, Any] | None, metric: str) -> bool:
    """Whether a score row already holds ``metric`` (computed, not failed)."""
    if not row or metric in (row.get("failures") or {}):
        return False
    listed = row.get("metrics")
    if isinstance(listed, list):
        return metric in listed
    return SUMMARY_FIELDS[metric][0] in row  # rows written before the metric list was recorded


def merge_score(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """``new`` (the metrics scored now) over ``old`` (the item's earlier row): the earlier metrics
    stay, a metric scored again replaces its failure or value."""
    if not old:
        return dict(new)
    now = list(new.get("metrics") or [])
    before = old.get("metrics")
    if not isinstance(before, list):
        before = [m for m in SUMMARY_FIELDS if metric_done(old, m) or m in (old.get("failures") or {})]
    failures = {k: v for k, v in (old.get("failures") or {}).items() if k not in now}
    failures.update(new.get("failures") or {})
    return {**old, **new, "failures": failures, "metrics": list(dict.fromkeys([*before, *now]))}


def latest_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per id, the last one written (a re-run appends merged rows), in first-seen order."""
    last: dict[str, dict[str, Any]] = {}
    for r in rows:
        last[str(r.get("id"))] = dict(r)  # a dict keeps a key's first position when its value changes
    return list(last.values())


def summarize(scores: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> list[dict[str, Any]]:
    """Rows {metric, field, mean, std, n, failures} over the scored (non-failed) items."""
    rows = []
    for m in metrics:
        ok = [s for s in scores if m not in (s.get("failures") or {})]
        fails = len(scores) - len(ok)
        for k, f in enumerate(SUMMARY_FIELDS[m]):
            vals = values_of(ok, f)
            if not vals and k:
                continue
            mean = sum(vals) / len(vals) if vals else None
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)) if vals else None
            rows.append({"metric": m, "field": f, "mean": mean, "std": std, "n": len(vals),
                         "failures": fails if k == 0 else None,
                         **({"top_failure": _top_reason(scores, m)} if k == 0 and fails else {})})
    return rows


def _top_reason(scores: Sequence[Mapping[str, Any]], metric: str) -> str:
    """The commonest failure reason of ``metric``, with how many items gave it."""
    from collections import Counter

    reasons = Counter(str((s.get("failures") or {})[metric]) for s in scores if metric in (s.get("failures") or {}))
    reason, n = reasons.most_common(1)[0]
    return f"{n}× {reason}"


def values_of(scores: Sequence[Mapping[str, Any]], f: str) -> list[float]:
    """Numeric values of field ``f`` (bools count as 0/1; None and missing are skipped)."""
    return [float(s[f]) for s in scores if isinstance(s.get(f), (int, float)) and math.isfinite(float(s[f]))]


def benchmark_totals(scores: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> dict[str, Any]:
    """Corpus-level numbers that are not means of per-item values (FACT; RACE per dimension)."""
    out: dict[str, Any] = {}
    if "fact" in metrics:
        ok = [s for s in scores if "fact" not in (s.get("failures") or {})]
        sup = sum(s.get("fact_supported", 0) for s in ok)
        judged = sup + sum(s.get("fact_unsupported", 0) for s in ok)
        cited = sum(1 for s in ok if s.get("fact_pairs"))
        out["fact_citation_accuracy"] = sup / judged if judged else None
        out["fact_effective_citations"] = sup / cited if cited else None
    if "race" in metrics:
        vals = values_of([s for s in scores if "race" not in (s.get("failures") or {})], "race")
        out["race_benchmark_score"] = sum(vals) / len(vals) if vals else None
    return out
