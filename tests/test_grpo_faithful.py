"""RL as the papers define it (issue 38) and the one stage registry (issue 37.4): rollouts come from
the policy being trained unless a config asks otherwise, and every stage is one registry entry."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from deepr.records import QRPair

RUBRICS = [{"id": "R1", "type": "factual", "description": "Earthquakes come from moving plates.", "weight": 1.0}]
SIX = {"planner", "answerer", "rubric", "decor", "warp-atomic", "warp-report"}


def test_all_six_stages_are_registry_entries_with_one_config_base(tmp_path: Path):
    from deepr.train.stage import StageConfig
    from deepr.train.stages import STAGES, stage_config

    assert set(STAGES) == SIX
    lrs = {}
    for name, entry in STAGES.items():
        cfg = stage_config({"stage": name, "model": "m", "out": tmp_path})
        assert isinstance(cfg, StageConfig) and cfg.stage == name and callable(entry.runner())
        lrs[name] = cfg.learning_rate
    # each paper's own value fills the fields left None (DecomposeR T5, DeepRubric B, DECOR T5, AgentCPM T7)
    assert lrs == {"planner": 4e-6, "answerer": 4e-6, "rubric": 1e-6, "decor": 2e-6, "warp-atomic": 2.5e-6,
                   "warp-report": 1e-6}
    with pytest.raises(ValueError, match="unknown stage; choose one of planner, answerer"):
        stage_config({"stage": "critic", "model": "m", "out": tmp_path})


def test_no_training_module_borrows_helpers_from_sft():
    """Shared run helpers live in deepr/train/runs.py; train/sft.py is only SFT."""
    root = Path(__file__).resolve().parents[1] / "deepr"
    users = []
    for path in root.rglob("*.py"):
        if path.name == "sft.py" or path.parent.name == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "deepr.train.sft":
                users.append(str(path.relative_to(root)))
    assert users == []


def test_rollout_formats_default_on_policy_and_constrained_only_when_asked(tmp_path: Path, capsys):
    from deepr.train.grpo import GrpoConfig
    from deepr.train.stage import sampling_record, warn_judge

    cfg = GrpoConfig(stage="planner", model="m", out=tmp_path)
    assert cfg.rollout_formats == "none" and sampling_record(cfg) == {"rollout_formats": "none", "on_policy": True}
    assert GrpoConfig(stage="planner", model="m", out=tmp_path, rollout_formats="off").rollout_formats == "none"
    warn_judge(cfg)
    assert "off-policy" not in capsys.readouterr().err
    off = GrpoConfig(stage="planner", model="m", out=tmp_path, rollout_formats="schema")
    assert sampling_record(off) == {"rollout_formats": "schema", "on_policy": False}
    warn_judge(off)  # said at start of the run
    assert "rollout_formats" in capsys.readouterr().err
    with pytest.raises(ValueError, match="vLLM would sample without it"):
        GrpoConfig(stage="planner", model="m", out=tmp_path, rollout_formats="schema", use_vllm=True)
    with pytest.raises(ValueError, match="is for --stage planner"):
        GrpoConfig(stage="answerer", model="m", out=tmp_path, rollout_formats="schema")
    with pytest.raises(ValueError, match="plan_validity"):
        GrpoConfig(stage="planner", model="m", out=tmp_path, plan_validity="strict")


def test_cli_sets_rollout_formats_and_plan_validity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from typer.testing import CliRunner

    import deepr.cli.search_opts as search_opts
    import deepr.train.environments as environments
    import deepr.train.grpo as grpo
    from deepr.cli import app

    seen, envs = [], []
    monkeypatch.setattr(grpo, "train_grpo", lambda config, rows, lookup, **kw: seen.append((config, kw)) or
                        grpo.GrpoResult(out=config.out, steps=0, rewards=[]))
    monkeypatch.setattr(environments, "PlannerEnvironment", lambda *a, **k: envs.append(k))
    monkeypatch.setattr(search_opts, "open_search", lambda *a, **k: None)
    data = tmp_path / "verified.jsonl"
    data.write_text(QRPair(id="q0", tree_id="t", question="What causes earthquakes?", selected_leaf_ids=[],
                           rubrics=RUBRICS).model_dump_json() + "\n")
    base = ["grpo", "--stage", "planner", "--model", "m", "--data", str(data)]
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "b"), "--rollout-formats", "schema",
                                 "--plan-validity", "run"])
    assert r.exit_code == 0, r.output
    assert [(c.rollout_formats, c.plan_validity) for c, _ in seen] == [("none", "paper"), ("schema", "run")]
    assert [e["validity"] for e in envs] == ["paper", "run"]
    from deepr.profiles.small.rollouts import planner_generate

    # the constrained generator is the small profile's, handed in only when schema is asked for
    assert [kw.get("generate_for") for _, kw in seen] == [None, planner_generate]


def test_sampled_rollout_tokens_come_from_the_unconstrained_policy(tiny, tok, retriever, tmp_path, monkeypatch):
    """The default planner rollout samples through the trainer's own generator (no decoding
    constraint is built), and every sampled token has nonzero probability under the model the loss
    differentiates (the same weights, no logits processor)."""
    import torch

    import deepr.llm.hf_constrain as hc
    from deepr.train import grpo
    from deepr.train.environments import PlannerEnvironment
    from deepr.train.rollouts import make_rollout_func

    def no_constraints(*a, **k):
        raise AssertionError("an on-policy rollout built a decoding constraint")

    monkeypatch.setattr(hc.Constrainer, "processor", no_constraints)
    rows, lookup = grpo.planner_dataset([QRPair(id="q0", tree_id="t", question="What causes earthquakes?",
                                                selected_leaf_ids=[], rubrics=RUBRICS)])
    cfg = grpo.GrpoConfig(stage="planner", model=str(tiny), out=tmp_path / "rl", num_generations=2,
                          prompts_per_step=1, mini_batch_prompts=1, max_completion_length=64, max_turn_tokens=24,
                          lora_r=4, lora_alpha=8, max_steps=1)
    rollout = make_rollout_func("planner", lookup, budget=64, env=PlannerEnvironment(retriever, k=2),
                                turn_cap=24, formats=cfg.rollout_formats)
    trainer = grpo.build_trainer(cfg, cfg.model, rows, rollout, lambda *a, **k: [0.0] * 2)
    rollout([rows[0]["prompt"]] * 2, trainer)
    calls = [c for ep in trainer._warp_calls for c in ep]
    assert len(calls) >= 2 and all(c.completion_ids for c in calls)
    model = trainer.model.eval()
    with torch.no_grad():
        for c in calls:
            ids = torch.tensor([c.prompt_ids + c.completion_ids])
            logits = model(input_ids=ids).logits[0, len(c.prompt_ids) - 1:-1].float()
            probs = torch.softmax(logits / cfg.temperature, dim=-1)
            picked = probs[torch.arange(len(c.completion_ids)), torch.tensor(c.completion_ids)]
            assert bool((picked > 0).all()) and bool(torch.isfinite(picked.log()).all())
    assert json.loads(json.dumps(cfg.model_dump(mode="json")))["rollout_formats"] == "none"


def test_constrained_rollouts_refuse_a_backend_that_cannot_apply_them():
    """Under --use-vllm the schema cannot apply; the run stops instead of silently sampling
    unconstrained while deepr_meta.json says "schema"."""
    from types import SimpleNamespace

    from deepr.profiles.small.rollouts import constrained_generate, planner_format

    with pytest.raises(RuntimeError, match="vLLM samples them"):
        constrained_generate(SimpleNamespace(use_vllm=True), planner_format)


def test_rollout_weights_count_each_episode_once_and_fillers_never():
    """Eq. 16 (DECOR Eq. 4 per trajectory): an episode's calls share 1/|o_e|, so the episode's
    weights sum to 1 however many calls it made; filler rows and empty episodes weigh 0 and the
    mean's denominator counts episodes with tokens."""
    from types import SimpleNamespace

    from deepr.train.warp_calls import Call, per_rollout_loss, rollout_weights

    eps = [[Call([1], [5, 6, 7]), Call([1], [8])], [Call([1], [9, 9])], []]
    weights, counted = rollout_weights(eps, 5)
    assert weights == pytest.approx([0.25, 0.25, 0.5, 0.0, 0.0]) and counted == 2
    tokens = [3, 1, 2, 0, 0]
    assert sum(w * n for w, n in zip(weights, tokens)) == pytest.approx(counted)
    for given, used, flag in (("grpo", "dapo", True), ("dapo", "dapo", False), ("bnpo", "bnpo", False)):
        t = SimpleNamespace(loss_type=given)
        per_rollout_loss(t)
        assert (t.loss_type, t._deepr_per_rollout) == (used, flag)
