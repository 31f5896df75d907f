"""Typed records, one class per JSONL artefact (their field names are the interface scripts rely on).

Every record has an ``id``; readers and writers live in :mod:`deepr.io`. Records accept
extra fields (``extra="allow"``) so artefacts written by a newer deepr, or annotated by a
user's script, still load; the fields named here are validated.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Record(BaseModel):
    """Base of every artefact record: an id plus validated fields, extras kept."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    id: str = Field(min_length=1)


# --- corpus ---------------------------------------------------------------------------


class Document(Record):
    """One corpus document (id, title, text, url optional)."""

    title: str = ""
    text: str
    url: str | None = None
    topic: str | None = None
    description: str | None = None


class Passage(Record):
    """A retrievable chunk of a document; ``id`` is ``<doc_id>#<k>`` and never changes."""

    doc_id: str
    title: str = ""
    text: str
    url: str | None = None


class Hit(BaseModel):
    """One ranked search result (a snippet with a stable id)."""

    id: str  # passage id
    doc_id: str
    title: str = ""
    text: str
    url: str | None = None
    score: float = 0.0
    rank: int = 0


# --- build-trees (DeepRubric §3.1) ------------------------------------------------------------


class SupportingDoc(BaseModel):
    doc_id: str
    snippet_id: str
    title: str = ""
    statements: list[str] = Field(default_factory=list)


class TreeNode(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    parent: str | None = None
    depth: int = Field(ge=0)
    query: str
    supporting_docs: list[SupportingDoc] = Field(default_factory=list)
    statements: list[str] = Field(default_factory=list)
    children: list[str] = Field(default_factory=list)
    stop_reason: str | None = None  # why it became a leaf: max_depth | atomic | no_children


class TreeStats(BaseModel):
    model_config = ConfigDict(extra="allow")
    nodes: int = 0
    leaves: int = 0
    depth: int = 0
    llm_calls: int = 0
    retrieval_calls: int = 0
    seconds: float = 0.0


class Tree(Record):
    topic: str
    root_id: str
    nodes: list[TreeNode]
    stats: TreeStats = Field(default_factory=TreeStats)
    backend: str = ""


# --- synthesize-rubrics / verify (DeepRubric §3.2) -----------------------------------------


class RubricItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["factual", "logical"]
    description: str = Field(min_length=1)
    weight: float = Field(ge=-1.0, le=1.0)
    source_leaf_ids: list[str] = Field(default_factory=list)
    evidence: list[str] = Field(default_factory=list)


def is_criteria(raw: Any) -> bool:
    """Rubrics written as ResearchRubrics criteria (``{criterion, weight, axis}``)."""
    return isinstance(raw, list) and bool(raw) and all(isinstance(r, dict) and "criterion" in r for r in raw)


def criteria_rubrics(raw: list[dict[str, Any]], where: str = "rubrics") -> list[dict[str, Any]]:
    """ResearchRubrics criteria as rubric items: each weight divided by the largest |weight|, so
    they fit [-1, 1] while every ratio, and so the compliance score Σ w·s / Σ_{w>0} w, stays the
    same; negative weights stay penalties. The published weight and axis are kept as extras."""
    for i, r in enumerate(raw, start=1):
        if not isinstance(r.get("criterion"), str) or not r["criterion"].strip():
            raise ValueError(f"{where}: criterion #{i} has no 'criterion' text")
        w = r.get("weight")
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise ValueError(f"{where}: criterion #{i} field 'weight': expected a number, got {w!r}")
    scale = max(abs(float(r["weight"])) for r in raw) or 1.0
    # "logical": judged on its description alone, as the benchmark's grader reads a criterion
    return [{"id": f"c{i}", "type": "logical", "description": r["criterion"].strip(),
             "weight": float(r["weight"]) / scale, "axis": r.get("axis"), "published_weight": r["weight"]}
            for i, r in enumerate(raw, start=1)]


class MergeStep(BaseModel):
    model_config = ConfigDict(extra="allow")
    inputs: list[str]
    output: str
    rationale: str = ""


class QRPair(Record):
    """A query–rubric pair; ``verified.jsonl`` rows add ``decision`` and ``error_tags``."""

    tree_id: str
    question: str = Field(min_length=1)
    selected_leaf_ids: list[str]
    selection_trace: list[dict[str, Any]] = Field(default_factory=list)
    merge_trace: list[MergeStep] = Field(default_factory=list)
    rubrics: list[RubricItem]
    decision: Literal["KEEP", "REVISE", "DROP"] | None = None
    error_tags: list[str] = Field(default_factory=list)


# --- plans (DecomposeR §3.3) ------------------------------------------------------------


class PlanNode(BaseModel):
    """A node of the typed DAG: search {query, key_points}, aggregate/answer {need, inputs}."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: str  # validated by deepr.evidence.plan.validate_plan so errors name the node
    query: str | None = None
    need: str | None = None
    key_points: list[str] = Field(default_factory=list)
    inputs: list[str] = Field(default_factory=list)


class Plan(BaseModel):
    model_config = ConfigDict(extra="allow")
    nodes: list[PlanNode]
    fetch: list[str] = Field(default_factory=list)


# --- run traces and trajectories ---------------------------------------


class Citation(BaseModel):
    model_config = ConfigDict(extra="allow")
    doc_id: str
    title: str = ""
    text: str
    url: str | None = None


class ModelCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    prompt_hash: str
    reply: str
    latency_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ok: bool = True
    error: str | None = None
    constrained: bool = False  # decoding was constrained to the role's output format
    truncated: bool = False  # generation stopped at max_tokens


class RunTrace(BaseModel):
    """The ``report.json`` sidecar of ``deepr run``."""

    model_config = ConfigDict(extra="allow")
    query: str
    mode: str
    plans: list[dict[str, Any]] = Field(default_factory=list)
    calls: list[ModelCall] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    citations: dict[str, Citation] = Field(default_factory=dict)
    report: str = ""


class Turn(BaseModel):
    """One model turn of a trajectory, tagged with its role and action."""

    model_config = ConfigDict(extra="allow")
    role: str  # planner | answerer | writer | filter | ...
    action: str  # plan | revise | wave | final | initialize | search | write | expand | terminate
    messages: list[dict[str, str]]  # the prompt as chat messages
    completion: str
    ok: bool = True


class Trajectory(Record):
    query: str
    mode: str
    turns: list[Turn]
    rubrics: list[RubricItem] = Field(default_factory=list)
    report: str = ""
    drafts: list[str] = Field(default_factory=list)  # warp intermediate drafts, in order


class ChatExample(Record):
    """One training example (SFT / RL): chat messages, tagged by role and action."""

    role: str
    action: str
    messages: list[dict[str, str]]
    query_id: str = ""
    weight: float = 1.0


# --- rejects and scores --------------------------------------------------------------


class Reject(Record):
    stage: str
    reason: str
    record: dict[str, Any] | None = None


class Score(Record):
    """One evaluated item: every metric component as a flat field, failures with reasons."""

    failures: dict[str, str] = Field(default_factory=dict)

    @field_validator("failures")
    @classmethod
    def _reasons_non_empty(cls, v: dict[str, str]) -> dict[str, str]:
        for metric, reason in v.items():
            if not reason:
                raise ValueError(f"failure of metric {metric!r} needs a reason")
        return v
