"""grpo: DecomposeR staged RL on TRL's GRPOTrainer (SPEC §8; 000 §3.4.2–3.4.3, Table 5).

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
temperature 1.0, completions of 8192 / 16384 tokens; loss aggregated as Eq. 16 (per-sequence token
mean, then the mean over sequences: TRL ``loss_type="grpo"``; each model turn is a sequence).

    deepr grpo --stage planner --model runs/sft-planner-merged --data verified.jsonl --out runs/rl-planner
    accelerate launch -m deepr grpo --stage planner ... --use-vllm --vllm-mode colocate   # GPUs
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deepr.io import redact, versions, write_json
from deepr.llm.base import GenDefaults
from deepr.records import QRPair

META = "deepr_meta.json"
METRICS = "metrics.jsonl"
PAPER_DEFAULTS = {  # 000 Table 5; loss: Eq. 16 averages each rollout's tokens, then the group (TRL "grpo")
    "planner": {"beta": 0.001, "prompts_per_step": 8, "mini_batch_prompts": 4, "max_completion_length": 8192,
                "loss_type": "grpo"},
    "answerer": {"beta": 0.005, "prompts_per_step": 4, "mini_batch_prompts": 2, "max_completion_length": 16384,
                 "loss_type": "grpo"},
}
# Stages whose reward has LLM-judged terms, and those terms (what the extractive judge stands in for).
JUDGED_TERMS = {"answerer": "J_rub", "rubric": "R_rubric and claim support in R_cite",
                "decor": "LJ of R_team and the role judges R_role",
                "warp-report": "the report-level rubric / quality judge",
                "warp-atomic": "outline and paragraph holistic quality and faithfulness"}


class GrpoConfig(BaseModel):
    """Settings of ``deepr grpo``; stage-dependent fields left None take the paper's value."""

    model_config = ConfigDict(extra="forbid")

    stage: Literal["planner", "answerer"] = Field(description="planner: turn 1 → search → turn 2, reward R_plan; "
                                                  "answerer: waves + final turn on prepared records, reward R_ans.")
    model: str = Field(description="Starting model folder (planner: the SFT checkpoint; answerer: the base).")
    out: Path = Field(description="Output folder: adapter, tokenizer, deepr_meta.json, metrics.jsonl, checkpoints.")
    planner_adapter: Path | None = Field(None, description="answerer: planner adapter merged into --model first.")
    full: bool = Field(False, description="Full fine-tune instead of LoRA.")
    lora_r: int = Field(64, ge=1, description="LoRA rank (Table 5: 64).")
    lora_alpha: int = Field(128, ge=1, description="LoRA alpha (Table 5: 128).")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA branch.")
    target_modules: str | list[str] = Field("all-linear", description="Modules that get LoRA weights.")
    learning_rate: float = Field(4e-6, gt=0, description="Learning rate, constant without warm-up (Table 5).")
    beta: float | None = Field(None, ge=0, description="KL coefficient; None: 0.001 planner, 0.005 answerer.")
    num_generations: int = Field(6, ge=2, description="Rollouts per prompt, the GRPO group (Table 5: 6).")
    prompts_per_step: int | None = Field(None, ge=1, description="Unique prompts per generation batch; None: "
                                         "8 planner, 4 answerer.")
    mini_batch_prompts: int | None = Field(None, ge=1, description="Prompts per optimiser update; None: half "
                                           "of prompts_per_step (Table 5: 2 mini-batches per step).")
    max_completion_length: int | None = Field(None, ge=8, description="Token budget of one rollout, environment "
                                              "turns included; None: 8192 planner, 16384 answerer.")
    max_turn_tokens: int | None = Field(None, ge=8, description="Most tokens of one model turn (None: only the "
                                        "rollout budget bounds it); a turn cut here ends its rollout.")
    train_turns: int | None = Field(None, ge=1, description="Train on the first N model turns of each rollout "
                                    "only; every turn is still sampled and the reward reads them all. None: all. "
                                    "planner 1 trains the initial plan alone: its revision call carries ~2.5k "
                                    "tokens of search results and cost ~4x the plan's training compute on CPU; a "
                                    "refused initial plan is then not re-asked (it scores 0).")
    rollout_formats: Literal["schema", "off"] = Field("schema", description="planner: sample rollouts under "
                                                      "the decoding schema `deepr run --formats schema` uses "
                                                      "(xgrammar, transformers path), or off: unconstrained.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of rollouts (Table 5: 1.0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of rollouts (Table 5: 1.0).")
    loss_type: str | None = Field(None, description="TRL loss aggregation; None: the stage paper's. grpo = mean "
                                  "over each sequence's tokens, then over sequences (000 Eq. 16, GRPO, DECOR's "
                                  "sequence-level GSPO objective); dapo = one mean over every token of the batch "
                                  "(long rollouts weigh more); also dr_grpo, bnpo, cispo, sapo, luspo, vespo.")
    lr_scheduler: str | None = Field(None, description="Learning-rate schedule (transformers name); None: the "
                                     "paper's (constant; DECOR cosine).")
    adam_beta2: float | None = Field(None, gt=0, lt=1, description="AdamW beta2; None: the paper's (0.999; "
                                     "DECOR 0.95).")
    epsilon: float = Field(0.2, gt=0, description="Lower clip range of the ratio.")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clip range (asymmetric clip); None = epsilon.")
    importance_sampling_level: Literal["token", "sequence"] = Field("token", description="Ratio per token or per "
                                                                    "sequence (GSPO).")
    scale_rewards: str = Field("group", description="Advantage scaling: group, batch or none.")
    use_vllm: bool = Field(False, description="Generate with vLLM (GPU only).")
    vllm_mode: Literal["colocate", "server"] = Field("colocate", description="colocate: vLLM in the training "
                                                     "processes; server: a `trl vllm-serve` process.")
    vllm_server_base_url: str | None = Field(None, description="server mode: URL of `trl vllm-serve`.")
    max_steps: int = Field(-1, description="Stop after this many optimiser steps; -1: one pass over the data.")
    epochs: float = Field(1.0, gt=0, description="Passes over the data when max_steps is -1.")
    save_steps: int = Field(50, ge=1, description="Checkpoint every this many steps (what --resume restarts from).")
    logging_steps: int = Field(1, ge=1, description="Log metrics every this many steps.")
    zero_advantage: Literal["stop", "warn", "off"] = Field("stop", description="When every group's reward is "
                                                           "constant in the first steps: stop, warn or off.")
    report_to: str = Field("none", description="Extra logging integration: none, tensorboard, wandb.")
    bf16: bool | None = Field(None, description="bf16; None: on when the GPU supports it.")
    gradient_checkpointing: bool | None = Field(None, description="Recompute activations in the backward pass; "
                                                "None: on (turn 2 of a planner rollout is ~3k tokens; storing them "
                                                "took a 135M model's step past 12 GB on CPU, bench/sft_memory.py).")
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of sampling, data order and LoRA initialisation.")
    resume: bool = Field(False, description="Continue from the last checkpoint in --out.")
    corpus: str = Field("wiki", description="planner: corpus the environment searches (as `deepr run --corpus`).")
    retriever: str = Field("hybrid", description="planner: dense, bm25 or hybrid.")
    k: int = Field(5, ge=1, le=50, description="planner: results per search node (Table 5: up to 5).")
    fetch_limit: int = Field(4, ge=0, le=10, description="Pages a revision may fetch (Table 5: up to 4).")
    judge_llm: str = Field("extractive", description="Judge of the reward's LLM-judged terms (answerer J_rub, "
                           "rubric, decor, warp stages): extractive (no LLM, a stand-in) or openai:<model>, ...")
    judge_gen: GenDefaults = Field(default_factory=GenDefaults, description="Generation settings of the judge's "
                                   "calls (--max-tokens, --temperature, --top-p, --seed as given on the command "
                                   "line); a field left None keeps the judge role's own.")
    require_judge_llm: bool = Field(False, description="Refuse to start when the stage's reward has LLM-judged "
                                    "terms and judge_llm is extractive (runs that must be the paper's reward).")

    @field_validator("model")
    @classmethod
    def _absolute_local_model(cls, v: str) -> str:
        # the adapter records this as its base: relative to today's directory, it would not load
        # from another one (`deepr run --llm hf:<adapter>` elsewhere)
        from deepr.llm.hf_adapters import local_path

        return local_path(v)

    @model_validator(mode="after")
    def _judge_required(self) -> GrpoConfig:
        if self.require_judge_llm and self.stage in JUDGED_TERMS and self.judge_llm == "extractive":
            raise ValueError(f"--require-judge-llm: the {self.stage} reward has LLM-judged terms "
                             f"({JUDGED_TERMS[self.stage]}); give --judge-llm openai:<model> (or another LLM spec)")
        return self

    @model_validator(mode="after")
    def _fill(self) -> GrpoConfig:
        for name, value in PAPER_DEFAULTS[self.stage].items():
            if name != "mini_batch_prompts" and getattr(self, name) is None:
                setattr(self, name, value)
        if self.mini_batch_prompts is None:
            self.mini_batch_prompts = max(1, self.prompts_per_step // 2)
        fill_optimiser(self)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.prompts_per_step % self.mini_batch_prompts:
            raise ValueError(f"prompts_per_step {self.prompts_per_step} must be a multiple of mini_batch_prompts "
                             f"{self.mini_batch_prompts}")
        if self.mini_batch_prompts % world:
            raise ValueError(f"mini_batch_prompts {self.mini_batch_prompts} must be a multiple of the "
                             f"{world} training processes")
        if self.planner_adapter is not None and self.stage != "answerer":
            raise ValueError("--planner-adapter is for --stage answerer (the planner stage trains that adapter)")
        return self

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


def fill_optimiser(config: GrpoConfig) -> None:
    """Values no stage paper sets: TRL's token-mean loss, a constant rate, AdamW's usual beta2."""
    for name, value in (("loss_type", "dapo"), ("lr_scheduler", "constant"), ("adam_beta2", 0.999)):
        if getattr(config, name) is None:
            setattr(config, name, value)


def judge_record(config: GrpoConfig) -> dict[str, Any]:
    """What deepr_meta.json says about the reward's judge."""
    terms = JUDGED_TERMS.get(config.stage)
    return {"judge": config.judge_llm, "judged_terms": terms,
            "extractive_fallback": bool(terms) and config.judge_llm == "extractive"}


def warn_judge(config: GrpoConfig) -> None:
    """Say at start, loudly, when LLM-judged reward terms run on the extractive stand-in."""
    import sys

    rec = judge_record(config)
    if rec["extractive_fallback"] and os.environ.get("RANK", "0") == "0":
        print(f"WARNING: grpo --stage {config.stage}: no --judge-llm, so {rec['judged_terms']} are scored by the "
              "extractive judge (embeddings + word overlap), not an LLM: this is not the paper's reward. Pass "
              "--judge-llm openai:<model>, or --require-judge-llm to refuse such runs.", file=sys.stderr, flush=True)


@dataclass
class GrpoResult:
    out: Path
    steps: int
    rewards: list[tuple[int, float]]
    interrupted: bool = False
    seconds: float = 0.0
    llm_spec: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)


# --- datasets ---------------------------------------------------------------------------------


def planner_dataset(pairs: Sequence[QRPair]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Rows {prompt, rubrics, query, id} and the prompt → query lookup the rollout needs."""
    from deepr.train.rollouts import planner_prompt

    rows, lookup = [], {}
    for p in pairs:
        prompt = planner_prompt(p.question)
        rows.append({"id": p.id, "prompt": prompt, "query": p.question,
                     "rubrics": [r.model_dump(mode="json") for r in p.rubrics]})
        lookup[prompt[-1]["content"]] = p.question
    return rows, lookup


def answerer_dataset(records: Sequence[Any]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Rows over prepared records (:class:`deepr.train.prepare.Prepared`) and the prompt → record lookup."""
    from deepr.train.rollouts import AnswererEnvironment

    rows, lookup = [], {}
    for rec in records:
        data = rec.model_dump(mode="json") if hasattr(rec, "model_dump") else dict(rec)
        prompt = AnswererEnvironment(data).first_messages()
        rows.append({"id": data["id"], "prompt": prompt, "query": data["query"],
                     "rubrics": data["rubrics"]})
        lookup[prompt[-1]["content"]] = data
    return rows, lookup


def fingerprint(rows: Sequence[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(list(rows), sort_keys=True).encode("utf-8")).hexdigest()[:16]


# --- model, logging, meta ---------------------------------------------------------------------


def merge_adapter(base: str, adapter: Path, dest: Path) -> Path:
    """Base + planner adapter merged into plain weights at ``dest`` (the answerer's start)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from deepr.train.sft import load_tokenizer

    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter} holds no LoRA adapter (adapter_config.json); give the planner "
                                "output folder of `deepr grpo --stage planner` or `deepr sft --role planner`")
    model = AutoModelForCausalLM.from_pretrained(base)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(dest)
    load_tokenizer(base).save_pretrained(dest)
    return dest


def metrics_callback(path: Path) -> Any:
    """A TrainerCallback appending every log row (all reward sub-terms TRL collected) to ``path``."""
    from transformers import TrainerCallback

    class MetricsLog(TrainerCallback):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            if not logs or not state.is_world_process_zero:
                return
            row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            self.rows.append(row)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())

    return MetricsLog()


def llm_spec(config: GrpoConfig, base: str) -> str:
    # a stage may train one adapter that several agent roles use (DECOR's team): it names them all
    roles = getattr(config, "adapter_roles", None) or [config.role]
    return f"hf:{base}" if config.full else f"hf:{base}," + ",".join(f"adapter={r}:{config.out}" for r in roles)


def write_run_meta(config: GrpoConfig, status: str, data_fp: str, base: str, extra: dict[str, Any]) -> None:
    write_json(config.out / META, {
        "stage": f"grpo-{config.stage}", "status": status, "role": config.role, "base_model": base,
        "adapter": not config.full, "llm_spec": llm_spec(config, base), "data_fingerprint": data_fp,
        "config": redact(config.model_dump(mode="json")), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": versions(), **judge_record(config), **extra})


# --- trainer ----------------------------------------------------------------------------------


def trl_args(config: GrpoConfig) -> Any:
    """GRPOConfig from our config: one group per micro-batch, mini_batch_prompts per update."""
    import torch
    from trl import GRPOConfig

    from deepr.train.memory import checkpointing_args

    on_gpu = torch.cuda.is_available()
    bf16_ok = on_gpu and torch.cuda.is_bf16_supported()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    vllm = {"vllm_mode": config.vllm_mode}
    if config.vllm_server_base_url:
        vllm["vllm_server_base_url"] = config.vllm_server_base_url
    return GRPOConfig(
        output_dir=str(config.out), learning_rate=config.learning_rate, lr_scheduler_type=config.lr_scheduler,
        adam_beta2=config.adam_beta2, warmup_steps=0, weight_decay=0.0, max_steps=config.max_steps,
        num_train_epochs=config.epochs,
        per_device_train_batch_size=config.num_generations,
        gradient_accumulation_steps=config.mini_batch_prompts // world,
        steps_per_generation=config.prompts_per_step // world, num_generations=config.num_generations,
        max_completion_length=config.max_completion_length, temperature=config.temperature, top_p=config.top_p,
        beta=config.beta, loss_type=config.loss_type, epsilon=config.epsilon, epsilon_high=config.epsilon_high,
        importance_sampling_level=config.importance_sampling_level, scale_rewards=config.scale_rewards,
        use_vllm=config.use_vllm, **vllm, bf16=bf16_ok if config.bf16 is None else config.bf16,
        # CPU too: each revision call trains on ~3k tokens and a micro-batch holds several (see the field)
        **checkpointing_args(GRPOConfig, config.gradient_checkpointing is not False),
        save_strategy="steps", save_steps=config.save_steps, save_total_limit=2,
        logging_steps=config.logging_steps, report_to=config.report_to, seed=config.seed,
        use_cpu=not on_gpu, dataloader_num_workers=0, log_completions=False)


def build_trainer(config: GrpoConfig, model_path: str, rows: Sequence[dict[str, Any]], rollout_func: Any,
                  reward_fn: Any, callbacks: Sequence[Any] = ()) -> Any:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from deepr.train.sft import load_tokenizer
    from deepr.train.warp_calls import warp_trainer_cls

    args = trl_args(config)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    peft_config = None
    if not config.full:
        from peft import LoraConfig

        peft_config = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                                 target_modules=config.target_modules, task_type="CAUSAL_LM")
    return warp_trainer_cls()(model=model, reward_funcs=[reward_fn], args=args,
                              train_dataset=Dataset.from_list(list(rows)), processing_class=load_tokenizer(model_path),
                              peft_config=peft_config, callbacks=list(callbacks), rollout_func=rollout_func)


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
    """Run one stage; ``env`` is the planner's :class:`~deepr.train.rollouts.PlannerEnvironment`;
    ``generate_for(trainer)`` replaces the rollout generator (tests script turns with it)."""
    from deepr.train.rollouts import make_rollout_func
    from deepr.train.sft import _make_stop_callback
    from deepr.train.signals import zero_advantage_callback

    t0 = time.perf_counter()
    data_fp, resume_now = prepare_out(config, rows)
    base = config.model
    if config.planner_adapter is not None:
        merged = config.out / "base"
        base = str(merged if (merged / "config.json").is_file() else merge_adapter(config.model,
                                                                                    config.planner_adapter, merged))
    rollout = make_rollout_func(config.stage, lookup, budget=config.max_completion_length, env=env,
                                generate_for=generate_for, turn_cap=config.max_turn_tokens,
                                train_turns=config.train_turns, formats=config.rollout_formats)
    stop, log = _make_stop_callback(), metrics_callback(config.out / METRICS)
    guard = zero_advantage_callback(config.zero_advantage, stage=config.stage)  # before `log`: it adds to the row
    trainer = build_trainer(config, base, rows, rollout, reward_fn or default_reward(config),
                            [stop, guard, log, *callbacks])
    return fit_and_save(config, trainer, stop, log, data_fp=data_fp, base=base, n_rows=len(rows),
                        resume_now=resume_now, t0=t0)


def prepare_out(config: GrpoConfig, rows: Sequence[dict[str, Any]]) -> tuple[str, bool]:
    """Fingerprint the data and check the output folder (refuses a different run without --resume)."""
    from deepr.train.sft import check_out

    if not rows:
        raise ValueError("no training rows: the data file is empty or every record was rejected")
    warn_judge(config)
    data_fp = fingerprint(rows)
    resume_now = check_out(config.out, config.resume, data_fp)
    config.out.mkdir(parents=True, exist_ok=True)
    return data_fp, resume_now


def fit_and_save(config: GrpoConfig, trainer: Any, stop: Any, log: Any, *, data_fp: str, base: str, n_rows: int,
                 resume_now: bool, t0: float) -> GrpoResult:
    """Train (Ctrl-C stops cleanly at a step), then save adapter + tokenizer + run metadata on rank 0.
    Every stage ends here, so outputs and deepr_meta.json look the same whatever the stage."""
    from deepr.train.memory import lean_lm_head, return_freed_memory_to_os
    from deepr.train.sft import graceful_interrupt

    return_freed_memory_to_os()
    main = trainer.is_world_process_zero()
    if main:
        write_run_meta(config, "running", data_fp, base, {"rows": n_rows})
    with graceful_interrupt(stop), lean_lm_head():
        trainer.train(resume_from_checkpoint=True if resume_now else None)
    status = "interrupted" if stop.requested else "done"
    key = f"rewards/{trainer.reward_func_names[0]}/mean"
    rewards = [(h["step"], h[key]) for h in log.rows if key in h]
    if main:
        if status == "done":
            trainer.save_model(str(config.out))
            trainer.processing_class.save_pretrained(str(config.out))
        write_run_meta(config, status, data_fp, base, {
            "rows": n_rows, "steps": trainer.state.global_step, "rewards": rewards,
            "seconds": round(time.perf_counter() - t0, 3)})
    return GrpoResult(out=config.out, steps=trainer.state.global_step, rewards=rewards, interrupted=stop.requested,
                      seconds=time.perf_counter() - t0, llm_spec=llm_spec(config, base), history=log.rows)
