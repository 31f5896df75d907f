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
}

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
                         "failures": fails if k == 0 else None})
    return rows


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
