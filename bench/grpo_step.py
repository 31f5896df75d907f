"""One planner GRPO step on a real small model, before vs after a change: what the reward gives
the gradient to work with.

Each label runs ``train_grpo`` for ONE optimiser step in a fresh child process, with the code at
``--code`` (e.g. ``git archive <commit> deepr | tar -x -C /tmp/before``) and that code's defaults
(rollout formats, validity, re-asks), on the same questions, model, seed and sizes. The reward
function is wrapped to record every rollout's R_plan, so the result holds, per GRPO group, the
rewards' mean and standard deviation, and over the step the share of groups whose rewards are
all equal (zero advantage: no gradient), plus where each scored plan came from.

    python bench/grpo_step.py --model "$(python -m deepr.llm.smollm2)" --data verified.jsonl \
        --label before --code /tmp/before --label after --code . --out bench/results/grpo_step.json

Sizes (default): 2 questions x 4 rollouts, turns of at most 384 tokens, LoRA r 8; SmolLM2-135M
samples ~15 tokens/s on 2 CPU cores, so one label takes several minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time
from pathlib import Path
opts = json.loads(sys.argv[1])
from deepr.corpus import open_retriever
from deepr.io import read_jsonl
from deepr.records import QRPair
from deepr.rewards.trl_adapters import PlanRewardFn
from deepr.train.grpo import GrpoConfig, planner_dataset, train_grpo
from deepr.train.rollouts import PlannerEnvironment

pairs = [p for p in read_jsonl(Path(opts.pop("data")), QRPair) if p.decision in (None, "KEEP", "REVISE")]
rows, lookup = planner_dataset(pairs[:opts["prompts_per_step"]])
config = GrpoConfig(**opts)
env = PlannerEnvironment(open_retriever(config.corpus, retriever=config.retriever), k=config.k,
                         fetch_limit=config.fetch_limit)
seen = []
class Recording(PlanRewardFn):
    def __call__(self, prompts, completions, **cols):
        out = super().__call__(prompts, completions, **cols)
        seen.append({"rewards": list(out), "source": list(cols.get("plan_source") or [])})
        return out
t0 = time.perf_counter()
res = train_grpo(config, rows, lookup, env=env, reward_fn=Recording())
g = config.num_generations
batch = seen[0]
groups = [batch["rewards"][i:i + g] for i in range(0, len(batch["rewards"]), g)]
stats = [{"mean": statistics.fmean(x), "std": statistics.pstdev(x), "rewards": x} for x in groups]
log = [json.loads(x) for x in (config.out / "metrics.jsonl").read_text().splitlines()]
import deepr
print("RESULT " + json.dumps({"deepr_from": deepr.__file__,
    "steps": res.steps, "seconds": round(time.perf_counter() - t0, 1), "groups": stats,
    "zero_advantage_fraction": sum(s["std"] == 0 for s in stats) / len(stats),
    "reward_mean": statistics.fmean(batch["rewards"]), "plan_source": batch["source"],
    "initial_plan_valid": log[0].get("rollout/initial_plan_valid"),
    "rollout_formats": getattr(config, "rollout_formats", None)}))
"""


def run_one(code: Path, opts: dict, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code.resolve()), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    # cwd: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH, so run
    # from the copy's root or the checkout's own deepr is imported whatever --code says
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(opts)], env=env, capture_output=True, text=True,
                          check=False, cwd=code.resolve())
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{code}: the child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Model folder (e.g. SmolLM2-135M-Instruct in HF format).")
    ap.add_argument("--data", type=Path, required=True, help="verified.jsonl (QRPair rows).")
    ap.add_argument("--label", action="append", required=True, help="Row label; one per --code.")
    ap.add_argument("--code", action="append", type=Path, required=True, help="Root of the deepr copy to run.")
    ap.add_argument("--questions", type=int, default=2, help="Questions (GRPO groups) in the step.")
    ap.add_argument("--group", type=int, default=4, help="Rollouts per question.")
    ap.add_argument("--turn-tokens", type=int, default=384, help="Most tokens of one model turn.")
    ap.add_argument("--corpus", default="wiki")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/grpo_step.json"))
    args = ap.parse_args()
    if len(args.label) != len(args.code):
        ap.error("give one --code per --label")
    rows = {}
    for label, code in zip(args.label, args.code):
        with tempfile.TemporaryDirectory() as tmp:
            opts = {"stage": "planner", "model": args.model, "out": str(Path(tmp) / "rl"), "data": str(args.data),
                    "num_generations": args.group, "prompts_per_step": args.questions, "mini_batch_prompts": 1,
                    "max_steps": 1, "max_turn_tokens": args.turn_tokens,
                    "max_completion_length": 4 * args.turn_tokens, "lora_r": 8, "lora_alpha": 16, "k": 3,
                    "corpus": args.corpus, "retriever": "bm25", "zero_advantage": "off", "seed": 0}
            t0 = time.perf_counter()
            rows[label] = {**run_one(code, opts, args.threads), "wall_seconds": round(time.perf_counter() - t0, 1),
                           "code": str(code)}
            print(label, json.dumps({k: v for k, v in rows[label].items() if k != "groups"}), flush=True)
    out = {"model": args.model, "data": str(args.data), "questions": args.questions, "group": args.group,
           "turn_tokens": args.turn_tokens, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
