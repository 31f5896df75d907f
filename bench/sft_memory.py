"""Peak memory and speed of ``deepr sft`` (or one GRPO step) on a real small model, one row per
``--label`` / ``--code`` (a deepr source root: another copy gives the "before" row), each in a
fresh child process: peak RSS (``ru_maxrss`` of the reaped child, cross-checked with ``VmHWM``),
wall and CPU seconds per optimiser step, the first step apart. Default data: 8 planner-shaped
wiki examples (~1.1k-3.7k tokens, the demo's planner lengths); settings: examples/demo.sh's sft.

    python bench/sft_memory.py --model "$(python -m deepr.llm.smollm2)" \
        --label before --code .bench-work/before --label after --code . --out bench/results/sft_memory.json

``--grpo-scripted``: one planner GRPO step at the learning bench's sizes, every model turn a fixed
plan from ``--plan-from`` (no generation), e.g. activation recomputation off / on:

    python bench/sft_memory.py --grpo-scripted --model learn-work/seed0/sft-merged --data learn-work/train.jsonl \
        --plan-from learn-work/trajectories.jsonl --steps 1 --rss-cap-mb 12000 \
        --label off --code . --overrides '{"gradient_checkpointing": false}' \
        --label on --code . --overrides '{"gradient_checkpointing": true}'

Rows of other labels are kept; ``ratios`` compares each row with its run's first row.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import RESULTS, peak_rss_mb, read_json, wiki_summaries, write_json

# Both children time their steps with this callback and read their options from argv[1].
CHILD_HEAD = r"""
import json, sys, time
from pathlib import Path
from transformers import TrainerCallback
class Timer(TrainerCallback):
    times, cpu = [], []
    def on_step_begin(self, *a, **k): self.t, self.c = time.perf_counter(), time.process_time()
    def on_step_end(self, *a, **k):
        self.times.append(time.perf_counter() - self.t)
        self.cpu.append(time.process_time() - self.c)
"""

# Runs inside the child: one sft run with a step timer; prints one JSON line.
CHILD = CHILD_HEAD + r"""
from deepr.io import read_jsonl
from deepr.records import ChatExample
from deepr.train.sft import SftConfig, train_sft

opts = json.loads(sys.argv[1])
examples = list(read_jsonl(Path(opts.pop("data")), ChatExample))
timer = Timer()
res = train_sft(examples, SftConfig(**opts), callbacks=[timer])
print("RESULT " + json.dumps({"step_seconds": timer.times, "step_cpu_seconds": timer.cpu, "examples": res.examples, "steps": res.steps,
                              "rejected": len(res.rejects), "losses": res.losses}))
"""


# The GRPO variant (--grpo): `deepr grpo --stage planner` at the demo's settings on QRPair rows.
GRPO_CHILD = CHILD_HEAD + r"""
from deepr.corpus import open_retriever
from deepr.io import read_jsonl
from deepr.records import QRPair
from deepr.train.grpo import GrpoConfig, planner_dataset, train_grpo
from deepr.train.environments import PlannerEnvironment

opts = json.loads(sys.argv[1])
pairs = [p for p in read_jsonl(Path(opts.pop("data")), QRPair) if p.decision in (None, "KEEP", "REVISE")]
rows, lookup = planner_dataset(pairs)
config = GrpoConfig(**opts)
env = PlannerEnvironment(open_retriever(config.corpus, retriever=config.retriever), k=config.k,
                         fetch_limit=config.fetch_limit)
timer = Timer()
res = train_grpo(config, rows, lookup, env=env, callbacks=[timer])
print("RESULT " + json.dumps({"step_seconds": timer.times, "step_cpu_seconds": timer.cpu, "examples": len(rows),
                              "steps": res.steps, "rewards": res.rewards}))
"""


# --grpo-scripted: the same planner step, but every model turn is a fixed reply (a valid plan,
# padded to --turn-tokens tokens), so the training step's memory is measured at the learning bench's
# sizes without paying for CPU generation. Turn 1 is valid, so turn 2's prompt carries real search results.
GRPO_SCRIPTED_CHILD = GRPO_CHILD.replace("timer = Timer()", r"""
plan_text, turn_tokens = opts_extra["plan"], opts_extra["turn_tokens"]
def generate_for(trainer):
    tok = trainer.processing_class
    ids = tok(plan_text, add_special_tokens=False)["input_ids"]
    pad = tok(" ", add_special_tokens=False)["input_ids"]
    reply = (ids + pad * turn_tokens)[:max(turn_tokens - 1, len(ids))] + [tok.eos_token_id]  # ends inside the cap
    return lambda seqs, first, max_new: ([reply[:max_new] for _ in seqs], None)
timer = Timer()""").replace("callbacks=[timer])", "callbacks=[timer], generate_for=generate_for)").replace(
    "opts = json.loads(sys.argv[1])", "opts = json.loads(sys.argv[1]); opts_extra = opts.pop('scripted')")


def measure(code: Path, opts: dict, child: str = CHILD, rss_cap_mb: int | None = None) -> dict:
    """One sft (or grpo) run in a child process: peak RSS (MB) and seconds per step."""
    env = {**os.environ, "PYTHONPATH": str(code.resolve()), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    # `python -c` puts the working directory first on sys.path: run in `code` so that its deepr is the
    # one imported, not the copy in whatever folder the bench was started from.
    proc = subprocess.Popen([sys.executable, "-c", child, json.dumps(opts)], env=env, cwd=code.resolve(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampled, capped = [0], [False]

    def sample() -> None:  # the kernel keeps the high-water mark; sampling only guards against a reused pid
        while proc.poll() is None:
            sampled[0] = max(sampled[0], int(1024 * (peak_rss_mb(proc.pid) or 0)))
            if rss_cap_mb and sampled[0] > rss_cap_mb * 1024:  # a shared machine: stop before the OOM killer does
                capped[0] = True
                proc.kill()
            time.sleep(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, err = proc.communicate()
    thread.join()
    wall = time.perf_counter() - t0
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if capped[0]:
        return {"peak_rss_mb": None, "killed_above_rss_mb": rss_cap_mb, "wall_seconds": round(wall, 1)}
    if proc.returncode or line is None:
        raise SystemExit(f"sft child failed (exit {proc.returncode}):\n{err[-3000:]}")
    res = json.loads(line[len("RESULT "):])
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the max over all reaped children: only trust it when it grew.
    peak = max(peak_kb if peak_kb > before else 0, sampled[0])
    steps, cpu = res.pop("step_seconds"), res.pop("step_cpu_seconds")
    later, cpu_later = steps[1:] or steps, cpu[1:] or cpu
    return {"peak_rss_mb": round(peak / 1024, 1), "wall_seconds": round(wall, 1),
            "first_step_seconds": round(steps[0], 2) if steps else None,
            "seconds_per_step": round(sum(later) / len(later), 2) if later else None,
            "step_seconds": [round(s, 2) for s in steps],
            # CPU seconds (all threads) per step: comparable across runs when other jobs share the cores
            "cpu_seconds_per_step": round(sum(cpu_later) / len(cpu_later), 2) if cpu_later else None, **res}


def synthetic_data(path: Path, n: int = 8) -> Path:
    """Planner-shaped chat examples from the wiki corpus (see the module docstring)."""
    arts = [a["extract"] for a in wiki_summaries().values() if a.get("extract")][:400]
    rows = []
    for i in range(n):
        evidence = "\n".join(f"[S{j}] {arts[(i * 40 + j) % len(arts)]}" for j in range(12 if i % 2 else 40))
        if i % 2 == 0:  # long examples: the first 30 lines (a snippet may span several)
            evidence = "\n".join(evidence.split("\n")[:30])
        plan = {"nodes": [{"id": "S1", "type": "search", "query": arts[i][:80]}]}
        rows.append({"id": f"syn{i}", "role": "planner", "action": "revise", "query_id": f"q{i}", "messages": [
            {"role": "system", "content": "You plan research as a JSON graph of search nodes."},
            {"role": "user", "content": f"Question {i}: what links these topics?\nEvidence:\n{evidence}"},
            {"role": "assistant", "content": json.dumps(plan)}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def ratios(rows: dict) -> dict:
    """Each later row against the first of this run that finished (a row killed at --rss-cap-mb has
    nothing to divide by): peak RSS and CPU time per step as ratios, and how far its losses (GRPO:
    rewards) are from that row's (same data and seed: they should agree)."""
    labels = [label for label in rows if rows[label].get("peak_rss_mb")]
    if len(labels) < 2:
        return {}
    base, out = rows[labels[0]], {}
    what = "losses" if "losses" in base else "rewards"

    def values(row: dict) -> list[float]:
        return [v[-1] if isinstance(v, list) else v for v in row.get(what, [])]

    for label in labels[1:]:
        row = rows[label]
        cpu = (row["cpu_seconds_per_step"] / base["cpu_seconds_per_step"]
               if row.get("cpu_seconds_per_step") and base.get("cpu_seconds_per_step") else None)
        diffs = [abs(a - b) for a, b in zip(values(row), values(base))]
        out[f"{label} / {labels[0]}"] = {
            "peak_rss": round(row["peak_rss_mb"] / base["peak_rss_mb"], 3),
            "cpu_seconds_per_step": round(cpu, 3) if cpu else None,
            f"{what}_identical": values(row) == values(base),
            f"{what}_max_abs_diff": max(diffs) if diffs else None}
    return out


def scripted_plan(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        turns = json.loads(line).get("turns", [])
        plan = next((t["completion"] for t in turns if t.get("action") == "plan" and t.get("ok")), None)
        if plan:  # the learning bench's compact form, so that it fits a turn and turn 2 gets the search results
            from deepr.learn.pipeline import compact_plan

            return compact_plan(plan) or plan
    raise SystemExit(f"{path}: no accepted planner turn (action 'plan', ok) to script turn 1 with")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Model folder (e.g. SmolLM2-135M-Instruct converted to HF).")
    ap.add_argument("--data", type=Path, help="sft.jsonl from prune-trajectories; default: synthetic (docstring).")
    ap.add_argument("--label", action="append", required=True, help="Name of a row; pair each with --code.")
    ap.add_argument("--code", action="append", required=True, type=Path, help="deepr source root for that row.")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lora", action="store_true", help="LoRA (deepr's default) instead of the demo's --full.")
    ap.add_argument("--grpo", action="store_true", help="Measure `grpo --stage planner` at the demo's settings "
                    "instead (--data: verified.jsonl / pairs.jsonl; corpus wiki from $DEEPR_CACHE).")
    ap.add_argument("--grpo-scripted", action="store_true", help="Measure one planner GRPO step at the learning "
                    "bench's sizes with scripted turns (no generation): --generations x --prompts rollouts of two "
                    "--turn-tokens turns; the plan of turn 1 is taken from --plan-from (a trajectories.jsonl).")
    ap.add_argument("--rss-cap-mb", type=int, help="Kill a run whose resident memory passes this (recorded as "
                    "killed_above_rss_mb), so that a measurement cannot take the machine down.")
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--turn-tokens", type=int, default=400)
    ap.add_argument("--plan-from", type=Path, help="trajectories.jsonl whose first planner turn is the scripted plan.")
    ap.add_argument("--overrides", action="append", default=[], help="Per --label: a JSON object of config "
                    "fields for that row (e.g. '{\"gradient_checkpointing\": false}').")
    ap.add_argument("--out", type=Path, default=RESULTS / "sft_memory.json")
    args = ap.parse_args()
    if len(args.label) != len(args.code):
        ap.error("give one --code per --label")
    if args.overrides and len(args.overrides) != len(args.label):
        ap.error("give one --overrides per --label, or none")
    overrides = [json.loads(o) for o in args.overrides] or [{} for _ in args.label]
    args.grpo = args.grpo or args.grpo_scripted
    if args.grpo_scripted and args.plan_from is None:
        ap.error("--grpo-scripted needs --plan-from (a trajectories.jsonl with a planner turn)")
    rows = {}
    data_tmp = tempfile.TemporaryDirectory()
    if args.grpo and args.data is None:
        ap.error("--grpo needs --data (QRPair rows: verified.jsonl or pairs.jsonl)")
    if args.data is None:
        args.data = synthetic_data(Path(data_tmp.name) / "sft.jsonl")
    for label, code, extra in zip(args.label, args.code, overrides):
        with tempfile.TemporaryDirectory() as tmp:
            opts = {"model": args.model, "data": str(args.data), "out": str(Path(tmp) / "o"), "max_steps": args.steps,
                    "save_steps": 10_000}
            if args.grpo_scripted:
                n = args.turn_tokens
                opts = {**opts, "stage": "planner", "num_generations": args.generations,
                        "prompts_per_step": args.prompts, "max_turn_tokens": n, "max_completion_length": 2 * n,
                        "k": 3, "zero_advantage": "off", "lora_r": 16, "lora_alpha": 32, **extra,
                        "scripted": {"plan": scripted_plan(args.plan_from), "turn_tokens": n}}
                row = {"overrides": extra, **measure(code, opts, GRPO_SCRIPTED_CHILD, args.rss_cap_mb)}
            elif args.grpo:  # examples/demo.sh grpo-planner; "warn" keeps a zero-reward group from ending the run
                opts.update(stage="planner", num_generations=2, prompts_per_step=1, max_completion_length=256, k=2,
                            zero_advantage="warn")
                row = measure(code, opts, GRPO_CHILD)
            else:
                opts = {**opts, "role": "planner", "full": not args.lora, "learning_rate": 1e-3, "grad_accum": 1,
                        "max_length": 4096, "logging_steps": 1, **extra}
                row = {**({"overrides": extra} if extra else {}), **measure(code, opts)}
        rows[label] = {"code": str(code), **row}
        print(label, json.dumps(rows[label]), flush=True)
    result = {"model": args.model, "data": "synthetic (see docstring)" if args.data.is_relative_to(data_tmp.name)
              else str(args.data), "steps": args.steps,
              "settings": (f"learning-bench grpo planner, scripted turns: {args.generations} generations x "
                           f"{args.prompts} prompts, turns of {args.turn_tokens} tokens, k 3, LoRA r 16"
                           if args.grpo_scripted else "demo.sh grpo-planner: --num-generations 2 --prompts-per-step 1 --max-completion-length "
                           "256 --k 2 (LoRA), zero_advantage warn" if args.grpo else
                           "demo.sh sft: --role planner --lr 1e-3 --grad-accum 1 --max-length 4096 "
                           + ("(LoRA)" if args.lora else "--full")),
              "machine": f"{os.cpu_count()} cpus; timings taken under load from other jobs", "runs": rows}
    existing = read_json(args.out)
    key = "grpo_planner_scripted" if args.grpo_scripted else "grpo_planner" if args.grpo else "lora" if args.lora else "full"
    result["ratios"] = {**existing.get(key, {}).get("ratios", {}), **ratios(rows)}
    result["runs"] = {**existing.get(key, {}).get("runs", {}), **rows}  # rows of other labels stay
    existing[key] = result
    write_json(args.out, existing)
    print(f"wrote {args.out} [{key}]")


if __name__ == "__main__":
    main()
