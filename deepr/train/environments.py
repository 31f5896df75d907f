"""The environments of `deepr grpo`'s rollouts (DecomposeR §3.4.2–3.4.3): what happens between
two model turns, and which reply counts as a plan.

:class:`PlannerEnvironment` runs the search nodes of the policy's first plan G0 and builds the
revision prompt; it decides Valid(G) (Eq. 17) for both plans. :class:`AnswererEnvironment` serves
one prepared record's wave and final prompts. Both build their prompts with the roles ``deepr run``
uses (:mod:`deepr.agent.planner`, :mod:`deepr.agent.answerer`), so RL samples under the same
messages as inference and SFT. The rollout functions that drive them are in
:mod:`deepr.train.rollouts`.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from deepr.agent.answerer import FINAL, WAVE, FinalAsk, WaveAsk, final_inputs, node_evidence
from deepr.evidence.citations import Catalog, Entry, normalize
from deepr.evidence.env import Ctx, RunConfig
from deepr.evidence.plan import validate_plan, waves
from deepr.agent.planner import INITIAL, REVISE, PlanAsk, initial_messages
from deepr.evidence.trace import Tracer
from deepr.rewards.trl_adapters import json_objects
from deepr.roles import judge_reply


class Played(Protocol):
    """What the environment reads of a played episode (:class:`deepr.train.rollouts.Episode`)."""

    prompts: list[list[dict[str, str]]]
    texts: list[str]
    truncated: bool


class PlannerEnvironment:
    """DecomposeR §3.4.2 as a GRPO environment: the policy writes G0, the environment runs G0's
    search nodes on the retriever, the policy writes G1 under the revision prompt, and R_plan
    scores G1 if G1 is valid, else the episode scores 0 (Eq. 17). Nothing is re-asked: a G0 that
    is not a valid plan has no search nodes to run, so the episode ends there with reward 0.

    ``validity`` is Valid(G): ``"paper"`` (default) — the reply holds a JSON plan that keeps the
    typed-DAG rules (:func:`deepr.evidence.plan.validate_plan`); ``"run"`` — what ``deepr run``
    accepts (:func:`deepr.roles.judge_reply`: the role's reply format plus its acceptance checks,
    such as placeholders, echoes, short queries, looped words and fetch lists), a departure from
    the paper that is off unless chosen."""

    def __init__(self, retriever: Any, *, k: int = 5, fetch_limit: int = 4,
                 validity: Literal["paper", "run"] = "paper"):
        if validity not in ("paper", "run"):
            raise ValueError(f"validity {validity!r}: use paper (DecomposeR Eq. 17) or run (deepr run's checks)")
        self.retriever, self.config = retriever, RunConfig(k=k, fetch_limit=fetch_limit)
        self.validity = validity

    def context(self, query: str) -> Ctx:
        from deepr.corpus.tools import ResearchTools

        # llm=None: the policy's turns come from the trainer; every other role runs extractive
        return Ctx(llm=None, tools=ResearchTools(self.retriever, k=self.config.k), config=self.config,
                   tracer=Tracer(query, "dag"))

    def judge(self, role: Any, ask: Any, text: str, messages: list[dict[str, str]]) -> tuple[Any, str | None]:
        """(the plan's value, None) when ``text`` is a valid plan under ``validity``, else (None, why)."""
        if self.validity == "run":
            return judge_reply(role, ask, text, messages)
        return paper_valid(text)

    def next_messages(self, query: str, turn1: str) -> tuple[list[dict[str, str]] | None, dict[str, Any]]:
        """Turn 2's prompt after G0 — the REVISE role's messages over G0's search results — and what
        the environment did; None when G0 is not valid (the episode ends, reward 0)."""
        value, error = self.judge(INITIAL, PlanAsk(None, query), turn1, initial_messages(query))  # type: ignore[arg-type]
        if value is None:
            return None, {"valid0": 0.0, "searches": 0, "error0": error}
        plan = validate_plan(value)[0]
        ctx = self.context(query)
        results = {n.id: ctx.search(n.id, n.query or "") for n in plan.nodes if n.type == "search"}
        ask = PlanAsk(ctx, query, plan, results)
        # the searches that reached the corpus (a blank query is not sent): a served corpus counts the same
        sent = sum(1 for t in ctx.tracer.tools if t["tool"] == "search" and str(t.get("query") or "").strip())
        return REVISE.messages(ask), {"valid0": 1.0, "searches": sent, "ask": ask}

    def scored_plan(self, query: str, ep: Played, info: dict[str, Any] | None) -> tuple[Any, str, str | None]:
        """(plan, where it came from, why it was refused): G1 when it is valid ("revised"), else a
        note R_plan scores 0 ("refused"), whatever G0 was (Eq. 17 rewards the revised graph only)."""
        if info is None:  # turn 1 was cut or the episode had no room left
            why = "the plan was cut at the token limit" if ep.truncated else "no plan was written"
        elif not info["valid0"]:
            why = f"G0 is not a valid plan ({info['error0']}), so there was nothing to search or revise"
        elif len(ep.texts) < 2 or ep.truncated:
            why = "the revision was cut at the token limit" if ep.truncated else "no revision was written"
        else:
            value, why = self.judge(REVISE, info["ask"], ep.texts[1], ep.prompts[1])
            if value is not None:
                return value, "revised", None
        return f"refused: {why}", "refused", why


def paper_valid(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """Valid(G) of DecomposeR Eq. 17: the reply's JSON object with a ``nodes`` list (a thinking
    block or prose around it is ignored) is a typed DAG (:func:`deepr.evidence.plan.validate_plan`).
    A revision's ``fetch`` list stays in the value; it is no part of the graph."""
    found = next((o for o in json_objects(text) if isinstance(o.get("nodes"), list)), None)
    if found is None:
        return None, "the reply holds no JSON object with a 'nodes' list"
    errors = validate_plan({"nodes": found["nodes"]})[1]
    return (found, None) if not errors else (None, "; ".join(errors))


def planner_prompt(query: str) -> list[dict[str, str]]:
    """The planner's turn-1 prompt: the INITIAL role's messages, as ``deepr run`` sends them."""
    return INITIAL.messages(PlanAsk(None, query))  # type: ignore[arg-type]


def rebuild_catalog(entries: dict[str, dict[str, Any]]) -> Catalog:
    cat = Catalog()
    for cid, e in entries.items():
        cat.entries[cid] = Entry(id=cid, **{k: v for k, v in e.items() if k != "id"})
    return cat


class AnswererEnvironment:
    """Serves one prepared record: each wave's and the final turn's prompt, built by the WAVE and
    FINAL roles over the record's catalog (the same messages ``deepr run`` sends)."""

    def __init__(self, record: dict[str, Any]):
        self.record = record
        self.plan, errors = validate_plan(record["plan"])
        if self.plan is None:
            raise ValueError(f"prepared record {record.get('id')}: invalid plan ({'; '.join(errors)})")
        self.waves = waves(self.plan)
        self.ctx = Ctx(None, None, RunConfig(), Tracer(record["query"], "dag"),  # type: ignore[arg-type]
                       catalog=rebuild_catalog(record["catalog"]))
        self.results = {k: list(v) for k, v in record["results"].items()}

    def wave_messages(self, wave: list[str], outputs: dict[str, str]) -> list[dict[str, str]]:
        by_id = {n.id: n for n in self.plan.nodes}
        shown, allowed = {}, {}
        for nid in wave:
            shown[nid], allowed[nid] = node_evidence(self.ctx, self.plan, by_id[nid], self.results, outputs)
        return WAVE.messages(WaveAsk(self.ctx, self.record["query"], self.plan, wave, dict(outputs), [], shown,
                                     allowed))

    def final_messages(self, outputs: dict[str, str]) -> list[dict[str, str]]:
        ans, ids = final_inputs(self.ctx, self.plan, outputs, self.record.get("dropped") or {})
        return FINAL.messages(FinalAsk(self.ctx, self.record["query"], self.plan, dict(outputs), [], ans, ids))

    def first_messages(self) -> list[dict[str, str]]:
        return self.wave_messages(self.waves[0], {}) if self.waves else self.final_messages({})

    def parse_wave(self, wave: list[str], text: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for obj in json_objects(text):
            out.update({k: normalize(v).strip() for k, v in obj.items() if k in wave and isinstance(v, str)})
        return out
