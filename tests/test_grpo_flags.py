"""deepr grpo's generation flags (issue 14.3): --max-tokens, --temperature, --top-p and --seed reach
the rollouts' sampling (TRL's GRPOConfig) and the reward judge's LLM; bad values stop at once with
one line naming the flag. No training runs here: the trainer entry point is replaced."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.cli import app
from deepr.llm.base import GenDefaults
from deepr.records import QRPair

RUBRICS = [{"id": "R1", "type": "factual", "description": "Earthquakes come from moving plates.", "weight": 1.0}]


@pytest.fixture
def planner_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list[str]]:
    """`deepr grpo --stage planner` arguments whose run stops where training would start; returns
    (the configs train_grpo received, the base arguments)."""
    import deepr.cli.search_opts as search_opts
    import deepr.train.environments as environments
    import deepr.train.grpo as grpo

    seen: list = []

    def fake_train(config, rows, lookup, **kw):
        seen.append(config)
        return grpo.GrpoResult(out=config.out, steps=0, rewards=[])

    monkeypatch.setattr(grpo, "train_grpo", fake_train)
    monkeypatch.setattr(environments, "PlannerEnvironment", lambda *a, **k: None)
    monkeypatch.setattr(search_opts, "open_search", lambda *a, **k: None)
    data = tmp_path / "verified.jsonl"
    data.write_text(QRPair(id="q0", tree_id="t", question="What causes earthquakes?", selected_leaf_ids=[],
                           rubrics=RUBRICS).model_dump_json() + "\n")
    return seen, ["grpo", "--stage", "planner", "--model", "m", "--data", str(data), "--out", str(tmp_path / "o")]


def test_generation_flags_reach_rollout_sampling_and_judge(planner_cli) -> None:
    from deepr.train.grpo import trl_args

    seen, args = planner_cli
    r = CliRunner().invoke(app, [*args, "--max-tokens", "64", "--temperature", "0.7", "--top-p", "0.9",
                                 "--seed", "3"])
    assert r.exit_code == 0, r.output
    (config,) = seen
    assert (config.max_turn_tokens, config.temperature, config.top_p, config.seed) == (64, 0.7, 0.9, 3)
    assert config.judge_gen == GenDefaults(max_tokens=64, temperature=0.7, top_p=0.9, seed=3)
    trl = trl_args(config)  # what TRL samples the rollouts with
    assert (trl.temperature, trl.top_p, trl.seed) == (0.7, 0.9, 3)


def test_without_flags_the_paper_defaults_and_the_judge_roles_own_settings_stay(planner_cli) -> None:
    seen, args = planner_cli
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    (config,) = seen
    assert (config.max_turn_tokens, config.temperature, config.top_p, config.seed) == (None, 1.0, 1.0, 0)
    assert config.judge_gen == GenDefaults()


@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "-0.5", "--temperature -0.5: must be between 0 and 2"),
    ("--temperature", "0", "--temperature 0: GRPO compares sampled rollouts"),
    ("--top-p", "0", "--top-p 0: must be in (0, 1]"),
    ("--top-p", "1.5", "--top-p 1.5: must be in (0, 1]"),
    ("--max-tokens", "4", "--max-tokens 4: must be >= 8"),
    ("--seed", "-1", "--seed -1: must be a non-negative integer"),
])
def test_bad_generation_values_give_one_line_naming_the_flag(planner_cli, flag: str, value: str,
                                                             message: str) -> None:
    seen, args = planner_cli
    r = CliRunner().invoke(app, [*args, flag, value])
    assert r.exit_code == 2 and message in r.output, r.output
    assert "Traceback" not in r.output and not seen


def test_judges_built_in_training_get_the_generation_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import deepr.corpus.embed as embed_mod
    import deepr.llm as llm_mod
    from deepr.train.grpo import GrpoConfig, default_reward, gen_settings
    from deepr.rewards.judges import make_judge


    built: list = []

    def fake_get_llm(spec, **kw):
        built.append((spec, kw.get("gen")))
        return None

    class Embedder:
        def encode(self, texts, **kw):
            return [[1.0] for _ in texts]

    monkeypatch.setattr(llm_mod, "get_llm", fake_get_llm)
    monkeypatch.setattr(embed_mod, "get_embedder", lambda *a, **k: Embedder())
    gen = GenDefaults(max_tokens=128, temperature=0.2, top_p=0.8, seed=7)
    config = GrpoConfig(stage="answerer", model="m", out=tmp_path, judge_llm="openai:judge", **gen_settings(gen))
    default_reward(config, embed=Embedder().encode)  # the answerer stage's J_rub judge
    make_judge("openai:judge", config.judge_gen)  # rubric, decor and warp stages
    assert built == [("openai:judge", gen), ("openai:judge", gen)]


def test_grpo_prepare_sends_the_flags_to_the_planner_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import deepr.cli.search_opts as search_opts
    import deepr.llm as llm_mod
    import deepr.train.prepare as prepare

    built: list = []

    def fake_get_llm(spec, **kw):
        built.append((spec, kw.get("gen")))
        raise ValueError("stop here: the planner model is built")

    monkeypatch.setattr(llm_mod, "get_llm", fake_get_llm)
    monkeypatch.setattr(search_opts, "open_search", lambda *a, **k: None)
    monkeypatch.setattr(prepare, "prepare_records", lambda *a, **k: iter(()))
    data = tmp_path / "verified.jsonl"
    data.write_text(QRPair(id="q0", tree_id="t", question="What causes earthquakes?", selected_leaf_ids=[],
                           rubrics=RUBRICS).model_dump_json() + "\n")
    args = ["grpo", "prepare", "--planner", "extractive", "--data", str(data), "--out", str(tmp_path / "p.jsonl")]
    r = CliRunner().invoke(app, [*args, "--max-tokens", "300", "--temperature", "0.5", "--seed", "2"])
    assert r.exit_code == 2 and "stop here" in r.output
    assert built == [("extractive", GenDefaults(max_tokens=300, temperature=0.5, seed=2))]
    r = CliRunner().invoke(app, [*args, "--top-p", "2"])
    assert r.exit_code == 2 and "--top-p 2: must be in (0, 1]" in r.output and len(built) == 1
