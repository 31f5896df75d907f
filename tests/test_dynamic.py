"""Dynamic sampling (deepr.train.dynamic): a step's flat groups are sampled again, and the ones still
flat are left out of the loss; the zero-advantage share reports what the step trained on."""

from __future__ import annotations

import json

import pytest

from grpo_helpers import capture_batches, scripted_rows


def test_flat_groups_and_merging_two_generation_batches():
    from deepr.train.dynamic import flat_groups, merge_rows

    keys = [("q1", "planner")] * 2 + [("q1", "filter")] * 2 + [("q2", "planner")] * 2
    assert flat_groups([1.0, 1.0, 0.2, 0.8, float("nan"), 0.5], keys) == {("q1", "planner"), ("q2", "planner")}
    # gather_object hands tuples back as lists; integer group numbers work as keys too
    assert flat_groups([0.0, 0.0, 0.0, 1.0], [[0, "a"], [0, "a"], 1, 1]) == {(0, "a")}
    assert merge_rows([["a1"], ["a2"]], [["b1"], ["b2", "b3"]], [False, True]) == [["a1"], ["b2", "b3"]]
    assert merge_rows([0.0, 0.0], [1.0, -1.0], [False, True]) == [0.0, -1.0]


def _planner_step(tiny, tok, retriever, out, samplings: list[list[list[str]]], dynamic: int, steps: int = 1,
                  callbacks: tuple = ()):
    """Planner GRPO steps (1 question x 2 rollouts); sampling i writes ``samplings[i]`` (turn x row)."""
    from test_grpo import _pairs

    from deepr.train import grpo, stage
    from deepr.train.environments import PlannerEnvironment

    rows, lookup = grpo.planner_dataset(_pairs(1))
    cfg = grpo.GrpoConfig(stage="planner", model=str(tiny), out=out, num_generations=2, prompts_per_step=1,
                          mini_batch_prompts=1, max_completion_length=3000, lora_r=4, lora_alpha=8,
                          k=2, learning_rate=1e-3, dynamic_sampling=dynamic, zero_advantage="warn",
                          max_steps=steps)
    store: list = []
    used: list[int] = []
    built = stage.build_stage_trainer

    def keep(*a, **kw):
        store.append(built(*a, **kw))
        return store[0]

    def gen_for(_trainer):
        used.append(len(used))
        return scripted_rows(tok, samplings[min(len(used) - 1, len(samplings) - 1)])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stage, "build_stage_trainer", keep)
        res = grpo.train_grpo(cfg, rows, lookup, env=PlannerEnvironment(retriever, k=2), generate_for=gen_for,
                              callbacks=[capture_batches(store), *callbacks])
    log = [json.loads(x) for x in (res.out / "metrics.jsonl").read_text().splitlines()]
    return res, store[1], log[0] if steps == 1 else log, len(used)


def _turns():
    from test_grpo import BAD_REVISION, PLAN, REVISED

    same = [[json.dumps(PLAN)], [json.dumps(REVISED)]]  # both rollouts score alike: a flat group
    mixed = [[json.dumps(PLAN)], [json.dumps(REVISED), json.dumps(BAD_REVISION)]]  # one revision invalid
    return same, mixed, json.dumps(BAD_REVISION)


def test_planner_flat_group_is_sampled_again_and_the_varied_one_trained(tiny, tok, retriever, tmp_path):
    same, mixed, bad = _turns()
    res, batch, row, samplings = _planner_step(tiny, tok, retriever, tmp_path / "rl", [same, mixed], dynamic=1)
    assert res.steps == 1 and samplings == 2
    live = [i for i, m in enumerate(batch["completion_mask"]) if int(m.sum()) > 0]
    replies = [tok.decode(batch["completion_ids"][i][batch["completion_mask"][i].bool()], skip_special_tokens=True)
               for i in live]
    assert replies.count(bad) == 1  # the trained rows are the second sampling's
    assert len({round(float(batch["advantages"][i]), 5) for i in live}) == 2
    assert row["dynamic/flat_first"] == 1.0 and row["dynamic/flat_left_out"] == 0.0
    assert row["dynamic/samplings"] == 2.0 and row["zero_advantage_frac"] == 0.0


def test_planner_group_still_flat_is_left_out_and_counted(tiny, tok, retriever, tmp_path):
    same, _, _ = _turns()
    res, batch, row, samplings = _planner_step(tiny, tok, retriever, tmp_path / "rl", [same, same, same], dynamic=2)
    assert res.steps == 1 and samplings == 3  # the first sampling and two more
    assert int(batch["completion_mask"].sum()) == 0  # nothing of the flat group reaches the loss
    assert row["dynamic/flat_first"] == 1.0 and row["dynamic/flat_left_out"] == 1.0
    assert row["zero_advantage_frac"] == 1.0 and row["loss"] == 0.0  # no KL term either


def test_planner_default_samples_once_and_trains_the_flat_group(tiny, tok, retriever, tmp_path):
    """Off by default (DecomposeR does not resample): a flat group is trained as sampled (KL term only)."""
    same, mixed, _ = _turns()
    res, batch, row, samplings = _planner_step(tiny, tok, retriever, tmp_path / "rl", [same, mixed], dynamic=0)
    assert res.steps == 1 and samplings == 1
    assert int(batch["completion_mask"].sum()) > 0
    assert all(float(a) == 0.0 for a in batch["advantages"])
    assert "dynamic/flat_first" not in row and row["zero_advantage_frac"] == 1.0


def test_a_step_with_every_group_left_out_does_not_move_the_weights(tiny, tok, retriever, tmp_path):
    """Step 1 trains a varied group (AdamW builds momentum); step 2's group stays flat and is left
    out: its gradient is zero, and the optimiser step is skipped rather than applying momentum."""
    import torch
    from transformers import TrainerCallback

    same, mixed, _ = _turns()
    snapshots: list = []

    class Weights(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            snapshots.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})

    res, _, log, samplings = _planner_step(tiny, tok, retriever, tmp_path / "rl", [mixed, same, same], dynamic=1,
                                           steps=2, callbacks=(Weights(),))
    assert res.steps == 2 and samplings == 3 and len(snapshots) == 2
    assert log[0]["dynamic/flat_left_out"] == 0.0 and "dynamic/update_skipped" not in log[0]
    assert log[1]["dynamic/flat_left_out"] == 1.0 and log[1]["dynamic/update_skipped"] == 1.0
    assert all(torch.equal(snapshots[0][n], snapshots[1][n]) for n in snapshots[0])
