"""The GRPO step's own overhead: the share of a step outside model compute, per stage, and a
profile of that share's top costs.

Every stage runs through ``run_from_settings`` (what ``deepr grpo`` calls) on the tiny random
model; ``--smollm2`` adds ONE planner step on SmolLM2-135M-Instruct. Phases come from metrics.jsonl's
``time/*`` columns: model compute is sampling + log-prob forwards + backward + optimiser; the rest
(environment, rewards, TRL's bookkeeping, the loop) is overhead. Step 1 warms up, steps 2..N-1 are
timed, step N is profiled (cProfile only while no model phase is open; it slows Python code, so
that share is an upper bound, ``profiler_inflation`` says by how much; so is the SmolLM2 step's).

    nice -n 10 python bench/grpo_overhead.py --out bench/results/grpo_overhead.json
    nice -n 10 python bench/grpo_overhead.py --only planner-schema --smollm2 --turn-tokens 160
    python bench/grpo_overhead.py --render-ab [--smollm2]   # the prompt-rendering A/B alone (the suite's run)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, read_json, write_json

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

QUESTIONS = ["What causes earthquakes?", "How do volcanoes affect the climate?"]
PARTS = ("generate", "environment", "reward", "forward", "backward", "optimizer", "loss", "score", "other")
COMMON = {"lora_r": 4, "lora_alpha": 8, "zero_advantage": "off", "save_steps": 1000, "learning_rate": 1e-3,
          "num_generations": 4, "prompts_per_step": 2, "mini_batch_prompts": 2, "seed": 0}
STAGES = {  # name: (data key, settings): the sizes tests/test_multiprocess.py runs every stage at
    "planner": ("verified", {"stage": "planner", "max_completion_length": 96, "k": 2}),
    "planner-schema": ("verified", {"stage": "planner", "max_completion_length": 1800, "max_turn_tokens": 900,
                                    "k": 2, "rollout_formats": "schema"}),
    "answerer": ("prepared", {"stage": "answerer", "max_completion_length": 96}),
    "rubric": ("verified", {"stage": "rubric", "max_completion_length": 48, "max_turn_tokens": 24,
                            "tool_turns": 2}),
    "decor": ("qa", {"stage": "decor", "max_completion_length": 64, "max_turn_tokens": 16, "decor_steps": 1}),
    "warp-atomic": ("warp", {"stage": "warp-atomic", "max_completion_length": 16, "k": 2}),
    "warp-report": ("verified", {"stage": "warp-report", "max_completion_length": 600, "max_turn_tokens": 24,
                                 "max_expansions": 1, "k": 2}),
}


CLOCKS: list[Any] = []
LOOPS: list[Any] = []
PROFILE_FROM = {"step": 1}  # the step (1-based) of each run from which non-model phases are profiled


def install_profiling() -> None:
    """Make every stage's clock profile its non-model phases from step ``PROFILE_FROM`` on."""
    from trl.trainer import grpo_trainer

    from deepr.train import step_timing

    class ProfilingClock(step_timing.PhaseClock):
        def __init__(self) -> None:
            super().__init__()
            self.steps, self.on, self.loop_on, self.in_step = 0, False, False, False
            self.prof, self.loop_prof = cProfile.Profile(), cProfile.Profile()
            CLOCKS.append(self)

        def begin_step(self) -> None:
            super().begin_step()
            self.steps, self.in_step = self.steps + 1, True
            self._sync()

        def end_step(self) -> dict[str, float]:
            self.in_step = False
            self._sync()
            return super().end_step()

        def enter(self, name: str) -> None:
            super().enter(name)
            self._sync()

        def leave(self, name: str) -> None:
            super().leave(name)
            self._sync()

        def _sync(self) -> None:
            top = self._stack[-1] if self._stack else None
            want = self.in_step and self.steps >= PROFILE_FROM["step"] and top not in step_timing.MODEL
            if want != self.on:
                self.on = want
                (self.prof.enable if want else self.prof.disable)()
            loop_want = want and top == "reward"  # async rewards run on TRL's event-loop thread
            if loop_want != self.loop_on and LOOPS:
                self.loop_on = loop_want
                LOOPS[-1].call_soon_threadsafe(self.loop_prof.enable if loop_want else self.loop_prof.disable)

    step_timing.PhaseClock = ProfilingClock
    start = grpo_trainer.start_event_loop_in_daemon

    def tracked(*a: Any, **kw: Any) -> Any:
        thread, loop, ready = start(*a, **kw)
        LOOPS.append(loop)
        return thread, loop, ready

    grpo_trainer.start_event_loop_in_daemon = tracked


def top_costs(clock: Any, n: int = 12) -> dict[str, list[dict[str, Any]]]:
    """The non-model profile's top functions by own time and by cumulative time."""
    import io

    clock.prof.disable()
    stats = pstats.Stats(clock.prof, stream=io.StringIO())
    try:
        clock.loop_prof.disable()
        stats.add(pstats.Stats(clock.loop_prof, stream=io.StringIO()))
    except TypeError:  # the loop profiler never ran (no async reward)
        pass

    def name(key: tuple) -> str:
        path, line, func = key
        for mark in ("site-packages/", str(ROOT) + "/"):
            if mark in path:
                path = path.split(mark, 1)[1]
        return f"{path}:{line}({func})"

    mine = ("step_timing.py", "grpo_overhead.py", "threading.py", "contextlib.py")
    rows = [(k, v) for k, v in stats.stats.items() if not any(m in k[0] for m in mine)]  # type: ignore[attr-defined]

    def listing(index: int) -> list[dict[str, Any]]:
        best = sorted(rows, key=lambda kv: kv[1][index], reverse=True)[:n]
        return [{"function": name(k), "calls": v[1], "own_s": round(v[2], 4), "cumulative_s": round(v[3], 4)}
                for k, v in best]

    return {"by_own_time": listing(2), "by_cumulative_time": listing(3)}


def make_inputs(d: Path, corpus: str, retriever: Any, retriever_name: str) -> dict[str, Path]:
    """Every stage's input from extractive runs, as tests/test_multiprocess.py builds them."""
    from typer.testing import CliRunner

    from deepr.agent import RunConfig, run_agent
    from deepr.cli import app
    from deepr.corpus.tools import ResearchTools
    from deepr.records import QRPair, RubricItem
    from deepr.train.trajectories import turn_examples

    tools = ResearchTools(retriever, k=2)
    warp = turn_examples(run_agent(QUESTIONS[1], tools=tools, llm=None,
                                   config=RunConfig(mode="warp", k=2, max_expansions=1)).trajectory)
    warp = [e for e in warp if e.action in ("search", "initialize")][:2]
    rub = RubricItem(id="R1", type="factual", description="Plate boundaries cause earthquakes", weight=1.0,
                     source_leaf_ids=["L1"], evidence=["Most earthquakes occur at plate boundaries."])
    pairs = [QRPair(id=f"q{i}", tree_id="t", question=q, selected_leaf_ids=[], rubrics=[rub], decision="KEEP")
             for i, q in enumerate(QUESTIONS)]
    paths = {"warp": d / "rl.jsonl", "verified": d / "verified.jsonl", "qa": d / "qa.jsonl",
             "prepared": d / "prepared.jsonl"}
    paths["warp"].write_text("".join(r.model_dump_json() + "\n" for r in warp), encoding="utf-8")
    paths["verified"].write_text("".join(r.model_dump_json() + "\n" for r in pairs), encoding="utf-8")
    paths["qa"].write_text("".join(json.dumps({"id": f"q{i}", "question": q, "answers": ["tectonic plates"]}) + "\n"
                                   for i, q in enumerate(QUESTIONS)))
    r = CliRunner().invoke(app, ["grpo", "prepare", "--planner", "extractive", "--data", str(paths["verified"]),
                                 "--out", str(paths["prepared"]), "--corpus", corpus, "--retriever", retriever_name,
                                 "--k", "2"])
    if r.exit_code != 0:
        raise RuntimeError(f"grpo prepare failed: {r.output[-2000:]}")
    return paths


def summarize(rows: list[dict[str, Any]], idx: list[int]) -> dict[str, float]:
    keys = [f"time/{p}" for p in (*PARTS, "step")]
    mean = {k: sum(rows[i][k] for i in idx) / len(idx) for k in keys}
    step = mean["time/step"]
    out = {k.split("/")[1] + "_s": round(v, 4) for k, v in mean.items()}
    model = sum(mean[f"time/{p}"] for p in ("generate", "forward", "backward", "optimizer"))
    out["outside_model_share"] = round((step - model) / step, 4) if step else 0.0
    return out


def run_stage(name: str, settings: dict[str, Any], data: Path, retriever: Any, steps: int) -> dict[str, Any]:
    from deepr.profiles.small.rollouts import planner_generate
    from deepr.train.stages import run_from_settings

    t0 = time.perf_counter()
    res, _, _ = run_from_settings({**settings, "max_steps": steps}, data, open_source=lambda _c: retriever,
                                  constrained=planner_generate)
    wall = time.perf_counter() - t0
    clock = CLOCKS[-1]
    rows = [r for r in res.history if "loss" in r and "time/step" in r]
    if len(rows) != steps:
        raise RuntimeError(f"{name}: {len(rows)} timed rows for {steps} steps")
    out: dict[str, Any] = {"settings": settings, "wall_s": round(wall, 1), "first_step": summarize(rows, [0])}
    timed = list(range(1, steps - 1))
    if timed:
        out["timed_steps"] = {"steps": [i + 1 for i in timed], **summarize(rows, timed)}
    out["profiled_step"] = {"step": steps, **summarize(rows, [steps - 1])}
    if timed:
        base = out["timed_steps"]["step_s"] * out["timed_steps"]["outside_model_share"]
        prof = out["profiled_step"]["step_s"] * out["profiled_step"]["outside_model_share"]
        out["profiler_inflation"] = round(prof / base, 2) if base else None
    out["profile"] = top_costs(clock)
    for key in ("kl", "entropy", "reward_std", "frac_reward_zero_std"):
        out.setdefault("trl_signals_in_metrics", {})[key] = key in rows[0]
    print(f"{name}: {json.dumps({k: out[k] for k in ('first_step', 'timed_steps', 'profiled_step') if k in out})}",
          flush=True)
    return out


def render_ab(tokenizer: Any, group: int, rounds: int = 30) -> dict[str, Any]:
    """What a planner step renders before its first sampling call and for TRL's placeholder rows
    (2 questions x ``group`` rollouts), each prompt rendered every time (before) or once per
    rollout call (:func:`~deepr.train.rollouts.rendered_once`, after). Each call is timed on its
    own and the fastest of ``rounds`` kept per call: on a loaded machine a 100 ms burst is
    preempted where a 1 ms one is not, which would flatter the cached variant."""
    from deepr.train.environments import planner_prompt
    from deepr.train.rollouts import prompt_ids, rendered_once

    prompts = [planner_prompt(q) for q in QUESTIONS for _ in range(group)] * 2  # first turn, then TRL's rows

    def step(prompts: list[Any], trainer: Any) -> list[tuple[list[int], float]]:
        out = []
        for p in prompts:
            t0 = time.perf_counter()
            out.append((prompt_ids(tokenizer, p), time.perf_counter() - t0))
        return out

    best: dict[str, list[float]] = {}
    for _ in range(rounds):
        for label, fn in (("before", step), ("after", rendered_once(step))):
            got = fn(prompts, None)
            best[label] = [min(a, b) for a, b in zip(best.get(label, [float("inf")] * len(got)), (t for _, t in got))]
    same = [ids for ids, _ in step(prompts, None)] == [ids for ids, _ in rendered_once(step)(prompts, None)]
    if not same:
        raise AssertionError("rendered_once changed the token ids")
    before, after = sum(best["before"]), sum(best["after"])
    return {"renders_before": len(prompts), "renders_after": len(QUESTIONS), "before_s": round(before, 5),
            "after_s": round(after, 5), "ratio": round(after / before, 3), "prompt_tokens": len(prompt_ids(
                tokenizer, prompts[0]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=list(STAGES), help="Tiny stages to run (default: all but "
                    "planner-schema, whose constrained sampling trips xgrammar's assertion on the tiny tokenizer).")
    ap.add_argument("--no-tiny", action="store_true", help="Skip the tiny-model stages.")
    ap.add_argument("--steps", type=int, default=4, help="Tiny steps per stage: 1 warm-up, timed, 1 profiled.")
    ap.add_argument("--smollm2", action="store_true", help="Add one SmolLM2-135M planner step (several minutes); "
                    "with --render-ab, its tokenizer beside the tiny one.")
    ap.add_argument("--turn-tokens", type=int, default=160, help="SmolLM2: most tokens of one planner turn.")
    ap.add_argument("--group", type=int, default=4, help="SmolLM2: rollouts per question (2 questions).")
    ap.add_argument("--formats", default="schema", choices=["schema", "none"],
                    help="SmolLM2: rollout_formats (schema: the small profile's plan format, so plans are "
                         "valid and the environment searches).")
    ap.add_argument("--render-ab", action="store_true", help="Only the prompt-rendering A/B (seconds).")
    ap.add_argument("--corpus", default="wiki")
    ap.add_argument("--retriever", default="hybrid", help="As deepr grpo's default.")
    ap.add_argument("--out", type=Path, default=RESULTS / "grpo_overhead.json")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (a warm-up step, then the profiled one)")

    if args.render_ab:
        return write_render_ab(args)
    from deepr.corpus import open_retriever
    from deepr.corpus.embed import get_embedder
    from deepr.train.tiny import build_tiny_model, wiki_texts

    install_profiling()
    PROFILE_FROM["step"] = args.steps
    retriever = open_retriever(args.corpus, retriever=args.retriever, progress=False)
    retriever.search(QUESTIONS[0], k=2)  # lazy parts (query encoder) load here, not in a timed step
    get_embedder().encode(["warm the rewards' embedder"])
    result: dict[str, Any] = {"command": " ".join(sys.argv), "python": platform.python_version(),
                              "load_average_before": os.getloadavg(), "corpus": args.corpus,
                              "retriever": args.retriever, "stages": {}}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        inputs = make_inputs(d, args.corpus, retriever, args.retriever)
        if not args.no_tiny:
            tiny = build_tiny_model(d / "tiny", corpus_texts=wiki_texts(300) or None, vocab_size=1500)
            for name in args.only or [s for s in STAGES if s != "planner-schema"]:
                key, cfg = STAGES[name]
                settings = {**COMMON, **cfg, "model": str(tiny), "out": str(d / f"rl-{name}"),
                            "corpus": args.corpus, "retriever": args.retriever}
                data = inputs[key]
                result["stages"][f"{name} (tiny)"] = recorded(
                    name, lambda n=name, c=settings, f=data: run_stage(n, c, f, retriever, args.steps))
        if args.smollm2:
            result["stages"]["planner (SmolLM2-135M)"] = recorded(
                "planner (SmolLM2)", lambda: run_smollm2(args, d, inputs["verified"], retriever))
    result["load_average_after"] = os.getloadavg()
    write_json(args.out, result, indent=1)
    print(f"wrote {args.out}")
    failed = [k for k, v in result["stages"].items() if "failed" in v]
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (reasons in {args.out})")


def recorded(name: str, run: Any) -> dict[str, Any]:
    """A stage's result, or its failure with the reason (the other stages still run)."""
    import traceback

    try:
        return run()
    except Exception as e:  # noqa: BLE001  (recorded in the result and in the exit status)
        where = traceback.extract_tb(e.__traceback__)[-1]
        print(f"{name}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return {"failed": f"{type(e).__name__}: {e} (at {where.filename}:{where.lineno})"}


def write_render_ab(args: argparse.Namespace) -> None:
    """Adds ``render_ab`` (the tiny tokenizer; SmolLM2's with --smollm2) to the results file, keeping its stages."""
    from transformers import AutoTokenizer

    from deepr.llm.smollm2 import smollm2_dir
    from deepr.train.tiny import build_tiny_model, wiki_texts

    out = read_json(args.out) or {"stages": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny", corpus_texts=wiki_texts(300) or None, vocab_size=1500)
        paths = {"tiny": tiny, **({"SmolLM2-135M": smollm2_dir()} if args.smollm2 else {})}
        out["render_ab"] = {"command": " ".join(sys.argv), "load_average": os.getloadavg(),
                            **{name: render_ab(AutoTokenizer.from_pretrained(str(path)), args.group)
                               for name, path in paths.items()}}
    write_json(args.out, out, indent=1)
    print(json.dumps(out["render_ab"], indent=1))


def run_smollm2(args: argparse.Namespace, d: Path, data: Path, retriever: Any) -> dict[str, Any]:
    """One planner step on SmolLM2-135M-Instruct: 2 questions x ``--group`` rollouts, profiled."""
    from deepr.llm.smollm2 import smollm2_dir

    model = str(smollm2_dir())
    PROFILE_FROM["step"] = 1  # the only step is the profiled one
    settings = {**COMMON, "stage": "planner", "model": model, "out": str(d / "rl-smollm2"), "lora_r": 8,
                "lora_alpha": 16, "num_generations": args.group, "max_turn_tokens": args.turn_tokens,
                "max_completion_length": 4 * args.turn_tokens, "k": 3, "rollout_formats": args.formats,
                "corpus": args.corpus, "retriever": args.retriever, "learning_rate": 4e-6}
    return run_stage("planner (SmolLM2)", settings, data, retriever, 1)


if __name__ == "__main__":
    main()
