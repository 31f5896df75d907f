"""Judges: the LLM-scored parts of the rewards, each with a no-LLM twin.

A :class:`Judge` wraps one LLM (None: the extractive engine, no model). Every judgement is a role
(:mod:`deepr.roles`) whose non-LLM implementation is embedding + lexical coverage mapped onto
the same scale (the result then says ``judge="extractive"``) and whose model path sends our
own prompt, parses the JSON reply and re-asks on failure (bounded). The rubric
criterion judge lives here; each other judge sits with the reward that uses it and goes
through :meth:`Judge.run`: claim support / needs-citation in rubric_reward, answer
equivalence and role judges in decor, RACE in race, FACT in fact.

A judgement is a :class:`Verdict`: ``ok`` with a value, or not ok with the reason. A
failed judgement is never turned into a score of 0; callers exclude it from means.
Successful judgements are cached by (kind, judge, inputs), in memory and optionally in a
JSONL file, so re-scoring the same report costs nothing.

Extractive mappings (s = ½ best sentence cos⁺ + ½ content-token coverage of the claim):
rubric criterion round(4 s)/4; cited claim full if s ≥ 0.7, partial if s ≥ 0.45 (none when it
names a number or name the sources never mention: ``deepr.extractive.support.invented``), relevant
if s ≥ 0.3; equivalence YES if every gold token is in the prediction or s ≥ 0.9; an uncited
sentence needs a citation if it holds a digit, a capitalised name or ≥ 8 content tokens;
role judges check the role's tag format and then its content (fresh query, gold facts kept,
answer equivalent); RACE 10 s per criterion; FACT supported if s ≥ 0.5.

Rubric weighting (used by every rubric-based score): signed weights, ``max(0, Σ w · s) / Σ_{w>0} w``.
A negative item describes a misleading claim: the judge rates how far the report asserts it
(s ∈ [0, 1]) and ``w · s`` subtracts; not asserting it earns nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from deepr.llm.base import LLM
from deepr.records import RubricItem, criteria_rubrics, is_criteria
from deepr.roles import JSONReply, Recorder, Role, engine_label, perform
from deepr.text import Embed, Vectors, coverage, split_sentences, strip_citations, tok


class RewardInputError(ValueError):
    """Input a reward cannot be defined on (no rubric, missing weight, ...); says how to fix it."""


def coerce_rubrics(raw: Sequence[Any] | None, *, where: str = "rubrics") -> list[RubricItem]:
    """Validate rubric items (dicts or RubricItem); every item needs a weight, Σ|w| > 0."""
    if not raw:
        raise RewardInputError(f"{where}: no rubric items; give at least one item with a weight "
                               "(join rubrics with --rubrics verified.jsonl)")
    if is_criteria(raw):  # ResearchRubrics' {criterion, weight, axis}
        try:
            raw = criteria_rubrics(list(raw), where)
        except ValueError as e:
            raise RewardInputError(str(e)) from None
    items = []
    for i, r in enumerate(raw, start=1):
        if isinstance(r, RubricItem):
            r = r.model_dump()
        if isinstance(r, dict) and r.get("weight") is None:
            rid = r.get("id", f"#{i}")
            raise RewardInputError(f"{where}: rubric item {rid} has no 'weight'; every item needs a "
                                   "weight in [-1, 1] (negative only for a claim to debunk)")
        try:
            items.append(RubricItem.model_validate(r))
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "item"
            raise RewardInputError(f"{where}: rubric item #{i} field {loc}: {err['msg']}") from None
        if not items[-1].description.strip():
            raise RewardInputError(f"{where}: rubric item {items[-1].id} has a blank description")
    if sum(abs(r.weight) for r in items) <= 0:
        raise RewardInputError(f"{where}: every rubric weight is 0, so no weighted mean exists")
    return items


def rubric_weighted(items: Sequence[RubricItem], scores: Sequence[float]) -> float:
    """Signed weights: max(0, Σ w · s) / Σ_{w>0} w. A negative item (a misleading claim, s = how far
    the report asserts it) only subtracts: not asserting it earns nothing, so an empty report
    cannot collect credit from penalty items (issue 15.10)."""
    den = sum(r.weight for r in items if r.weight > 0) or sum(abs(r.weight) for r in items)
    return max(0.0, sum(r.weight * s for r, s in zip(items, scores))) / den


@dataclass
class Verdict:
    """One judgement: ``value`` when ok, else ``reason``; ``judge`` names who decided."""

    ok: bool
    value: Any = None
    reason: str | None = None
    judge: str = ""
    cached: bool = False


class JudgeCache:
    """Successful judgements by key; with ``path`` they persist as JSONL across runs."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self.data: dict[str, Any] = {}
        self._out = None
        if self.path and self.path.exists():
            from deepr.io import read_jsonl

            for row in read_jsonl(self.path, tolerate_torn_tail=True):
                self.data[row["key"]] = row["value"]

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        if self.path is not None:
            if self._out is None:
                from deepr.io import JsonlAppender

                self._out = JsonlAppender(self.path, fsync=False)
            self._out.write({"id": key, "key": key, "value": value})

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


# --- schemas of the judge replies -------------------------------------------------------


class _Score04(BaseModel):
    score: int = Field(ge=0, le=4, description="integer 0..4")


SYSTEM = "You are a careful, strict evaluator. Reply with JSON only."

RUBRIC_PROMPT = """Rate how well a response meets ONE criterion, and nothing else.

A factual criterion is met only when the response states the required facts correctly and
specifically; naming the topic is not enough. A logical criterion is met only when the
response actually carries out the reasoning asked for (a comparison, a distinction, a
synthesis or a conclusion).

Scale: 4 = fully met, every essential part present and correct; 3 = mostly met, small gaps
or vagueness; 2 = partly met, an essential part missing; 1 = barely met, generic or loosely
connected; 0 = not met, or the content is wrong.

Question: {question}

Response:
<<<
{response}
>>>

Criterion ({kind}): {description}{evidence}

Return {{"score": <integer 0-4>}}."""


# --- the judge ----------------------------------------------------------------------


def _key(kind: str, judge: str, payload: Any) -> str:
    blob = json.dumps([kind, judge, payload], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _criterion_text(r: RubricItem) -> str:
    return " ".join([r.description, *r.evidence]) if r.type == "factual" else r.description


class Judge:
    """LLM or extractive judgements with a shared cache; see the module docstring."""

    def __init__(self, llm: LLM | None = None, embed: Embed | None = None, *,
                 cache: JudgeCache | None = None, max_reasks: int = 2, max_tokens: int = 512):
        self.llm = llm  # None: the extractive engine (each judgement's ``local()``)
        self.embed = embed
        self.cache = cache or JudgeCache()
        self.max_reasks, self.max_tokens = max_reasks, max_tokens
        self.name = engine_label(self.llm)
        self.failures = 0

    # -- plumbing shared by every judgement --

    async def run(self, kind: str, payload: Any, *, local: Callable[[], Any] | None = None,
                  prompt: str | None = None, schema: type[BaseModel] | None = None,
                  convert: Callable[[Any], Any] = lambda v: v,
                  check: Callable[[Any], Sequence[str]] | None = None,
                  max_tokens: int | None = None) -> Verdict:
        """Cached judgement, performed as the role ``judge/<kind>``: ``local()`` is its non-LLM
        implementation, ``prompt`` its message, ``schema`` its reply (see :mod:`deepr.roles`)."""
        key = _key(kind, self.name, payload)
        hit = self.cache.get(key)
        if hit is not None:
            return Verdict(True, hit, judge=self.name, cached=True)

        def model(v: Any) -> Any:
            return schema.model_validate(v) if schema is not None else v

        role = Role(name="judge", action=kind, output=JSONReply(schema),
                    messages=lambda _: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                    check=(lambda _, v: check(model(v))) if check else None, extractive=lambda _: local(),
                    result=lambda _, v: convert(model(v)), fallback=None, direct=True,
                    max_tokens=max_tokens or self.max_tokens, temperature=0.0)
        # A fresh recorder per judgement: judges run inside training loops, where one that kept
        # every call would grow without bound; the verdict carries what callers need.
        out = await perform(role, None, llm=self.llm, rec=Recorder(), max_reasks=self.max_reasks)
        if not out.ok:
            self.failures += 1
            return Verdict(False, reason=f"{kind} judge failed: {out.error}", judge=self.name)
        self.cache.put(key, out.value)
        return Verdict(True, out.value, judge=self.name)

    def support(self, claim: str, evidence: str) -> float:
        """Extractive support in [0, 1]: ½ best sentence cos⁺ + ½ content-token coverage."""
        if self.embed is None:
            raise ValueError("the extractive judge needs an embedder (embed=...), e.g. "
                             "deepr.corpus.embed.get_embedder().encode")
        sents = split_sentences(strip_citations(evidence)) or [strip_citations(evidence)]
        sents = [s for s in sents if s.strip()]
        claim = strip_citations(claim)
        if not claim.strip() or not sents:
            return 0.0
        vec = Vectors(self.embed, [claim, *sents])
        emb = float(vec.sim([claim], sents).max())
        lex = coverage(claim, tok(evidence))
        return 0.5 * emb + 0.5 * (lex if lex is not None else emb)

    # -- rubric criteria (002 App. A.1; also J_rub of 000 Eq. 30: 0-4 / 4 is the five levels) --

    async def criterion(self, question: str, response: str, item: RubricItem) -> Verdict:
        """One criterion scored 0–4 and normalised to {0, .25, .5, .75, 1}."""
        evidence = ("\nSupporting evidence: " + " | ".join(item.evidence)) if item.evidence else ""
        payload = [question, response, item.type, item.description, item.evidence]
        return await self.run(
            "rubric", payload,
            local=lambda: round(4 * self.support(_criterion_text(item), response)) / 4,
            prompt=RUBRIC_PROMPT.format(question=question, response=response, kind=item.type,
                                        description=item.description, evidence=evidence),
            schema=_Score04, convert=lambda v: v.score / 4)

    async def rubrics(self, question: str, response: str, items: Sequence[RubricItem]) -> Verdict:
        """Weighted rubric score; fails (with every failing item named) if any item fails."""
        verdicts = await asyncio.gather(*(self.criterion(question, response, r) for r in items))
        bad = [f"{r.id}: {v.reason}" for r, v in zip(items, verdicts) if not v.ok]
        per_item = {r.id: v.value for r, v in zip(items, verdicts)}
        if bad:
            return Verdict(False, per_item, reason="; ".join(bad), judge=self.name)
        return Verdict(True, {"score": rubric_weighted(items, [v.value for v in verdicts]),
                              "items": per_item}, judge=self.name)

class LazyJudge:
    """Base of TRL reward callables whose default judge is the extractive one: the judge (and the
    embedder it needs) is built on the first scored sample, so building a trainer stays cheap.
    Subclasses set ``_judge`` and ``_embed`` (either may be None) in their ``__init__``."""

    _judge: Any = None
    _embed: Any = None

    @property
    def judge(self) -> Any:
        if self._judge is None:
            if self._embed is None:
                from deepr.corpus.embed import get_embedder

                self._embed = get_embedder().encode
            self._judge = Judge(None, self._embed)
        return self._judge


def make_judge(spec: str, gen: Any = None) -> Any:
    """The reward judge: extractive (embeddings) or an LLM spec such as openai:<model>, called with
    ``gen`` (the command's GenDefaults: --max-tokens, --temperature, --top-p, --seed)."""
    from deepr.corpus.embed import get_embedder

    from deepr.llm import get_llm

    return Judge(get_llm(spec, gen=gen), get_embedder().encode)  # extractive: no model, Judge(None)
