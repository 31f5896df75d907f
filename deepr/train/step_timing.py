"""Where a GRPO step's time goes: per-step phase timings in every row of ``metrics.jsonl``.

Every stage's trainer is built with :func:`timed_trainer_cls` around its class and the
:class:`StepClock` callback, so each logged row carries (seconds, mean over the steps the row
covers):

- ``time/step``: one optimiser step, from the callback's ``on_step_begin`` to ``on_step_end``
  (rollouts, rewards, every micro-batch's forward and backward, the optimiser);
- ``time/generate``: the policy's sampling (TRL's ``_generate_single_turn``, or the rollout's own
  generator, e.g. constrained planner turns);
- ``time/environment``: the rollout function outside sampling (search and retrieval, building the
  next turn's messages, tokenising prompts, parsing replies);
- ``time/reward``: the reward functions (TRL's ``_calculate_rewards``, judges included);
- ``time/forward``: the model's log-prob forward passes (old / reference / policy);
- ``time/backward``: the rest of each micro-batch's ``training_step``: the backward pass;
- ``time/optimizer``: ``optimizer.step()``;
- ``time/loss``: the loss arithmetic around the policy's forward pass (``compute_loss``);
- ``time/score``: the scoring step's own work (padding, advantages, gathering, metric sums);
- ``time/other``: what is left of the step (the training loop, callbacks, gradient clipping);
- ``time/outside_model_share``: (environment + reward + loss + score + other) / step, the share of
  the step outside model compute (sampling, forward, backward, optimiser).

A step that reuses buffered rollouts (``steps_per_generation`` > gradient accumulation) has no
generation, environment or reward time. Phases nest (a generator call inside the rollout
function): time goes to the innermost open phase, so the parts never sum to more than the step.
Phases are entered by one thread at a time (the training loop, or a helper thread it waits on).

    deepr grpo --stage planner ...   # then: jq '."time/outside_model_share"' runs/rl-planner/metrics.jsonl
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

PHASES = ("generate", "environment", "reward", "forward", "backward", "optimizer", "loss", "score")
MODEL = ("generate", "forward", "backward", "optimizer")  # model compute; the rest is the step's overhead


class PhaseClock:
    """Exclusive phase timer: seconds go to the innermost open phase."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []
        self._since = self._t0 = 0.0

    def enter(self, name: str) -> None:
        now = time.perf_counter()
        if self._stack:
            self.totals[self._stack[-1]] += now - self._since
        self._stack.append(name)
        self._since = now

    def leave(self, name: str) -> None:
        now = time.perf_counter()
        if not self._stack or self._stack[-1] != name:  # a phase left out of order: drop the stack's state
            self._stack.clear()
            return
        self.totals[self._stack.pop()] += now - self._since
        self._since = now

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.leave(name)

    def begin_step(self) -> None:
        """A new optimiser step: phase totals start from zero."""
        self.totals.clear()
        self._t0 = time.perf_counter()

    def end_step(self) -> dict[str, float]:
        """The step's ``time/*`` row (see :func:`step_row`)."""
        return step_row(self.totals, time.perf_counter() - self._t0)


def step_row(totals: dict[str, float], step: float) -> dict[str, float]:
    """One step's ``time/*`` entries from the phase totals and the step's wall time."""
    row = {f"time/{p}": totals.get(p, 0.0) for p in PHASES}
    row["time/step"] = step
    row["time/other"] = max(0.0, step - sum(totals.get(p, 0.0) for p in PHASES))
    model = sum(totals.get(p, 0.0) for p in MODEL)
    row["time/outside_model_share"] = max(0.0, step - model) / step if step > 0 else 0.0
    return row


def step_clock(clock: PhaseClock) -> Any:
    """A TrainerCallback that times each optimiser step and adds the mean ``time/*`` of the steps a
    log row covers to that row (place it before the callback that writes metrics.jsonl)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.open = False
            self.pending: list[dict[str, float]] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.begin_step()
            self.open = True

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.enter("optimizer")

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.leave("optimizer")

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.open:
                self.pending.append(clock.end_step())
            self.open = False

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            if logs is None or not self.pending or "loss" not in logs:  # training rows only
                return
            for key in self.pending[0]:
                logs[key] = sum(r[key] for r in self.pending) / len(self.pending)
            self.pending.clear()

    return StepClock()


def timed_rollout(clock: PhaseClock, rollout_func: Callable | None) -> Callable | None:
    """The rollout function with its time counted as ``environment`` (sampling inside it nests)."""
    if rollout_func is None:
        return None

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        with clock.phase("environment"):
            return rollout_func(prompts, trainer)

    return rollout


def timed_generate(trainer: Any, generate: Callable) -> Callable:
    """A rollout generator counted as ``generate`` on ``trainer``'s clock (when it has one)."""
    clock = getattr(trainer, "_deepr_clock", None)
    if clock is None:
        return generate

    def gen(*args: Any, **kw: Any) -> Any:
        with clock.phase("generate"):
            return generate(*args, **kw)

    return gen


def timed_trainer_cls(base: type, clock: PhaseClock) -> type:
    """``base`` (a GRPOTrainer class) with its sampling, rewards, forward, loss, backward and scoring
    timed on ``clock``; behaviour unchanged."""

    def timed(name: str, phase: str) -> Callable:
        inner = getattr(base, name)

        def method(self: Any, *args: Any, **kw: Any) -> Any:
            with clock.phase(phase):
                return inner(self, *args, **kw)

        method.__name__ = name
        return method

    names = {"_generate_single_turn": "generate", "_calculate_rewards": "reward", "training_step": "backward",
             "_get_per_token_logps_and_entropies": "forward", "compute_loss": "loss", "_prepare_inputs": "score"}
    body = {n: timed(n, p) for n, p in names.items()}
    body["_deepr_clock"] = clock
    # the same name: logs and checks that name the trainer class keep reading it
    return type(base.__name__, (base,), {**body, "__qualname__": base.__qualname__})
