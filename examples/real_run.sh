#!/usr/bin/env bash
# The demo's chain for a real run: an OpenAI-compatible endpoint as teacher and judge, a real base
# model trained on GPUs. Compare with examples/demo.sh: only the flags marked CHANGED differ.
#
#   TEACHER=openai:Qwen/Qwen3-32B BASE_URL=http://gpu-node:8000/v1 JUDGE=openai:gpt-4.1 \
#   BASE_MODEL=/models/Qwen3-8B CORPUS=/data/my_corpus.jsonl bash examples/real_run.sh runs/r1
#
# Serve the teacher first, e.g. `vllm serve Qwen/Qwen3-32B --port 8000`. The judge may be another
# endpoint: pass JUDGE_BASE_URL, and its key through OPENAI_API_KEY (never on the command line).
set -euo pipefail
# deepr exits 3 when a stage finished but rejected some records or fell back on some turns (see
# README "Exit status"): this script then stops so you can look. To go on, append `|| [ $? -eq 3 ]`.
D=${1:-runs/real}
TEACHER=${TEACHER:?set TEACHER=openai:<model>}
BASE_URL=${BASE_URL:?set BASE_URL=http://host:port/v1}
JUDGE=${JUDGE:-$TEACHER}
JUDGE_BASE_URL=${JUDGE_BASE_URL:-$BASE_URL}
BASE_MODEL=${BASE_MODEL:?set BASE_MODEL=/path/to/hf/checkpoint}
CORPUS=${CORPUS:-wiki}                                  # CHANGED: your corpus (.jsonl/.parquet/folder/hf:)
ACCEL=${ACCEL:-docs/accelerate/multi_gpu.yaml}           # CHANGED: multi-GPU or DeepSpeed ZeRO-2 config
mkdir -p "$D"

deepr index --corpus "$CORPUS"
# CHANGED: more trees, an LLM teacher and a stronger judge; shard with --shard K/N on a cluster.
deepr build-trees --corpus "$CORPUS" --n-trees 500 --llm "$TEACHER" --base-url "$BASE_URL" \
    --concurrency 64 --out "$D/trees.jsonl"
deepr synthesize-rubrics "$D/trees.jsonl" --llm "$TEACHER" --base-url "$BASE_URL" --out "$D/pairs.jsonl"
deepr verify "$D/pairs.jsonl" --judge-llm "$JUDGE" --base-url "$JUDGE_BASE_URL" --out "$D/verified.jsonl"
# CHANGED: the teacher writes the trajectories; warp teacher runs over-expand for best-draft pruning.
deepr run --queries "$D/verified.jsonl" --corpus "$CORPUS" --llm "$TEACHER" --base-url "$BASE_URL" \
    --out "$D/runs-teacher" --record "$D/trajectories.jsonl"
deepr run --queries "$D/verified.jsonl" --corpus "$CORPUS" --llm "$TEACHER" --base-url "$BASE_URL" \
    --mode warp --force-expand 6 --out "$D/runs-warp" --record "$D/trajectories.jsonl"
deepr prune-trajectories "$D/trajectories.jsonl" --rubrics "$D/verified.jsonl" \
    --judge-llm "$JUDGE" --base-url "$JUDGE_BASE_URL" --out-dir "$D/data"
# CHANGED: a real base model on GPUs through accelerate; paper defaults (lr 1e-5, 2 epochs, LoRA 64/128).
accelerate launch --config_file "$ACCEL" -m deepr sft --model "$BASE_MODEL" --data "$D/data/sft.jsonl" \
    --role planner --out "$D/ckpt/planner-sft"
accelerate launch --config_file "$ACCEL" -m deepr grpo --stage planner --model "$D/ckpt/planner-sft" \
    --data "$D/verified.jsonl" --corpus "$CORPUS" --out "$D/ckpt/planner" --use-vllm --vllm-mode colocate
deepr grpo prepare --planner "$D/ckpt/planner" --data "$D/verified.jsonl" --corpus "$CORPUS" \
    --out "$D/prepared.jsonl"
accelerate launch --config_file "$ACCEL" -m deepr grpo --stage answerer --model "$BASE_MODEL" \
    --planner-adapter "$D/ckpt/planner" --data "$D/prepared.jsonl" --judge-llm "$JUDGE" \
    --out "$D/ckpt/answerer" --use-vllm --vllm-mode colocate
TRAINED=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['llm_spec'])" "$D/ckpt/answerer/deepr_meta.json")
deepr run --queries "$D/verified.jsonl" --corpus "$CORPUS" --llm "$TRAINED" --out "$D/runs-trained"
for r in teacher trained; do
  deepr eval "$D/runs-$r" --metric rubric,citation,fact,structure --rubrics "$D/verified.jsonl" \
      --judge-llm "$JUDGE" --base-url "$JUDGE_BASE_URL" --out "$D/scores-$r.jsonl" --html "$D/scores-$r.html"
done
python examples/demo_summary.py "$D"
