"""Settings, budget and helpers of the learning experiment (`make learn`, docs/learning.md), kept
apart so the report (deepr.learn.report) reads them without importing the pipeline back."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the folder holding this deepr package: every `deepr` subprocess runs this code, not another install
ROOT = Path(__file__).resolve().parents[2]


OK_CODES = (0, 3)  # 3: done, some turns fell back (recorded per run; the metrics count them)


@dataclass
class LearnConfig:
    """Size and budget of one experiment; every field is a flag of the same name."""

    work: Path = Path("learn-work")
    results: Path = Path("learn-results")
    img: Path = Path("learn-results") / "img"
    trees: int = 50  # ~24 train questions after the split and the verifier
    heldout_topics: int = 3
    heldout: int = 4
    max_train: int = 24
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    # one pass over ~24 plans and ~24 answers at --sft-batch 2: a step of one plan (~810 tokens) and one
    # answer (~1,430) takes 63-75 s on one core in fp32, so 48 steps would be ~55 min a seed
    sft_steps: int = 24
    sft_batch: int = 2
    sft_lr: float = 1e-3
    sft_actions: str = "plan,final"  # turns to learn from: the initial plan and the final answer (+ revise)
    # times each kept turn of an action appears in the SFT data, e.g. "plan=3": the plans-x3 + revisions
    # recipe of docs/learning.md (G0 valid 16 of 20 unseen questions against 10 for plans alone)
    sft_repeat: str = ""
    sft_graph: str = "teacher"  # the taught plans' graphs: teacher (as written), flat (one level of aggregates), ordered
    # activations stored, not recomputed: 0.79x the CPU time of an SFT step at ~4.5 GB instead of ~1.5 GB
    sft_checkpointing: bool = False
    # fp32: on a CPU without native bf16 (AVX512-BF16/AMX), TRL's fused LM head runs every bf16 tile
    # through slow kernels; with answer turns in the data (~2,200 tokens a step) one bf16 step took
    # longer than 8 fp32 steps (docs/experiments.md). --sft-bf16 for CPUs that have it.
    sft_bf16: bool = False
    # GRPO with bf16 weights (its rollouts decoded in bf16 too): one step took 550 s against 742 s in fp32
    grpo_bf16: bool = True
    grpo_steps: int = 2
    grpo_lr: float = 1e-4
    grpo_train_turns: int = 1  # planner turns GRPO trains on (0: both); 1 = the initial plan, see GrpoConfig
    grpo_dynamic_sampling: int = 0  # re-samplings of a flat group (deepr.train.dynamic); 0: DecomposeR's rule
    num_generations: int = 4
    prompts_per_step: int = 2
    rollout_tokens: int = 1400  # both planner turns of one GRPO episode
    # a plan in the default schema's form (six fields a node) is 283-503 tokens in the SFT data (14 of
    # 24 over 400): at 400 the SFT'd model's plans were cut before they closed
    eval_max_tokens: int = 640
    eval_parallel: int = 4  # held-out questions in flight per evaluation; the hf backend batches their calls
    lora_r: int = 16
    top_k: int = 3
    minutes: float = 60.0
    llm: str = "smollm2"
    # decoding constraints of every evaluation (deepr run --formats), one for all stages: the planner by
    # its own schema (the plan's graph is the model's), the answerer by the small profile's cited prose
    # over the ids it is shown, with that profile's repetition rules (docs/learning.md, Results)
    formats: str = "schema,answerer=strict"
    # the profile every stage is evaluated under (deepr run --profile); GRPO samples on-policy under
    # `default`, and under `small` (graph schema + plan guard) with --rollout-formats schema, the same constraints
    profile: str = "default"
    corpus: str = "wiki"
    use_vllm: bool = False
    threads: int = 1
    # base eval + 1 seed at first: an SFT process with stored activations peaks near 9 GB on answer
    # turns, so three at once would not fit 24 GB (--sft-checkpointing: ~1/3, but ~1.8x the time here)
    jobs: int = 2
    report_to: str = "none"
    report_only: bool = False


def positive(name: str, value: float, *, minimum: float = 1) -> None:
    if value < minimum:
        raise ValueError(f"--{name.replace('_', '-')} {value}: must be at least {minimum}")


def validate(cfg: LearnConfig) -> LearnConfig:
    """One-line errors for sizes and budgets that cannot work, before anything runs."""
    for name in ("trees", "heldout_topics", "heldout", "max_train", "sft_steps", "sft_batch", "grpo_steps", "prompts_per_step",
                 "rollout_tokens", "eval_max_tokens", "eval_parallel", "lora_r", "top_k", "threads", "jobs"):
        positive(name, getattr(cfg, name))
    positive("num_generations", cfg.num_generations, minimum=2)  # a GRPO group needs two rollouts to compare
    positive("minutes", cfg.minutes, minimum=1)
    if cfg.trees < 2 * cfg.heldout_topics:
        raise ValueError(f"--trees {cfg.trees}: too few to hold out {cfg.heldout_topics} topics and train on others")
    if not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds):
        raise ValueError(f"--seeds {cfg.seeds}: give distinct seeds, e.g. 0,1,2")
    if cfg.grpo_train_turns not in (0, 1, 2):
        raise ValueError(f"--grpo-train-turns {cfg.grpo_train_turns}: give 1 (the initial plan), 2 or 0 (both turns)")
    if not 0 <= cfg.grpo_dynamic_sampling <= 4:
        raise ValueError(f"--grpo-dynamic-sampling {cfg.grpo_dynamic_sampling}: give 0 (off) to 4 re-samplings")
    if cfg.profile not in ("default", "small"):
        raise ValueError(f"--profile {cfg.profile!r}: give default or small")
    from deepr.profiles import parse_formats

    parse_formats(cfg.formats)  # deepr run's own check and message
    if cfg.sft_graph not in ("teacher", "flat", "ordered"):
        raise ValueError(f"--sft-graph {cfg.sft_graph!r}: give teacher, flat or ordered")
    bad = set(cfg.sft_actions.split(",")) - {"plan", "revise", "final"}
    if bad or "plan" not in cfg.sft_actions.split(","):
        raise ValueError(f"--sft-actions {cfg.sft_actions!r}: give plan, optionally with revise and final "
                         "(e.g. plan,final)")
    repeat_counts(cfg)
    for lr in ("sft_lr", "grpo_lr"):
        if not 0 < getattr(cfg, lr) < 1:
            raise ValueError(f"--{lr.replace('_', '-')} {getattr(cfg, lr)}: must be in (0, 1)")
    check_sft_memory(cfg, machine_gb())
    return cfg


def repeat_counts(cfg: LearnConfig) -> dict[str, int]:
    """``--sft-repeat`` as {action: times}, every action of ``--sft-actions`` present (1 unless given)."""
    actions = cfg.sft_actions.split(",")
    counts = dict.fromkeys(actions, 1)
    for part in filter(None, (x.strip() for x in cfg.sft_repeat.split(","))):
        action, _, times = part.partition("=")
        if action not in actions or not times.isdigit() or not 1 <= int(times) <= 10:
            raise ValueError(f"--sft-repeat {cfg.sft_repeat!r}: give ACTION=N pairs, N from 1 to 10, for actions "
                             f"of --sft-actions {cfg.sft_actions} (e.g. plan=3)")
        counts[action] = int(times)
    return counts


def machine_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def sft_peak_gb(cfg: LearnConfig) -> float:
    """Peak memory of one SFT process, measured with stored activations at --sft-batch 2: ~9 GB with
    answer turns (~1,430 tokens), 19.3 GB with revision turns (~2,600 prompt tokens of search results);
    recomputing activations takes about a third of that."""
    peak = (19.3 if "revise" in cfg.sft_actions.split(",") else 9.0) * cfg.sft_batch / 2
    return peak / 3 if cfg.sft_checkpointing else peak


def check_sft_memory(cfg: LearnConfig, total_gb: float) -> None:
    """--jobs SFT processes can run at once; refuse a setting whose peaks add up past the machine's
    memory before anything runs, instead of the kernel killing a seed an hour in."""
    jobs = min(cfg.jobs, len(cfg.seeds))
    need = jobs * sft_peak_gb(cfg)
    if need > 0.9 * total_gb:
        raise ValueError(f"--jobs {cfg.jobs} with --sft-actions {cfg.sft_actions} --sft-batch {cfg.sft_batch}: "
                         f"{jobs} SFT processes need ~{need:.0f} GB at once, this machine has {total_gb:.0f} GB; "
                         "add --sft-checkpointing (about a third of the memory) or lower --jobs")


def parse_args(argv: list[str] | None = None, *, results: Path | None = None, img: Path | None = None) -> LearnConfig:
    """The flags of the experiment; ``results`` and ``img`` replace the default output folders."""
    d = LearnConfig(results=results or LearnConfig.results, img=img or LearnConfig.img)
    p = argparse.ArgumentParser(prog="learning", description="Does training make the model better on held-out "
                                "topics? SFT then GRPO, scored on questions whose topics training never saw "
                                "(docs/learning.md). Subcommands: episodes, answers, curves (each with --help).",
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", type=Path, default=d.work, help="folder for every artefact (resumable)")
    p.add_argument("--results", type=Path, default=d.results, help="where learning.json goes")
    p.add_argument("--img", type=Path, default=d.img, help="where the PNG figures go")
    for name in ("trees", "heldout_topics", "heldout", "max_train", "sft_steps", "sft_batch", "grpo_steps", "num_generations",
                 "prompts_per_step", "rollout_tokens", "eval_max_tokens", "eval_parallel", "lora_r", "top_k", "threads",
                 "jobs", "grpo_train_turns", "grpo_dynamic_sampling"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("sft_lr", "grpo_lr", "minutes"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    p.add_argument("--sft-actions", default=d.sft_actions, help="turns SFT learns from: plan, plus revise (the "
                   "planner's revision) and final (the answerer's final answer), e.g. plan,final")
    p.add_argument("--sft-repeat", default=d.sft_repeat, help="times each turn of an action appears in the SFT "
                   "data, as ACTION=N pairs (e.g. plan=3: each plan three times, the other turns once); changing it "
                   "needs a new --work")
    p.add_argument("--profile", default=d.profile, help="profile of every evaluation: default (each role's own "
                   "schema; GRPO on-policy) or small (graph schema and plan guard, GRPO rollouts under them too)")
    p.add_argument("--sft-graph", default=d.sft_graph, help="taught plan graphs: teacher (as the teacher wrote "
                   "them), flat (aggregates over searches only, ids renumbered) or ordered (the teacher's graphs, ids in reading "
                   "order: searches by the aggregate that first reads them); changing it needs a new --work")
    p.add_argument("--sft-checkpointing", action="store_true", help="SFT recomputes activations in the backward "
                   "pass: ~1/3 of the memory, ~1.27x the time (for machines short of memory)")
    p.add_argument("--sft-bf16", action="store_true", help="SFT in bf16 mixed precision (default fp32: on a CPU "
                   "without native bf16 a step is many times slower; see docs/learning.md)")
    p.add_argument("--grpo-fp32", dest="grpo_bf16", action="store_false", help="GRPO in fp32 (default: bf16 "
                   "weights, rollouts decoded in bf16 too; the evaluations are fp32 either way)")
    p.add_argument("--corpus", default=d.corpus, help="corpus of trees, runs and rollouts (as deepr --corpus)")
    p.add_argument("--formats", default=d.formats, help="decoding constraints of every evaluation, as deepr run --formats: "
                   "schema (each role's own format; the plan's structure is the model's), strict (the small profile's "
                   "per-call formats: a fixed plan skeleton), or a mode with ROLE=MODE exceptions (default: %(default)s)")
    p.add_argument("--llm", default=d.llm, help="base model spec (smollm2, or hf:<folder> of a chat model)")
    p.add_argument("--use-vllm", action="store_true", help="GRPO rollouts with vLLM (GPU)")
    p.add_argument("--report-only", action="store_true", help="run nothing: rescore what --work holds and "
                   "rewrite the results and figures (e.g. after a run was stopped)")
    p.add_argument("--report-to", default=d.report_to, help="GRPO/SFT logging integration (e.g. tensorboard)")
    a = p.parse_args(argv)
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds {a.seeds!r}: comma-separated integers, e.g. 0,1,2")
    kw = {k: v for k, v in vars(a).items() if k != "seeds"}
    try:
        return validate(LearnConfig(seeds=seeds, **kw))
    except ValueError as e:
        p.error(str(e))
        raise


# --- running deepr ------------------------------------------------------------------------------


class Budget:
    """The wall-clock budget: stages start only while time is left; the report says what was cut."""

    def __init__(self, minutes: float) -> None:
        self.t0, self.seconds = time.monotonic(), minutes * 60

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def deepr(args: list[str], log: Path, *, threads: int, ok: tuple[int, ...] = OK_CODES) -> int:
    """Run one ``deepr`` command (this checkout's code), its output appended to ``log``."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false",
           # more torch threads than free cores makes small-model training many times slower here
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n$ deepr {' '.join(args)}\n")
        f.flush()
        rc = subprocess.call([sys.executable, "-m", "deepr", *args], stdout=f, stderr=subprocess.STDOUT, env=env)
        f.write(f"[exit {rc} after {time.monotonic() - t0:.0f} s]\n")
    if rc not in ok:
        raise RuntimeError(f"deepr {args[0]} failed with exit {rc}; see {log}")
    print(f"  deepr {args[0]}: exit {rc}, {time.monotonic() - t0:.0f} s", flush=True)
    return rc


def done(folder: Path) -> bool:
    return (folder / ".done").is_file()


def mark(folder: Path, **info: Any) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / ".done", info)


def write_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()] if path.exists() else []


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
