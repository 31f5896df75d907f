"""prune-trajectories: teacher trajectories -> turn-level SFT and RL examples (AgentCPM-Report §2.3.1; DecomposeR §3.4.1).

Input: :class:`~deepr.records.Trajectory` records written by ``deepr run --record`` (dag or
warp mode). Output: :class:`~deepr.records.ChatExample` records split by query into an SFT
set and a held-out RL set, plus rejects (one per dropped trajectory, with its reason) and
counts for the summary table. Four steps, in order:

1. validity: every planner plan passes :func:`deepr.evidence.plan.validate_plan`, every answerer turn
   parses, no turn failed; otherwise the whole trajectory is dropped (DecomposeR §3.4.1);
2. best-draft pruning (warp): score drafts D_1..D_N (rubric reward, or the judge's report
   quality when the query has no rubrics), cut at the best one and relabel the deepening
   decision taken on it TERMINATE; when the best is the last draft, on which the run took no
   decision, a TERMINATE turn is added (AgentCPM-Report §2.3.1, App. A.4);
3. one chat example per model turn, tagged with its role and action;
4. split by query, then action-balanced resampling toward target ratios (App. A.5).

    deepr prune-trajectories trajectories.jsonl --out-dir data/ --target-ratios plan=0.3,terminate=0.2
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deepr.llm.parse import JSONExtractError, extract_json
from deepr.evidence.plan import nodes_of, validate_plan, waves
from deepr.records import ChatExample, Plan, Reject, Trajectory, Turn

STAGE = "prune-trajectories"
PLANNER_ACTIONS = ("plan", "revise")
ANSWERER_ACTIONS = ("wave", "final")
DECISIONS = ("expand", "terminate")  # warp deepening turns: the ones pruning relabels

# (trajectory, draft text) -> report-level score; raises DraftScoreError when it cannot score.
ScoreFn = Callable[[Trajectory, str], float]


class DraftScoreError(ValueError):
    """A draft that cannot be scored (no rubrics, judge failure); the message says why."""


class PruneConfig(BaseModel):
    """Settings of ``prune-trajectories``; validated on construction."""

    model_config = ConfigDict(extra="forbid")

    target_ratios: dict[str, float] | None = Field(
        None, description="Wanted share of each action after balancing, e.g. {'plan': 0.3, 'terminate': 0.2}. "
        "Actions not named share what is left in proportion to their natural counts. None gives every "
        "action present the same share; an empty dict keeps the natural distribution (no balancing).")
    max_upsample: float = Field(
        3.0, ge=1.0, description="Most copies balancing may make of one example; the split shrinks rather "
        "than repeat a rare action more often than this.")
    total: int | None = Field(
        None, ge=1, description="Examples per split after balancing (an upper bound); default: as many as before.")
    heldout: float = Field(0.1, ge=0.0, lt=1.0, description="Fraction of queries whose examples go to rl.jsonl.")
    seed: int = Field(0, description="Seed of the query split and of the balancing draws (same seed, same files).")
    prune_drafts: bool = Field(True, description="Cut warp trajectories at their best-scoring draft.")

    @field_validator("target_ratios", mode="before")
    @classmethod
    def _parse_text(cls, v: Any) -> Any:
        return parse_ratios(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check_ratios(self) -> PruneConfig:
        for action, r in (self.target_ratios or {}).items():
            if not 0.0 <= r <= 1.0:
                raise ValueError(f"target ratio of {action!r} is {r}; ratios lie between 0 and 1")
        if sum((self.target_ratios or {}).values()) > 1.0 + 1e-6:
            raise ValueError(f"target ratios sum to {sum(self.target_ratios.values()):.3f}; they must sum to at "
                             "most 1 (unnamed actions share the rest)")
        return self


def parse_ratios(text: str) -> dict[str, float] | None:
    """``"plan=0.3,terminate=0.2"`` -> dict; ``"uniform"`` -> None; ``"none"`` -> {} (no balancing)."""
    text = text.strip()
    if text.lower() == "uniform":
        return None
    if text.lower() in ("", "none", "natural"):
        return {}
    out: dict[str, float] = {}
    for item in text.split(","):
        action, _, value = item.partition("=")
        try:
            out[action.strip() or _bad(item)] = float(value)
        except ValueError:
            raise ValueError(f"--target-ratios item {item!r}: expected action=number, e.g. plan=0.3") from None
    return out


def _bad(item: str) -> str:
    raise ValueError(f"--target-ratios item {item!r}: expected action=number, e.g. plan=0.3")


# --- 1. validity --------------------------------------------------------------------------


def plan_errors(completion: str) -> tuple[Plan | None, list[str]]:
    """Parse a planner completion and validate the plan it carries."""
    try:
        obj = extract_json(completion, "object")
    except JSONExtractError as e:
        return None, [str(e)]
    return validate_plan(obj)


def answerer_errors(turn: Turn, plan: Plan | None) -> list[str]:
    """Does an answerer turn parse? A wave maps exactly its wave's aggregate ids (from the
    plan and the turn's ``wave`` number) to non-empty text; a final turn has a non-empty
    answer body, read with the agent's own parser."""
    from deepr.roles import body_of

    if turn.action == "final":
        return [] if body_of(turn.completion, "answer") else ["final answer is empty"]
    try:
        outputs = extract_json(turn.completion, "object")
    except JSONExtractError as e:
        return [f"wave reply: {e}"]
    wave_no = (turn.model_extra or {}).get("wave")
    expected = _wave_ids(plan, wave_no)
    errors = [f"wave {wave_no} misses node {nid}" for nid in expected or () if nid not in outputs]
    allowed = set(expected) if expected else {n.id for n in nodes_of(plan, "aggregate")} if plan else None
    for nid, text in outputs.items():
        if allowed is not None and nid not in allowed:
            errors.append(f"wave writes {nid!r}, which is not an aggregate node of this wave")
        if not isinstance(text, str) or not text.strip():
            errors.append(f"wave output of {nid!r} is not non-empty text")
    return errors or ([] if outputs else ["wave reply is an empty object; it must map node ids to text"])


def _wave_ids(plan: Plan | None, wave_no: Any) -> list[str] | None:
    if plan is None or not isinstance(wave_no, int):
        return None
    all_waves = waves(plan)
    return all_waves[wave_no - 1] if 1 <= wave_no <= len(all_waves) else None


def warp_errors(turn: Turn) -> list[str]:
    """A warp write has a non-empty <content> body; every other warp action is a JSON object
    whose ``name`` (when given) matches the turn's action tag."""
    from deepr.roles import body_of

    if turn.action == "write":
        return [] if body_of(turn.completion, "content") else ["section body is empty"]
    try:
        obj = extract_json(turn.completion, "object")
    except JSONExtractError as e:
        return [str(e)]
    name = obj.get("name", turn.action)
    return [] if name == turn.action else [f"the action JSON names {name!r} but the turn is {turn.action!r}"]


def validity_errors(traj: Trajectory) -> tuple[str, str] | None:
    """First reason to drop ``traj`` as (code, detail), or None when every turn is usable."""
    if not traj.turns:
        return "empty_trajectory", "the trajectory has no model turns"
    plan: Plan | None = None
    for i, turn in enumerate(traj.turns, start=1):
        where = f"turn {i} ({turn.role}/{turn.action})"
        if not turn.ok:
            return "failed_turn", f"{where} is marked failed (ok=false)"
        if not turn.messages:
            return "empty_prompt", f"{where} has no prompt messages"
        if not turn.completion.strip():
            return "empty_completion", f"{where} has an empty completion"
        if turn.role == "planner" and turn.action in PLANNER_ACTIONS:
            plan, errors = plan_errors(turn.completion)
            if errors:
                return "invalid_plan", f"{where}: {'; '.join(errors[:3])}"
        elif turn.role == "answerer" and turn.action in ANSWERER_ACTIONS:
            errors = answerer_errors(turn, plan)
            if errors:
                return "unparseable_answer", f"{where}: {'; '.join(errors[:3])}"
        elif turn.role == "warp" and (errors := warp_errors(turn)):
            return "unparseable_action", f"{where}: {'; '.join(errors[:3])}"
    return None


# --- 2. best-draft pruning ----------------------------------------------------------------


def terminate_reply(decision_completion: str) -> str:
    """The TERMINATE decision written in the shape the teacher used for its decisions."""
    try:
        obj = extract_json(decision_completion, "object")
    except JSONExtractError:
        obj = {}
    key = next((k for k in ("action", "decision", "name") if isinstance(obj.get(k), str)), "action")
    return json.dumps({key: "terminate"})


def decision_turns(traj: Trajectory) -> list[tuple[int, int]]:
    """(turn index, draft index) of every deepening decision. A turn may name its draft in an
    extra ``draft`` field; otherwise the k-th decision is taken on draft k."""
    out = []
    for k, i in enumerate(i for i, t in enumerate(traj.turns) if t.action in DECISIONS):
        extra = traj.turns[i].model_extra or {}
        out.append((i, int(extra["draft"]) if isinstance(extra.get("draft"), int) else k))
    return out


def prune_to_best_draft(traj: Trajectory, score_fn: ScoreFn) -> tuple[Trajectory | None, dict[str, Any]]:
    """Cut ``traj`` at its best draft (earliest on ties) and relabel that decision TERMINATE.

    Returns (pruned trajectory or None, info); info carries ``scores``, ``best`` and, on a
    drop, ``reason`` = (code, detail).
    """
    decisions = decision_turns(traj)
    if len(traj.drafts) < 2 or not decisions:
        return traj, {"pruned": False}
    if any(not 0 <= d < len(traj.drafts) for _, d in decisions):
        return None, {"reason": ("drafts_mismatch", f"{len(decisions)} deepening decisions refer to drafts "
                                 f"beyond the {len(traj.drafts)} recorded")}
    try:
        scores = [score_fn(traj, d) for d in traj.drafts]
    except DraftScoreError as e:
        return None, {"reason": ("unscorable_drafts", str(e))}
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    info = {"pruned": False, "scores": scores, "best": best, "turns_removed": 0, "relabeled": False}
    cut = next((ti for ti, d in decisions if d == best), None)
    if cut is None:  # the best draft is the last one and the run ended before deciding on it
        added = terminate_turn(traj, decisions, best)
        info["terminate_added"] = added is not None
        if added is None:
            return traj, info
        info["relabeled"] = info["pruned"] = True
        return traj.model_copy(update={"turns": [*traj.turns, added], "report": traj.drafts[best]}), info
    old = traj.turns[cut]
    turns = list(traj.turns[:cut])
    if old.action != "terminate":
        old = old.model_copy(update={"action": "terminate", "completion": terminate_reply(old.completion),
                                     "relabeled": True})
        info["relabeled"] = True
    turns.append(old)
    info["turns_removed"] = len(traj.turns) - len(turns)
    info["pruned"] = info["relabeled"] or info["turns_removed"] > 0
    pruned = traj.model_copy(update={"turns": turns, "drafts": traj.drafts[: best + 1],
                                     "report": traj.drafts[best]})
    return pruned, info


_EXPANDABLE = re.compile(r"^(Sections that may be expanded:)[ \t]*(.*)$", re.M)


def _expandable_after(listed: str, decision: str, max_levels: int) -> str:
    """The expandable list after ``decision`` expanded one of ``listed``: the expanded section is no
    longer a leaf, its new subsections are when they stay within ``max_levels`` (as Outline does)."""
    names = [x.strip() for x in listed.split(",") if x.strip()]
    try:
        obj = extract_json(decision, "object")
    except JSONExtractError:
        return ", ".join(names)
    pos, subs = str(obj.get("position", "")), obj.get("subsections")
    if pos not in names or not isinstance(subs, list):
        return ", ".join(names)
    level = pos.removeprefix("section-").count(".") + 2
    kids = [f"{pos}.{k}" for k in range(1, len(subs) + 1)] if level < max_levels else []
    return ", ".join(n for n in [*names, *kids] if n != pos)


def terminate_turn(traj: Trajectory, decisions: Sequence[tuple[int, int]], best: int) -> Turn | None:
    """A TERMINATE decision on the last draft, which the run never asked for (it stopped at its
    expansion limit). Its prompt is the latest deepening prompt with that draft and the expandable
    list it would have shown; None when the prompt cannot be rebuilt or nothing could be expanded."""
    from deepr.evidence.env import RunConfig

    ti, d = max(decisions, key=lambda p: p[1])
    src = unforce(traj.turns[ti])
    msgs = [dict(m) for m in src.messages]
    u = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=None)
    old = traj.drafts[d]
    if u is None or not old or old not in msgs[u]["content"]:
        return None
    text = msgs[u]["content"].replace(old, traj.drafts[best])
    m = _EXPANDABLE.search(text)
    if m:
        left = _expandable_after(m.group(2), src.completion, RunConfig().max_levels)
        if not left:
            return None  # the agent would not have been asked: no section could be expanded
        text = text[:m.start(2)] + left + text[m.end(2):]
    msgs[u] = {**msgs[u], "content": text}
    return src.model_copy(update={"messages": msgs, "action": "terminate", "ok": True, "draft": best,
                                  "completion": terminate_reply(src.completion), "relabeled": True,
                                  "synthesized": True})


def unforce(turn: Turn) -> Turn:
    """A forced expansion's prompt told the teacher it may not stop; a kept example must read
    like a free decision, so that instruction is taken out of its prompt."""
    if not (turn.model_extra or {}).get("forced"):
        return turn
    from deepr.agent.warp import FORCED

    msgs = [{**m, "content": str(m.get("content", "")).replace(FORCED, "")} for m in turn.messages]
    return turn.model_copy(update={"messages": msgs, "forced": False, "unforced": True})


def judge_scorer(make_judge: Callable[[], Any]) -> ScoreFn:
    """Report-level score of a draft from a :class:`~deepr.rewards.judges.Judge` (LLM or extractive),
    built on first use so a run without scorable drafts loads no model: R_rubric when the
    trajectory has rubrics, else the judge's four report-quality criteria (AgentCPM-Report App. A.6.2,
    :mod:`deepr.rewards.report_quality`)."""
    from deepr.llm.base import run_sync
    from deepr.rewards.report_quality import report_score

    judge: list[Any] = []

    def score(traj: Trajectory, draft: str) -> float:
        judge or judge.append(make_judge())
        out = run_sync(report_score(traj.query, draft, traj.rubrics, judge[0]))
        if out["R"] is None:
            raise DraftScoreError(f"the judge could not score a draft: {out.get('failure') or 'no reason given'}")
        return float(out["R"])

    return score


# --- 3. turn-level examples -----------------------------------------------------------------


def query_id(traj: Trajectory) -> str:
    """The id the split groups by: a recorded ``query_id`` or a hash of the normalised query,
    so dag and warp runs of the same question land on the same side."""
    given = (traj.model_extra or {}).get("query_id")
    if isinstance(given, str) and given:
        return given
    norm = " ".join(traj.query.lower().split())
    return "q-" + hashlib.sha1(norm.encode("utf-8")).hexdigest()[:12]


def turn_examples(traj: Trajectory) -> list[ChatExample]:
    """One example per model turn: its prompt messages (forced-expansion wording removed) plus
    the completion as the assistant reply."""
    qid = query_id(traj)
    turns = [unforce(t) for t in traj.turns]
    return [ChatExample(id=f"{traj.id}:t{i}", role=t.role, action=t.action, query_id=qid,
                        messages=[*t.messages, {"role": "assistant", "content": t.completion}],
                        traj_id=traj.id, turn=i, mode=traj.mode,
                        relabeled=bool((t.model_extra or {}).get("relabeled")))
            for i, t in enumerate(turns)]


# --- 4. split and action-balanced sampling --------------------------------------------------


def split_by_query(examples: Sequence[ChatExample], heldout: float, seed: int
                   ) -> tuple[list[ChatExample], list[ChatExample]]:
    """(sft, rl): round(heldout * #queries) queries, chosen by a seeded hash, go to rl."""
    qids = sorted({e.query_id for e in examples},
                  key=lambda q: hashlib.sha1(f"{seed}:{q}".encode()).hexdigest())
    rl_ids = set(qids[: round(heldout * len(qids))])
    return ([e for e in examples if e.query_id not in rl_ids], [e for e in examples if e.query_id in rl_ids])


def resolve_ratios(counts: Counter, targets: dict[str, float] | None) -> dict[str, float]:
    """Target share per present action: named ones as given, the rest sharing what is left in
    proportion to their counts; renormalised to sum to 1."""
    present = {a: n for a, n in counts.items() if n > 0}
    if targets is None:
        return {a: 1.0 / len(present) for a in present}
    named = {a: r for a, r in targets.items() if a in present}
    rest = {a: n for a, n in present.items() if a not in named}
    left = max(0.0, 1.0 - sum(named.values()))
    shares = dict(named)
    shares.update({a: left * n / sum(rest.values()) for a, n in rest.items()})
    total = sum(shares.values())
    if total <= 0:
        raise ValueError("target ratios leave every present action at 0; give at least one a positive share")
    return {a: s / total for a, s in shares.items()}


def balance(examples: Sequence[ChatExample], config: PruneConfig, split: str) -> list[ChatExample]:
    """Resample ``examples`` per action toward the target ratios, never repeating one example
    more than ``max_upsample`` times; extra copies get ids ``<id>~<k>``."""
    if config.target_ratios == {} or not examples:
        return list(examples)
    by_action: dict[str, list[tuple[int, ChatExample]]] = {}
    for pos, e in sorted(enumerate(examples), key=lambda p: p[1].id):
        by_action.setdefault(e.action, []).append((pos, e))
    ratios = resolve_ratios(Counter({a: len(v) for a, v in by_action.items()}), config.target_ratios)
    size = min([config.total or len(examples)]
               + [int(len(by_action[a]) * config.max_upsample / r) for a, r in ratios.items() if r > 0])
    picks: list[tuple[int, int, ChatExample]] = []
    for action, pool in by_action.items():
        want = round(ratios[action] * size)
        rng = random.Random(f"{config.seed}:{split}:{action}")
        copies, extra = divmod(want, len(pool))
        picks += [(pos, c, e) for c in range(copies) for pos, e in pool]
        picks += [(pos, copies, e) for pos, e in rng.sample(pool, extra)]
    # Input order is kept (copies right after their original) so files stay easy to read.
    picks.sort(key=lambda p: p[:2])
    return [e if c == 0 else e.model_copy(update={"id": f"{e.id}~{c}"}) for _, c, e in picks]


# --- the stage ----------------------------------------------------------------------------


def prune_trajectories(trajs: Sequence[Trajectory], config: PruneConfig, score_fn: ScoreFn
                       ) -> tuple[dict[str, list[ChatExample]], list[Reject], dict[str, Any]]:
    """Run the four steps; returns ({"sft": [...], "rl": [...]}, rejects, stats). ``score_fn``
    scores warp drafts (e.g. :func:`judge_scorer`)."""
    rejects: list[Reject] = []
    dropped: Counter = Counter()
    kept: list[Trajectory] = []
    pruning = Counter(trajectories_cut=0, turns_removed=0, relabeled_terminate=0)

    def drop(t: Trajectory, code: str, detail: str) -> None:
        dropped[code] += 1
        rejects.append(Reject(id=t.id, stage=STAGE, reason=f"{code}: {detail}", code=code,
                              record={"query": t.query, "mode": t.mode, "turns": len(t.turns)}))

    for t in trajs:
        bad = validity_errors(t)
        if bad:
            drop(t, *bad)
            continue
        if config.prune_drafts and t.mode == "warp" and len(t.drafts) > 1:
            pruned, info = prune_to_best_draft(t, score_fn)
            if pruned is None:
                drop(t, *info["reason"])
                continue
            t = pruned
            pruning["trajectories_cut"] += int(info.get("pruned", False))
            pruning["turns_removed"] += info.get("turns_removed", 0)
            pruning["relabeled_terminate"] += int(info.get("relabeled", False))
        kept.append(t)
    examples = [e for t in kept for e in turn_examples(t)]
    sft, rl = split_by_query(examples, config.heldout, config.seed)
    out = {"sft": balance(sft, config, "sft"), "rl": balance(rl, config, "rl")}
    stats = {
        "trajectories": len(trajs), "kept": len(kept), "dropped": dict(sorted(dropped.items())),
        **dict(pruning),
        "queries": {"sft": len({e.query_id for e in sft}), "rl": len({e.query_id for e in rl})},
        "actions_before": {"sft": dict(Counter(e.action for e in sft)), "rl": dict(Counter(e.action for e in rl))},
        "actions_after": {k: dict(Counter(e.action for e in v)) for k, v in out.items()},
    }
    return out, rejects, stats
