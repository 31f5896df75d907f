"""Does deepr make a real model better? SFT then GRPO on SmolLM2-135M-Instruct, measured on
held-out questions whose topics training never saw, through the real CLI at every step.

Pipeline (every step a ``deepr`` command; every output under ``--work``; re-running resumes):
  data     build-trees (wiki) → synthesize-rubrics → verify (extractive teacher, offline) → split
           train / held-out by topic (corpus category), recorded in ``split.json``
  teacher  deepr run --mode dag on the train questions (extractive) --record → prune-trajectories
  base     deepr run --llm smollm2 on the held-out questions (greedy) + deepr eval
  per seed deepr sft --role planner (LoRA) → deepr export (merge) → evaluate;
           deepr grpo --stage planner from the merged SFT model → evaluate (--llm hf:<adapter>)
  report   mean and 95 % bootstrap interval per stage and metric, paired differences, figures

Outputs: ``bench/results/learning.json`` (summary), ``bench/results/learning_runs.json`` (every
held-out run's metrics per stage and seed), ``docs/img/learning_grpo.png`` and
``docs/img/learning_stages.png``. Example (the default is sized for ≤ 60 minutes on 2 CPU cores):

    python bench/learning.py                       # make learn
    python bench/learning.py --trees 120 --heldout 40 --grpo-steps 60 --seeds 0,1,2,3,4 --use-vllm
"""

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.learning_stats import STAGES, split_by_topic  # noqa: E402

OK_CODES = (0, 3)  # 3: done, some turns fell back (recorded per run; the metrics count them)


@dataclass
class LearnConfig:
    """Size and budget of one experiment; every field is a flag of the same name."""

    work: Path = Path("learn-work")
    results: Path = ROOT / "bench" / "results"
    img: Path = ROOT / "docs" / "img"
    trees: int = 30
    heldout_topics: int = 3
    heldout: int = 6
    max_train: int = 24
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    sft_steps: int = 10
    sft_lr: float = 5e-4
    grpo_steps: int = 4
    grpo_lr: float = 1e-4
    num_generations: int = 4
    prompts_per_step: int = 2
    rollout_tokens: int = 800
    eval_max_tokens: int = 400
    lora_r: int = 16
    top_k: int = 3
    minutes: float = 60.0
    llm: str = "smollm2"
    corpus: str = "wiki"
    use_vllm: bool = False
    threads: int = 1
    jobs: int = 2
    report_to: str = "none"
    report_only: bool = False


def positive(name: str, value: float, *, minimum: float = 1) -> None:
    if value < minimum:
        raise ValueError(f"--{name.replace('_', '-')} {value}: must be at least {minimum}")


def validate(cfg: LearnConfig) -> LearnConfig:
    """One-line errors for sizes and budgets that cannot work, before anything runs."""
    for name in ("trees", "heldout_topics", "heldout", "max_train", "sft_steps", "grpo_steps", "prompts_per_step",
                 "rollout_tokens", "eval_max_tokens", "lora_r", "top_k", "threads", "jobs"):
        positive(name, getattr(cfg, name))
    positive("num_generations", cfg.num_generations, minimum=2)  # a GRPO group needs two rollouts to compare
    positive("minutes", cfg.minutes, minimum=1)
    if cfg.trees < 2 * cfg.heldout_topics:
        raise ValueError(f"--trees {cfg.trees}: too few to hold out {cfg.heldout_topics} topics and train on others")
    if not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds):
        raise ValueError(f"--seeds {cfg.seeds}: give distinct seeds, e.g. 0,1,2")
    for lr in ("sft_lr", "grpo_lr"):
        if not 0 < getattr(cfg, lr) < 1:
            raise ValueError(f"--{lr.replace('_', '-')} {getattr(cfg, lr)}: must be in (0, 1)")
    return cfg


def parse_args(argv: list[str] | None = None) -> LearnConfig:
    d = LearnConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", type=Path, default=d.work, help="folder for every artefact (resumable)")
    p.add_argument("--results", type=Path, default=d.results, help="where learning.json goes")
    p.add_argument("--img", type=Path, default=d.img, help="where the PNG figures go")
    for name in ("trees", "heldout_topics", "heldout", "max_train", "sft_steps", "grpo_steps", "num_generations",
                 "prompts_per_step", "rollout_tokens", "eval_max_tokens", "lora_r", "top_k", "threads", "jobs"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("sft_lr", "grpo_lr", "minutes"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    p.add_argument("--corpus", default=d.corpus, help="corpus of trees, runs and rollouts (as deepr --corpus)")
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


# --- stages -------------------------------------------------------------------------------------


def build_data(cfg: LearnConfig, log: Path) -> tuple[Path, Path]:
    """Trees, verified pairs, the by-topic split; returns (train.jsonl, heldout.jsonl)."""
    w, t = cfg.work, cfg.threads
    train, held = w / "train.jsonl", w / "heldout.jsonl"
    if done(w / "data"):
        return train, held
    deepr(["build-trees", "--corpus", cfg.corpus, "--n-trees", str(cfg.trees), "--seed", "0", "--max-depth", "2",
           "--out", str(w / "trees.jsonl")], log, threads=t)
    deepr(["synthesize-rubrics", str(w / "trees.jsonl"), "--out", str(w / "pairs.jsonl")], log, threads=t)
    deepr(["verify", str(w / "pairs.jsonl"), "--out", str(w / "verified.jsonl")], log, threads=t)
    pairs, trees = read_jsonl(w / "verified.jsonl"), read_jsonl(w / "trees.jsonl")
    tr, ho, record = split_by_topic(pairs, trees, heldout_topics=cfg.heldout_topics, seed=0,
                                    max_heldout=cfg.heldout, max_train=cfg.max_train)
    if not tr or not ho:
        raise RuntimeError(f"the split left {len(tr)} train and {len(ho)} held-out questions; raise --trees")
    write_jsonl(train, tr)
    write_jsonl(held, ho)
    write_atomic(w / "split.json", record)
    mark(w / "data", train=len(tr), heldout=len(ho))
    return train, held


def teacher_sft_data(cfg: LearnConfig, train: Path, log: Path) -> Path:
    """Teacher (extractive) trajectories on the train questions, pruned into SFT examples."""
    w = cfg.work
    out = w / "sft-data"
    if not done(out):
        deepr(["run", "--queries", str(train), "--mode", "dag", "--corpus", cfg.corpus, "--top-k", str(cfg.top_k),
               "--out", str(w / "runs-teacher"),
               "--record", str(w / "trajectories.jsonl")], log, threads=cfg.threads)
        deepr(["prune-trajectories", str(w / "trajectories.jsonl"), "--rubrics", str(train), "--out-dir", str(out),
               "--heldout", "0", "--target-ratios", "none"], log, threads=cfg.threads)
        mark(out, **compact_sft(out / "sft.jsonl", out / "sft-compact.jsonl"))
    return out / "sft-compact.jsonl"


def _words(text: Any, n: int) -> str:
    return " ".join(str(text or "").replace("\u2026", " ").split()[:n])


def compact_plan(reply: str, *, query_words: int = 7) -> str | None:
    """The teacher's plan with queries and needs cut to a few words and the optional key points
    dropped (ids, types, inputs and fetch lists untouched); None when the reply is not a plan. The
    extractive teacher copies whole evidence sentences into key points (~600 tokens a plan): a 135M
    model on CPU writes a plan of that length in minutes, so it learns the same graphs in short form."""
    try:
        value = json.loads(reply)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("nodes"), list):
        return None
    for node in value["nodes"]:
        if not isinstance(node, dict):
            return None
        if node.get("query"):
            node["query"] = _words(node["query"], query_words)
        if node.get("need"):
            node["need"] = _words(node["need"], query_words + 2)
        node.pop("key_points", None)  # optional; the teacher fills them with copied evidence sentences
    return json.dumps(value, ensure_ascii=False)


def compact_sft(src: Path, dest: Path) -> dict[str, int]:
    """Planner examples of ``src`` with compact plan replies (see :func:`compact_plan`) → ``dest``."""
    kept, skipped = [], 0
    for ex in read_jsonl(src):
        if ex.get("role") != "planner":
            continue
        short = compact_plan(ex["messages"][-1]["content"])
        if short is None:
            skipped += 1
            continue
        ex["messages"][-1] = {**ex["messages"][-1], "content": short}
        kept.append(ex)
    write_jsonl(dest, kept)
    return {"planner_examples": len(kept), "not_a_plan": skipped}


def base_model(cfg: LearnConfig) -> str:
    """Folder of the base checkpoint (smollm2 is converted once into deepr's cache)."""
    if cfg.llm == "smollm2":
        sys.path.insert(0, str(ROOT))
        from deepr.llm.smollm2 import smollm2_dir

        return str(smollm2_dir())
    if cfg.llm.startswith("hf:"):
        return cfg.llm[3:]
    raise ValueError(f"--llm {cfg.llm!r}: the experiment trains a local model; give smollm2 or hf:<folder>")


def evaluate(cfg: LearnConfig, spec: str, name: str, held: Path, seed: int, log: Path) -> Path:
    """`deepr run` on the held-out questions with ``spec`` (greedy), then `deepr eval`; returns the
    scores file. The same command for every stage: only --llm differs."""
    runs, scores = cfg.work / "runs" / name, cfg.work / "scores" / f"{name}.jsonl"
    if done(runs):
        return scores
    deepr(["run", "--queries", str(held), "--mode", "dag", "--corpus", cfg.corpus, "--top-k", str(cfg.top_k), "--llm", spec, "--out", str(runs), "--no-cache",
           "--temperature", "0", "--seed", str(seed), "--max-tokens", str(cfg.eval_max_tokens), "--timeout", "900",
           "--max-reasks", "0", "--allow-fallback"], log, threads=cfg.threads)
    scores.parent.mkdir(parents=True, exist_ok=True)
    deepr(["eval", str(runs), "--metric", "plan_reward,rubric,citation", "--rubrics", str(held), "--out",
           str(scores), "--allow-fallback"], log, threads=cfg.threads)
    mark(runs, spec=spec)
    return scores


def train_seed(cfg: LearnConfig, base: str, sft_data: Path, train: Path, seed: int, log: Path) -> tuple[str, str]:
    """SFT (LoRA, planner turns), merge, GRPO planner from the merged model; returns the two --llm specs."""
    w = cfg.work / f"seed{seed}"
    sft, merged, grpo = w / "sft", w / "sft-merged", w / "grpo"
    if not done(sft):
        deepr(["sft", "--model", base, "--data", str(sft_data), "--role", "planner", "--out", str(sft),
               "--lora-r", str(cfg.lora_r), "--lora-alpha", str(2 * cfg.lora_r), "--lr", str(cfg.sft_lr),
               "--max-steps", str(cfg.sft_steps), "--grad-accum", "1", "--batch-size", "1", "--max-length", "4096",
               "--logging-steps", "1", "--seed", str(seed), "--report-to", cfg.report_to, "--resume"],
              log, threads=cfg.threads)
        mark(sft)
    if not done(merged):
        if merged.exists():  # a merge cut short: export wants an empty folder
            import shutil

            shutil.rmtree(merged)
        deepr(["export", str(sft), "--out", str(merged)], log, threads=cfg.threads)
        mark(merged)
    if not done(grpo):
        conf = {"seed": seed, "lora_r": cfg.lora_r, "lora_alpha": 2 * cfg.lora_r, "learning_rate": cfg.grpo_lr,
                "temperature": 0.8, "max_turn_tokens": cfg.eval_max_tokens, "zero_advantage": "warn", "save_steps": 1, "report_to": cfg.report_to,
                "use_vllm": cfg.use_vllm}
        write_atomic(w / "grpo.json", conf)
        deepr(["grpo", "--stage", "planner", "--model", str(merged), "--data", str(train), "--out", str(grpo),
               "--config", str(w / "grpo.json"), "--corpus", cfg.corpus, "--k", str(cfg.top_k), "--max-steps", str(cfg.grpo_steps),
               "--num-generations", str(cfg.num_generations), "--prompts-per-step", str(cfg.prompts_per_step),
               "--max-completion-length", str(cfg.rollout_tokens), "--resume"], log, threads=cfg.threads, ok=(0,))
        mark(grpo)
    return f"hf:{merged}", f"hf:{grpo}"


# --- the experiment -----------------------------------------------------------------------------


def seed_pipeline(cfg: LearnConfig, base: str, sft_data: Path, train: Path, held: Path, seed: int,
                  held_ids: list[str]) -> dict[str, Any]:
    """One seed: SFT → merge → evaluate; GRPO → evaluate. Returns {stage: per-question metrics}."""
    from bench.learning_report import collect

    log = cfg.work / f"learning-seed{seed}.log"
    sft_spec, grpo_spec = train_seed(cfg, base, sft_data, train, seed, log)
    evaluate(cfg, sft_spec, f"sft-s{seed}", held, seed, log)
    evaluate(cfg, grpo_spec, f"grpo-s{seed}", held, seed, log)
    return {"sft": collect(cfg, f"sft-s{seed}", held_ids), "grpo": collect(cfg, f"grpo-s{seed}", held_ids)}


def experiment(cfg: LearnConfig) -> dict[str, Any]:
    """Data and teacher first; then the base evaluation and the seeds, ``--jobs`` at a time
    (each job one process with ``--threads`` torch threads); a report after each finishes."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    from bench.learning_report import collect, report

    budget, log = Budget(cfg.minutes), cfg.work / "learning.log"
    cfg.work.mkdir(parents=True, exist_ok=True)
    print(f"deepr learning experiment in {cfg.work} (logs: {cfg.work}/learning*.log); budget {cfg.minutes:g} min",
          flush=True)
    train, held = build_data(cfg, log)
    held_ids = [r["id"] for r in read_jsonl(held)]
    sft_data = teacher_sft_data(cfg, train, log)
    base = base_model(cfg)
    per_run: dict[str, dict[int, Any]] = {s: {} for s in STAGES}
    skipped: list[int] = []
    with ThreadPoolExecutor(max_workers=cfg.jobs) as pool:
        futures = {pool.submit(evaluate, cfg, f"hf:{base}", "base", held, 0, cfg.work / "learning-base.log"): "base"}
        queue = list(cfg.seeds)
        while futures:
            while queue and len(futures) < cfg.jobs:
                seed = queue.pop(0)
                if budget.left() <= 0:
                    skipped.append(seed)
                    continue
                futures[pool.submit(seed_pipeline, cfg, base, sft_data, train, held, seed, held_ids)] = seed
            finished, _ = wait(futures, return_when=FIRST_COMPLETED)
            for fut in finished:
                what = futures.pop(fut)
                result = fut.result()  # a failed command stops the experiment with its log named
                if what == "base":
                    rows = collect(cfg, "base", held_ids)
                    per_run["base"] = {s: rows for s in cfg.seeds}
                else:
                    per_run["sft"][what], per_run["grpo"][what] = result["sft"], result["grpo"]
                if per_run["base"]:
                    report(cfg, per_run, held_ids, budget, f"running: seeds done {sorted(per_run['grpo'])}")
    status = "complete" if not skipped else (f"partial: the {cfg.minutes:g}-minute budget ran out before seeds "
                                             f"{skipped} started")
    return report(cfg, per_run, held_ids, budget, status)


def main(argv: list[str] | None = None) -> int:
    from bench.learning_report import rescore

    cfg = parse_args(argv)
    try:
        res = rescore(cfg) if cfg.report_only else experiment(cfg)
    except (RuntimeError, ValueError) as e:
        print(f"learning: {e}", file=sys.stderr)
        return 1
    r = res["differences"].get("grpo_minus_base", {}).get("r_plan")
    wall = f"{res['wall_seconds'] / 60:.1f} min" if res["wall_seconds"] is not None else "rescored"
    print(f"{res['status']}; {wall}; R_plan SFT+GRPO − base: {r}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
