"""Benchmark: SmolLM2-135M-Instruct generation speed and JSON validity, hf vs llama.cpp.

1. Conversion: the GGUF -> transformers conversion time (``--cache`` empty: converted here;
   otherwise the time recorded when it was converted).
2. hf tokens/s, greedy, ``--tokens`` new tokens forced (EOS ignored), same prompt: variants
   (fp32 dynamic KV cache = baseline, static KV cache, bf16, 1 thread, optional torch.compile)
   measured in interleaved rounds in one process, best round kept (a shared machine only
   ever slows a round down), reported as ratios to the baseline.
3. llama.cpp (when llama-cpp-python[server] is installed): the same GGUF served on 127.0.0.1
   and driven through deepr's openai backend; tokens/s from the server's usage counts.
4. JSON validity on role-like prompts, unconstrained vs constrained, through hf and the
   llama.cpp server: "strict" = the whole reply is schema-valid JSON; "lenient" = deepr's
   parser finds schema-valid JSON in it (fences, prose).

    nice -n 10 python bench/llm_speed.py                  # writes bench/results/llm_speed.json
    python bench/llm_speed.py --tokens 32 --rounds 1 --no-llamacpp --no-validity
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydantic import BaseModel, Field  # noqa: E402

from deepr.llm import OutputFormat  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a long, detailed essay about how volcanoes form, erupt and "
                                      "shape the land around them."}]


class Plan(BaseModel):
    queries: list[str] = Field(min_length=1, max_length=4)


class Score(BaseModel):
    score: int = Field(ge=1, le=5)
    reason: str


class Rubric(BaseModel):
    items: list[str] = Field(min_length=2, max_length=5)


class Claims(BaseModel):
    claims: list[str] = Field(min_length=1, max_length=5)


TASKS: list[tuple[type[BaseModel], str, str]] = [
    (Plan, "You plan web searches for a research question.",
     'Question: How do volcanoes form and why do they erupt?\nReply with JSON {"queries": [...]} '
     "holding 2 to 4 search queries."),
    (Plan, "You plan web searches for a research question.",
     'Question: What caused the fall of the Roman Empire?\nReply with JSON {"queries": [...]} '
     "holding 2 to 4 search queries."),
    (Score, "You grade answers.",
     "Question: Which river flows through London?\nAnswer: The Thames flows through London.\n"
     'Grade the answer from 1 to 5. Reply with JSON {"score": <1-5>, "reason": "..."}.'),
    (Rubric, "You write grading rubrics.",
     "Question: How do glaciers shape valleys?\nWrite 2 to 5 checklist items a good answer must cover. "
     'Reply with JSON {"items": [...]}.'),
    (Claims, "You extract factual claims.",
     "Text: Mount Etna is in Sicily. It is one of the most active volcanoes in the world and erupted in "
     '2021.\nList the factual claims. Reply with JSON {"claims": [...]}.'),
    (Score, "You grade answers.",
     "Question: What is the boiling point of water at sea level?\nAnswer: About 50 degrees Celsius.\n"
     'Grade the answer from 1 to 5. Reply with JSON {"score": <1-5>, "reason": "..."}.'),
]


# -- hf speed ---------------------------------------------------------------------------------

def hf_variants(folder: Path, use_compile: bool) -> dict[str, dict[str, Any]]:
    v: dict[str, dict[str, Any]] = {
        "fp32 (baseline)": {"dtype": "float32", "gen": {}},
        "fp32 static cache": {"dtype": "float32", "gen": {"cache_implementation": "static"}},
        "bf16": {"dtype": "bfloat16", "gen": {}},
        "fp32 1 thread": {"dtype": "float32", "gen": {}, "threads": 1},
    }
    if use_compile:
        v["fp32 static cache + torch.compile"] = {"dtype": "float32", "compile": True,
                                                   "gen": {"cache_implementation": "static"}}
    return v


def load(folder: Path, dtype: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                 dtype=getattr(torch, dtype)).eval()
    return tok, model


def tokens_per_s(tok: Any, model: Any, n: int, gen: dict[str, Any], threads: int | None) -> float:
    import torch

    enc = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, temperature=None,
                                 top_p=None, top_k=None, pad_token_id=tok.eos_token_id, **gen)
            dt = time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)
    return (out.shape[1] - enc["input_ids"].shape[1]) / dt


def bench_hf(folder: Path, n: int, rounds: int, use_compile: bool) -> dict[str, Any]:
    import torch

    variants = hf_variants(folder, use_compile)
    models: dict[str, tuple[Any, Any]] = {}
    for name, v in variants.items():
        key = v["dtype"] + (" compiled" if v.get("compile") else "")
        if key not in models:
            tok, model = load(folder, v["dtype"])
            if v.get("compile"):
                model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
            models[key] = (tok, model)
        v["key"] = key
    for name, v in variants.items():  # warm-up: first calls allocate / compile
        tokens_per_s(*models[v["key"]], 8, v["gen"], v.get("threads"))
    best: dict[str, float] = {}
    for r in range(rounds):
        for name, v in variants.items():
            tps = tokens_per_s(*models[v["key"]], n, v["gen"], v.get("threads"))
            best[name] = max(best.get(name, 0.0), tps)
            print(f"  round {r + 1} {name}: {tps:.1f} tokens/s", flush=True)
    base = best["fp32 (baseline)"]
    return {name: {"tokens_per_s": round(t, 2), "vs_baseline": round(t / base, 3)} for name, t in best.items()}


def bench_backend(folder: Path, n: int, rounds: int) -> float:
    """The hf backend as deepr runs it (whatever settings it keeps), same prompt and length."""
    from deepr.llm.hf_backend import HFLLM

    llm = HFLLM(folder)
    best = 0.0
    for _ in range(rounds):
        before = llm.usage.completion_tokens
        t0 = time.perf_counter()
        llm.chat(PROMPT, max_tokens=n)
        best = max(best, (llm.usage.completion_tokens - before) / (time.perf_counter() - t0))
    return round(best, 2)


# -- llama.cpp server -------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llamacpp(gguf: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "8192", "--n_threads", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(240):
        try:
            urllib.request.urlopen(url + "/models", timeout=1).read()
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("llama_cpp.server exited at start") from None
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("llama_cpp.server did not answer within 120 s")


def bench_llamacpp(url: str, n: int, rounds: int) -> float:
    from deepr.llm import get_llm

    llm = get_llm("openai:smollm2", base_url=url, cache=False, timeout=300)
    llm.chat(PROMPT, max_tokens=8, temperature=0.0)  # warm-up
    best = 0.0
    for _ in range(rounds):
        before = llm.usage.completion_tokens
        t0 = time.perf_counter()
        llm.chat(PROMPT, max_tokens=n, temperature=0.0)
        best = max(best, (llm.usage.completion_tokens - before) / (time.perf_counter() - t0))
    llm.close()
    return round(best, 2)


# -- JSON validity ----------------------------------------------------------------------------

def validity(llm: Any, max_tokens: int, n_tasks: int) -> dict[str, Any]:
    from deepr.llm.parse import parse_reply

    out: dict[str, Any] = {}
    for mode in ("unconstrained", "constrained"):
        strict = lenient = constrained = truncated = 0
        for model, system, user in TASKS[:n_tasks]:
            fmt = OutputFormat(model.__name__.lower(), json_schema=model.model_json_schema())
            reply = llm.chat([{"role": "system", "content": system}, {"role": "user", "content": user}],
                             max_tokens=max_tokens, temperature=0.0, fmt=fmt if mode == "constrained" else None)
            try:
                model.model_validate_json(reply)
                strict += 1
            except ValueError:
                pass
            lenient += parse_reply(reply, model)[1] is None
            constrained += bool(getattr(reply, "constrained", False))
            truncated += bool(getattr(reply, "truncated", False))
        out[mode] = {"calls": len(TASKS[:n_tasks]), "strict_valid": strict, "lenient_valid": lenient,
                     "flagged_constrained": constrained, "truncated": truncated}
        print(f"  {mode}: {out[mode]}", flush=True)
    return out


# -- main -------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per speed measurement")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=None, help="deepr cache dir (default $DEEPR_CACHE or ~/.cache/deepr)")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (slow to warm up on CPU)")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--no-validity", action="store_true")
    ap.add_argument("--validity-only", action="store_true", help="keep the speed figures already in --out")
    ap.add_argument("--max-tokens", type=int, default=160, help="reply budget of the validity prompts")
    ap.add_argument("--tasks", type=int, default=len(TASKS), help="how many of the validity prompts to run")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "llm_speed.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    from deepr.llm.smollm2 import DONE, gguf_path, smollm2_dir

    t0 = time.perf_counter()
    folder = smollm2_dir(args.cache)
    took = time.perf_counter() - t0
    converted = json.loads((folder / DONE).read_text())
    result: dict[str, Any] = {
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} torch threads; "
                   "timings taken on a shared machine under load (nice -n 10)",
        "command": "python " + " ".join(sys.argv),
        "conversion_s": converted["seconds"], "converted_in_this_run": took > 5,
        "new_tokens": args.tokens, "rounds": args.rounds,
    }
    print(f"conversion: {converted['seconds']} s (this run: {took:.1f} s)", flush=True)
    if args.validity_only and args.out.is_file():
        kept = json.loads(args.out.read_text())
        result.update({k: v for k, v in kept.items() if k not in ("json_validity", "command")})
        result["validity_command"] = result["command"]
        result["command"] = kept.get("command", result["command"])
    else:
        print("hf variants:", flush=True)
        result["hf"] = bench_hf(folder, args.tokens, args.rounds, args.compile)
        result["hf_tokens_per_s_baseline"] = result["hf"]["fp32 (baseline)"]["tokens_per_s"]
        result["hf_backend_tokens_per_s"] = bench_backend(folder, args.tokens, args.rounds)
        print(f"hf backend as shipped: {result['hf_backend_tokens_per_s']} tokens/s", flush=True)
        save(args.out, result)  # each finished section is kept, even if a later one is interrupted
    server = None
    try:
        import importlib.util

        if not args.no_llamacpp and importlib.util.find_spec("llama_cpp") is not None:
            server, url = start_llamacpp(gguf_path())
            if not args.validity_only:
                result["llamacpp_tokens_per_s"] = bench_llamacpp(url, args.tokens, args.rounds)
                print(f"llama.cpp server: {result['llamacpp_tokens_per_s']} tokens/s", flush=True)
                save(args.out, result)
        if not args.no_validity:  # the fast server first, so a cut-short run still has it
            from deepr.llm import get_llm

            result["json_validity"] = {}
            if server is not None:
                print("JSON validity, llama.cpp server:", flush=True)
                llm = get_llm("openai:smollm2", base_url=url, cache=False, timeout=300)
                result["json_validity"]["llamacpp"] = validity(llm, args.max_tokens, args.tasks)
                save(args.out, result)
            print("JSON validity, hf:", flush=True)
            result["json_validity"]["hf"] = validity(get_llm(f"hf:{folder}"), args.max_tokens, args.tasks)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    save(args.out, result)
    print(f"wrote {args.out}")


def save(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main()
