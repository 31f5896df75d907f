"""`deepr eval`: metrics over reports, plans and short answers (and the rewards of the papers).

Inputs (one of):
- a JSONL of records with an ``id``: plan records ``{"plan", "rubrics"}``, answer records
  ``{"plan", "node_outputs", "answer", "rubrics"}``, short answers ``{"prediction",
  "answers"}``, reports ``{"report" | "article" | "completion", "query", "citations"}``;
- a ``deepr run`` sidecar (``report.json``, records.RunTrace) or a folder of them (each
  next to its report.md); the item id is the sidecar's path without ``.json``.
References: ``--rubrics`` (QRPair-like rows, joined by id, else by question text),
``--gold`` (``{"id", "answers"}``), RACE's criteria and reference files.
Output: one records.Score per item (every component as a flat field, failures with
reasons), a summary (mean, std, n, failures per metric) and an optional HTML page.

``support`` checks every cited claim against the text it cites (deepr.agent.support):
entailment by the ``--judge-llm`` model when one is given, word overlap otherwise.

    deepr eval reports.jsonl --metric rubric,citation --rubrics verified.jsonl --out scores.jsonl
    deepr eval runs/ --metric support --out support.jsonl
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field, field_validator

from deepr.eval.benchmarks import recall_scores, searched_docids
from deepr.records import Record, RunTrace, Score
from deepr.rewards.answer_reward import score_answer
from deepr.rewards.decor import exact_match, f1_score, llm_judge, r_team
from deepr.rewards.fact import fact_check, source_text
from deepr.rewards.judges import Judge, RewardInputError
from deepr.rewards.plan_reward import PlanReward, plan_reward, plan_rewards, plan_structure
from deepr.rewards.race import RaceTask, drop_reference_lists, find_task, race_score
from deepr.rewards import rubric_reward as rr
from deepr.text import Embed, report_prose, squad_normalize

METRICS = ("rubric", "citation", "format", "search", "composite", "plan_reward", "answer_reward",
           "em", "f1", "lj", "team", "structure", "race", "fact", "support", "recall")
JUDGED = {"rubric", "citation", "composite", "answer_reward", "lj", "team", "race", "fact", "support"}
OVERLAP_ONLY = {"support"}  # with the extractive judge these need no embedder
EMBEDDED = {"plan_reward", "answer_reward"}


class EvalConfig(BaseModel):
    """Resolved settings of one `deepr eval` run (goes into the provenance sidecar)."""

    metrics: list[str] = Field(description="metrics to compute, in order; see deepr.eval.evaluate.METRICS")
    judge: str = Field("extractive", description="judge backend spec (--judge-llm)")
    limit: int | None = Field(None, ge=1, description="score at most this many items")
    concurrency: int = Field(8, ge=1, description="items scored concurrently")

    @field_validator("metrics")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if m not in METRICS]
        if bad or not v:
            raise ValueError(f"unknown metric(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(METRICS)}")
        return list(dict.fromkeys(v))


class EvalRecord(Record):
    """A JSONL input row: only ``id`` is required (benchmark files use integer ids, kept as
    text); the fields a metric needs are checked by that metric."""

    @field_validator("id", mode="before")
    @classmethod
    def _int_ids(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


@dataclass
class EvalItem:
    id: str
    query: str = ""
    report: str = ""
    completion: str | None = None
    prediction: str | None = None
    answers: list[str] | None = None
    plan: Any = None
    node_outputs: dict[str, str | None] | None = None
    answer: str | None = None
    rubrics: list[dict] | None = None
    citations: dict[str, Any] = field(default_factory=dict)
    tool_calls: int | None = None
    where: str = ""
    # Fields the input actually carried: an absent field is a failure, an empty one is scored
    # (an empty prediction or report scores 0, so saying nothing cannot raise a mean).
    present: frozenset[str] = frozenset()
    searched: list[str] | None = None  # document ids the run's searches returned (recall)
    query_id: str | None = None  # the benchmark's question id (qrels are keyed by it)
    raw_report: str = ""  # before reference lists are dropped (FACT reads DRB's numbered URL list)
    from_run: bool = False  # a deepr run sidecar: the run owed an answer, so none is an empty one


RUBRIC_METRICS = ("rubric", "composite", "plan_reward", "answer_reward")
GOLD_METRICS = ("em", "f1", "lj", "team")


def missing_inputs(metrics: Sequence[str], items: Sequence["EvalItem"], ctx: "EvalContext") -> list[str]:
    """One line per group of requested metrics whose input neither an item nor a reference file
    gives: such a run would only record the same failure on every item."""
    problems = []
    want = [m for m in metrics if m in RUBRIC_METRICS]
    if want and not (ctx.rubrics[0] or any(it.rubrics for it in items)):
        problems.append(f"--metric {','.join(want)} scores against rubric items, and there are none: no item "
                        "carries 'rubrics' and --rubrics was not given (pass --rubrics verified.jsonl)")
    want = [m for m in metrics if m in GOLD_METRICS]
    if want and not (ctx.gold[0] or any(it.answers for it in items)):
        problems.append(f"--metric {','.join(want)} compares with gold answers, and there are none: no item "
                        "carries 'answers' and --gold was not given (pass --gold gold.jsonl)")
    if "recall" in metrics and ctx.qrels is None:
        problems.append("--metric recall compares with relevance judgements: pass --qrels FILE (TREC qrels)")
    if "race" in metrics and ctx.race_tasks is None:
        problems.append("--metric race needs DeepResearch Bench's criteria and reference reports: "
                        "pass --race-criteria and --race-reference")
    return problems


class MetricFailure(Exception):
    """A metric that cannot be computed for one item; recorded in Score.failures."""


def _text(v: Any) -> str:
    return v if isinstance(v, str) else ""


_SHAPES = {"citations": (dict, "an object {id: {doc_id, title, text, url}} or {id: text}"),
           "node_outputs": (dict, "an object {node id: text}"), "answers": ((list, str), "a list of strings"),
           "rubrics": (list, "a list of rubric items")}


def _check_shapes(rec: dict, where: str) -> None:
    for name, (kind, what) in _SHAPES.items():
        if rec.get(name) is not None and not isinstance(rec[name], kind):
            raise ValueError(f"{where} field '{name}': expected {what}, got {type(rec[name]).__name__}")
    if isinstance(rec.get("answers"), list) and not all(isinstance(a, str) for a in rec["answers"]):
        raise ValueError(f"{where} field 'answers': every gold answer must be a string")
    outs = rec.get("node_outputs") or {}
    bad = [k for k, v in outs.items() if v is not None and not isinstance(v, str)]
    if bad:
        raise ValueError(f"{where} field 'node_outputs': values must be text or null (node {bad[0]})")


def item_from_record(rec: dict, where: str) -> EvalItem:
    """An item from one input row; a field of the wrong JSON type is a clear error here."""
    _check_shapes(rec, where)

    completion = rec.get("completion") if isinstance(rec.get("completion"), str) else None
    report = _text(rec.get("report")) or _text(rec.get("article")) or (
        rr.answer_text(completion) if completion else "") or _text(rec.get("answer"))
    answers = rec.get("answers")
    present = {k for k in ("prediction", "completion", "plan", "node_outputs")
               if isinstance(rec.get(k), (str, dict, list))}
    if any(isinstance(rec.get(k), str) for k in ("report", "article", "completion", "answer")):
        present.add("report")
    if "answer" in rec:  # null is an answer that failed to parse (partial credit), not a missing field
        present.add("answer")
    return EvalItem(
        id=str(rec["id"]), where=where,
        query=_text(rec.get("query")) or _text(rec.get("question")) or _text(rec.get("prompt")),
        report=drop_reference_lists(report), completion=completion, raw_report=report,
        prediction=rec.get("prediction") if isinstance(rec.get("prediction"), str) else None,
        answers=[answers] if isinstance(answers, str) else answers, plan=rec.get("plan"),
        node_outputs=rec.get("node_outputs"), answer=rec.get("answer") if "answer" in rec else None,
        rubrics=rec.get("rubrics"), citations=rec.get("citations") or {},
        tool_calls=rec.get("tool_calls") if isinstance(rec.get("tool_calls"), int) else None,
        searched=[str(d) for d in rec["retrieved_docids"]] if isinstance(rec.get("retrieved_docids"), list) else None,
        query_id=str(rec["query_id"]) if rec.get("query_id") is not None else None, present=frozenset(present))


def item_from_trace(trace: RunTrace, item_id: str, md_text: str = "", where: str = "") -> EvalItem:
    """An item from a deepr run sidecar; the report is the trace's, else the .md next to it.
    ``plans`` entries may wrap the graph ({"turn", "plan": {...}}): the last graph is scored."""
    graphs = [p.get("plan", p) for p in trace.plans if isinstance(p.get("plan", p), dict)]
    extra = trace.model_extra or {}  # dag runs also record node_outputs and the final answer
    outs = extra.get("node_outputs")
    return EvalItem(id=item_id, query=trace.query, report=drop_reference_lists(trace.report or md_text),
                    plan=graphs[-1] if graphs else None, answer=_text(extra.get("answer")) or None,
                    node_outputs=outs if isinstance(outs, dict) else None,
                    citations={k: c.model_dump() for k, c in trace.citations.items()},
                    tool_calls=sum(1 for t in trace.tools if not t.get("error") and t.get("ok", True)), where=where,
                    from_run=True, searched=searched_docids(trace.model_dump()),
                    query_id=str(extra["query_id"]) if extra.get("query_id") is not None else None,
                    present=frozenset({"report", "answer"} | ({"plan"} if graphs else set())
                                      | ({"node_outputs"} if isinstance(outs, dict) else set())))


@dataclass
class EvalContext:
    judge: Judge | None = None
    embed: Embed | None = None
    rubrics: tuple[dict, dict] = ({}, {})
    gold: tuple[dict, dict] = ({}, {})
    race_tasks: dict[str, RaceTask] | None = None
    qrels: dict[str, dict[str, int]] | None = None  # TREC qrels: {query id: {doc id: relevance}}
    pages: Any = None  # deepr.search page reader for FACT on reports that cite URLs
    # R_plan of the chunk being scored, computed in one call (keyed by id() of the item)
    plan_batch: dict[int, PlanReward] = field(default_factory=dict)

    def lookup(self, refs: tuple[dict, dict], item: EvalItem) -> dict | None:
        return refs[0].get(item.id) or (refs[1].get(squad_normalize(item.query)) if item.query else None)

    def need_rubrics(self, item: EvalItem) -> tuple[str, list]:
        if item.rubrics:
            return item.query, item.rubrics
        row = self.lookup(self.rubrics, item)
        if row is None:
            raise MetricFailure(f"no rubrics for item {item.id}: none inline and none in --rubrics "
                                "with this id or question")
        return item.query or row.get("question") or "", row["rubrics"]

    def need_gold(self, item: EvalItem) -> list[str]:
        if item.answers:
            return item.answers
        row = self.lookup(self.gold, item)
        if row is None:
            raise MetricFailure(f"no gold answers for item {item.id}: add 'answers' or pass --gold")
        g = row.get("answers") or row.get("answer")
        return [g] if isinstance(g, str) else list(g)

    def need_judge(self) -> Judge:
        if self.judge is None:
            raise MetricFailure("this metric needs a judge; none was configured")
        return self.judge


def store_texts(citations: Mapping[str, Any]) -> dict[str, str]:
    """{citation id: source text} from a sidecar's or record's ``citations``."""
    return {k: t for k in citations if (t := source_text(citations, k)) is not None}


def _require(value: Any, what: str, item: EvalItem) -> Any:
    """``value`` unless it is absent; an empty string or object is a value (it scores 0)."""
    if value is None:
        raise MetricFailure(f"item {item.id} has no {what}")
    return value


def _report(item: EvalItem) -> str:
    if "report" not in item.present:
        raise MetricFailure(f"item {item.id} has no report (field 'report', 'article', 'completion' or 'answer'); "
                            "an empty string is scored as an empty report")
    return item.report


async def _rubric(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    question, rubrics = ctx.need_rubrics(item)
    r = await rr.rubric_score(question, _report(item), rubrics, ctx.need_judge())
    if r.get("failure"):
        raise MetricFailure(r["failure"])
    return {"rubric": r["R_rubric"], "rubric_items": r.get("items", {}),
            **({"rubric_note": r["note"]} if r.get("note") else {})}


async def _citation(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    # the report's frame (question, notes, plan table, references) holds no claims to score
    c = await rr.citation_reward(item.query, report_prose(_report(item)), store_texts(item.citations),
                                 ctx.need_judge())
    if c.failure:
        raise MetricFailure(c.failure)
    f = c.fmt
    return {"R_cite": c.R_cite, "F1_mean": c.F1_mean, "R_fmt": f["R_fmt"], "cite_v": f["v"], "cite_m": f["m"],
            "cite_d": f["d"], "cite_n": f["n"], "cite_span": f["span"], "cite_uniformity": f["uniformity"],
            "cite_center": f["center"], "cite_unknown_ids": f["unknown_ids"], "citation_claims": c.claims,
            **({"citation_note": "; ".join(c.notes)} if c.notes else {})}


async def _format(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    return rr.r_format(_require(item.completion, "raw agent completion (field 'completion')", item))


async def _search(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    n = item.tool_calls if item.tool_calls is not None else rr.tool_calls(
        _require(item.completion, "tool-call count (sidecar 'tools' or a 'completion')", item))[0]
    return {"R_search": rr.r_search(n), "tool_calls": n}


async def _composite(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    parts = {**await _format(item, ctx), **await _search(item, ctx), **await _rubric(item, ctx),
             **await _citation(item, ctx)}
    parts["composite"] = (rr.W_RUBRIC * parts["rubric"] + rr.W_FORMAT * parts["R_format"]
                          + rr.W_CITE * parts["R_cite"] + rr.W_SEARCH * parts["R_search"])
    return parts


async def _plan_reward(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    r = ctx.plan_batch.pop(id(item), None)
    if r is None:
        _, rubrics = ctx.need_rubrics(item)
        r = plan_reward(_require(item.plan, "'plan'", item), rubrics, ctx.embed)
    out = r.as_dict()
    out["plan_errors"] = out.pop("errors")
    return out


async def _answer_reward(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    question, rubrics = ctx.need_rubrics(item)
    outputs = _require(item.node_outputs, "'node_outputs' ({node id: text})", item)
    if "answer" not in item.present:
        raise MetricFailure(f"item {item.id} has no 'answer' (give null for an answer that failed to parse)")
    r = await score_answer(_require(item.plan, "'plan'", item), outputs, item.answer, rubrics, ctx.embed,
                           ctx.need_judge(), question=question or None)
    if r.failure:
        raise MetricFailure(r.failure)
    out = r.as_dict()
    out.pop("failure")
    for k in ("valid", "errors", "notes"):  # prefixed: plan_reward writes its own "valid"
        out[f"answer_{k}"] = out.pop(k)
    return out


def _prediction(item: EvalItem) -> str:
    """The short answer; "" is an answer that says nothing (scores 0), absence is a failure —
    except from a ``deepr run`` sidecar, where the run was asked for an answer: one it did not
    write (empty, null or missing) scores 0 and counts in the mean."""
    if item.prediction is not None:
        return item.prediction
    if isinstance(item.answer, str):
        return item.answer
    if item.from_run:
        return ""
    raise MetricFailure(f"item {item.id} has no 'prediction'")


async def _em(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    return {"em": exact_match(_prediction(item), ctx.need_gold(item))}


async def _f1(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    return {"f1": f1_score(_prediction(item), ctx.need_gold(item))}


async def _lj(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    pred, gold = _prediction(item), ctx.need_gold(item)
    if not pred.strip():
        return {"lj": 0.0}  # nothing said is never equivalent to a gold answer: no judge needed
    v = await llm_judge(item.query, pred, gold, ctx.need_judge())
    if not v.ok:
        raise MetricFailure(v.reason)
    return {"lj": v.value}


async def _team(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    f1, lj = (await _f1(item, ctx))["f1"], (await _lj(item, ctx))["lj"]
    return {"f1": f1, "lj": lj, "R_team": r_team(f1, lj)}


async def _structure(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    if item.plan is None and "report" not in item.present:
        raise MetricFailure(f"item {item.id} has neither a plan nor a report")
    out = plan_structure(item.plan) if item.plan is not None else {}
    if "report" in item.present:
        docs = {k: (v.get("doc_id", k) if isinstance(v, dict) else k) for k, v in item.citations.items()}
        out.update(rr.report_structure(item.report, docs))
    return out


async def _race(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    if ctx.race_tasks is None:
        raise MetricFailure("race needs the benchmark files: pass --race-criteria and --race-reference")
    task = find_task(ctx.race_tasks, item.id, item.query)
    if task is None:
        raise MetricFailure(f"no RACE task with id {item.id} or this prompt in --race-criteria")
    r = await race_score(task, _report(item), ctx.need_judge())
    if r.failure:
        raise MetricFailure(r.failure)
    return {"race": r.score, "race_T": r.T, "race_R": r.R, **{f"race_{d}": v for d, v in r.dims.items()},
            "race_target_avg": r.target_avg, "race_reference_avg": r.reference_avg,
            **({"race_notes": r.notes} if r.notes else {})}


async def _fact(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    report, r = _report(item), None  # an absent report is a failure before any page is fetched
    if ctx.pages is not None and not store_texts(item.citations):
        from deepr.rewards.fact import fact_check_web

        r = await fact_check_web(item.raw_report, ctx.need_judge(), ctx.pages)
    if r is None:
        r = await fact_check(report, item.citations, ctx.need_judge())
    if r.failure:
        raise MetricFailure(r.failure)
    return {"fact_accuracy": r.accuracy, "fact_supported": r.supported, "fact_unsupported": r.unsupported,
            "fact_unknown": r.unknown, "fact_pairs": [vars(p) for p in r.pairs],
            **({"fact_unfetched": r.unfetched} if r.unfetched else {})}


def _support_judge(judge: Judge) -> Any:
    """Entailment by the judge model through the judge's cache; None: the overlap check."""
    from deepr.agent import support as sp
    from deepr.extractive.support import overlap_verdict

    if judge.llm is None:  # the extractive judge would only repeat the overlap check
        return None

    async def ask(question: str, claim: str, sources: str) -> tuple[dict | None, str | None]:
        v = await judge.run("support", [question, claim, sources], prompt=sp.PROMPT.format(
            question=question or "(not given)", claim=claim, sources=sources), schema=sp.SupportReply,
            local=lambda: overlap_verdict(claim, sources),
            convert=lambda r: {"verdict": r.verdict, "reason": r.unsupported_part}, max_tokens=160)
        return (v.value, None) if v.ok else (None, v.reason)

    return ask


async def _support(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    from deepr.agent.support import check_support

    judge = _support_judge(ctx.judge) if ctx.judge is not None else None
    r = await check_support(_report(item), store_texts(item.citations), question=item.query, judge=judge,
                            judge_name=ctx.judge.name if judge else "")
    d = r.as_dict()
    return {"support": d["support"], "support_unsupported": d["unsupported"], "support_partial": d["partial"],
            "support_unchecked": d["unchecked"], "support_claims": d["claims"], "support_by": d["checked_by"],
            "support_unsupported_claims": d["unsupported_claims"]}


async def _recall(item: EvalItem, ctx: EvalContext) -> dict[str, Any]:
    if ctx.qrels is None:
        raise MetricFailure("recall needs --qrels")
    try:
        return recall_scores(ctx.qrels, item.query_id or item.id, item.citations, item.report, item.searched)
    except LookupError as e:
        raise MetricFailure(str(e)) from None


METRIC_FUNCS = {"rubric": _rubric, "citation": _citation, "format": _format, "search": _search,
                "composite": _composite, "plan_reward": _plan_reward, "answer_reward": _answer_reward,
                "em": _em, "f1": _f1, "lj": _lj, "team": _team, "structure": _structure, "race": _race,
                "fact": _fact, "support": _support, "recall": _recall}


async def score_item(item: EvalItem, metrics: Sequence[str], ctx: EvalContext) -> Score:
    """Every requested metric of one item; a metric that cannot be computed is a failure."""
    fields: dict[str, Any] = {}
    failures: dict[str, str] = {}
    for m in metrics:
        try:
            fields.update(await METRIC_FUNCS[m](item, ctx))
        except RewardInputError as e:
            failures[m] = str(e)
        except MetricFailure as e:
            failures[m] = str(e) or f"{m} could not be computed"
    if ctx.judge is not None and JUDGED & set(metrics):
        fields["judge"] = ctx.judge.name
    return Score(id=item.id, failures=failures, metrics=list(metrics), **fields)


async def evaluate(items: Sequence[EvalItem], metrics: Sequence[str], ctx: EvalContext, *,
                   sink: Callable[[Score], None], concurrency: int = 8,
                   progress: Callable[[int], None] | None = None) -> int:
    """Score items ``concurrency`` at a time; each finished chunk goes to ``sink`` in input order."""
    import asyncio

    done = 0
    for start in range(0, len(items), concurrency):
        chunk = items[start:start + concurrency]
        if "plan_reward" in metrics:
            ctx.plan_batch = _batch_plan_rewards(chunk, ctx)
        for score in await asyncio.gather(*(score_item(it, metrics, ctx) for it in chunk)):
            sink(score)
            done += 1
        if progress:
            progress(len(chunk))
    return done


def _batch_plan_rewards(chunk: Sequence[EvalItem], ctx: EvalContext) -> dict[int, PlanReward]:
    """R_plan of a chunk's items in ONE embed call: a plan's few new texts alone cannot fill a
    forward pass, so one call per plan ran at 2.4x the uncached speed against 4x for a batch
    (docs/benchmarks.md, docs/scaling.md). Items that lack a plan or rubrics are left to the
    per-item path, which reports what is missing; so is the whole chunk if one item's rubrics
    are unusable (plan_rewards raises for the batch, the per-item path names the item)."""
    pairs = []
    for it in chunk:
        try:
            rubrics = ctx.need_rubrics(it)[1]
        except MetricFailure:
            continue
        if it.plan is not None:
            pairs.append((it, rubrics))
    if len(pairs) < 2 or ctx.embed is None:
        return {}
    try:
        scores = plan_rewards([(it.plan, rubrics) for it, rubrics in pairs], ctx.embed)
    except (RewardInputError, ValueError):
        return {}
    return {id(it): r for (it, _), r in zip(pairs, scores)}


def needs(metrics: Sequence[str], extractive_judge: bool) -> bool:
    """Whether this run needs the sentence embedder."""
    return bool(EMBEDDED & set(metrics)) or (extractive_judge and bool((JUDGED - OVERLAP_ONLY) & set(metrics)))
