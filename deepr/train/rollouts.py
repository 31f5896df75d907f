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
episode scores 0 (Eq. 17; :class:`~deepr.train.environments.PlannerEnvironment`). By default every turn is sampled from the
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
from typing import Any

from deepr.rewards.trl_adapters import parse_answerer
from deepr.train.environments import AnswererEnvironment, PlannerEnvironment
from deepr.train.sampling import Generate, policy_generate, trainer_generate
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
    in docs/benchmarks.md: training step phases). Same token ids; nothing is kept between calls."""

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
             "turns": [len(e.texts) for e in eps],
             "searches": [infos.get(i, {}).get("searches", 0) for i in range(len(eps))]}
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
    turn's text, which plan R_plan scored and, for a refused one, the executor's reason, and how many
    searches G0 sent to the corpus. A run whose rewards are all 0 then says why its plans were
    refused; a shared retrieval server's count can be checked against the searches logged."""
    from pathlib import Path

    from deepr.io import JsonlAppender
    from deepr.train.runs import ROLLOUTS

    out = getattr(getattr(trainer, "args", None), "output_dir", None)
    if not out:
        return
    step = getattr(getattr(trainer, "state", None), "global_step", None)
    with JsonlAppender(Path(out) / ROLLOUTS, fsync=False) as log:
        for i, ep in enumerate(episodes):
            log.write({"step": step, "query": queries.get(_user_text(prompts[i])), "turns": list(ep.texts),
                       "truncated": ep.truncated, "plan_source": extra["plan_source"][i],
                       "refused": extra["refused"][i], "searches": extra["searches"][i]})


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
        if generate_for is None and formats == "schema" and stage == "planner":
            raise ValueError("rollout_formats schema: pass generate_for, the profile's constrained planner "
                             "generator (deepr.profiles.small.rollouts.planner_generate), or set rollout_formats none")
        gen = policy_generate(trainer, generate_for)
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
