"""Dynamic sampling (DECOR §4.4, taken from DAPO): a group whose rewards are all equal has zero
advantage and carries no policy gradient. The trainer samples the step's prompts again, keeps the
groups that now vary, and leaves the groups still flat out of the loss (they would move only the
KL term and the optimiser's moments).

The DECOR stage trains with it (``dynamic_sampling`` 1 by default, as its paper); the planner and
answerer stages may turn it on (``dynamic_sampling`` in ``deepr grpo --config``); DecomposeR itself
does not use it (docs/faithfulness.md). Each step logs, as shares of the step's groups:

- ``dynamic/flat_first``: groups flat at the first sampling (what the step would have trained on);
- ``dynamic/flat_left_out``: groups still flat after the re-samplings, left out of the loss; the
  zero-advantage share :mod:`deepr.train.signals` reports when this is present;
- ``dynamic/samplings``: how many times the step's prompts were sampled (1 when nothing was flat);
- ``dynamic/update_skipped``: 1 in a step whose every group was left out. Its gradient is zero, and
  AdamW would still move the weights along its momentum, so the optimiser step is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

FIRST, LEFT_OUT, SAMPLINGS = "dynamic/flat_first", "dynamic/flat_left_out", "dynamic/samplings"
SKIPPED = "dynamic/update_skipped"


class Scored(NamedTuple):
    """One sampling of the step: this process's episodes and advantages, and every process's row
    rewards and group keys (as gathered; this process's rows are its slice of them)."""

    episodes: list[Any]
    advantages: list[float]
    rewards: list[float]
    keys: list[Any]


def _key(k: Any) -> Hashable:
    return tuple(k) if isinstance(k, list) else k  # gather_object hands tuples back as lists


def flat_groups(rewards: Sequence[float], keys: Sequence[Any]) -> set[Hashable]:
    """Groups with no spread among their scored (non-NaN) rewards: zero advantage, no gradient."""
    by: dict[Hashable, list[float]] = {}
    for r, k in zip(rewards, keys):
        by.setdefault(_key(k), [])
        if not math.isnan(r):
            by[_key(k)].append(r)
    return {k for k, v in by.items() if len(v) < 2 or max(v) - min(v) < 1e-9}


def weighted_rewards(trainer: Any, per_func: Any) -> list[float]:
    """Each row's reward as TRL sums it (the reward functions' weighted sum; NaN when no function
    scored the row), from the gathered ``rewards_per_func`` of ``_calculate_rewards``."""
    import torch

    per = per_func * trainer.reward_weights.to(per_func.device).unsqueeze(0)
    return torch.where(torch.isnan(per_func).all(dim=1), torch.nan, per.nansum(dim=1)).tolist()


def merge_rows(a: Sequence[Any], b: Sequence[Any], take_b: Sequence[bool]) -> list[Any]:
    """Row i of ``b`` where ``take_b[i]``, else of ``a`` (two samplings of the same inputs)."""
    return [y if t else x for x, y, t in zip(a, b, take_b)]


def resample_flat(trainer: Any, score: Callable[[], Scored], rounds: int) -> tuple[list[Any], list[float]]:
    """Sample with ``score()``; while groups are flat, sample again (at most ``rounds`` times) and take
    each flat group's rows from the first sampling that varies. Returns the episodes to train on (a
    group still flat has its episodes emptied: no loss term) and their advantages. Off (one sampling,
    nothing changed) when ``rounds`` is 0 or the model is not training (evaluation)."""
    s = score()
    if not rounds or not trainer.model.training:
        return s.episodes, s.advantages
    start = trainer.accelerator.process_index * len(s.episodes)
    local = [_key(k) for k in s.keys[start:start + len(s.episodes)]]
    first = flat_groups(s.rewards, s.keys)
    episodes, adv, flat, samplings = s.episodes, s.advantages, set(first), 1
    for _ in range(rounds):
        if not flat:
            break
        again = score()
        samplings += 1
        still = flat_groups(again.rewards, again.keys)
        take = [k in flat and k not in still for k in local]
        episodes, adv = merge_rows(episodes, again.episodes, take), merge_rows(adv, again.advantages, take)
        flat &= still
    groups = max(len({_key(k) for k in s.keys}), 1)
    metrics = trainer._metrics["train"]
    metrics[FIRST].append(len(first) / groups)
    metrics[LEFT_OUT].append(len(flat) / groups)
    metrics[SAMPLINGS].append(float(samplings))
    return [[] if k in flat else calls for calls, k in zip(episodes, local)], adv


def skip_empty_updates(trainer: Any) -> None:
    """Skip the optimiser step when no parameter got a gradient (every group of the step left out):
    AdamW skips a parameter whose ``grad`` is None, where a zero gradient would still apply its
    momentum. Gradients are reduced across processes before this point, so all decide alike."""
    from transformers import TrainerCallback

    class SkipEmptyUpdate(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            params = [p for p in trainer.model.parameters() if p.requires_grad]
            if all(p.grad is None or not bool(p.grad.any()) for p in params):
                for p in params:
                    p.grad = None
                trainer._metrics["train"][SKIPPED].append(1.0)
            return control

    trainer.add_callback(SkipEmptyUpdate())
