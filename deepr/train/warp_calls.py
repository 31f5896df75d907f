"""Call samples: every policy call of an episode is its own training sample (003 §2.3.2).

Used by warp-report, and by the planner, answerer and DECOR stages, whose turns are sampled under
the prompts ``deepr run`` sends (:mod:`deepr.train.rollouts`).

A WARP episode is many short calls (search, initialize, write, deepen), each sampled under its
own prompt. Training them as one long conversation would condition later replies on text they
never saw, recompute log-probs the sampler already had, and cut the episode at the completion
budget (late calls and the stop decision dropped out while the reward scored the whole report).
So the trainer scores episodes as TRL does (one placeholder sample per episode: the report's
reward, the group's advantage), then trains on a batch of the episodes' calls instead: each call's
prompt ids and reply ids as sampled, its sampling log-probs, and its episode's advantage. With
``loss_type="grpo"`` the loss is Eq. 16 over episodes, not over calls: the mean over the episodes of
each episode's mean token loss (all its calls' tokens together); filler rows weigh nothing and an
episode of several calls counts once (:func:`per_rollout_loss`).

Input: the rollout function's ``trainer._warp_calls`` (per local episode, a list of
:class:`Call`); output: the tensors TRL's loss reads (``prompt_ids`` ... ``num_items_in_batch``,
``old_per_token_logps`` / ``ref_per_token_logps`` / ``sampling_per_token_logps`` /
``importance_sampling_ratio`` when TRL would compute them).

    deepr grpo --stage warp-report --model runs/rl-warp-atomic --data verified.jsonl --out runs/rl-warp
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Call:
    """One policy call as sampled: prompt token ids, reply token ids, their sampling log-probs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] | None = None


def call_rows(episodes: Sequence[Sequence[Call]], advantages: Sequence[float], size: int,
              filler: Call) -> tuple[list[Call], list[float], list[int]]:
    """Every call with its episode's advantage, padded with ``filler`` (weight 0) to ``size`` rows."""
    calls = [c for calls in episodes for c in calls]
    adv = [float(a) for calls, a in zip(episodes, advantages) for _ in calls]
    live = [1] * len(calls)
    extra = size - len(calls)
    return calls + [filler] * extra, adv + [0.0] * extra, live + [0] * extra


def rollout_weights(episodes: Sequence[Sequence[Call]], size: int) -> tuple[list[float], int]:
    """Per-row token weights of DecomposeR Eq. 16 over episodes (and DECOR Eq. 4 over trajectories):
    every token of episode e weighs 1 / |o_e|, |o_e| its model tokens over all its calls, so the
    weighted sum over a batch is the sum over episodes of each episode's token-mean loss. Filler
    rows weigh 0. Returns the row weights (in :func:`call_rows` order) and the count of episodes
    that have tokens (the mean's denominator; an episode without tokens has no loss term)."""
    weights, counted = [], 0
    for calls in episodes:
        tokens = sum(len(c.completion_ids) for c in calls)
        counted += tokens > 0
        weights += [1.0 / tokens if tokens else 0.0] * len(calls)
    return weights + [0.0] * (size - len(weights)), counted


def per_rollout_loss(trainer: Any) -> None:
    """Make ``loss_type="grpo"`` mean Eq. 16 over episodes for a trainer whose rows are calls.

    TRL's "grpo" averages each row's tokens, then the rows: an episode of several calls would
    count once per call and filler rows would enter the mean. Instead the trainer runs TRL's
    token-sum loss ("dapo": the sum of ``per_token_loss * completion_mask * tool_mask`` over the
    batch, divided by ``num_items_in_batch``) with ``tool_mask`` = :func:`rollout_weights` and
    ``num_items_in_batch`` = the episodes counted: (1/E) Σ_e (1/|o_e|) Σ_{t ∈ o_e} loss_t, the
    mean over episodes of each episode's token mean, as Eq. 16 writes it (G rollouts per group)."""
    trainer._deepr_per_rollout = trainer.loss_type == "grpo"
    if trainer._deepr_per_rollout:
        trainer.loss_type = "dapo"


def batch_size_for(n_local: int, trainer: Any) -> int:
    """Rows per process: the largest call count over processes, rounded up to whole gradient-
    accumulation chunks (TRL splits a generation batch into ``steps_per_generation`` equal parts)."""
    import torch

    acc = trainer.accelerator
    most = int(acc.gather(torch.tensor([n_local], device=acc.device)).max())
    chunks = trainer.args.steps_per_generation
    return max(chunks, -(-most // chunks) * chunks)


def _is_ratio(trainer: Any, old: Any, sampled: Any, mask: Any) -> Any:
    """vLLM importance-sampling correction of the sampler / trainer mismatch, as TRL configures it."""
    import math

    import torch

    mode = trainer.vllm_importance_sampling_mode
    diff = torch.nan_to_num((old - sampled) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    lo, hi = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    bad = (ratio < (-math.inf if lo is None else lo)) | (ratio > (math.inf if hi is None else hi))
    return ratio.masked_fill(bad, 0.0)


def _logps(trainer: Any, ids: Any, attn: Any, keep: int, reference: bool) -> Any:
    from trl.trainer.utils import use_adapter

    bs = trainer.args.per_device_train_batch_size
    if not reference:
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, keep, batch_size=bs)[0]
    if trainer.ref_model is not None:
        return trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, attn, keep, batch_size=bs)[0]
    model = trainer.accelerator.unwrap_model(trainer.model)
    with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, keep, batch_size=bs)[0]


def call_batch(trainer: Any, episodes: Sequence[Sequence[Call]], advantages: Sequence[float]) -> dict[str, Any]:
    """The training batch of this process: one row per call (see the module docstring)."""
    import torch
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import pad

    dev, tok, args = trainer.accelerator.device, trainer._tokenizer, trainer.args
    filler = Call([tok.pad_token_id], [trainer.eos_token_ids[0]], [0.0])
    n_local = sum(len(c) for c in episodes)
    calls, adv, live = call_rows(episodes, advantages, batch_size_for(n_local, trainer), filler)

    def padded(seqs: list[list[Any]], side: str, value: Any, dtype: Any = torch.long) -> Any:
        return pad([torch.tensor(s, dtype=dtype) for s in seqs], padding_value=value, padding_side=side).to(dev)

    prompt_ids = padded([c.prompt_ids for c in calls], "left", tok.pad_token_id)
    prompt_mask = padded([[1] * len(c.prompt_ids) for c in calls], "left", 0)
    completion_ids = padded([c.completion_ids for c in calls], "right", tok.pad_token_id)
    completion_mask = padded([[w] * len(c.completion_ids) for c, w in zip(calls, live)], "right", 0)
    out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
           "completion_mask": completion_mask, "advantages": torch.tensor(adv, dtype=torch.float32, device=dev),
           "num_items_in_batch": trainer.accelerator.gather(completion_mask.sum()).sum()}
    if getattr(trainer, "_deepr_per_rollout", False):  # Eq. 16 over episodes (see per_rollout_loss)
        weights, counted = rollout_weights(episodes, len(calls))
        out["tool_mask"] = padded([[w] * len(c.completion_ids) for c, w in zip(calls, weights)], "right", 0.0,
                                  torch.float32)
        out["num_items_in_batch"] = trainer.accelerator.gather(torch.tensor(float(counted), device=dev)).sum()
    ids, attn = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    keep = completion_ids.size(1)
    vllm_is = bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, args.gradient_checkpointing_kwargs):
        if args.gradient_accumulation_steps % (args.steps_per_generation * trainer.num_iterations) or vllm_is:
            out["old_per_token_logps"] = _logps(trainer, ids, attn, keep, reference=False)
        if trainer.beta != 0.0:
            out["ref_per_token_logps"] = _logps(trainer, ids, attn, keep, reference=True)
    if all(c.logprobs is not None for c in calls):
        sampled = padded([c.logprobs for c in calls], "right", 0.0, torch.float32)
        out["sampling_per_token_logps"] = sampled
        if vllm_is:
            out["importance_sampling_ratio"] = _is_ratio(trainer, out["old_per_token_logps"], sampled,
                                                         completion_mask)
    return out


def warp_trainer_cls(dynamic_sampling: int = 0) -> type:
    from trl import GRPOTrainer

    from deepr.train.dynamic import Scored, resample_flat, skip_empty_updates, weighted_rewards

    class WarpReportTrainer(GRPOTrainer):
        """GRPOTrainer that scores whole episodes (TRL's rewards and group advantages over one
        placeholder per episode) and trains on their calls (:func:`call_batch`); loss_type "grpo"
        is Eq. 16 over episodes (:func:`per_rollout_loss`); ``dynamic_sampling`` > 0 samples a
        step's flat groups again (:mod:`deepr.train.dynamic`)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            per_rollout_loss(self)
            if dynamic_sampling:
                skip_empty_updates(self)

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self._episode_rewards = rewards  # every process's rows: TRL gathers them before grouping
            return rewards

        def _scored(self, inputs):
            scored = super()._generate_and_score_completions(inputs)
            episodes, self._warp_calls = self._warp_calls, None
            if len(episodes) != len(scored["advantages"]):
                raise RuntimeError(f"{len(episodes)} WARP episodes but {len(scored['advantages'])} advantages; "
                                   "the warp-report rollout must record one call list per prompt")
            totals = weighted_rewards(self, self._episode_rewards)
            groups = [i // self.num_generations for i in range(len(totals))]  # TRL's grouping: G rows in a row
            return Scored(episodes, scored["advantages"].tolist(), totals, groups)

        def _generate_and_score_completions(self, inputs):
            episodes, adv = resample_flat(self, lambda: self._scored(inputs), dynamic_sampling)
            return call_batch(self, episodes, adv)

    return WarpReportTrainer
