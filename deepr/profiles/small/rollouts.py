"""Planner rollouts under the small profile's plan format: GRPO's off-policy option.

Chosen only by ``rollout_formats="schema"`` (``deepr grpo --rollout-formats schema``): rollouts
are decoded under the graph schema, the plan guard and the distinct-word ban the small profile
gives ``deepr run --formats schema``, while the loss reads the model's unconstrained
log-probabilities, so the gradient is off-policy (docs/faithfulness.md). ``deepr grpo`` hands
:func:`planner_generate` to the training stage; the training code itself never imports this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepr.agent.planner import INITIAL, REVISE
from deepr.train.sampling import Generate, trainer_generate


def planner_generate(trainer: Any) -> Generate:
    """The planner's rollout generator under :func:`planner_format` (``generate_for`` of a stage)."""
    return constrained_generate(trainer, planner_format)


def planner_format(turn: int) -> Any:
    """The format the small profile decodes planner turn ``turn`` with when its strict formats
    are off (``deepr run --profile small --formats schema``): the graph schema and its guard. A
    re-asked initial plan fits the revision's shape too (its fetch list is optional)."""
    import dataclasses

    from deepr.profiles import SMALL

    return dataclasses.replace(SMALL, strict=False).format(INITIAL if turn == 0 else REVISE, None, [])


def constrained_generate(trainer: Any, fmt_for: Callable[[int], Any]) -> Generate:
    """Rollout sampling under the decoding formats ``deepr run`` applies (``fmt_for(turn)``: an
    :class:`~deepr.llm.base.OutputFormat` or None), through xgrammar on the transformers path.
    Chosen only by ``rollout_formats="schema"``: the loss then reads the model's unconstrained
    log-probabilities of tokens it was not free to choose, so the gradient is off-policy. Where
    the formats cannot apply (vLLM, no xgrammar) it refuses rather than sample otherwise."""
    from deepr.llm.hf_constrain import Constrainer

    plain = trainer_generate(trainer)
    if getattr(trainer, "use_vllm", False) or not Constrainer.available():
        raise RuntimeError("rollout_formats schema: rollouts cannot be decoded under the run's formats ("
                           + ("vLLM samples them" if getattr(trainer, "use_vllm", False) else
                              "xgrammar is not installed") + "); set rollout_formats none (on-policy sampling)")
    turn = [0]

    def generate(seqs: list[list[int]], first: bool, max_new: int) -> tuple[list[list[int]], None]:
        turn[0] = 0 if first else turn[0] + 1
        fmt = fmt_for(turn[0])
        if fmt is None:
            return plain(seqs, first, max_new)
        return _sample_constrained(trainer, seqs, trainer.num_generations if first else 1, max_new, fmt), None

    return generate


def _sample_constrained(trainer: Any, seqs: list[list[int]], n: int, max_new: int, fmt: Any) -> list[list[int]]:
    import copy

    import torch
    from trl.models.utils import unwrap_model_for_generation
    from trl.trainer.utils import pad

    from deepr.llm.hf_constrain import Constrainer

    tok, dev = trainer.processing_class, trainer.accelerator.device
    rows = [s for s in seqs for _ in range(n)]
    ids = pad([torch.tensor(r) for r in rows], padding_value=tok.pad_token_id, padding_side="left").to(dev)
    mask = pad([torch.ones(len(r), dtype=torch.long) for r in rows], padding_value=0, padding_side="left").to(dev)
    cfg = copy.deepcopy(trainer.generation_config)
    cfg.max_new_tokens = max_new
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                     gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
                                     ) as model, torch.no_grad():
        if getattr(trainer, "_deepr_constrainer", None) is None:
            trainer._deepr_constrainer = Constrainer(tok, int(model.config.vocab_size), trainer.eos_token_ids)
        processors = [trainer._deepr_constrainer.processor(fmt)]
        if fmt.distinct_words:  # as the hf backend of `deepr run` decodes the planner
            from deepr.llm.hf_constrain import StutterBan

            if getattr(trainer, "_deepr_word_ban", None) is None:
                trainer._deepr_word_ban = StutterBan(tok)
            processors.append(trainer._deepr_word_ban.string_processor(ids.size(1), [True] * len(rows)))
        if fmt.guard is not None:  # the plan's graph rules, as `deepr run` decodes them
            from deepr.llm.hf_constrain import guard_processor

            processors.append(guard_processor([fmt.guard] * len(rows), tok, ids.size(1)))
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg, logits_processor=processors)
    eos = set(trainer.eos_token_ids)
    replies = []
    for row in out[:, ids.size(1):].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        replies.append(row if end is None else row[:end + 1])  # the end token stays: it is trained
    return replies
