"""Benchmark: the hf backend's prefix KV cache (``HFConfig.prefix_cache``) on and off, SmolLM2.

A tools-mode conversation grows by a tool response per turn, so each call's prompt starts with
the whole previous prompt and reply. With the prefix cache the backend keeps the last call's
KV cache and computes only the new tokens. This replays such a conversation (the real tools
system prompt, ``--turns`` calls, each adding ~300 tokens of evidence) on two backends, one
with the cache and one without, interleaved call by call so load affects both alike; replies
are greedy and must be identical. Reported: seconds per call, prompt tokens, the speed-up.

    flock /work/briefs/timed.lock nice -n -10 python bench/hf_prefix_cache.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EVIDENCE = ("[S{t}-R{k}] Volcano: A volcano is a rupture in the crust of a planetary-mass object that allows hot "
            "lava, volcanic ash and gases to escape from a magma chamber below the surface. Volcanoes are most "
            "often found where tectonic plates diverge or converge, and most of them are under water. ")


def conversation(turns: int) -> list[list[dict[str, str]]]:
    from deepr.agent.tools_agent import first_messages, tool_response

    convo = first_messages("How do volcanoes form and why do they erupt?")
    prompts = []
    for t in range(1, turns + 1):
        prompts.append(list(convo))
        call = '<tool_call>{"name": "search", "arguments": {"query": "volcano formation magma %d"}}</tool_call>' % t
        convo += [{"role": "assistant", "content": call},
                  {"role": "user", "content": tool_response("".join(EVIDENCE.format(t=t, k=k) for k in (1, 2)))}]
    return prompts


def prompt_tokens(tokenizer, messages: list[dict[str, str]]) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per call")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "hf_prefix_cache.json")
    a = ap.parse_args()
    from deepr.llm import get_llm
    from deepr.llm.base import run_sync

    load_before = [round(x, 2) for x in os.getloadavg()]
    llms = {"on": get_llm("smollm2", prefix_cache=True), "off": get_llm("smollm2", prefix_cache=False)}
    rows = []
    for n, messages in enumerate(conversation(a.turns), 1):
        row: dict = {"call": n, "prompt_tokens": prompt_tokens(llms["on"].tokenizer, messages)}
        replies = {}
        for name, llm in llms.items():
            t0 = time.perf_counter()
            replies[name] = run_sync(llm.achat(messages, role="agent", temperature=0.0, max_tokens=a.tokens))
            row[f"{name}_s"] = round(time.perf_counter() - t0, 2)
        row["same_reply"] = replies["on"] == replies["off"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    later = rows[1:] or rows  # call 1 has nothing to reuse
    on, off = sum(r["on_s"] for r in later), sum(r["off_s"] for r in later)
    result = {"command": "flock /work/briefs/timed.lock nice -n -10 python bench/hf_prefix_cache.py "
                         f"--turns {a.turns} --tokens {a.tokens}",
              "load_avg_before": load_before, "load_avg_after": [round(x, 2) for x in os.getloadavg()],
              "note": "2 shared cores; timed run under the lock (other helpers' work at nice 19 still running)",
              "calls": rows, "seconds_calls_2_on": {"prefix_cache_on": round(on, 2), "prefix_cache_off": round(off, 2)},
              "speedup": round(off / on, 2) if on else None,
              "prefix_hits": llms["on"].prefix_hits, "prefix_tokens_reused": llms["on"].prefix_tokens,
              "replies_identical": all(r["same_reply"] for r in rows)}
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("seconds_calls_2_on", "speedup", "replies_identical")}))


if __name__ == "__main__":
    main()
