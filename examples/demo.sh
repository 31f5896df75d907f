#!/usr/bin/env bash
# The whole deepr pipeline on offline defaults: wiki corpus, extractive backend (no LLM), a tiny
# locally built model for training. Every artefact lands in one folder; re-running resumes.
#
#   bash examples/demo.sh [DEMO_DIR]        (make demo runs this inside the project's .venv)
#
# For a real run (an LLM endpoint as teacher/judge, a GPU model) see examples/real_run.sh.
set -euo pipefail
D=${1:-demo}
N_TREES=${N_TREES:-6}
mkdir -p "$D"
export PATH="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin:$PATH"
: > "$D/timings.tsv"

source "$(dirname "$0")/steps.sh"

Q="How did the printing press change the spread of scientific knowledge in Europe?"

step index          deepr index --corpus wiki
step search         deepr search "how do vaccines train the immune system" -k 3
step build-trees    deepr build-trees --corpus wiki --n-trees "$N_TREES" --out "$D/trees.jsonl"
step rubrics        deepr synthesize-rubrics "$D/trees.jsonl" --out "$D/pairs.jsonl"
step verify         deepr verify "$D/pairs.jsonl" --out "$D/verified.jsonl"
# The warp and trained runs take the first two questions. A fixed file, so a re-run skips them:
# --limit counts pending queries, and would take two new ones (and change the SFT data) each time.
head -n 2 "$D/verified.jsonl" > "$D/sample.jsonl"
# Teacher runs on the verified questions (dag), plus warp runs forced to over-expand for pruning.
step run-teacher    deepr run --queries "$D/verified.jsonl" --out "$D/runs-teacher" --mode dag \
                      --record "$D/trajectories.jsonl"
step run-warp       deepr run --queries "$D/sample.jsonl" --out "$D/runs-warp" --mode warp \
                      --force-expand 2 --record "$D/trajectories.jsonl"
step prune          deepr prune-trajectories "$D/trajectories.jsonl" --rubrics "$D/verified.jsonl" \
                      --out-dir "$D/data" --heldout 0.2
step tiny-model     python -m deepr.train.tiny "$D/tiny-base"
step sft            deepr sft --model "$D/tiny-base" --data "$D/data/sft.jsonl" --role planner \
                      --out "$D/ckpt/planner-sft" --full --lr 1e-3 --max-steps 20 --grad-accum 1 \
                      --max-length 4096 --resume
step grpo-planner   deepr grpo --stage planner --model "$D/ckpt/planner-sft" --data "$D/verified.jsonl" \
                      --out "$D/ckpt/planner" --max-steps 2 --num-generations 2 --prompts-per-step 1 \
                      --max-completion-length 256 --k 2 --resume
step grpo-prepare   deepr grpo prepare --planner "$D/ckpt/planner" --data "$D/verified.jsonl" \
                      --out "$D/prepared.jsonl" --k 2
step grpo-answerer  deepr grpo --stage answerer --model "$D/ckpt/planner-sft" \
                      --planner-adapter "$D/ckpt/planner" --data "$D/prepared.jsonl" \
                      --out "$D/ckpt/answerer" --max-steps 2 --num-generations 2 --prompts-per-step 1 \
                      --max-completion-length 256 --resume
TRAINED=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['llm_spec'])" "$D/ckpt/answerer/deepr_meta.json")
# The tiny model is trained for a few steps only: most of its turns fall back to the extractive
# roles (recorded in each trace), so this step accepts fallback explicitly.
step run-trained    deepr run --queries "$D/sample.jsonl" --out "$D/runs-trained" \
                      --llm "$TRAINED" --timeout 600 --allow-fallback
step quickstart     deepr run "$Q" --out "$D/report.md" --html
step eval-teacher   deepr eval "$D/runs-teacher" --metric rubric,citation,structure,plan_reward,answer_reward \
                      --rubrics "$D/verified.jsonl" --out "$D/scores-teacher.jsonl"
step eval-trained   deepr eval "$D/runs-trained" --metric rubric,citation,structure,plan_reward,answer_reward \
                      --rubrics "$D/verified.jsonl" --out "$D/scores-trained.jsonl"
python examples/demo_summary.py "$D"
