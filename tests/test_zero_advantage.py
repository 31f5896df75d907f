"""GRPO says when its reward carries no signal: every group constant -> warned/stopped within the
first steps, and metrics.jsonl holds the share of zero-advantage groups per step."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import ClassVar

import pytest

from deepr.train.stage import StageConfig, train_stage

ROWS = [{"prompt": [{"role": "user", "content": f"Question {i}: when did the museum open?"}]} for i in range(8)]


class TinyStage(StageConfig):
    """The smallest stage: two groups of four rollouts per step, short completions."""

    PAPER: ClassVar[dict] = {"beta": 0.0, "prompts_per_step": 2, "mini_batch_prompts": 2,
                             "max_completion_length": 8, "learning_rate": 1e-3, "num_generations": 4}


def constant_reward(completions, **kw):
    return [0.0] * len(completions)


def varied_reward(completions, **kw):
    return [random.random() for _ in completions]


def run(tiny: Path, out: Path, reward, **over):
    cfg = TinyStage(stage="tiny", model=str(tiny), out=out, lora_r=4, lora_alpha=8, **over)
    res = train_stage(cfg, ROWS, None, reward)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return res, [r for r in rows if "zero_advantage_frac" in r]


def test_constant_reward_stops_within_the_first_steps(tiny: Path, tmp_path: Path, capfd) -> None:
    res, rows = run(tiny, tmp_path / "stop", constant_reward, max_steps=6)
    assert res.steps == 2  # patience 2, not the 6 the budget allowed
    assert [r["zero_advantage_frac"] for r in rows] == [1.0, 1.0] and rows[-1]["zero_advantage_stop"] == 1.0
    err = capfd.readouterr().err
    assert "zero advantage" in err and "stopping" in err


def test_constant_reward_warns_and_trains_on_when_asked(tiny: Path, tmp_path: Path, capfd) -> None:
    res, rows = run(tiny, tmp_path / "warn", constant_reward, max_steps=3, zero_advantage="warn")
    assert res.steps == 3 and [r["zero_advantage_frac"] for r in rows] == [1.0, 1.0, 1.0]
    assert not any("zero_advantage_stop" in r for r in rows)
    err = capfd.readouterr().err
    assert err.count("zero advantage") == 1 and "stopping" not in err


def test_varied_reward_logs_a_fraction_below_one(tiny: Path, tmp_path: Path, capfd) -> None:
    random.seed(0)
    res, rows = run(tiny, tmp_path / "varied", varied_reward, max_steps=2)
    assert res.steps == 2 and len(rows) == 2 and all(r["zero_advantage_frac"] < 1.0 for r in rows)
    assert "zero advantage" not in capfd.readouterr().err


@pytest.mark.parametrize("fracs, stops_at", [([1.0, 1.0, 1.0], 2), ([0.5, 1.0, 1.0, 1.0], None),
                                             ([1.0, 0.0, 1.0, 1.0], None)])
def test_guard_only_judges_the_opening_steps(fracs, stops_at) -> None:
    from types import SimpleNamespace

    from transformers import TrainerControl

    from deepr.train.signals import zero_advantage_callback

    guard, state = zero_advantage_callback("stop", patience=2), SimpleNamespace(is_world_process_zero=False)
    stopped = None
    for step, frac in enumerate(fracs, 1):
        control = guard.on_log(None, state, TrainerControl(), logs={"frac_reward_zero_std": frac})
        if control.should_training_stop and stopped is None:
            stopped = step
    assert stopped == stops_at and guard.history == fracs
