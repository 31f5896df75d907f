"""Rollouts of `deepr grpo` (DecomposeR §3.4.2–3.4.3) as TRL ``rollout_func`` s.

Planner stage: planner turn 1 writes G0 → the environment runs every search node of G0 on
the retriever → planner turn 2 writes the revised G1 under the revision prompt. Answerer stage:
over a prepared record (plan, search results, fetched pages, citation catalog) the model writes
one wave of aggregate nodes per turn, then a last turn writes the ``<answer>``.

Every model turn is sampled under a fresh prompt built by its role declaration
(:mod:`deepr.agent.planner` ``INITIAL`` / ``REVISE``, :mod:`deepr.agent.answerer` ``WAVE`` /
``FINAL``): the same messages ``deepr run`` sends and the SFT examples of ``prune-trajectories``
hold, so RL, SFT and inference train and run the model on one context per turn. Nothing is
re-asked during RL (DecomposeR §3.4.2 has no re-ask): R_plan scores G1 if it is valid, else the
episode scores 0 (Eq. 17; :class:`PlannerEnvironment`). By default every turn is sampled from the
policy being trained. Every turn is trained as its own sample under the
prompt it was sampled from, with its sampling log-probs and the episode's advantage
(:mod:`deepr.train.warp_calls`); TRL scores one placeholder per episode. ``budget`` (TRL's
``max_completion_length``) bounds the model tokens of one episode.

:func:`run_turns` keeps the continuation format (model and environment turns in one completion,
the environment's tokens masked) for the tool-calling agent, which is multi-turn in ``deepr run``
too.

    rollout = make_rollout_func("planner", lookup, budget=8192, env=PlannerEnvironment(retriever))
    warp_trainer_cls()(..., rollout_func=rollout)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal

from deepr.agent.answerer import FINAL, WAVE, FinalAsk, WaveAsk, final_inputs, node_evidence
from deepr.agent.citations import Catalog, Entry, normalize
from deepr.agent.env import Ctx, RunConfig
from deepr.agent.planner import INITIAL, REVISE, PlanAsk, initial_messages
from deepr.agent.trace import Tracer
from deepr.agent.plan import validate_plan, waves
from deepr.rewards.trl_adapters import json_objects, parse_answerer
from deepr.roles import judge_reply
from deepr.train.sampling import Generate, trainer_generate
from deepr.train.step_timing import timed_generate
from deepr.train.warp_calls import Call

__all__ = ["Generate", "trainer_generate"]  # the stages import them here
_A_MARK, _U_MARK = "\x00A\x00", "\x00U\x00"
_RENDERED: ContextVar[dict | None] = ContextVar("deepr_rendered_prompts", default=None)


def prompt_ids(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
    """Token ids of a chat prompt with the assistant generation header, as TRL renders it
    (inside :func:`rendered_once`, each distinct prompt is rendered once)."""
    memo = _RENDERED.get()
    key = (id(tokenizer), json.dumps(list(messages), sort_keys=True, default=str)) if memo is not None else None
    if key is not None and key in memo:
        return list(memo[key])
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    if key is not None:
        memo[key] = ids
    return list(ids)


def rendered_once(rollout_func: Callable[[list[Any], Any], dict]) -> Callable[[list[Any], Any], dict]:
    """``rollout_func`` rendering each distinct chat prompt once per call: a group's rollouts share
    their first prompt, and TRL's placeholder rows repeat it, so without this every prompt was
    rendered and tokenised 2 x num_generations times a step (the largest cost outside the model
    in bench/grpo_overhead.py). Same token ids; nothing is kept between calls."""

    def rollout(prompts: list[Any], trainer: Any) -> dict:
        token = _RENDERED.set({})
        try:
            return rollout_func(prompts, trainer)
        finally:
            _RENDERED.reset(token)

    return rollout


def env_turn_ids(tokenizer: Any, content: str, *, closed: bool) -> list[int]:
    """Tokens between a model turn and the next one: end of the assistant turn (the end token
    itself only when the model did not write it), a user turn with ``content``, and the next
    assistant header. Read off the chat template, so it matches ``deepr run``'s rendering."""
    eos = tokenizer.eos_token
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _A_MARK},
             {"role": "user", "content": _U_MARK}]
    full = tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    start = full.find(_A_MARK) + len(_A_MARK)
    if start < len(_A_MARK) or not eos or full.find(eos, start) < 0:
        raise ValueError("the chat template does not close an assistant turn with the tokenizer's eos token; "
                         "multi-turn rollouts need a template that does (e.g. a Qwen/ChatML template)")
    cut = full.find(eos, start) + len(eos)
    text = ("" if closed else eos) + full[cut:].replace(_U_MARK, content)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class Rollout:
    """One multi-turn rollout: the prompt, then alternating model and environment parts."""

    prompt_ids: list[int]
    parts: list[tuple[list[int], bool, list[float] | None]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # decoded model turns
    env_texts: list[str] = field(default_factory=list)
    done: bool = False
    truncated: bool = False

    @property
    def completion_ids(self) -> list[int]:
        return [t for ids, _, _ in self.parts for t in ids]

    @property
    def env_mask(self) -> list[int]:
        return [int(model) for ids, model, _ in self.parts for _ in ids]

    @property
    def logprobs(self) -> list[float] | None:
        if any(model and lp is None for _, model, lp in self.parts):
            return None
        return [x for ids, model, lp in self.parts for x in (lp if model else [0.0] * len(ids))]

    def used(self) -> int:
        return sum(len(ids) for ids, _, _ in self.parts)


NextMessage = Callable[[int, Rollout], str | None]


def run_turns(prompts: list[list[int]], generate: Generate, next_message: NextMessage, tokenizer: Any,
              *, budget: int, eos_ids: Sequence[int], max_turns: int, turn_cap: int | None = None) -> list[Rollout]:
    """Drive all rollouts turn by turn; ``next_message(i, rollout)`` gives the environment's
    reply after a model turn, or None when rollout ``i`` is finished. ``turn_cap`` bounds one
    model turn (a turn that hits it without its end token ends the rollout, truncated)."""
    rollouts = [Rollout(list(p)) for p in prompts]
    active = list(range(len(rollouts)))
    for turn in range(max_turns):
        seqs = [rollouts[i].prompt_ids + rollouts[i].completion_ids for i in active]
        cap = turn_cap or budget
        new_ids, new_lps = generate(seqs, turn == 0, min(cap, max(budget - rollouts[i].used() for i in active)))
        for j, i in enumerate(active):
            r, room = rollouts[i], min(cap, budget - rollouts[i].used())
            ids = list(new_ids[j])[:max(room, 0)]
            lp = list(new_lps[j])[:max(room, 0)] if new_lps is not None and new_lps[j] is not None else None
            r.truncated = len(new_ids[j]) > room or (len(ids) == room and (not ids or ids[-1] not in eos_ids))
            r.parts.append((ids, True, lp))
            r.texts.append(tokenizer.decode(ids, skip_special_tokens=True))
        still = []
        for i in active:
            r = rollouts[i]
            msg = None if r.truncated or turn == max_turns - 1 else next_message(i, r)
            if msg is None:
                r.done = True
                continue
            closed = bool(r.parts[-1][0]) and r.parts[-1][0][-1] in eos_ids
            env = env_turn_ids(tokenizer, msg, closed=closed)
            if r.used() + len(env) >= budget:  # no room left for the model to answer
                r.done, r.truncated = True, True
                continue
            r.parts.append((env, False, None))
            r.env_texts.append(msg)
            still.append(i)
        if not (active := still):
            break
    return rollouts


# --- turns as separate calls --------------------------------------------------------------------


@dataclass
class Episode:
    """One rollout played as calls: every model turn sampled under its own prompt (``prompts``)."""

    calls: list[Call] = field(default_factory=list)
    prompts: list[list[dict[str, str]]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    truncated: bool = False

    def used(self) -> int:
        return sum(len(c.completion_ids) for c in self.calls)


NextPrompt = Callable[[int, Episode], "list[dict[str, str]] | None"]


def play_calls(first: Sequence[Sequence[dict[str, str]]], generate: Generate, next_prompt: NextPrompt,
               tokenizer: Any, *, budget: int, eos_ids: Sequence[int], max_turns: int,
               turn_cap: int | None = None, group_first: bool = True) -> list[Episode]:
    """Drive all episodes turn by turn, one batched generation per turn. ``next_prompt(i, episode)``
    gives the messages of episode ``i``'s next call, or None when it is finished. ``budget`` bounds
    an episode's model tokens, ``turn_cap`` one call's (a call cut without its end token ends the
    episode, truncated). ``group_first``: the first call samples the group (identical prompts)."""
    eps = [Episode() for _ in first]
    pending = {i: [dict(m) for m in msgs] for i, msgs in enumerate(first)}
    cap = turn_cap or budget
    for turn in range(max_turns):
        if not pending:
            break
        order = list(pending)
        seqs = [prompt_ids(tokenizer, pending[i]) for i in order]
        rooms = [min(cap, budget - eps[i].used()) for i in order]
        new_ids, new_lps = generate(seqs, turn == 0 and group_first, max(rooms))
        after: dict[int, list[dict[str, str]]] = {}
        for j, i in enumerate(order):
            ep, room = eps[i], rooms[j]
            ids = list(new_ids[j])[:room]
            lp = list(new_lps[j])[:room] if new_lps is not None and new_lps[j] is not None else None
            ep.calls.append(Call(seqs[j], ids, lp))
            ep.prompts.append(pending[i])
            ep.texts.append(tokenizer.decode(ids, skip_special_tokens=True))
            ep.truncated = len(new_ids[j]) > room or (len(ids) == room and (not ids or ids[-1] not in eos_ids))
            if ep.truncated or turn == max_turns - 1:
                continue
            msgs = next_prompt(i, ep)
            if msgs is not None and ep.used() >= budget:  # no room left for the model to answer
                ep.truncated = True
            elif msgs is not None:
                after[i] = msgs
        pending = after
    return eps


# --- environments -----------------------------------------------------------------------------


class PlannerEnvironment:
    """DecomposeR §3.4.2 as a GRPO environment: the policy writes G0, the environment runs G0's
    search nodes on the retriever, the policy writes G1 under the revision prompt, and R_plan
    scores G1 if G1 is valid, else the episode scores 0 (Eq. 17). Nothing is re-asked: a G0 that
    is not a valid plan has no search nodes to run, so the episode ends there with reward 0.

    ``validity`` is Valid(G): ``"paper"`` (default) — the reply holds a JSON plan that keeps the
    typed-DAG rules (:func:`deepr.agent.plan.validate_plan`); ``"run"`` — what ``deepr run``
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
        from deepr.llm.extractive import ExtractiveLLM

        return Ctx(ExtractiveLLM(), ResearchTools(self.retriever, k=self.config.k), self.config,
                   Tracer(query, "dag"))

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
        return REVISE.messages(ask), {"valid0": 1.0, "searches": float(len(results)), "ask": ask}

    def scored_plan(self, query: str, ep: Episode, info: dict[str, Any] | None) -> tuple[Any, str, str | None]:
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
    block or prose around it is ignored) is a typed DAG (:func:`deepr.agent.plan.validate_plan`).
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


# --- rollout functions -------------------------------------------------------------------------


def _user_text(prompt: Any) -> str:
    return prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)


def _log(trainer: Any, name: str, values: Sequence[float]) -> None:
    if values and hasattr(trainer, "_log_metric"):
        trainer._log_metric(name, float(sum(values) / len(values)))


def _mask_stats(trainer: Any, rollouts: Sequence[Rollout]) -> None:
    total = sum(len(r.env_mask) for r in rollouts)
    masked = sum(len(r.env_mask) - sum(r.env_mask) for r in rollouts)
    _log(trainer, "rollout/masked_token_share", [masked / total if total else 0.0])
    _log(trainer, "rollout/truncated", [float(r.truncated) for r in rollouts])
    _log(trainer, "rollout/model_turns", [float(len(r.texts)) for r in rollouts])


def call_stats(trainer: Any, episodes: Sequence[Episode]) -> None:
    _log(trainer, "rollout/calls_per_episode", [float(len(e.calls)) for e in episodes])
    _log(trainer, "rollout/trained_tokens_per_episode", [float(e.used()) for e in episodes])
    _log(trainer, "rollout/truncated", [float(e.truncated) for e in episodes])


def planner_rollouts(prompts: Sequence[Any], queries: dict[str, str], env: PlannerEnvironment, generate: Generate,
                     tokenizer: Any, *, budget: int, eos_ids: Sequence[int],
                     turn_cap: int | None = None) -> tuple[list[Episode], dict]:
    """Turn 1 → search → turn 2 for every prompt; returns episodes and per-episode extra columns
    (``plan``: what R_plan scores, see :meth:`PlannerEnvironment.scored_plan`)."""
    infos: dict[int, dict[str, Any]] = {}

    def query_of(i: int) -> str:
        text = _user_text(prompts[i])
        if text not in queries:
            raise KeyError("a prompt the planner stage did not build reached the rollout; build the dataset with "
                           "deepr.train.grpo.planner_dataset")
        return queries[text]

    def reply(i: int, ep: Episode) -> list[dict[str, str]] | None:
        msgs, infos[i] = env.next_messages(query_of(i), ep.texts[0])
        return msgs

    eps = play_calls(list(prompts), generate, reply, tokenizer, budget=budget, eos_ids=eos_ids, max_turns=2,
                     turn_cap=turn_cap)
    scored = [env.scored_plan(query_of(i), e, infos.get(i)) for i, e in enumerate(eps)]
    extra = {"plan": [p for p, _, _ in scored], "plan_source": [src for _, src, _ in scored],
             "refused": [why for _, _, why in scored],
             "initial_valid": [infos.get(i, {}).get("valid0", 0.0) for i in range(len(eps))],
             "turns": [len(e.texts) for e in eps]}
    return eps, extra


def answerer_rollouts(prompts: Sequence[Any], records: dict[str, dict[str, Any]], generate: Generate,
                      tokenizer: Any, *, budget: int, eos_ids: Sequence[int],
                      turn_cap: int | None = None) -> tuple[list[Episode], dict]:
    """Waves then the final turn over prepared records; a wave that yields no node stops the
    episode (later nodes score 0, no answer: DecomposeR's partial credit)."""
    envs = [AnswererEnvironment(records[_user_text(p)]) for p in prompts]
    outputs: list[dict[str, str]] = [{} for _ in prompts]
    failed = [False] * len(prompts)

    def reply(i: int, ep: Episode) -> list[dict[str, str]] | None:
        env, t = envs[i], len(ep.texts) - 1
        if t < len(env.waves):
            got = env.parse_wave(env.waves[t], ep.texts[-1])
            outputs[i].update(got)
            if not got:
                failed[i] = True
                return None
        if t + 1 < len(env.waves):
            return env.wave_messages(env.waves[t + 1], outputs[i])
        return env.final_messages(outputs[i]) if t + 1 == len(env.waves) else None

    max_turns = max(len(e.waves) for e in envs) + 1
    eps = play_calls(list(prompts), generate, reply, tokenizer, budget=budget, eos_ids=eos_ids,
                     max_turns=max_turns, turn_cap=turn_cap)
    answers: list[str | None] = []
    for i, ep in enumerate(eps):
        final = len(ep.texts) == len(envs[i].waves) + 1 and not failed[i]
        answers.append(parse_answerer(ep.texts[-1], envs[i].record["plan"])[1] if final else None)
    extra = {"plan": [e.record["plan"] for e in envs], "node_outputs": outputs, "answer": answers,
             "waves_done": [sum(1 for w in e.waves if all(n in o for n in w)) / max(len(e.waves), 1)
                            for e, o in zip(envs, outputs)]}
    return eps, extra


def log_planner_rollouts(trainer: Any, prompts: Sequence[Any], queries: dict[str, str], episodes: Sequence[Episode],
                         extra: dict[str, Any]) -> None:
    """One line per planner rollout in ``<output_dir>/rollouts.jsonl``: the step, the question, each
    turn's text, which plan R_plan scored and, for a refused one, the executor's reason. A run
    whose rewards are all 0 then says why its plans were refused."""
    from pathlib import Path

    from deepr.io import JsonlAppender

    out = getattr(getattr(trainer, "args", None), "output_dir", None)
    if not out:
        return
    step = getattr(getattr(trainer, "state", None), "global_step", None)
    with JsonlAppender(Path(out) / "rollouts.jsonl", fsync=False) as log:
        for i, ep in enumerate(episodes):
            log.write({"step": step, "query": queries.get(_user_text(prompts[i])), "turns": list(ep.texts),
                       "truncated": ep.truncated, "plan_source": extra["plan_source"][i],
                       "refused": extra["refused"][i]})


def placeholders(trainer: Any, prompts: Sequence[Any], episodes: Sequence[Episode],
                 train_turns: int | None = None) -> dict[str, Any]:
    """What TRL scores: one masked end token per episode; the episodes' calls are what trains
    (``trainer._warp_calls``, read by :func:`deepr.train.warp_calls.call_batch`): all of them, or
    the first ``train_turns`` of each (the reward still reads every turn)."""
    tok = trainer.processing_class
    eos = (list(getattr(trainer, "eos_token_ids", None) or []) or [tok.eos_token_id])[0]
    trainer._warp_calls = [e.calls[:train_turns] if train_turns else e.calls for e in episodes]
    call_stats(trainer, episodes)
    return {"prompt_ids": [prompt_ids(tok, p) for p in prompts], "completion_ids": [[eos] for _ in prompts],
            "logprobs": [[0.0] for _ in prompts], "env_mask": [[0] for _ in prompts]}


def make_rollout_func(stage: str, lookup: dict[str, Any], *, budget: int, env: PlannerEnvironment | None = None,
                      generate_for: Callable[[Any], Generate] | None = None,
                      turn_cap: int | None = None, train_turns: int | None = None,
                      formats: str = "none") -> Callable[[list[Any], Any], dict]:
    """A TRL ``rollout_func`` for ``stage``; ``lookup`` maps a prompt's last user message to its
    query (planner) or prepared record (answerer), since TRL hands the function prompts only.
    ``generate_for(trainer)`` swaps the generator (default: the policy itself, through the trainer's
    own backend). ``formats="schema"`` needs ``generate_for``: the profile's constrained generator
    (:func:`deepr.profiles.small.rollouts.planner_generate`, which ``deepr grpo`` hands in). Train with
    :func:`deepr.train.warp_calls.warp_trainer_cls`."""

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tok = trainer.processing_class
        if generate_for is not None:
            gen = generate_for(trainer)
        elif formats == "schema" and stage == "planner":
            raise ValueError("rollout_formats schema: pass generate_for, the profile's constrained planner "
                             "generator (deepr.profiles.small.rollouts.planner_generate), or set rollout_formats none")
        else:
            gen = trainer_generate(trainer)
        gen = timed_generate(trainer, gen)  # a profile's own generator is sampling time too
        eos_ids = list(getattr(trainer, "eos_token_ids", None) or [tok.eos_token_id])
        if stage == "planner":
            if env is None:
                raise ValueError("the planner stage needs a PlannerEnvironment (env=...)")
            eps, extra = planner_rollouts(prompts, lookup, env, gen, tok, budget=budget, eos_ids=eos_ids,
                                          turn_cap=turn_cap)
            _log(trainer, "rollout/initial_plan_valid", extra["initial_valid"])
            log_planner_rollouts(trainer, prompts, lookup, eps, extra)
            _log(trainer, "rollout/plan_revised", [float(s == "revised") for s in extra["plan_source"]])
        else:
            eps, extra = answerer_rollouts(prompts, lookup, gen, tok, budget=budget, eos_ids=eos_ids,
                                           turn_cap=turn_cap)
            _log(trainer, "rollout/waves_done", extra["waves_done"])
        return {**placeholders(trainer, prompts, eps, train_turns), **extra}

    return rollout_func
