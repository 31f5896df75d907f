"""Where R_plan's cached mode spends its time, and what bounds its speed-up (issue 16 item 3).

    python bench/rplan_profile.py [--plans 128]
    python bench/rplan_profile.py --tokens-only   # the token counts alone: no model, a few seconds

Scores the plans of bench/rewards.py the way its ``uncached`` and ``cached`` modes do (one
embedder, torch model loaded first as in GRPO; cache cleared before every call, or once), the
cached mode under cProfile. For each mode it records the texts that reached the model, their
tokens, and the rows of the passes the encoder ran ("padded": a call's tokens rounded up to the
4-row alignment of npbert.ROW_ALIGN, per call rather than per thread's share). A pass costs
about its rows, so ``uncached padded / cached padded`` is the speed-up that caching alone can
give, whatever the encoder. Reports the cached mode's share of wall time in the encoder's calls and
the functions with the most own time, and the encoder's tokens per second by call size (a
call's few misses cannot fill the cores the way a bigger call's texts do). Also counts the tokens of the aggregates' joined texts:
d_par read them until issue 16 (new in almost every rollout, they capped the cached mode near
2x); it now reads the mean of the cached field vectors, so this count should stay 0.
Writes bench/results/rplan_profile.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rewards as bench_rewards  # noqa: E402

from deepr.corpus.embed import Embedder  # noqa: E402
from deepr.corpus.npbert import ROW_ALIGN  # noqa: E402
from deepr.records import PlanNode  # noqa: E402
from deepr.rewards.plan_reward import node_text, plan_reward  # noqa: E402


class Counting:
    """Wraps an Embedder's model call: texts, real tokens and padded tokens that reached it."""

    def __init__(self, emb: Embedder, joined: set[str]):
        self.emb, self.inner, self.joined = emb, emb._encode_model, joined
        self.tok = emb._lite_encoder().tok
        self.reset()
        emb._encode_model = self  # instance attribute: encode() calls it for cache misses

    def reset(self) -> None:
        self.texts = self.tokens = self.padded = self.calls = self.joined_tokens = 0
        self.per_call: list[tuple[int, int, float]] = []  # (texts, tokens, seconds) of each model call

    def __call__(self, texts: list[str], **kw):
        encs = self.tok.encode_batch(texts)
        lens = sorted((len(e.ids) for e in encs), reverse=True)
        self.joined_tokens += sum(len(e.ids) for t, e in zip(texts, encs) if t in self.joined)
        self.calls += 1
        self.texts += len(texts)
        self.tokens += sum(lens)
        self.padded += -(-sum(lens) // ROW_ALIGN) * ROW_ALIGN
        t = time.perf_counter()
        out = self.inner(texts, **kw)
        self.per_call.append((len(texts), sum(lens), time.perf_counter() - t))
        return out

    def row(self) -> dict:
        by_size = {}
        for lo, hi in ((1, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, 10**9)):
            sel = [c for c in self.per_call if lo <= c[0] < hi]
            if sel:
                by_size[f"{lo}-{hi - 1 if hi < 10**9 else ''} texts"] = {
                    "calls": len(sel), "tokens": sum(c[1] for c in sel),
                    "tokens_per_s": sum(c[1] for c in sel) / max(sum(c[2] for c in sel), 1e-9)}
        return {"model_calls": self.calls, "texts": self.texts, "tokens": self.tokens, "padded_tokens": self.padded,
                "tokens_of_joined_aggregate_texts": self.joined_tokens, "encoder_tokens_per_s_by_call_size": by_size}


def run(groups, emb: Embedder, count: Counting, uncached: bool) -> tuple[float, dict]:
    emb.clear_cache()
    count.reset()
    t = time.perf_counter()
    for p, plans in groups:
        for pl in plans:
            if uncached:
                emb.clear_cache()
            plan_reward(pl, p["rubrics"], emb.encode)
    return time.perf_counter() - t, count.row()


def token_counts(groups, joined: set[str]) -> dict:
    """Texts and tokens each mode sends to the model, from the cache logic alone (no model)."""
    import numpy as np

    from deepr.corpus.embed import default_model_path
    from deepr.corpus.npbert import NumpyBert

    tok = NumpyBert.load(default_model_path()).tok
    out = {}
    for mode in ("uncached", "cached"):
        seen: set[str] = set()
        row = {"texts": 0, "tokens": 0, "padded_tokens": 0, "tokens_of_joined_aggregate_texts": 0}

        def embed(texts: list[str]) -> "np.ndarray":
            miss = [t for t in dict.fromkeys(texts) if t not in seen]
            seen.update(miss)
            if miss:
                encs = tok.encode_batch(miss)
                lens = sorted((len(e.ids) for e in encs), reverse=True)
                row["texts"] += len(miss)
                row["tokens"] += sum(lens)
                row["padded_tokens"] += -(-sum(lens) // ROW_ALIGN) * ROW_ALIGN
                row["tokens_of_joined_aggregate_texts"] += sum(len(e.ids) for t, e in zip(miss, encs) if t in joined)
            return np.ones((len(texts), 4), dtype=np.float32)

        for p, plans in groups:
            for pl in plans:
                if mode == "uncached":
                    seen.clear()
                plan_reward(pl, p["rubrics"], embed)
        out[mode] = row
    u, c = out["uncached"], out["cached"]
    j = "tokens_of_joined_aggregate_texts"
    out["ratio uncached/cached (tokens): the most caching can give"] = u["tokens"] / c["tokens"]
    out["ratio uncached/cached (padded tokens, numpy passes)"] = u["padded_tokens"] / c["padded_tokens"]
    out["ratio uncached/cached (tokens), if d_par's joined texts were not embedded"] = \
        (u["tokens"] - u[j]) / max(1, c["tokens"] - c[j])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", type=int, default=128)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "rplan_profile.json"))
    ap.add_argument("--tokens-only", action="store_true", help="count what each mode encodes; run no model")
    args = ap.parse_args()
    if args.tokens_only:
        groups = bench_rewards.build(args.plans, 8, 0)
        joined = {node_text(PlanNode(**n)) for _, plans in groups for pl in plans for n in pl["nodes"]
                  if n["type"] == "aggregate"}
        res = {"plans": sum(len(ps) for _, ps in groups), **token_counts(groups, joined)}
        out = Path(args.out).with_name("rplan_tokens.json") if "--out" not in sys.argv else Path(args.out)
        out.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
        return print(json.dumps(res, indent=1))
    emb = Embedder()
    emb.model  # noqa: B018  loaded up front, as in a GRPO run
    groups = bench_rewards.build(args.plans, 8, 0)
    joined = {node_text(PlanNode(**n)) for _, plans in groups for pl in plans for n in pl["nodes"]
              if n["type"] == "aggregate"}
    count = Counting(emb, joined)
    load0 = os.getloadavg()
    uncached_s, unc = run(groups, emb, count, True)
    prof = cProfile.Profile()
    prof.enable()
    cached_s, cac = run(groups, emb, count, False)
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(v[2] for v in stats.values())  # own time of every function
    # the numpy encoder's forward passes run in worker threads, which cProfile does not see:
    # the encoder's share is the wall time of the model calls themselves
    in_model = sum(c[2] for c in count.per_call)
    own = sorted(((v[2] / total, f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, v in stats.items()), reverse=True)
    res = {"load_avg_start": load0, "load_avg_end": os.getloadavg(), "plans": sum(len(ps) for _, ps in groups),
           "uncached": {"seconds": uncached_s, **unc}, "cached (profiled)": {"seconds": cached_s, **cac},
           "ratio uncached/cached (time; cached runs under cProfile)": uncached_s / cached_s,
           "ratio uncached/cached (texts)": unc["texts"] / cac["texts"],
           "ratio uncached/cached (padded tokens: the bound caching gives)":
           unc["padded_tokens"] / cac["padded_tokens"],
           "ratio uncached/cached (tokens), if d_par's joined texts were not embedded":
           (unc["tokens"] - unc["tokens_of_joined_aggregate_texts"])
           / max(1, cac["tokens"] - cac["tokens_of_joined_aggregate_texts"]),
           "cached: share of wall time in the encoder's calls": in_model / cached_s,
           "cached: top own time": [{"share": round(s, 3), "function": f} for s, f in own[:15]]}
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
