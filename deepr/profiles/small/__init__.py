"""The small profile's tables (see :class:`deepr.profiles.Tables`), gathered from the agent and
dataset modules beside this one."""

from __future__ import annotations

from deepr.profiles import Tables
from deepr.profiles.small import agent, data, planner

TABLES = Tables(strict={**planner.STRICT, **agent.STRICT, **data.STRICT}, schema={**planner.SCHEMA, **agent.SCHEMA},
                messages=data.MESSAGES, precheck=data.PRECHECK)
