"""Every training entry point under two processes on CPU, launched as users launch it:

    torchrun --standalone --nproc_per_node 2 -m deepr sft ...   (torchrun = python -m torch.distributed.run)
    torchrun --standalone --nproc_per_node 2 -m deepr grpo --stage planner|answerer|rubric|decor|warp-atomic|warp-report ...

gloo on CPU, the tiny model, one or two steps each. Each run must finish with one adapter, one
deepr_meta.json and one metrics.jsonl row per step (rank 0 writes; a second writer would repeat
rows), the two ranks must share the batch rather than each train on all of it, SFT's first
losses must equal a one-process run with the same global batch, and --resume must continue a
two-process run from its checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What causes earthquakes?", "How do volcanoes affect the climate?"]
# Two-process runs take ~15-40 s each on two cores (two imports of torch + trl per launch).
pytestmark = pytest.mark.timeout(900)


def torchrun(*args: object, nproc: int = 2, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N -m deepr ARGS` (torchrun is python -m torch.distributed.run)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", **(env_extra or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "deepr", *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False)
    errors = [x for x in done.stderr.splitlines() if "Error" in x or "error:" in x][:8]  # ranks' own, first
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-2000:]}\n" + "\n".join(errors)
    return done


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, mini_corpus: Path) -> dict[str, Path]:
    """Every stage's input, made once: SFT turns and WARP actions from extractive runs, verified
    pairs, DECOR's QA rows, the answerer's prepared records, a bm25 index built before any launch
    (two ranks must not race to build it)."""
    from typer.testing import CliRunner

    from deepr.agent import RunConfig, run_agent
    from deepr.cli import app
    from deepr.corpus import open_retriever
    from deepr.corpus.tools import ResearchTools
    from deepr.records import QRPair, RubricItem
    from deepr.train.trajectories import turn_examples

    d = tmp_path_factory.mktemp("mp-inputs")
    retriever = open_retriever(str(mini_corpus), retriever="bm25", progress=False)
    tools = ResearchTools(retriever, k=2)
    planner = [e for q in QUESTIONS for e in turn_examples(run_agent(q, tools=tools, llm=None,
                                                                        config=RunConfig(mode="dag", k=2)).trajectory)
               if e.role == "planner"]
    warp = turn_examples(run_agent(QUESTIONS[1], tools=tools, llm=None,
                                   config=RunConfig(mode="warp", k=2, max_expansions=1)).trajectory)
    warp = [e for e in warp if e.action in ("search", "initialize")][:2]
    assert len(planner) >= 4 and len(warp) == 2
    rub = RubricItem(id="R1", type="factual", description="Plate boundaries cause earthquakes", weight=1.0,
                     source_leaf_ids=["L1"], evidence=["Most earthquakes occur at plate boundaries."])
    files = {"sft": (planner[:4], "sft.jsonl"), "warp": (warp, "rl.jsonl"),
             "verified": ([QRPair(id=f"q{i}", tree_id="t", question=q, selected_leaf_ids=[], rubrics=[rub],
                                  decision="KEEP") for i, q in enumerate(QUESTIONS)], "verified.jsonl")}
    paths = {}
    for key, (rows, name) in files.items():
        paths[key] = d / name
        paths[key].write_text("".join(r.model_dump_json() + "\n" for r in rows), encoding="utf-8")
    paths["qa"] = d / "qa.jsonl"
    paths["qa"].write_text("".join(json.dumps({"id": f"q{i}", "question": q, "answers": ["tectonic plates"]}) + "\n"
                                   for i, q in enumerate(QUESTIONS)))
    paths["prepared"] = d / "prepared.jsonl"
    r = CliRunner().invoke(app, ["grpo", "prepare", "--planner", "extractive", "--data", str(paths["verified"]),
                                 "--out", str(paths["prepared"]), "--corpus", str(mini_corpus), "--retriever", "bm25",
                                 "--k", "2"])
    assert r.exit_code == 0, r.output
    return paths


def steps_logged(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(x)]


def one_run_saved(out: Path, steps: int) -> dict:
    """One finished run: adapter, meta (done, all steps), metrics.jsonl with each step once."""
    meta = json.loads((out / "deepr_meta.json").read_text())
    assert meta["status"] == "done" and meta.get("counts", meta)["steps"] == steps  # sft keeps it under counts
    assert (out / "adapter_model.safetensors").is_file() or (out / "model.safetensors").is_file()
    if (out / "metrics.jsonl").is_file():  # GRPO stages; a second writing rank would repeat each step
        assert steps_logged(out) == list(range(1, steps + 1))
    return meta


def log_history(out: Path) -> list[dict]:
    state = max(out.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    return json.loads(state.read_text())["log_history"]


def test_sft_two_processes_match_one_with_the_same_global_batch(tiny, inputs, tmp_path):
    """2 ranks x batch 1 == 1 rank x batch 2: same examples per step, same losses and gradients.
    Tolerance 1e-4: the only difference is the order of a float32 sum (DDP averages two ranks'
    gradients; transformers scales each rank's token loss by the batch's global token count), so
    losses agree to ~1e-6; 1e-4 is the issue's bound and still catches a rank that trained on
    other examples (losses then differ by ~1e-2 here)."""
    common = ["sft", "--model", tiny, "--data", inputs["sft"], "--role", "planner", "--full", "--lr", "1e-3",
              "--max-steps", "2", "--grad-accum", "1", "--max-length", "4096", "--logging-steps", "1",
              "--save-steps", "2"]
    torchrun(*common, "--out", tmp_path / "two", "--batch-size", "1")
    torchrun(*common, "--out", tmp_path / "one", "--batch-size", "2", nproc=1)
    two, one = (one_run_saved(tmp_path / k, 2) for k in ("two", "one"))
    h2, h1 = ([r for r in log_history(tmp_path / k) if "loss" in r] for k in ("two", "one"))
    assert [r["epoch"] for r in h2] == [r["epoch"] for r in h1] == [0.5, 1.0]  # 4 examples, 2 per step: shared
    for a, b in zip(h2, h1, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4
    assert two["losses"] == one["losses"] and len(two["losses"]) == 2


GRPO_COMMON = {"lora_r": 4, "lora_alpha": 8, "zero_advantage": "off", "save_steps": 1, "mini_batch_prompts": 2}
STAGES = {  # stage: (data key, config, extra flags)
    "planner": ("verified", {"max_completion_length": 96}, ["--k", "2"]),
    "answerer": ("prepared", {"max_completion_length": 96}, []),
    "rubric": ("verified", {"max_completion_length": 48, "max_turn_tokens": 24, "tool_turns": 2}, []),
    "decor": ("qa", {"max_completion_length": 64, "max_turn_tokens": 16, "decor_steps": 1}, []),
    "warp-atomic": ("warp", {"max_completion_length": 16, "k": 2}, []),
    "warp-report": ("verified", {"max_completion_length": 600, "max_turn_tokens": 24, "max_expansions": 1,
                                 "k": 2}, []),
}


def grpo_args(stage: str, tiny: Path, inputs: dict, mini_corpus: Path, out: Path, steps: int,
              over: dict | None = None) -> list:
    key, cfg, extra = STAGES[stage]
    cfg_file = out.parent / f"{stage}.json"
    cfg_file.write_text(json.dumps({**GRPO_COMMON, **cfg, **(over or {})}))
    corpus = [] if stage == "answerer" else ["--corpus", mini_corpus, "--retriever", "bm25"]
    return ["grpo", "--stage", stage, "--model", tiny, "--data", inputs[key], "--out", out, "--config", cfg_file,
            "--max-steps", steps, "--num-generations", "2", "--prompts-per-step", "2", "--lr", "1e-3",
            *corpus, *extra]


@pytest.mark.parametrize("stage", list(STAGES))
def test_grpo_stage_under_two_processes(stage, tiny, inputs, mini_corpus, tmp_path):
    """Each rank takes one prompt's whole group (prompts per step 2, 2 ranks): one step covers
    both prompts once, as in one process, and rank 0 alone writes."""
    out = tmp_path / "rl"
    torchrun(*grpo_args(stage, tiny, inputs, mini_corpus, out, 1))
    meta = one_run_saved(out, 1)
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    rows = {"qa": 3 * len(QUESTIONS), "warp": 2}.get(STAGES[stage][0], len(QUESTIONS))
    # 2 prompts a step over `rows` prompts: the ranks shared the step (two unrelated runs would say the same
    # epoch but repeat metrics rows, caught above); DECOR trains 3 roles per question.
    assert row["epoch"] == pytest.approx(2 / rows) and meta["status"] == "done"
    if stage == "planner":  # each rank logs its own rollouts: 2 prompts x 2 generations in all, not twice that
        lines = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
        assert len(lines) == 4 and sorted({x["query"] for x in lines}) == sorted(QUESTIONS)


def test_resume_under_two_processes(tiny, inputs, mini_corpus, tmp_path):
    """A two-process run stopped after step 1 (its checkpoint saved) continues to step 2 with --resume.
    Rollouts unconstrained here: with schema formats, this resumed two-process run's sampling on
    rank 0 tripped xgrammar's own assertion (a sampled token its matcher refuses; the one-process
    resume of the same checkpoint did not), an open matter of constrained sampling in
    deepr/train/sampling.py, outside what this test checks."""
    out = tmp_path / "rl"
    over = {"rollout_formats": "off"}
    torchrun(*grpo_args("planner", tiny, inputs, mini_corpus, out, 1, over))
    one_run_saved(out, 1)
    args = grpo_args("planner", tiny, inputs, mini_corpus, out, 2, over)
    torchrun(*args, "--resume")
    one_run_saved(out, 2)
    assert (out / "checkpoint-2").is_dir()


# Sampling is seeded per rank (TRL's set_seed(seed, device_specific=True)) and one process samples all
# groups in one batched generate, so sampled rollouts differ between 1 and 2 processes. The comparison
# therefore fixes the rollouts: every prompt's rollout j writes a valid G0 for even j and no plan for odd j,
# and each G1 is the revision, so each group's rewards have a spread and the loss is not zero. What then
# differs is only who computes what: each rank's group must be complete (its advantages are
# group-relative), the rewards gathered, and the loss scaled to the global batch.
SAME_ROLLOUTS = r'''
import json, sys
from pathlib import Path
from deepr.corpus import open_retriever
from deepr.io import read_jsonl
from deepr.records import QRPair
from deepr.train import grpo
from deepr.train.environments import PlannerEnvironment

model, data, corpus, out = sys.argv[1:5]
PLAN = {"nodes": [
    {"id": "N1", "type": "search", "query": "causes of earthquakes plate tectonics", "key_points": ["faults"]},
    {"id": "N2", "type": "search", "query": "volcano eruption climate effects", "key_points": ["ash"]},
    {"id": "N3", "type": "aggregate", "need": "what the searches found", "key_points": ["plates"],
     "inputs": ["N1", "N2"]},
    {"id": "N4", "type": "answer", "need": "a short report", "inputs": ["N3"]}]}
REVISED = {"nodes": PLAN["nodes"], "fetch": ["N1-R1"]}

def scripted(trainer):
    tok = trainer.processing_class
    def generate(seqs, first, max_new):
        texts = [json.dumps(PLAN) if j % 2 == 0 else "no plan" for j in range(len(seqs))] if first \
            else [json.dumps(REVISED)] * len(seqs)
        return [(tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:max_new] for t in texts], None
    return generate

rows, lookup = grpo.planner_dataset(list(read_jsonl(Path(data), QRPair)))
cfg = grpo.GrpoConfig(stage="planner", model=model, out=out, num_generations=4, prompts_per_step=2,
                      mini_batch_prompts=2, max_completion_length=3000, max_steps=2, lora_r=4, lora_alpha=8, k=2,
                      learning_rate=1e-3, zero_advantage="off", save_steps=10, full=True)
env = PlannerEnvironment(open_retriever(corpus, retriever="bm25", progress=False), k=2)
grpo.train_grpo(cfg, rows, lookup, env=env, generate_for=scripted)
'''


def torchrun_script(script: Path, *args: object, nproc: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(script), *map(str, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def test_planner_two_processes_match_one_with_the_same_rollouts(tiny, inputs, mini_corpus, tmp_path):
    """Same global batch (2 prompts x 4 rollouts a step), same rollouts: rewards, their spread, the
    loss and the gradient norm of the first two steps match a one-process run, within 1e-4
    (relative for the gradient norm): the ranks' sums differ only in float32 order (the rewards'
    embeddings are batched differently). A rank that scored an incomplete group, or a loss scaled
    by the local instead of the global batch, moves them by far more (the advantages or the
    gradient change by a factor). At step 1 the policy is its own reference and old policy, so
    the loss is the mean advantage, 0: the gradient norm carries that step's comparison."""
    script = tmp_path / "same_rollouts.py"
    script.write_text(SAME_ROLLOUTS)
    for n in (1, 2):
        torchrun_script(script, tiny, inputs["verified"], mini_corpus, tmp_path / f"p{n}", nproc=n)
    one, two = ([json.loads(x) for x in (tmp_path / f"p{n}" / "metrics.jsonl").read_text().splitlines()
                 if "loss" in json.loads(x)] for n in (1, 2))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two, strict=True):
        assert a["reward_std"] > 0.01 and a["grad_norm"] > 1e-3  # the check has something to compare
        for key in ("rewards/plan_reward/mean", "reward_std", "frac_reward_zero_std", "loss"):
            assert abs(a[key] - b[key]) < 1e-4, (key, a[key], b[key])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    for n in (1, 2):  # every query's group of 4, whole, in each step's rollouts
        lines = [json.loads(x) for x in (tmp_path / f"p{n}" / "rollouts.jsonl").read_text().splitlines()]
        for step in (1, 2):
            queries = sorted(x["query"] for x in lines if x["step"] == step - 1)
            assert queries == sorted(QUESTIONS * 4), (n, step, queries)
