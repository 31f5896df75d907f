"""The verify stage's audit without a model: the code findings decide alone."""

from __future__ import annotations

from typing import Any

from deepr.roles.rubric_checks import rubric_problems
from deepr.roles.verify_checks import repair


def audit_reply(a: Any) -> dict[str, Any]:
    """Decide from the code findings alone: none → KEEP, only fixable ones → REVISE by
    dropping or reweighting the criteria they name, any fatal one → DROP; as an audit reply."""
    fatal = [f for f in a.found if f.kind == "fatal"]
    if fatal:
        return {"decision": "DROP", "justification": "; ".join(f.detail for f in fatal)}
    if not any(f.kind == "fixable" for f in a.found):
        return {"decision": "KEEP"}
    cfg = a.cfg
    fixed = repair(a.pair.rubrics, a.found, cfg.revise_max)
    left = rubric_problems(fixed, a.pair.selected_leaf_ids, a.leaves, cfg.limits,
                           min_n=cfg.revise_min, max_n=cfg.revise_max)
    if left:
        return {"decision": "DROP", "justification": "repair not possible: " + "; ".join(left)}
    return {"decision": "REVISE", "fix_plan": "dropped or reweighted the criteria named by the findings",
            "revised_rubrics": [r.model_dump() for r in fixed]}


