"""The extractive path of :func:`deepr.roles.perform`: a role done by its non-LLM implementation.

:class:`~deepr.llm.extractive.ExtractiveLLM` hands this function to the executor
(``llm.role_engine()``), so the executor never asks which engine it runs on.
"""

from __future__ import annotations

import json
from typing import Any

from deepr.roles import Outcome, Recorder, Role, RoleFailed, failed


def perform(role: Role, inp: Any, rec: Recorder, extra: dict[str, Any]) -> Outcome:
    """``role.extractive(inp)`` recorded as the role's turn: the messages a model would have been
    sent and the reply it should have given, so every stage yields trajectories the same way."""
    messages = role.messages(inp)
    try:
        value = role.extractive(inp)
    except RoleFailed as e:
        rec.turn(role.name, role.action, messages, "", ok=False, attempts=0, extractive=True, error=str(e), **extra)
        return failed(role, rec, str(e), 0, None, extra)
    action = role.turn_action(value) if role.turn_action else role.action
    shown = json.dumps(value, default=str) if role.direct else role.output.render(value)
    rec.turn(role.name, action, messages, shown, ok=True, attempts=1, extractive=True, **extra)
    rec.engines["extractive"] += 1
    return Outcome(value if role.direct else role.result(inp, value), "extractive", attempts=0)
