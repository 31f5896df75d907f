"""grpo --stage decor: one shared policy plays DECOR's planner / filter / answerer (001 §4.3–4.4,
App. C).

Input: question–answer JSONL ``{"id", "question", "answers": [str]}``. Every question becomes
three rows, one per role u; each row's G rollouts are whole team episodes of 001 Alg. 1
(planner → retrieve top-k → filter → memory, at most T_max steps, then the answerer), every
role written by the policy. A row's samples are role u's steps of its episode, each under the
prompt ``deepr run --mode decor`` sends that role (its role declaration's messages: the same
context as inference and SFT), all with the row's advantage; the sequence-level ratio of Eq. 5
is taken per step. Reward (Eq. 2–3): R_total^u = −1
when any output of the episode breaks its role's block protocol (the episode stops there), else
α R_team + (1 − α) R_role^u with R_team = λ F1 + (1 − λ) LJ of the team's answer and R_role^u
the role judge's majority verdict over u's steps. Advantages are normalised per (question,
role) group (Eq. 6) by :class:`DecorTrainer`. Loss: sequence-level importance ratio with the
asymmetric clip ε 3e-4 / ε_high 4e-4 (Table 5), lr 2e-6 on a cosine schedule, AdamW β₂ 0.95,
G = 8, T_max 4; DAPO's dynamic sampling resamples (question, role) groups whose rewards are all
equal and leaves the ones still flat out of the loss.

    deepr grpo --stage decor --model runs/sft-decor --data qa.jsonl --out runs/rl-decor
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator

from deepr.agent.decor import ANSWER, ANSWER_SYSTEM, FILTER, FILTER_SYSTEM, PLAN, PLANNER_SYSTEM, DecorAsk, \
    MemoryItem, _STOP, memory_text
from deepr.rewards.decor import ALPHA, LAMBDA, format_ok, role_advantages, role_content
from deepr.rewards.judges import LazyJudge
from deepr.rewards.trl_adapters import log_means
from deepr.train.stage import StageConfig, lookup_row, train_stage

ROLES = ("planner", "filter", "answerer")
# The system prompts of `deepr run --mode decor`; each asks for reasoning in <think> first, the
# protocol the reward checks (001 App. B).
SYSTEMS = {"planner": PLANNER_SYSTEM, "filter": FILTER_SYSTEM, "answerer": ANSWER_SYSTEM}
DECLARED = {"planner": PLAN, "filter": FILTER, "answerer": ANSWER}


class QARecord(BaseModel):
    """One training question with its gold answers."""

    id: str
    question: str = Field(min_length=1)
    answers: list[str] = Field(min_length=1)

    @field_validator("answers", mode="before")
    @classmethod
    def _listify(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class DecorStageConfig(StageConfig):
    """Settings of ``deepr grpo --stage decor`` (defaults: 001 Table 5)."""

    PAPER: ClassVar[dict[str, Any]] = {"learning_rate": 2e-6, "beta": 0.0, "num_generations": 8,
                                       "prompts_per_step": 8, "mini_batch_prompts": 4,
                                       "max_completion_length": 20480, "max_turn_tokens": 4096,
                                       # Eq. 4-5: one ratio per sequence, averaged over sequences; Table 5
                                       # / App. C: AdamW beta2 0.95 with a cosine schedule
                                       "loss_type": "grpo", "lr_scheduler_type": "cosine", "adam_beta2": 0.95,
                                       # Table 5: clip 3e-4 / 4e-4 on a sequence-level ratio (GSPO, Eq. 5)
                                       "epsilon": 3e-4, "epsilon_high": 4e-4, "importance_sampling_level": "sequence"}
    ROLE: ClassVar[str] = "decor"
    stage: Literal["decor"] = Field("decor", description="DECOR planner / filter / answerer team.")
    decor_steps: int = Field(4, ge=1, le=10, description="T_max, most planner/filter steps (Table 5: 4).")
    memory_limit: int = Field(4096, ge=64, description="L_max tokens of memory before condensing.")
    alpha: float = Field(ALPHA, ge=0, le=1, description="Weight of R_team against R_role (Eq. 3: 0.6).")
    lam: float = Field(LAMBDA, ge=0, le=1, description="Weight of F1 against LJ in R_team (Eq. 2: 0.5).")
    dynamic_sampling: int = Field(1, ge=0, le=4, description="DAPO dynamic sampling (001 §4.4): a (question, "
                                  "role) group whose rewards are all equal carries no gradient; the batch is "
                                  "sampled again up to this many times to replace such groups, and groups still "
                                  "flat are left out of the loss. 0 turns it off.")

    @property
    def adapter_roles(self) -> list[str]:
        return ["decor_planner", "decor_filter", "decor_answerer"]  # the roles of `deepr run --mode decor`


def decor_dataset(records: Sequence[QARecord]) -> tuple[list[dict[str, Any]], dict[tuple[str, str], QARecord]]:
    """Rows {id, prompt, role, question, answers} — one per (question, role) — and their lookup."""
    rows, lookup = [], {}
    for rec in records:
        for role in ROLES:
            rows.append({"id": f"{rec.id}:{role}", "prompt": [{"role": "system", "content": SYSTEMS[role]},
                                                              {"role": "user", "content": rec.question}],
                         "role": role, "question": rec.question, "answers": list(rec.answers), "qid": rec.id})
            lookup[(SYSTEMS[role], rec.question)] = rec
    return rows, lookup


def observation(role: str, question: str, ep: Episode, ids: Sequence[str] = (), q: str = "") -> list[dict[str, str]]:
    """What ``role`` is sent: its role declaration's messages, exactly as ``deepr run --mode decor``."""
    if role == "planner":
        ask = DecorAsk(ep.ctx, question, list(ep.memory), list(ep.past))
    elif role == "filter":
        ask = DecorAsk(ep.ctx, q, list(ep.memory), ids=list(ids), question=question)
    else:
        ask = DecorAsk(ep.ctx, question, list(ep.memory))
    return DECLARED[role].messages(ask)


@dataclass
class Episode:
    """One team episode; ``steps`` holds the trained role's (context, output) pairs for its judge."""

    role: str
    rec: QARecord
    ctx: Any
    memory: list[MemoryItem] = field(default_factory=list)
    past: list[str] = field(default_factory=list)
    steps: list[dict[str, str]] = field(default_factory=list)
    answer: str = ""
    format_ok: bool = True
    broken: str = ""  # "<role>: reason" of the first protocol break (the episode stopped there)


class TeamDriver:
    """Plays one episode. :meth:`play` is a generator: it yields each observation of the trained
    role and receives that role's reply; the other roles are written by ``say(role, messages)``."""

    def __init__(self, ep: Episode, say: Callable[[str, list[dict[str, str]]], str], steps: int, memory_limit: int):
        self.ep, self.say, self.steps, self.limit = ep, say, steps, memory_limit

    def _check(self, role: str, out: str) -> str | None:
        ok, why = format_ok(role, out)
        if role == self.ep.role:
            self.ep.format_ok = self.ep.format_ok and ok
        if not ok:
            self.ep.broken = f"{role}: {why}"
            return None
        return role_content(role, out)

    def _turn(self, role: str, msgs: list[dict[str, str]], context: str) -> Generator[Any, str, str | None]:
        if role == self.ep.role:
            out = yield msgs
            self.ep.steps.append({"context": context, "output": out})
        else:
            out = self.say(role, msgs)
        return self._check(role, out)

    def play(self) -> Generator[list[dict[str, str]], str, None]:
        from deepr.extractive import decor as ex
        from deepr.evidence.citations import normalize
        from deepr.evidence.extract import approx_tokens

        ep, question = self.ep, self.ep.rec.question
        for t in range(1, self.steps + 1):
            plan = yield from self._turn("planner", observation("planner", question, ep), "\n".join(ep.past))
            if plan is None:
                return  # a broken protocol truncates the episode (001 §4.3)
            if _STOP.match(plan):
                break
            q = " ".join(plan.split())
            ep.past.append(q)
            ids = ep.ctx.search(f"S{t}", q)
            obs = observation("filter", question, ep, ids, q)
            ev = yield from self._turn("filter", obs, obs[-1]["content"])
            if ev is None:
                return
            if ep.memory and approx_tokens(memory_text(ep.memory)) + approx_tokens(ev) > self.limit:
                facts = ex.condense_facts(ep.ctx, question, ep.memory, self.limit // 2)
                ep.memory = [MemoryItem("condensed facts", " ".join(facts))]
            ep.memory.append(MemoryItem(q, normalize(ev).strip()))
        answer = yield from self._turn("answerer", observation("answerer", question, ep), memory_text(ep.memory))
        ep.answer = normalize(answer or "").strip()


def _send(gen: Generator[Any, str, None], reply: str | None) -> list[dict[str, str]] | None:
    """Advance an episode; the trained role's next prompt, or None when the episode ended."""
    try:
        return next(gen) if reply is None else gen.send(reply)
    except StopIteration:
        return None


def decor_rollouts(prompts: Sequence[Any], lookup: dict[tuple[str, str], QARecord], make_ctx: Callable[[str], Any],
                   generate: Any, tokenizer: Any, *, budget: int, eos_ids: Sequence[int], steps: int = 4,
                   memory_limit: int = 4096, turn_cap: int | None = None) -> tuple[list[Any], dict[str, list]]:
    """One team episode per row; its samples are the row's role's steps, each under the prompt that
    role is sent in ``deepr run --mode decor``. A row whose role never got to speak (the team
    stopped first) has no samples (an empty :class:`~deepr.train.rollouts.Episode`)."""
    from deepr.train.rollouts import Episode as Played, play_calls, prompt_ids

    def say(role: str, messages: list[dict[str, str]]) -> str:
        ids, _ = generate([prompt_ids(tokenizer, messages)], False, turn_cap or budget)
        return tokenizer.decode(ids[0], skip_special_tokens=True)

    eps, gens, firsts = [], [], []
    for p in prompts:
        rec = lookup_row(lookup, (p[0]["content"], p[-1]["content"]), "decor")
        role = next(r for r in ROLES if SYSTEMS[r] == p[0]["content"])
        ep = Episode(role, rec, make_ctx(rec.question))
        gen = TeamDriver(ep, say, steps, memory_limit).play()
        eps.append(ep), gens.append(gen), firsts.append(_send(gen, None))
    live = [i for i, f in enumerate(firsts) if f is not None]
    # Every row's first prompt is its own episode's (filter / answerer rows differ within a group, and
    # silent rows drop out), so no call is generated as G samples of one prompt (group_first=False):
    # vLLM server mode would keep every G-th prompt and pair completions with the wrong rows.
    done = play_calls([firsts[i] for i in live], generate, lambda j, e: _send(gens[live[j]], e.texts[-1]),
                      tokenizer, budget=budget, eos_ids=eos_ids, max_turns=steps + 1, turn_cap=turn_cap,
                      group_first=False) if live else []
    played: list[Any] = []
    for i, ep in enumerate(eps):
        if i in live:
            e = done[live.index(i)]
            if len(ep.steps) < len(e.texts):  # the last call (cut or at the turn limit) still counts
                _send(gens[i], e.texts[-1])
            played.append(e)
        else:
            played.append(Played())
    extra = {"team_answer": [ep.answer for ep in eps], "role_steps": [ep.steps for ep in eps],
             "format_valid": [ep.format_ok for ep in eps], "broken": [ep.broken for ep in eps],
             "spoke": [i in live for i in range(len(eps))]}
    return played, extra


def make_decor_rollout_func(lookup: dict[tuple[str, str], QARecord], make_ctx: Callable[[str], Any], *,
                            budget: int, steps: int = 4, memory_limit: int = 4096, turn_cap: int | None = None,
                            generate_for: Callable[[Any], Any] | None = None) -> Callable[[list[Any], Any], dict]:
    from deepr.train.rollouts import _log, placeholders
    from deepr.train.sampling import policy_generate

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tok = trainer.processing_class
        eos_ids = list(getattr(trainer, "eos_token_ids", None) or [tok.eos_token_id])
        gen = policy_generate(trainer, generate_for)
        played, extra = decor_rollouts(prompts, lookup, make_ctx, gen, tok,
                                       budget=budget, eos_ids=eos_ids, steps=steps, memory_limit=memory_limit,
                                       turn_cap=turn_cap)
        _log(trainer, "rollout/role_spoke", [float(s) for s in extra["spoke"]])
        _log(trainer, "rollout/episode_broken", [float(bool(b)) for b in extra["broken"]])
        return {**placeholders(trainer, prompts, played), **extra}

    return rollout_func


class DecorRewardFn(LazyJudge):
    """R_total^u per row (Eq. 3); logs R_team, F1, LJ, R_role, the format rate and R_total per role."""

    __name__ = "decor_reward"

    def __init__(self, judge: Any = None, embed: Any = None, *, alpha: float = ALPHA, lam: float = LAMBDA):
        self._judge, self._embed, self.alpha, self.lam = judge, embed, alpha, lam

    async def score(self, role: str, question: str, answers: list[str], team_answer: str,
                    steps: list[dict[str, str]], fmt_ok: bool, broken: str = "") -> dict[str, Any] | None:
        """Every term of one row's reward; None when a judge call failed (no reward, not 0)."""
        from deepr.rewards.decor import f1_score, llm_judge, r_team, r_total, role_judge
        from deepr.text import strip_citations

        team_answer = strip_citations(team_answer or "").strip()
        if broken or not fmt_ok:
            # 001 §4.3: a protocol break anywhere gives the whole trajectory −1 and ends it, so every
            # role's row of that episode gets it (also a role the break silenced)
            return {"R_total": -1.0, "format_ok": 0.0, "role": role}
        if not steps:
            return None  # the role never spoke in this episode
        f1 = f1_score(team_answer, answers) if team_answer else 0.0
        lj = await llm_judge(question, team_answer, answers, self.judge) if team_answer else None
        verdicts = await asyncio.gather(*(role_judge(self.judge, role, question, s["context"], s["output"],
                                                     answers[0]) for s in steps))
        if (lj is not None and not lj.ok) or not all(v.ok for v in verdicts):
            return None
        team = r_team(f1, lj.value if lj is not None else 0.0, self.lam)
        role_r = 1 if sum(v.value for v in verdicts) > 0 else -1  # the majority of the role's steps
        return {"R_total": r_total(True, team, role_r, self.alpha), "R_team": team, "F1": f1,
                "LJ": lj.value if lj is not None else 0.0, "R_role": float(role_r), "format_ok": 1.0, "role": role}

    async def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **cols: Any) -> list[float | None]:
        n = len(completions)
        broken = cols.get("broken") or [""] * n
        rows = await asyncio.gather(*(self.score(cols["role"][i], cols["question"][i], list(cols["answers"][i]),
                                                 cols["team_answer"][i], cols["role_steps"][i],
                                                 cols["format_valid"][i], broken[i]) for i in range(n)))
        done = [r for r in rows if r]
        log_means(cols, "decor", done, ("R_total", "R_team", "F1", "LJ", "R_role", "format_ok"))
        for role in ROLES:
            log_means(cols, f"decor/{role}", [r for r in done if r["role"] == role], ("R_total",))
        return [r["R_total"] if r else None for r in rows]


def role_group_advantages(rewards: Sequence[float], keys: Sequence[tuple[Hashable, str]]) -> list[float]:
    """Eq. 6 over (question, role) groups; unscored rows (NaN) get 0 and stay out of μ and σ."""
    keep = [i for i, r in enumerate(rewards) if not math.isnan(r)]
    adv = role_advantages([rewards[i] for i in keep], [keys[i][1] for i in keep], [keys[i][0] for i in keep])
    out = [0.0] * len(rewards)
    for i, a in zip(keep, adv):
        out[i] = a
    return out


def _decor_trainer_cls(dynamic_sampling: int = 0) -> type:
    from trl import GRPOTrainer

    from deepr.train.dynamic import Scored, resample_flat, skip_empty_updates, weighted_rewards
    from deepr.train.warp_calls import call_batch, per_rollout_loss

    class DecorTrainer(GRPOTrainer):
        """GRPOTrainer whose advantages are Eq. 6: normalised within each (question, role) group,
        with the population σ, whatever the batch layout (TRL's own is per prompt, unbiased σ);
        it trains on each row's role steps, one sample per step under its own prompt
        (:func:`~deepr.train.warp_calls.call_batch`); with dynamic sampling, flat groups are
        sampled again and, if still flat, left out. loss_type "grpo" is Eq. 4 per trajectory: each
        row's steps (one role's trajectory) count once, token-weighted among themselves
        (:func:`~deepr.train.warp_calls.per_rollout_loss`)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            per_rollout_loss(self)
            if dynamic_sampling:
                skip_empty_updates(self)

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            from accelerate.utils import gather_object

            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self._decor_keys = gather_object([(inp["qid"], inp["role"]) for inp in inputs])
            self._decor_rewards = rewards
            return rewards

        def _role_scored(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            episodes, self._warp_calls = self._warp_calls, None
            total = weighted_rewards(self, self._decor_rewards)
            adv = role_group_advantages(total, self._decor_keys)
            n = len(out["advantages"])
            start = self.accelerator.process_index * n
            return Scored(episodes, adv[start:start + n], total, self._decor_keys)

        def _generate_and_score_completions(self, inputs):
            episodes, adv = resample_flat(self, lambda: self._role_scored(inputs), dynamic_sampling)
            self._decor_advantages = list(adv)
            return call_batch(self, episodes, adv)

    return DecorTrainer


def context_factory(retriever: Any, k: int = 5) -> Callable[[str], Any]:
    from deepr.evidence.env import Ctx, RunConfig
    from deepr.evidence.trace import Tracer
    from deepr.corpus.tools import ResearchTools

    # llm=None: the policy's turns come from the trainer; every other role runs extractive
    return lambda q: Ctx(llm=None, tools=ResearchTools(retriever, k=k), config=RunConfig(mode="decor", k=k),
                         tracer=Tracer(q, "decor"))


def train_decor(config: DecorStageConfig, records: Sequence[QARecord], retriever: Any, *, reward_fn: Any = None,
                generate_for: Any = None, callbacks: Sequence[Any] = ()) -> Any:
    rows, lookup = decor_dataset(records)
    rollout = make_decor_rollout_func(lookup, context_factory(retriever, config.k), budget=config.max_completion_length,
                                      steps=config.decor_steps, memory_limit=config.memory_limit,
                                      turn_cap=config.max_turn_tokens, generate_for=generate_for)
    reward = reward_fn or DecorRewardFn(alpha=config.alpha, lam=config.lam)
    return train_stage(config, rows, rollout, reward, trainer_cls=_decor_trainer_cls(config.dynamic_sampling),
                       callbacks=callbacks)
