"""Report-level score (003 App. A.6.2): the rubric reward when the query has rubrics,
else the judge's four report-quality criteria (comprehensiveness, insight, instruction
following, readability) combined with equal weights. Used by best-draft pruning and by
``grpo --stage warp-report``.

Input: query, report text, rubric items (may be empty) and a :class:`~deepr.rewards.judges.Judge`;
output: ``{"R": score, ...parts}`` or ``{"R": None, "failure": reason}`` (never a silent 0).
"""

from __future__ import annotations

from typing import Any

QUALITY = {"comprehensiveness": "The report covers every part of the question with the relevant facts.",
           "insight": "The report analyses causes, comparisons and implications instead of listing facts.",
           "instruction_following": "The report answers exactly what the question asks, in its language.",
           "readability": "The report is clearly organised in sections with fluent, non-repetitive prose."}


async def report_score(query: str, report: str, rubrics: Any, judge: Any) -> dict[str, Any]:
    """R_rubric with rubrics, else the mean of the four quality criteria scored by ``judge``."""
    from deepr.records import RubricItem
    from deepr.rewards.rubric_reward import rubric_score

    if rubrics:
        out = await rubric_score(query, report, rubrics, judge)
        if out.get("R_rubric") is None:
            return {"R": None, "failure": out.get("failure") or "the judge could not score the report"}
        return {"R": out["R_rubric"], "R_rubric": out["R_rubric"], "scored_by": "rubrics"}
    # The question goes into the criteria that are about it, so the extractive judge (which
    # matches criterion text against the report) rewards a draft that addresses the question.
    about = {"comprehensiveness", "instruction_following"}
    items = [RubricItem(id=k, type="logical", weight=1.0,
                        description=f"{d} Question: {query}" if k in about else d) for k, d in QUALITY.items()]
    verdict = await judge.rubrics(query, report, items)
    if not verdict.ok:
        return {"R": None, "failure": verdict.reason}
    return {"R": verdict.value["score"], **verdict.value["items"], "scored_by": "quality"}
