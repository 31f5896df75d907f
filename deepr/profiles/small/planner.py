"""The small profile's plan formats: bounded fields, the graph schema with its guard, and the
fixed skeleton of strict formats (:func:`deepr.profiles.formats.plan_schema`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deepr.agent.planner import INITIAL, REVISE
from deepr.llm.base import OutputFormat
from deepr.profiles.formats import plan_schema
from deepr.profiles.plan_guard import PlanGuard, graph_schema

# Bounds of what a planner may write. They go into the decoding schema, so a model that copies the
# question into every query still closes its plan inside its token budget (a 135M model did, and
# every plan ran out at 400 tokens); a good query, need or key point is far shorter.
_Short = Annotated[str, Field(max_length=150)]
_NodeId = Annotated[str, Field(pattern=r"^N[0-9]{1,2}$")]  # the prompt's id style (N1, N2, ...)
# 2 to 10 words of at most 24 characters: the acceptance check wants two content words, and the
# length sits in the pattern because xgrammar drops maxLength from a string that has a pattern (a
# query of "R B and R B and ..." ran to the 400-token cap with max_length alone). No maxLength beside
# it: xgrammar warns on every compile and drops it anyway; the pattern bounds it to 249 characters.
_Query = Annotated[str, Field(pattern=r'^[^ "\\]{1,24}( [^ "\\]{1,24}){1,9}$')]
# 1 to 15 words, the same way: the validator refuses a blank need (a random decoder wrote " "),
# and xgrammar cannot compile a long bounded run such as ".{1,150}"
_Need = Annotated[str, Field(pattern=r'^[^ "\\]{1,24}( [^ "\\]{1,24}){0,14}$')]


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: _NodeId


class _SearchShape(_Shape):
    """A search node as the prompt describes it: a query and key points, never inputs."""

    type: Literal["search"]
    query: _Query
    key_points: list[_Short] = Field(default_factory=list, max_length=4)


class _AnswerShape(_Shape):
    type: Literal["answer"]
    need: _Need
    inputs: list[_NodeId] = Field(min_length=1, max_length=8)


class _AggregateShape(_AnswerShape):
    type: Literal["aggregate"]  # type: ignore[assignment]
    key_points: list[_Short] = Field(default_factory=list, max_length=4)


class _PlanShape(BaseModel):
    """The node shapes of a plan: each node type with its own fields, so a search node cannot take
    inputs nor a reader lack them. Decoding uses them through :func:`graph_schema`, which adds the
    wiring (ids in order, inputs drawn from earlier ids, the answer last)."""

    model_config = ConfigDict(extra="forbid")
    # rule 4: at most 6 searches, their aggregates, one answer
    nodes: list[_SearchShape | _AggregateShape | _AnswerShape] = Field(min_length=2, max_length=10)


class _RevisionShape(_PlanShape):
    fetch: list[str] = []


def graph_format(revision: bool = False) -> OutputFormat:
    """The plan as the small profile decodes it with strict formats off (``--formats schema``)."""
    shape = _RevisionShape if revision else _PlanShape
    return OutputFormat("revision" if revision else "plan", json_schema=graph_schema(shape.model_json_schema()),
                        distinct_words=True, guard=PlanGuard())


def _result_titles(a: Any) -> list[str]:
    cat = a.ctx.catalog
    return [cat[i].title or "" for ids in a.results.values() for i in ids if i in cat]


def initial_format(a: Any) -> OutputFormat:
    return OutputFormat("plan", json_schema=plan_schema(texts=[a.query]), distinct_words=True)


def revision_format(a: Any) -> OutputFormat:
    return OutputFormat("revision", json_schema=plan_schema(
        fetch_ids=[i for ids in a.results.values() for i in ids], fetch_limit=a.ctx.config.fetch_limit,
        texts=[a.query, *_result_titles(a)]), distinct_words=True)


STRICT = {INITIAL: initial_format, REVISE: revision_format}
SCHEMA = {INITIAL: lambda: graph_format(False), REVISE: lambda: graph_format(True)}
