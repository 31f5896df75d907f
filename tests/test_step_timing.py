"""Per-step phase timings in metrics.jsonl (deepr.train.step_timing): every GRPO row says how the
step's seconds split between sampling, the environment, rewards and the model's own passes."""

from __future__ import annotations

import json
import time

import pytest
from grpo_helpers import scripted_rows

from deepr.records import QRPair, RubricItem

PLAN = {"nodes": [
    {"id": "N1", "type": "search", "query": "causes of earthquakes plate tectonics", "key_points": ["faults"]},
    {"id": "N2", "type": "aggregate", "need": "how earthquakes happen", "key_points": ["plates"], "inputs": ["N1"]},
    {"id": "N3", "type": "answer", "need": "a short report", "inputs": ["N2"]}]}
PARTS = ("generate", "environment", "reward", "forward", "backward", "optimizer", "loss", "score", "other")


def test_phases_are_exclusive_and_nest():
    from deepr.train.step_timing import PhaseClock, step_row

    clock = PhaseClock()
    t0 = time.perf_counter()
    with clock.phase("environment"):
        time.sleep(0.02)
        with clock.phase("generate"):
            time.sleep(0.05)
            with clock.phase("generate"):  # a generator wrapped twice counts once
                time.sleep(0.01)
    step = time.perf_counter() - t0
    assert clock.totals["generate"] == pytest.approx(0.06, abs=0.02)
    assert clock.totals["environment"] == pytest.approx(0.02, abs=0.015)
    row = step_row(clock.totals, step)
    assert row["time/environment"] + row["time/generate"] + row["time/other"] == pytest.approx(step)
    # sampling is model compute; the environment and the rest are the overhead
    assert row["time/outside_model_share"] == pytest.approx(1 - row["time/generate"] / step)


class SlowReward:
    """Sleeps, then scores episodes 1, 0, 1, 0 (a spread, so the group has an advantage)."""

    __name__ = "slow_reward"

    def __call__(self, prompts, completions, **cols):
        time.sleep(0.15)
        return [float(i % 2 == 0) for i in range(len(completions))]


def _slow(generate, seconds):
    def gen(seqs, first, max_new):
        time.sleep(seconds)
        return generate(seqs, first, max_new)
    return gen


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_planner_row_splits_its_step_into_phases(tiny, tok, retriever, tmp_path):
    """Two steps over one generation batch: step 1 samples (two turns, each generator call sleeping
    0.1 s), searches and scores (the reward sleeping 0.15 s); step 2 trains on the buffered half."""
    from deepr.train import grpo
    from deepr.train.environments import PlannerEnvironment

    rub = RubricItem(id="R1", type="factual", description="Plates cause earthquakes.", weight=1.0)
    pairs = [QRPair(id=f"q{i}", tree_id="t", question=q, selected_leaf_ids=[], rubrics=[rub])
             for i, q in enumerate(["What causes earthquakes?", "How do volcanoes affect the climate?"])]
    rows, lookup = grpo.planner_dataset(pairs)
    cfg = grpo.GrpoConfig(stage="planner", model=str(tiny), out=tmp_path / "rl", num_generations=2,
                          prompts_per_step=2, mini_batch_prompts=1, max_completion_length=1500, max_steps=2,
                          lora_r=4, lora_alpha=8, k=2, learning_rate=1e-3, zero_advantage="off")
    turns = [[json.dumps(PLAN)], [json.dumps(PLAN)]]
    grpo.train_grpo(cfg, rows, lookup, env=PlannerEnvironment(retriever, k=2), reward_fn=SlowReward(),
                    generate_for=lambda _t: _slow(scripted_rows(tok, turns), 0.1))
    log = [r for r in _rows(cfg.out) if "loss" in r]
    assert [r["step"] for r in log] == [1, 2]
    for r in log:
        parts = [r[f"time/{p}"] for p in PARTS]
        assert all(x >= 0 for x in parts) and r["time/step"] > 0
        assert sum(parts) == pytest.approx(r["time/step"], rel=1e-6)
        assert r["time/forward"] > 0 and r["time/backward"] > 0 and r["time/optimizer"] > 0
        assert 0 <= r["time/outside_model_share"] <= 1
    first, second = log
    assert first["time/generate"] >= 0.2  # two turns, 0.1 s each, counted as sampling not environment
    assert first["time/reward"] >= 0.15 and first["time/environment"] > 0  # G0 is valid: its search ran
    assert second["time/generate"] == second["time/environment"] == second["time/reward"] == 0.0
    # TRL's own per-step signals reach the file too
    assert {"kl", "entropy", "reward_std", "frac_reward_zero_std", "step_time"} <= set(first)


def test_trl_generation_is_timed_without_a_rollout_function(tiny, tmp_path):
    """warp-atomic samples through TRL's own generation (no rollout function): that time is
    ``generate``, and nothing is counted as environment."""
    from deepr.records import ChatExample
    from deepr.train.warp_stage import WarpAtomicConfig, train_warp_atomic

    msgs = [{"role": "system", "content": "You write outlines."},
            {"role": "user", "content": "Question: What causes earthquakes?\nWrite the outline."},
            {"role": "assistant", "content": json.dumps({"name": "initialize", "sections": ["Plates"]})}]
    examples = [ChatExample(id="w1", role="warp", action="initialize", messages=msgs)]
    cfg = WarpAtomicConfig(stage="warp-atomic", model=str(tiny), out=tmp_path / "rl", num_generations=2,
                           prompts_per_step=1, mini_batch_prompts=1, max_completion_length=16, max_steps=1,
                           lora_r=4, lora_alpha=8, learning_rate=1e-3, zero_advantage="off")
    train_warp_atomic(cfg, examples, None)
    (row,) = [r for r in _rows(cfg.out) if "loss" in r]
    assert row["time/generate"] > 0 and row["time/environment"] == 0.0 and row["time/reward"] > 0
    assert sum(row[f"time/{p}"] for p in PARTS) == pytest.approx(row["time/step"], rel=1e-6)


class CountingTokenizer:
    """The tokenizer, counting chat-template renderings."""

    def __init__(self, tok):
        self.tok, self.rendered = tok, 0

    def apply_chat_template(self, *a, **kw):
        self.rendered += 1
        return self.tok.apply_chat_template(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_rollout_renders_each_distinct_prompt_once(tok):
    """A step's 2 prompts x 4 rollouts: the first turn's prompts and TRL's placeholder rows are
    rendered twice (once per distinct prompt), not 16 times, with the same token ids."""
    from grpo_helpers import scripted

    from deepr.train.environments import planner_prompt
    from deepr.train.rollouts import (
        play_calls,
        prompt_ids,
        rendered_once,
    )

    counting = CountingTokenizer(tok)
    prompts = [planner_prompt("What causes earthquakes?")] * 4 + [planner_prompt("How do volcanoes form?")] * 4

    def rollout(prompts, trainer):
        eps = play_calls(prompts, scripted(tok, ["no plan"]), lambda i, e: None, counting, budget=32,
                         eos_ids=[tok.eos_token_id], max_turns=1)
        return {"calls": [e.calls[0].prompt_ids for e in eps], "rows": [prompt_ids(counting, p) for p in prompts]}

    out = rendered_once(rollout)(prompts, None)
    assert counting.rendered == 2
    plain = [prompt_ids(tok, p) for p in prompts]
    assert out["calls"] == out["rows"] == plain
    out["rows"][0].append(-1)  # a caller's change does not reach another caller's ids
    assert out["calls"][0] == plain[0]
    prompt_ids(counting, prompts[0]), prompt_ids(counting, prompts[0])  # outside a rollout: nothing kept
    assert counting.rendered == 4
