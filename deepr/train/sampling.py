"""Rollout sampling: how the policy writes each model turn of a GRPO rollout.

:func:`trainer_generate` samples from the policy being trained, through the trainer's own backend
(transformers generate, TRL's generation, vLLM colocate or server), as TRL's tool loop does: the
default of every stage. Sampling under the small profile's decoding formats (off-policy, only when
``rollout_formats="schema"`` asks for it) lives with that profile
(:func:`deepr.profiles.small.rollouts.planner_generate`), and the command hands it in. Used by
:mod:`deepr.train.rollouts` and the stages built on it.

    deepr grpo --stage planner --model runs/sft-planner-merged --data verified.jsonl --out runs/rl-planner
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any



# generate(token-id sequences, first_turn, max_new_tokens) -> (new ids per sequence, logprobs or None)
Generate = Callable[[list[list[int]], bool, int], tuple[list[list[int]], list[list[float]] | None]]


def trainer_generate(trainer: Any) -> Generate:
    """Generation through the trainer's own backend (transformers or vLLM), exactly as TRL's
    tool loop does: the first turn samples the group, later turns continue each sequence once."""

    def generate(seqs: list[list[int]], first: bool, max_new: int) -> tuple[list[list[int]], list[list[float]] | None]:
        n = trainer.num_generations if first else 1
        # Later turns only have the budget's remainder; vLLM paths keep their own limit (output is cut anyway).
        cfg, kw = getattr(trainer, "generation_config", None), getattr(trainer, "generation_kwargs", None)
        before = (cfg.max_new_tokens if cfg is not None else None, dict(kw) if isinstance(kw, dict) else None)
        if cfg is not None:
            cfg.max_new_tokens = min(cfg.max_new_tokens or max_new, max_new)
        if isinstance(kw, dict) and kw.get("max_new_tokens"):
            kw["max_new_tokens"] = min(kw["max_new_tokens"], max_new)
        try:
            ids, lps = trainer._generate_single_turn(seqs, None, {}, n)
        finally:
            if cfg is not None:
                cfg.max_new_tokens = before[0]
            if before[1] is not None:
                kw.update(before[1])
        return [list(x) for x in ids], lps

    return generate


def policy_generate(trainer: Any, generate_for: Callable[[Any], Generate] | None = None) -> Generate:
    """The generator a stage's rollouts sample with: ``generate_for(trainer)`` (a profile's or a
    test's) else :func:`trainer_generate`, counted as sampling time on the trainer's step clock."""
    from deepr.train.step_timing import timed_generate

    return timed_generate(trainer, (generate_for or trainer_generate)(trainer))

