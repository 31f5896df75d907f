"""grpo: DecomposeR staged RL on TRL's GRPOTrainer (DecomposeR §3.4.2–3.4.3, Table 5).

Input: ``verified.jsonl`` (QRPair: question + rubrics) for ``stage="planner"``; the prepared
records of ``deepr grpo prepare`` for ``stage="answerer"``. Output folder: the LoRA adapter
(or full model), tokenizer, ``deepr_meta.json`` (role, base model, the ``--llm`` spec that
loads it), ``metrics.jsonl`` (one row per logged step: every reward sub-term, initial-plan
validity, lengths, masked-token share), checkpoints for ``--resume``.

The rollouts are :mod:`deepr.train.rollouts` passed as TRL's ``rollout_func``; every model
turn is sampled under the prompt ``deepr run`` gives it and trained as its own sample with the
episode's advantage (:mod:`deepr.train.warp_calls`, the trainer TRL's GRPOTrainer becomes); the
rewards are :mod:`deepr.rewards.trl_adapters` (dataset column ``rubrics``; ``plan`` /
``node_outputs`` / ``answer`` come from the rollout). The answerer stage starts from the base with
the planner adapter merged (saved in ``<out>/base``), so ``hf:<out>/base,adapter=answerer:<out>``
runs the trained planner (no adapter) and the trained answerer (adapter) from one model.

Table 5 defaults: LoRA r 64 / α 128, lr 4e-6 constant, β 0.001 (planner) / 0.005 (answerer),
8 (planner) / 4 (answerer) prompts × 6 rollouts per step, 2 optimiser updates per batch,
temperature 1.0, completions of 8192 / 16384 tokens; loss aggregated as Eq. 16 (``loss_type="grpo"``:
the mean over each rollout's model tokens, all its calls together, then the mean over rollouts; see
:func:`deepr.train.warp_calls.call_batch`). The stage registry is :mod:`deepr.train.stages`.

    deepr grpo --stage planner --model runs/sft-planner-merged --data verified.jsonl --out runs/rl-planner
    accelerate launch -m deepr grpo --stage planner ... --use-vllm --vllm-mode colocate   # GPUs
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from deepr.llm.base import GenDefaults
from deepr.records import QRPair
from deepr.train.runs import fingerprint  # noqa: F401  (its old home)
from deepr.train.stage import (JUDGED_TERMS, META, METRICS, GrpoResult, StageConfig,  # noqa: F401  (their old home)
                               build_stage_trainer, fit_and_save, judge_record, llm_spec,
                               prepare_out, trl_args, warn_judge, write_run_meta)

PAPER_DEFAULTS = {  # DecomposeR Table 5; loss: Eq. 16 averages each rollout's tokens, then the group
    "planner": {"learning_rate": 4e-6, "num_generations": 6, "beta": 0.001, "prompts_per_step": 8,
                "max_completion_length": 8192, "loss_type": "grpo"},
    "answerer": {"learning_rate": 4e-6, "num_generations": 6, "beta": 0.005, "prompts_per_step": 4,
                 "max_completion_length": 16384, "loss_type": "grpo"},
}


class GrpoConfig(StageConfig):
    """Settings of ``deepr grpo --stage planner|answerer``; fields left None take Table 5's value."""

    stage: Literal["planner", "answerer"] = Field(description="planner: turn 1 → search → turn 2, reward R_plan; "
                                                  "answerer: waves + final turn on prepared records, reward R_ans.")
    plan_validity: Literal["paper", "run"] = Field("paper", description="planner: what Valid(G) of DecomposeR "
                                                   "Eq. 17 checks. paper: the plan parses and keeps the typed-DAG "
                                                   "rules of §3.1. run: also deepr run's acceptance checks "
                                                   "(placeholders, echoes, short queries, looped words, fetch "
                                                   "lists) — a departure from the paper.")
    dynamic_sampling: int = Field(0, ge=0, le=4, description="Sample a step's prompts again, up to this many "
                                  "times, while a group's rewards are all equal, and leave the groups still "
                                  "equal out of the loss (DAPO's dynamic sampling, as DECOR §4.4 trains; "
                                  "DecomposeR does not: 0, off).")

    def paper(self) -> dict[str, Any]:
        return PAPER_DEFAULTS[self.stage]

    def check_stage_fields(self) -> None:
        if self.planner_adapter is not None and self.stage != "answerer":
            raise ValueError("--planner-adapter is for --stage answerer (the planner stage trains that adapter)")
        if self.rollout_formats != "none" and self.stage != "planner":
            raise ValueError(f"rollout_formats {self.rollout_formats!r} is for --stage planner, not {self.stage}")
        if self.rollout_formats != "none" and self.trl.get("use_vllm"):
            raise ValueError(f"rollout_formats {self.rollout_formats!r} decodes on the transformers path; vLLM "
                             "would sample without it. Drop --use-vllm, or set rollout_formats none (on-policy)")

    @property
    def role(self) -> str:
        return self.stage


def gen_settings(gen: GenDefaults) -> dict[str, Any]:
    """GrpoConfig fields for the shared generation flags (checked by ``deepr.cli.flags.gen_defaults``):
    --max-tokens caps each model turn of a rollout, --temperature / --top-p / --seed set the
    rollouts' sampling (TRL's GRPOConfig), and all four go to the judge's calls too."""
    out: dict[str, Any] = {"max_turn_tokens": gen.max_tokens, "temperature": gen.temperature, "top_p": gen.top_p,
                           "seed": gen.seed}
    out = {k: v for k, v in out.items() if v is not None}
    if out:
        out["judge_gen"] = gen
    return out


# --- datasets ---------------------------------------------------------------------------------


def planner_dataset(pairs: Sequence[QRPair]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Rows {prompt, rubrics, query, id} and the prompt → query lookup the rollout needs."""
    from deepr.train.environments import planner_prompt

    rows, lookup = [], {}
    for p in pairs:
        prompt = planner_prompt(p.question)
        rows.append({"id": p.id, "prompt": prompt, "query": p.question,
                     "rubrics": [r.model_dump(mode="json") for r in p.rubrics]})
        lookup[prompt[-1]["content"]] = p.question
    return rows, lookup


def answerer_dataset(records: Sequence[Any]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Rows over prepared records (:class:`deepr.train.prepare.Prepared`) and the prompt → record lookup."""
    from deepr.train.environments import AnswererEnvironment

    rows, lookup = [], {}
    for rec in records:
        data = rec.model_dump(mode="json") if hasattr(rec, "model_dump") else dict(rec)
        prompt = AnswererEnvironment(data).first_messages()
        rows.append({"id": data["id"], "prompt": prompt, "query": data["query"],
                     "rubrics": data["rubrics"]})
        lookup[prompt[-1]["content"]] = data
    return rows, lookup


# --- model ---------------------------------------------------------------------------------


def merge_adapter(base: str, adapter: Path, dest: Path) -> Path:
    """Base + planner adapter merged into plain weights at ``dest`` (the answerer's start)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from deepr.train.runs import load_tokenizer

    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter} holds no LoRA adapter (adapter_config.json); give the planner "
                                "output folder of `deepr grpo --stage planner` or `deepr sft --role planner`")
    model = AutoModelForCausalLM.from_pretrained(base)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(dest)
    load_tokenizer(base).save_pretrained(dest)
    return dest


# --- trainer ----------------------------------------------------------------------------------


def build_trainer(config: GrpoConfig, model_path: str, rows: Sequence[dict[str, Any]], rollout_func: Any,
                  reward_fn: Any, callbacks: Sequence[Any] = ()) -> Any:
    """The planner / answerer trainer: scores episodes, trains their calls (:mod:`deepr.train.warp_calls`)."""
    from deepr.train.warp_calls import warp_trainer_cls

    return build_stage_trainer(config, rows, rollout_func, reward_fn, callbacks,
                               warp_trainer_cls(config.dynamic_sampling), model_path)


def default_reward(config: GrpoConfig, embed: Any = None) -> Any:
    from deepr.rewards.trl_adapters import AnswerRewardFn, PlanRewardFn

    if config.stage == "planner":
        return PlanRewardFn(embed)
    judge = None
    if config.judge_llm != "extractive":
        from deepr.corpus.embed import get_embedder
        from deepr.llm import get_llm
        from deepr.rewards.judges import Judge

        judge = Judge(get_llm(config.judge_llm, gen=config.judge_gen), embed or get_embedder().encode)
    return AnswerRewardFn(judge, embed)


def train_grpo(config: GrpoConfig, rows: Sequence[dict[str, Any]], lookup: dict[str, Any], *, env: Any = None,
               reward_fn: Any = None, callbacks: Sequence[Any] = (), generate_for: Any = None) -> GrpoResult:
    """Run one stage; ``env`` is the planner's :class:`~deepr.train.environments.PlannerEnvironment`;
    ``generate_for(trainer)`` replaces the rollout generator (tests script turns with it)."""
    from deepr.train.rollouts import make_rollout_func
    from deepr.train.stage import train_stage
    from deepr.train.warp_calls import warp_trainer_cls

    def start() -> str:  # after the output folder is checked: the merged base lives inside it
        if config.planner_adapter is None:
            return config.model
        merged = config.out / "base"
        return str(merged if (merged / "config.json").is_file() else merge_adapter(config.model,
                                                                                  config.planner_adapter, merged))

    rollout = make_rollout_func(config.stage, lookup, budget=config.max_completion_length, env=env,
                                generate_for=generate_for, turn_cap=config.max_turn_tokens,
                                train_turns=config.train_turns, formats=config.rollout_formats)
    return train_stage(config, rows, rollout, reward_fn or default_reward(config),
                       trainer_cls=warp_trainer_cls(config.dynamic_sampling), callbacks=callbacks, start=start)
