"""signals: say early when a GRPO stage cannot learn because its reward carries no signal.

GRPO learns from differences between the rollouts of one prompt (its group): a group whose
rewards are all equal has advantage 0 everywhere and moves nothing but the KL term. When every
group of a step is like that (the reward is 0 for every rollout, say), the step is wasted.

Input: the logs TRL writes each logging step, in particular ``frac_reward_zero_std``, the share
of groups whose reward std is zero (with ``scale_rewards`` group or none; under ``batch``
TRL measures the whole batch, so the share is 1.0 only when every reward of the step is equal,
which still means every group is constant), or, when the stage samples flat groups again
(:mod:`deepr.train.dynamic`), the share of groups still flat after it (left out of the loss:
what the step could not learn from). Output: ``zero_advantage_frac`` added to the same
log row (so metrics.jsonl has it per step), and, after ``patience`` consecutive steps with
fraction 1.0 before any step had signal, a warning on stderr (``mode="warn"``) or the end of
training with ``zero_advantage_stop`` = 1 in the row (``mode="stop"``, the default). Put
``zero_advantage = "warn"`` (or ``"off"``) in the ``deepr grpo --config`` TOML/JSON file to change it.

    deepr grpo --stage planner --model M --data verified.jsonl --out runs/rl-planner
"""

from __future__ import annotations

import sys
from typing import Any, Literal

from deepr.train.dynamic import LEFT_OUT

TRL_KEY = "frac_reward_zero_std"
KEY = "zero_advantage_frac"
STOP_KEY = "zero_advantage_stop"
Mode = Literal["stop", "warn", "off"]


def zero_advantage_message(steps: int, stage: str) -> str:
    return (f"grpo {stage}: the reward was identical for every rollout of every prompt in the first {steps} "
            "step(s) (zero advantage: nothing to learn from). Check that the reward can tell rollouts apart "
            "(e.g. every reward 0 means no rollout passed the format checks), raise --num-generations or the "
            "temperature, or start from an SFT model")


def zero_advantage_callback(mode: Mode = "stop", patience: int = 2, stage: str = "") -> Any:
    """A TrainerCallback; put it BEFORE the callback that writes metrics.jsonl so the row carries
    the fraction (callbacks see one shared logs dict, in list order)."""
    from transformers import TrainerCallback

    class ZeroAdvantageGuard(TrainerCallback):
        def __init__(self) -> None:
            self.streak = 0  # consecutive logged steps with every group constant
            self.had_signal = False
            self.fired = False
            self.history: list[float] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> Any:
            if mode == "off" or not logs or TRL_KEY not in logs:
                return control
            # with dynamic sampling TRL's share averages every sampling of the step; what the
            # step trained on is the share still flat at the end
            frac = float(logs.get(LEFT_OUT, logs[TRL_KEY]))
            logs[KEY] = frac
            self.history.append(frac)
            if frac < 1.0:
                self.had_signal, self.streak = True, 0
                return control
            self.streak += 1
            # Only the opening steps decide: a run that had signal and then converges (every rollout
            # right) is not a broken run.
            if self.had_signal or self.fired or self.streak < patience:
                return control
            self.fired = True
            message = zero_advantage_message(self.streak, stage)
            if mode == "stop":
                logs[STOP_KEY] = 1.0
                control.should_training_stop = True
                message += '; stopping (zero_advantage = "warn" in a --config file trains on anyway)'
            if state.is_world_process_zero:
                print(f"warning: {message}", file=sys.stderr, flush=True)
            return control

    return ZeroAdvantageGuard()
