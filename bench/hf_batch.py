"""Benchmark: concurrent greedy calls to the hf backend, one at a time vs decoded as one batch.

The six role-like prompts of bench/llm_speed.py (plans, grades, rubrics, claims), each
constrained to its JSON schema, are sent at once (``abatch``) to SmolLM2-135M-Instruct through
deepr's hf backend: ``batch_size 1`` (the calls queue and run one by one, the baseline) and the
default ``batch_size`` (waiting calls decoded together). Interleaved rounds in one process, best
round kept (a shared machine only ever slows a round down). Reported: wall seconds for the six
calls, completion tokens/s over all of them, the ratio to the baseline, and how many replies are
identical in the two settings (padding a row changes its float sums a little, so a greedy tie
may flip).

    python bench/hf_batch.py                  # writes bench/results/hf_batch.json
    python bench/hf_batch.py --rounds 1 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.llm_speed import TASKS  # noqa: E402
from deepr.llm import OutputFormat  # noqa: E402


def calls() -> list[tuple[list[dict[str, str]], OutputFormat]]:
    return [([{"role": "system", "content": system}, {"role": "user", "content": user}],
             OutputFormat(model.__name__.lower(), json_schema=model.model_json_schema()))
            for model, system, user in TASKS]


async def send(llm: Any, batch: list[tuple[list[dict[str, str]], OutputFormat]], max_tokens: int) -> list[str]:
    return list(await asyncio.gather(*(llm.achat(m, max_tokens=max_tokens, temperature=0.0, fmt=f) for m, f in batch)))


def measure(llm: Any, max_tokens: int) -> tuple[float, int, list[str]]:
    before = llm.usage.completion_tokens
    t0 = time.perf_counter()
    replies = asyncio.run(send(llm, calls(), max_tokens))
    return time.perf_counter() - t0, llm.usage.completion_tokens - before, [str(r) for r in replies]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hf_batch.json")
    a = p.parse_args(argv)
    from deepr.llm.hf_backend import HFConfig, HFLLM
    from deepr.llm.smollm2 import smollm2_dir

    folder = smollm2_dir()
    default = HFConfig(path=str(folder)).batch_size
    llms = {"one at a time (batch_size 1)": HFLLM(folder, batch_size=1),
            f"batched (batch_size {default}, the default)": HFLLM(folder)}
    for llm in llms.values():  # warm-up: grammars compile, buffers allocate
        measure(llm, 8)
    best: dict[str, tuple[float, int, list[str]]] = {}
    for r in range(a.rounds):
        for name, llm in llms.items():
            secs, tokens, replies = measure(llm, a.max_tokens)
            print(f"  round {r + 1} {name}: {secs:.1f} s, {tokens} tokens, {tokens / secs:.1f} tokens/s", flush=True)
            if name not in best or secs < best[name][0]:
                best[name] = (secs, tokens, replies)
    (base_s, base_t, base_r), (bat_s, bat_t, bat_r) = best.values()
    res = {"model": "SmolLM2-135M-Instruct (hf backend, fp32, 1 thread)", "calls": len(TASKS),
           "max_tokens": a.max_tokens, "rounds": a.rounds, "load_average_at_end": os.getloadavg()[0],
           "settings": {name: {"wall_s": round(s, 2), "completion_tokens": t, "tokens_per_s": round(t / s, 2)}
                        for name, (s, t, _) in best.items()},
           "batched_vs_one_at_a_time": {"wall": round(bat_s / base_s, 3),
                                        "tokens_per_s": round((bat_t / bat_s) / (base_t / base_s), 3)},
           "identical_replies": sum(x == y for x, y in zip(base_r, bat_r)),
           "batched_calls": llms[list(llms)[1]].batched_calls}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
