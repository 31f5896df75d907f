"""DeepResearch Bench-style RACE scoring, reading the benchmark's own files.

Inputs: criteria JSONL ``{"id", "prompt", "dimension_weight": {dim: W_d}, "criterions":
{dim: [{"criterion", "explanation", "weight"}]}}``, reference reports ``{"id", "prompt",
"article"}``, optional queries ``{"id", "topic", "language", "prompt"}``, and target
reports in the reference format (or any deepr report). Output per task: target and
reference dimension averages, per-dimension scores t_d / (t_d + r_d) and the task score
T / (T + R), where avg_d = Σ w_c s_c / Σ w_c over the judge's 0–10 criterion scores and
T = Σ_d W_d avg_d. 0.5 means "as good as the reference".

    deepr eval targets.jsonl --metric race --race-criteria criteria.jsonl \
        --race-reference reference.jsonl --out race.jsonl

Citations and reference lists are stripped from both articles before judging. One judge
call per task sees the task, target as article 1, reference as article 2 and the criteria
without weights. When both articles score 0 everywhere the task score is 0, as the benchmark
scores it (not 0.5), with a note.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deepr.io import RecordError, read_jsonl
from deepr.rewards.judges import Judge
from deepr.text import strip_citations

DIMENSIONS = ("comprehensiveness", "insight", "instruction_following", "readability")


class RaceCriterion(BaseModel):
    model_config = ConfigDict(extra="allow")
    criterion: str = Field(min_length=1)
    explanation: str = ""
    weight: float = Field(ge=0)


class RaceCriteria(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | int
    prompt: str
    dimension_weight: dict[str, float]
    criterions: dict[str, list[RaceCriterion]]


class RaceArticle(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | int
    prompt: str = ""
    article: str


@dataclass
class RaceTask:
    id: str
    prompt: str
    criteria: RaceCriteria
    reference: str


def load_race_tasks(criteria_path: str | Path, reference_path: str | Path) -> dict[str, RaceTask]:
    """Tasks by id from the benchmark's criteria and reference files (joined by id, else prompt)."""
    crits = list(read_jsonl(criteria_path, RaceCriteria))
    refs = list(read_jsonl(reference_path, RaceArticle))
    ref_by_id = {str(r.id): r for r in refs}
    ref_by_prompt = {r.prompt.strip(): r for r in refs if r.prompt.strip()}
    tasks: dict[str, RaceTask] = {}
    for lineno, c in enumerate(crits, start=1):
        missing = [d for d in c.criterions if d not in c.dimension_weight]
        if missing:
            raise RecordError(criteria_path, lineno, f"dimension(s) {missing} have criteria but no weight "
                              "in dimension_weight", field="dimension_weight")
        ref = ref_by_id.get(str(c.id)) or ref_by_prompt.get(c.prompt.strip())
        if ref is None:
            raise RecordError(criteria_path, lineno, f"task {c.id} has no reference report in "
                              f"{reference_path} (joined by id, then by prompt)", field="id")
        tasks[str(c.id)] = RaceTask(str(c.id), c.prompt, c, ref.article)
    return tasks


def find_task(tasks: dict[str, RaceTask], item_id: str, prompt: str | None) -> RaceTask | None:
    if item_id in tasks:
        return tasks[item_id]
    p = (prompt or "").strip()
    return next((t for t in tasks.values() if p and t.prompt.strip() == p), None)


_REF_HEAD = re.compile(r"^\s*(#{1,6}\s*|\*\*)?(references|reference list|sources|bibliography|works cited|"
                       r"citations|参考文献|参考资料|引用)\s*:?\s*(\*\*)?\s*:?\s*$", re.I)
_HEAD = re.compile(r"^\s*(#{1,6})\s")
_LINK = re.compile(r"\[([^\]]+)\]\((?:https?://|www\.)[^)]*\)")
_URL = re.compile(r"https?://\S+")


def drop_reference_lists(text: str) -> str:
    """Remove sections headed References / Sources / Bibliography (up to the next heading
    of the same or a higher level): they list sources, they are not report content."""
    out, skip_level = [], 0
    for line in (text or "").splitlines():
        m = _REF_HEAD.match(line)
        if m:
            hashes = (m.group(1) or "").strip().count("#")
            skip_level = hashes or 6  # a bold or plain label: any later heading ends the list
            continue
        h = _HEAD.match(line)
        if skip_level and h and len(h.group(1)) <= skip_level:
            skip_level = 0
        if not skip_level:
            out.append(line)
    return "\n".join(out)


def clean_article(text: str) -> str:
    """Drop reference lists, link URLs and inline citation markers (RACE judges content only)."""
    return strip_citations(_URL.sub("", _LINK.sub(r"\1", drop_reference_lists(text))))


def criteria_keys(criteria: RaceCriteria) -> list[tuple[str, str, RaceCriterion]]:
    """(key, dimension, criterion) with stable keys like "insight-2"."""
    return [(f"{d}-{i}", d, c) for d, cs in criteria.criterions.items() for i, c in enumerate(cs, start=1)]


class _Pair(BaseModel):
    article_1: float = Field(ge=0, le=10)
    article_2: float = Field(ge=0, le=10)


class _RaceReply(BaseModel):
    scores: dict[str, _Pair]


RACE_PROMPT = """You compare two research reports written for the same task, criterion by
criterion. For each criterion give each article a score from 0 (fails it completely) to 10
(meets it in an exemplary way). Judge the content against the criterion only; do not let
length alone raise a score, and score the two articles independently of their order.

Task:
{task}

Article 1:
<<<
{target}
>>>

Article 2:
<<<
{reference}
>>>

Criteria:
{criteria}

Return {{"scores": {{"<criterion key>": {{"article_1": <0-10>, "article_2": <0-10>}}, ...}}}}
with one entry for every criterion key above."""


@dataclass
class RaceResult:
    id: str
    score: float | None
    dims: dict[str, float] = field(default_factory=dict)
    T: float | None = None
    R: float | None = None
    target_avg: dict[str, float] = field(default_factory=dict)
    reference_avg: dict[str, float] = field(default_factory=dict)
    judge: str = ""
    failure: str | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ratio(t: float, r: float) -> float:
    return 0.0 if t + r == 0 else t / (t + r)  # as DeepResearch Bench: both zero scores 0, not a tie


def race_from_scores(task: RaceTask, scores: dict[str, Sequence[float]], judge: str = "") -> RaceResult:
    """Combine per-criterion (target, reference) 0–10 scores into the RACE task result."""
    res = RaceResult(task.id, None, judge=judge)
    keys = criteria_keys(task.criteria)
    for dim in task.criteria.criterions:
        rows = [(c.weight, scores[k]) for k, d, c in keys if d == dim]
        den = sum(w for w, _ in rows)
        if not rows or den <= 0:
            res.notes.append(f"dimension {dim} has no weighted criteria; left out")
            continue
        res.target_avg[dim] = sum(w * s[0] for w, s in rows) / den
        res.reference_avg[dim] = sum(w * s[1] for w, s in rows) / den
        res.dims[dim] = _ratio(res.target_avg[dim], res.reference_avg[dim])
    dw = task.criteria.dimension_weight
    res.T = sum(dw[d] * v for d, v in res.target_avg.items())
    res.R = sum(dw[d] * v for d, v in res.reference_avg.items())
    if res.T + res.R == 0:
        res.notes.append("both articles scored 0 on every criterion: scored 0 as DeepResearch Bench does")
    res.score = _ratio(res.T, res.R)
    return res


async def race_score(task: RaceTask, target: str, judge: Judge) -> RaceResult:
    """One judge call (LLM) or per-criterion coverage (extractive) → :class:`RaceResult`."""
    keys = criteria_keys(task.criteria)
    tgt, ref = clean_article(target), clean_article(task.reference)
    if not tgt.strip():  # nothing to judge: T = 0 and the task score is 0 whatever R is
        return RaceResult(task.id, 0.0, {d: 0.0 for d in task.criteria.criterions}, T=0.0, judge=judge.name,
                          notes=["empty target report (after stripping citations): score 0, no judge call"])
    listing = "\n".join(f"- {k}: {c.criterion}" + (f" ({c.explanation})" if c.explanation else "")
                        for k, _, c in keys)
    want = {k for k, _, _ in keys}

    def local() -> dict[str, list[float]]:
        return {k: [10 * _cov(judge, c, tgt), 10 * _cov(judge, c, ref)] for k, _, c in keys}

    v = await judge.run(
        "race", [task.prompt, tgt, ref, listing], local=local,
        prompt=RACE_PROMPT.format(task=task.prompt, target=tgt, reference=ref, criteria=listing),
        schema=_RaceReply,
        convert=lambda r: {k: [p.article_1, p.article_2] for k, p in r.scores.items() if k in want},
        check=lambda r: [f"missing scores for: {', '.join(sorted(want - set(r.scores)))}"]
        if want - set(r.scores) else [], max_tokens=max(1024, 40 * len(keys)))
    if not v.ok:
        return RaceResult(task.id, None, judge=judge.name, failure=v.reason)
    return race_from_scores(task, v.value, judge.name)


def _cov(judge: Judge, c: RaceCriterion, article: str) -> float:
    return judge.support(f"{c.criterion} {c.explanation}".strip(), article) if article.strip() else 0.0


def race_summary(results: Sequence[RaceResult]) -> dict[str, Any]:
    """Benchmark score: mean task score and mean per-dimension score over scored tasks."""
    ok = [r for r in results if r.score is not None]
    out: dict[str, Any] = {"tasks": len(ok), "failed": len(results) - len(ok),
                           "overall": sum(r.score for r in ok) / len(ok) if ok else None}
    for d in sorted({d for r in ok for d in r.dims}):
        vals = [r.dims[d] for r in ok if d in r.dims]
        out[d] = sum(vals) / len(vals)
    return out
