"""One training configuration: deepr's fields on the stage config, every TRL / LoRA setting by TRL's
own name (a config file, --set, or a flag), checked against TRL's dataclasses before weights load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.train.grpo import GrpoConfig
from deepr.train.sft import SftConfig
from deepr.train.stage import trl_args


def test_a_trl_setting_given_by_trls_name_reaches_grpoconfig(tmp_path: Path) -> None:
    cfg = GrpoConfig(stage="planner", model="m", out=tmp_path, warmup_steps=7, max_grad_norm=0.5, lora_dropout=0.1)
    args = trl_args(cfg)
    assert (args.warmup_steps, args.max_grad_norm) == (7, 0.5)
    assert cfg.peft_config().lora_dropout == 0.1 and cfg.peft_config().r == 64  # DecomposeR Table 5's rank stays


def test_the_users_value_wins_over_the_paper_and_the_paper_over_deeprs_base(tmp_path: Path) -> None:
    paper = GrpoConfig(stage="planner", model="m", out=tmp_path)
    assert (paper.learning_rate, paper.beta, paper.loss_type, paper.lr_scheduler_type) == (4e-6, 0.001, "grpo",
                                                                                           "constant")
    mine = GrpoConfig(stage="planner", model="m", out=tmp_path, learning_rate=1e-5, lr_scheduler="cosine")
    assert (mine.learning_rate, trl_args(mine).lr_scheduler_type.value) == (1e-5, "cosine")  # an old name too


def test_an_unknown_setting_is_refused_naming_it(tmp_path: Path) -> None:
    cfg = SftConfig(model="m", out=tmp_path, learnig_rate=1e-5)  # a typo
    from deepr.train.sft import _trl_args

    with pytest.raises(ValueError, match="unknown setting 'learnig_rate'"):
        _trl_args(cfg, False, False)


def test_the_run_record_lists_every_setting_under_one_name(tmp_path: Path) -> None:
    flat = SftConfig(model="m", out=tmp_path, lora_r=8, seed=3).flat()
    assert (flat["lora_r"], flat["seed"], flat["learning_rate"], flat["role"]) == (8, 3, 1e-5, "all")
    assert "trl" not in flat and "lora" not in flat


def test_cli_set_and_config_file_feed_the_same_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deepr.cli import app
    from deepr.train import stages

    seen: dict = {}

    def fake_run(settings, data, open_source=None, constrained=None):
        seen["config"] = stages.stage_config(settings)
        raise ValueError("stop here")

    monkeypatch.setattr(stages, "run_from_settings", fake_run)
    data = tmp_path / "v.jsonl"
    data.write_text("{}\n")
    conf = tmp_path / "c.json"
    conf.write_text(json.dumps({"warmup_steps": 3, "beta": 0.02}))
    r = CliRunner().invoke(app, ["grpo", "--stage", "planner", "--model", "m", "--data", str(data), "--out",
                                 str(tmp_path / "o"), "--config", str(conf), "--set", "max_grad_norm=0.25",
                                 "--beta", "0.05"])
    assert r.exit_code == 2 and "stop here" in r.output, r.output
    cfg = seen["config"]
    assert (cfg.warmup_steps, cfg.max_grad_norm, cfg.beta) == (3, 0.25, 0.05)  # the flag wins over the file
    bad = CliRunner().invoke(app, ["grpo", "--stage", "planner", "--model", "m", "--data", str(data), "--out",
                                   str(tmp_path / "o"), "--set", "beta"])
    assert bad.exit_code == 2 and "expected NAME=VALUE" in bad.output and "Traceback" not in bad.output
