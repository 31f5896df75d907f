"""Throughput of the DecomposeR rewards with and without the embedder's cache.

R_plan over 512 plans and R_ans over 128 answers from wiki texts, shaped like GRPO batches (64
prompts x 8 rollouts sharing a rubric). Modes: uncached (cache cleared before every call), cached
(kept across calls, as grpo and eval do), grouped (a prompt's rollouts in ONE call, as the TRL
adapter does), eval (`deepr eval`'s evaluate(), shuffled plans in chunks of 8). Scores must agree
across modes; speed-ups are against uncached in the same run.

    python bench/rewards.py [--plans 512] [--answers 128] [--rollouts 8] [--out FILE]   # --answers 0: R_plan only
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

from _common import RESULTS, wiki_summaries, write_json

from deepr.corpus.embed import Embedder  # noqa: E402
from deepr.rewards.answer_reward import score_answer  # noqa: E402
from deepr.rewards.judges import Judge  # noqa: E402
from deepr.rewards.plan_reward import plan_reward, plan_rewards  # noqa: E402
from deepr.text import split_sentences  # noqa: E402


def wiki_articles(n: int, seed: int = 0) -> list[dict]:
    arts = [a for a in wiki_summaries().values() if len(split_sentences(a.get("extract", ""))) >= 4]
    return random.Random(seed).sample(arts, n)


def make_prompt(rng: random.Random, arts: list[dict]) -> dict:
    """One prompt: rubric from the articles' sentences, a pool of plan texts to sample from."""
    sents = [s for a in arts for s in split_sentences(a["extract"])[:4]]
    rubrics = [{"id": f"R{i}", "type": "factual", "description": s, "weight": round(rng.uniform(0.3, 1.0), 2)}
               for i, s in enumerate(rng.sample(sents, 5), start=1)]
    queries = [f"{a['title']} {a.get('description') or ''}".strip() for a in arts]
    return {"rubrics": rubrics, "queries": queries, "sents": sents, "titles": [a["title"] for a in arts]}


def make_plan(rng: random.Random, p: dict) -> dict:
    qs = rng.sample(p["queries"], rng.randint(3, len(p["queries"])))
    nodes = [{"id": f"S{i}", "type": "search", "query": q, "key_points": rng.sample(p["sents"], 1)}
             for i, q in enumerate(qs, start=1)]
    aggs = []
    for j in range(rng.randint(2, 3)):
        inputs = rng.sample([n["id"] for n in nodes], 2)
        aggs.append({"id": f"A{j + 1}", "type": "aggregate", "need": f"synthesis of {rng.choice(p['titles'])}",
                     "key_points": rng.sample(p["sents"], 2), "inputs": inputs})
    ans = {"id": "ANS", "type": "answer", "need": "final answer", "inputs": [a["id"] for a in aggs]}
    return {"nodes": nodes + aggs + [ans]}


def make_answer(rng: random.Random, p: dict, plan: dict) -> tuple[dict, str]:
    outputs = {n["id"]: " ".join(rng.sample(p["sents"], 3)) for n in plan["nodes"] if n["type"] == "aggregate"}
    return outputs, " ".join(rng.sample(p["sents"], 4))


def build(n_items: int, rollouts: int, seed: int) -> list[tuple[dict, list[dict]]]:
    rng = random.Random(seed)
    prompts = n_items // rollouts
    arts = wiki_articles(prompts * 4, seed)
    out = []
    for k in range(prompts):
        p = make_prompt(rng, arts[4 * k:4 * k + 4])
        out.append((p, [make_plan(rng, p) for _ in range(rollouts)]))
    return out


Result = dict[str, tuple[float, list[float], int]]  # mode -> (seconds, scores, texts encoded)


def per_plan(groups, emb: Embedder, *, uncached: bool) -> list[float]:
    """R_plan one plan per call; ``uncached`` clears the embedder's cache before every call."""
    scores = []
    for p, plans in groups:
        for pl in plans:
            if uncached:
                emb.clear_cache()
            scores.append(plan_reward(pl, p["rubrics"], emb.encode).plan_reward)
    return scores


def bench_plans(groups, emb: Embedder) -> Result:
    modes = {
        "uncached": lambda: per_plan(groups, emb, uncached=True),
        "cached": lambda: per_plan(groups, emb, uncached=False),
        "grouped": lambda: [r.plan_reward for p, plans in groups
                            for r in plan_rewards([(pl, p["rubrics"]) for pl in plans], emb.encode)],
        "eval": lambda: eval_scores(groups, emb),
    }
    res = {}
    for mode, score in modes.items():
        emb.clear_cache()
        before, t0 = emb.encoded, time.perf_counter()
        scores = score()
        res[mode] = (time.perf_counter() - t0, scores, emb.encoded - before)
    return res


def eval_scores(groups, emb: Embedder, chunk: int = 8) -> list[float]:
    """R_plan of every plan through deepr eval's evaluate(), in a shuffled order; returned in
    the order of ``groups`` so the modes compare plan by plan."""
    from deepr.eval.evaluate import EvalContext, evaluate, item_from_record

    flat = [(pl, p["rubrics"]) for p, plans in groups for pl in plans]
    order = list(range(len(flat)))
    random.Random(1).shuffle(order)
    items = [item_from_record({"id": str(i), "plan": flat[i][0], "rubrics": flat[i][1]}, where="bench") for i in order]
    got: dict[str, float] = {}
    asyncio.run(evaluate(items, ["plan_reward"], EvalContext(embed=emb.encode),
                         sink=lambda s: got.__setitem__(s.id, s.model_dump().get("plan_reward", 0.0)), concurrency=chunk))
    return [got[str(i)] for i in range(len(flat))]


def bench_answers(groups, emb: Embedder) -> Result:
    rng = random.Random(1)
    items = [(p, pl, *make_answer(rng, p, pl)) for p, plans in groups for pl in plans]
    res = {}
    for mode in ("uncached", "cached"):
        emb.clear_cache()
        judge = Judge(None, emb.encode)  # extractive J_rub: embeds too, its own cache is per judge
        before, t0, scores = emb.encoded, time.perf_counter(), []
        for p, pl, outputs, answer in items:
            if mode == "uncached":
                emb.clear_cache()
                judge = Judge(None, emb.encode)
            r = asyncio.run(score_answer(pl, outputs, answer, p["rubrics"], emb.encode, judge))
            scores.append(r.answer_reward)
        res[mode] = (time.perf_counter() - t0, scores, emb.encoded - before)
    return res


def summary(n: int, res: Result) -> dict:
    base = res["uncached"][0]
    return {mode: {"seconds": secs, "items_per_s": n / secs, "speedup_vs_uncached": base / secs,
                   "texts_encoded": encoded} for mode, (secs, _, encoded) in res.items()}


def report(title: str, unit: str, n: int, res: Result) -> None:
    base, ref = res["uncached"][:2]
    print(f"\n{title} ({n} {unit})\n{'mode':24} {'seconds':>8} {unit + '/s':>10} {'speed-up':>9} "
          f"{'texts encoded':>14} {'max |Δ|':>9}")
    for mode, (secs, scores, encoded) in res.items():
        delta = max(abs(a - b) for a, b in zip(scores, ref))
        print(f"{mode:24} {secs:8.2f} {n / secs:10.2f} {base / secs:8.2f}x {encoded:14d} {delta:9.1e}")
        if delta > 0.02:
            sys.exit(f"{mode} scores differ from uncached by {delta:.3f}: caching changed the reward")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", type=int, default=512)
    ap.add_argument("--answers", type=int, default=128)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "rewards.json"))
    args = ap.parse_args()
    emb = Embedder()
    emb.dim  # noqa: B018  model load is not part of any mode (GRPO has it loaded)
    emb.encode(["warm-up"])
    out: dict = {"load_avg_start": os.getloadavg(), "args": vars(args)}
    plan_groups = build(args.plans, args.rollouts, args.seed)
    n, res = sum(len(ps) for _, ps in plan_groups), bench_plans(plan_groups, emb)
    report("R_plan", "plans", n, res)
    out["R_plan"] = summary(n, res)
    if args.answers > 0:
        ans_groups = build(args.answers, args.rollouts, args.seed + 1)
        n, res = sum(len(ps) for _, ps in ans_groups), bench_answers(ans_groups, emb)
        report("R_ans (extractive J_rub)", "answers", n, res)
        out["R_ans"] = summary(n, res)
    out["load_avg_end"] = os.getloadavg()
    write_json(args.out, out)


if __name__ == "__main__":
    main()
