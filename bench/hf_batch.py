"""Benchmark: concurrent greedy calls to the hf backend, one at a time vs decoded as one batch.

Two sets of calls go at once (``asyncio.gather``) to SmolLM2-135M-Instruct through deepr's hf
backend:
- ``short``: the six role-like prompts of bench/llm_speed.py (plans, grades, rubrics, claims,
  51-70 prompt tokens), each constrained to its JSON schema;
- ``long``: four 1.8k-2.5k-token prompts (wiki summaries to condense, the size of a planner revision
  or an answerer wave in ``deepr run``), unconstrained.
Settings: ``batch_size 1`` (the calls queue and run one by one: the baseline), batched with no
prompt limit, and the defaults (long prompts run alone, see ``batch_max_prompt``). Interleaved
rounds in one process, best round kept (a shared machine only ever slows a round down).
Reported per set and setting: wall seconds, completion tokens/s, the ratio to the baseline, and
how many replies equal the baseline's (padding changes a row's float sums a little, so a greedy
tie may flip).

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

from bench.learning_setup import write_atomic  # noqa: E402
from bench.llm_speed import TASKS  # noqa: E402
from deepr.llm import OutputFormat  # noqa: E402

Call = tuple[list[dict[str, str]], OutputFormat | None]


def short_calls() -> list[Call]:
    return [([{"role": "system", "content": system}, {"role": "user", "content": user}],
             OutputFormat(model.__name__.lower(), json_schema=model.model_json_schema()))
            for model, system, user in TASKS]


def long_calls(n: int = 4, words: int = 1800) -> list[Call]:
    from deepr.corpus.sources import load_wiki

    text = " ".join(d.text for d in load_wiki(400)).split()
    return [([{"role": "user", "content": "Condense these notes into three sentences:\n"
               + " ".join(text[i * words:(i + 1) * words - i * 150])}], None) for i in range(n)]


async def send(llm: Any, calls: list[Call], max_tokens: int) -> list[str]:
    return list(await asyncio.gather(*(llm.achat(m, max_tokens=max_tokens, temperature=0.0, fmt=f) for m, f in calls)))


def measure(llm: Any, calls: list[Call], max_tokens: int) -> tuple[float, int, list[str]]:
    before = llm.usage.completion_tokens
    t0 = time.perf_counter()
    replies = asyncio.run(send(llm, calls, max_tokens))
    return time.perf_counter() - t0, llm.usage.completion_tokens - before, [str(r) for r in replies]


def compare(llms: dict[str, Any], calls: list[Call], max_tokens: int, rounds: int, label: str) -> dict[str, Any]:
    for llm in llms.values():  # warm-up: grammars compile, buffers allocate
        measure(llm, calls[:2], 4)
    best: dict[str, tuple[float, int, list[str]]] = {}
    for r in range(rounds):
        for name, llm in llms.items():
            secs, tokens, replies = measure(llm, calls, max_tokens)
            print(f"  {label} round {r + 1} {name}: {secs:.1f} s, {tokens} tokens", flush=True)
            if name not in best or secs < best[name][0]:
                best[name] = (secs, tokens, replies)
    base_s, base_t, base_r = next(iter(best.values()))
    return {name: {"wall_s": round(s, 2), "completion_tokens": t, "tokens_per_s": round(t / s, 2),
                   "wall_vs_one_at_a_time": round(s / base_s, 3), "same_replies": sum(x == y for x, y in zip(base_r, r))}
            for name, (s, t, r) in best.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--long-max-tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hf_batch.json")
    a = p.parse_args(argv)
    from deepr.llm.hf_backend import HFConfig, HFLLM
    from deepr.llm.smollm2 import smollm2_dir

    folder = smollm2_dir()
    d = HFConfig(path=str(folder))
    llms = {"one at a time (batch_size 1)": HFLLM(folder, batch_size=1),
            f"batched, no prompt limit (batch_size {d.batch_size})": HFLLM(folder, batch_max_prompt=10**6),
            f"defaults (batch_size {d.batch_size}, batch_max_prompt {d.batch_max_prompt})": HFLLM(folder)}
    short, long = short_calls(), long_calls()
    tok = llms["one at a time (batch_size 1)"].tokenizer
    res = {"model": "SmolLM2-135M-Instruct (hf backend, fp32, 1 thread)", "rounds": a.rounds,
           "short": {"calls": len(short), "max_tokens": a.max_tokens, "constrained": True,
                     "settings": compare(llms, short, a.max_tokens, a.rounds, "short")},
           "long": {"calls": len(long), "max_tokens": a.long_max_tokens, "constrained": False,
                    "prompt_tokens": [len(tok.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"]) for m, _ in long],
                    "settings": compare(llms, long, a.long_max_tokens, a.rounds, "long")},
           "load_average_at_end": round(os.getloadavg()[0], 2)}
    write_atomic(a.out, res)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
