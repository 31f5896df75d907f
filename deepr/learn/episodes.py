"""Held-out R_plan as GRPO scores it: each checkpoint plays one greedy planner episode per unseen
question (plan G0 → the environment searches G0's nodes → revised plan G1; DecomposeR §3.4.2) and
gets the reward GRPO's planner stage trains on (R_plan of G1, 0 when G0 or G1 is not a valid plan:
Eq. 17; no re-ask). The same environment, reward, turn caps and free decoding as
`deepr grpo --stage planner`'s rollouts, greedy instead of sampled, so the number is what the
training moved, on questions it never saw. Only the planner's two turns run: ~10x cheaper than a
full `deepr run` + `deepr eval` of the same questions on 2 cores.

    python -m deepr.learn episodes runs/seed0/sft-merged runs/seed0/grpo --label SFT --label SFT+GRPO \
        --questions heldout.jsonl --corpus wiki --k 3

    python -m deepr.learn episodes --pool seed0.json --pool seed1.json --baseline sft.json
    python -m deepr.learn episodes --pool grpo-s0.json --pool grpo-s1.json \
        --baseline sft-s0.json --baseline sft-s1.json

``--out`` (default: plan_episodes.json in the results folder) keeps what an earlier output there holds: this
call's runs and paired differences are added to its own by label (a label scored again is replaced,
and said so), its other keys stay unless this call writes the same key, so the documented commands
never wipe the record of earlier checkpoints.

``--pool`` scores nothing: it takes earlier outputs, one per seed of a setting, and compares them
with ``--baseline`` together (the interval resamples questions and seeds): one baseline for every
run (GRPO seeds from one SFT), or one per run, in order (seeds of the whole pipeline, each GRPO run
against its own SFT). A folder with
``adapter_config.json`` is loaded on its base (PEFT). Paired differences (each later
checkpoint minus the first) come with a 95 % bootstrap interval over questions. Writes, per checkpoint and question the reward, G0's validity, what was
scored and why a plan was refused.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

OUTPUT = "plan_episodes.json"


def load_policy(folder: str) -> tuple[Any, Any]:
    """Model (eval mode, fp32) and tokenizer; an adapter folder is put on the base it names."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepr.llm.hf_adapters import adapter_base

    path = Path(folder)
    if (path / "adapter_config.json").is_file():
        from peft import PeftModel

        base = adapter_base(path)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def greedy_generate(model: Any, tok: Any, eos_ids: list[int]) -> Any:
    """A rollout generator (:data:`deepr.train.sampling.Generate`): one greedy continuation a
    sequence, the batch left-padded, each cut after its first end token."""
    import torch

    pad = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]

    def generate(seqs: list[list[int]], first: bool, max_new: int) -> tuple[list[list[int]], None]:
        width = max(map(len, seqs))
        ids = torch.tensor([[pad] * (width - len(s)) + list(s) for s in seqs])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=eos_ids, pad_token_id=pad)
        rows = []
        for row in out[:, width:].tolist():
            end = next((i for i, t in enumerate(row) if t in eos_ids), None)
            rows.append(row if end is None else row[:end + 1])
        return rows, None

    return generate


def eos_of(model: Any, tok: Any) -> list[int]:
    """Every token generation stops at: the generation config's eos list and the tokenizer's eos."""
    from deepr.llm.hf_backend import _as_list  # the hf backend reads its stop ids the same way

    return sorted({int(t) for t in _as_list(model.generation_config.eos_token_id)} | {int(tok.eos_token_id)})


def episodes(generate: Any, tok: Any, eos_ids: list[int], pairs: list[Any], env: Any, *, budget: int,
             turn_cap: int) -> list[dict[str, Any]]:
    """One episode a question, played with ``generate``, scored with GRPO's planner reward."""
    from deepr.rewards.trl_adapters import PlanRewardFn
    from deepr.train.grpo import planner_dataset
    from deepr.train.rollouts import planner_rollouts

    rows, lookup = planner_dataset(pairs)
    prompts = [r["prompt"] for r in rows]
    eps, extra = planner_rollouts(prompts, lookup, env, generate, tok, budget=budget, eos_ids=eos_ids,
                                  turn_cap=turn_cap)
    # the scored plan (G1, or the refusal note that scores 0) rides in the "plan" column, as in GRPO
    rewards = PlanRewardFn()(prompts, [e.texts[-1] for e in eps], plan=extra["plan"],
                             rubrics=[r["rubrics"] for r in rows])
    return [{"id": r["id"], "r_plan": rw, "initial_valid": v0, "scored": src, "refused": why,
             "truncated": e.truncated, "tokens": e.used()}
            for r, rw, v0, src, why, e in zip(rows, rewards, extra["initial_valid"], extra["plan_source"],
                                              extra["refused"], eps)]


def _rewards(rows: list[dict[str, Any]]) -> dict[str, float]:
    """question id -> R_plan of the questions a run scored."""
    return {x["id"]: x["r_plan"] for x in rows if x["r_plan"] is not None}


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """mean(b − a) of R_plan over the questions both scored, with a 95 % bootstrap interval."""
    from deepr.learn.stats import paired_ci

    ra = _rewards(a)
    pairs = [(ra[x["id"]], x["r_plan"]) for x in b if x["r_plan"] is not None and x["id"] in ra]
    if not pairs:
        raise ValueError("no question has a reward under both checkpoints")
    mean, lo, hi = paired_ci([[y] for _, y in pairs], [[x] for x, _ in pairs])
    return {"questions": len(pairs), "mean": round(mean, 4), "ci95": [round(lo, 4), round(hi, 4)]}


def pooled(seed_runs: list[tuple[str, list[dict[str, Any]]]],
           bases: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """mean(seed run − its baseline) of R_plan over the questions every run and baseline scored, the
    runs taken as seeds of one setting: the 95 % interval resamples questions and seeds independently
    (deepr.learn.stats, as `make learn` does), so a single lucky seed widens it. ``bases`` holds
    one baseline for all runs or one per run (seed s's run minus seed s's baseline)."""
    from deepr.learn.stats import paired_ci

    if len(seed_runs) < 2:
        raise ValueError("--pool needs two runs or more (one is the plain --baseline comparison)")
    if len(bases) not in (1, len(seed_runs)):
        raise ValueError(f"{len(seed_runs)} pooled runs need one --baseline or {len(seed_runs)} "
                         f"(one per run, in order), not {len(bases)}")
    bases = bases * len(seed_runs) if len(bases) == 1 else bases
    refs, seeds = [_rewards(b) for b in bases], [_rewards(rows) for _, rows in seed_runs]
    qids = [q for q in refs[0] if all(q in s for s in seeds + refs)]
    if not qids:
        raise ValueError("no question has a reward in every baseline and every pooled run")
    mean, lo, hi = paired_ci([[s[q] for s in seeds] for q in qids], [[r[q] for r in refs] for q in qids])
    return {"runs": [label for label, _ in seed_runs], "questions": len(qids), "seeds": len(seeds),
            "mean": round(mean, 4), "ci95": [round(lo, 4), round(hi, 4)],
            "per_run": {label: paired(b, rows) for (label, rows), b in zip(seed_runs, bases)}}


def baseline_run(spec: str) -> tuple[str, list[dict[str, Any]]]:
    """``FILE[:LABEL]``: a run of an earlier output of this command (its first run without a label),
    so checkpoints scored in separate invocations are still compared question by question."""
    path, _, label = spec.rpartition(":") if ":" in spec and not Path(spec).exists() else (spec, "", "")
    try:
        runs = json.loads(Path(path).read_text(encoding="utf-8"))["runs"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--baseline {spec}: not an output of the planner episodes ({e})") from None
    label = label or next(iter(runs), "")
    if label not in runs:
        raise SystemExit(f"--baseline {spec}: no run {label!r} in {path} (it has {', '.join(runs)})")
    return label, runs[label]["questions"]


def merged_output(earlier: dict[str, Any], doc: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``doc`` written over an earlier output: runs and paired differences merge by label, each
    call's command joins the earlier ones in "commands", any other key of ``doc`` replaces the
    earlier one. Returns the merged output and what it replaced."""
    out, replaced = dict(earlier), []
    for key in ("runs", "paired_differences"):
        if key in doc:
            old = dict(out.get(key) or {})
            replaced += [f"{key}: {label}" for label in doc[key] if label in old]
            out[key] = {**old, **doc[key]}
    commands = list(out.pop("commands", None) or [])
    if "command" in out:
        commands.append(out.pop("command"))
    out["commands"] = commands + [doc["command"]]
    for key, value in doc.items():
        if key not in ("runs", "paired_differences", "command"):
            if key in out and out[key] != value:
                replaced.append(key)
            out[key] = value
    return out, replaced


def write_output(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` atomically, merged into an earlier output there (:func:`merged_output`);
    a file there that is not one is refused rather than overwritten."""
    if path.exists():
        try:
            earlier = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise SystemExit(f"--out {path}: not an output of the planner episodes ({e}); give another --out") from None
        if not isinstance(earlier, dict):
            raise SystemExit(f"--out {path}: not an output of the planner episodes; give another --out")
        doc, replaced = merged_output(earlier, doc)
        if replaced:
            print(f"{path}: replaced {', '.join(replaced)}", file=sys.stderr)
    from deepr.io import atomic_open

    with atomic_open(path) as f:
        f.write(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str] | None = None, results: Path = Path("learn-results")) -> int:
    ap = argparse.ArgumentParser(prog="episodes", description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="*", help="checkpoints: merged model folders or adapter folders")
    ap.add_argument("--label", action="append", default=[], help="a name per checkpoint, in order")
    ap.add_argument("--questions", type=Path, help="verified pairs (jsonl) the checkpoints did not train on")
    ap.add_argument("--corpus", default="wiki")
    ap.add_argument("--retriever", default="hybrid")
    ap.add_argument("--k", type=int, default=3, help="results per search node (as deepr grpo --k)")
    ap.add_argument("--budget", type=int, default=1400, help="model tokens of an episode (--max-completion-length)")
    ap.add_argument("--turn-cap", type=int, default=640, help="model tokens of one turn (max_turn_tokens)")
    ap.add_argument("--limit", type=int, default=None, help="first N questions only")
    ap.add_argument("--baseline", action="append", default=[], metavar="FILE[:LABEL]",
                    help="also compare every checkpoint with a run of an earlier output (with --pool: "
                         "once, or once per pooled run)")
    ap.add_argument("--pool", action="append", default=[], metavar="FILE[:LABEL]",
                    help="score nothing: pool earlier runs (one per seed of a setting) against --baseline")
    ap.add_argument("--out", type=Path, default=results / OUTPUT)
    a = ap.parse_args(argv)
    if a.pool:
        return pool_command(a, ap, argv)
    if not a.folders or a.questions is None:
        ap.error("give the checkpoints to score and --questions (or --pool earlier runs)")
    labels = a.label + a.folders[len(a.label):]
    if len(a.baseline) > 1:
        ap.error("scoring checkpoints takes one --baseline (several go with --pool)")
    base = baseline_run(a.baseline[0]) if a.baseline else None  # read first: a bad path fails before any model loads
    from deepr.corpus import open_retriever
    from deepr.io import read_records
    from deepr.records import QRPair
    from deepr.train.environments import PlannerEnvironment

    pairs = read_records(a.questions, QRPair)[:a.limit]
    env = PlannerEnvironment(open_retriever(a.corpus, retriever=a.retriever, progress=False), k=a.k)
    runs: dict[str, Any] = {}
    for label, folder in zip(labels, a.folders):
        t0 = time.perf_counter()
        model, tok = load_policy(folder)
        eos_ids = eos_of(model, tok)
        rows = episodes(greedy_generate(model, tok, eos_ids), tok, eos_ids, pairs, env, budget=a.budget,
                        turn_cap=a.turn_cap)
        scored = [r["r_plan"] for r in rows if r["r_plan"] is not None]
        runs[label] = {"folder": folder, "seconds": round(time.perf_counter() - t0, 1),
                       "mean_r_plan": round(sum(scored) / len(scored), 4) if scored else None,
                       "initial_valid": sum(r["initial_valid"] for r in rows), "scored_g1": sum(
                           r["scored"] == "revised" for r in rows), "questions": rows}
        print(label, {k: v for k, v in runs[label].items() if k != "questions"}, flush=True)
    first = labels[0]
    diffs = {f"{lab} - {first}": paired(runs[first]["questions"], runs[lab]["questions"]) for lab in labels[1:]}
    if base is not None:
        base_label, base_rows = base
        for lab in labels:
            try:
                diff = paired(base_rows, runs[lab]["questions"])
            except ValueError as e:  # other questions than the baseline's: keep this run's scores, say why
                diff = {"error": f"{e} (--baseline {a.baseline[0]} scored other questions)"}
            diffs[f"{lab} - {base_label}"] = diff
    doc = {"command": " ".join(["python", *sys.argv]),
           "questions_file": str(a.questions), "k": a.k, "budget": a.budget, "turn_cap": a.turn_cap,
           "runs": runs, "paired_differences": diffs}
    write_output(a.out, doc)
    print(json.dumps(diffs, indent=1))
    return 0


def pool_command(a: argparse.Namespace, ap: argparse.ArgumentParser, argv: list[str] | None) -> int:
    if a.folders or not a.baseline:
        ap.error("--pool takes earlier runs and a --baseline, no checkpoints")
    bases = [baseline_run(spec) for spec in a.baseline]
    runs = [baseline_run(spec) for spec in a.pool]
    try:
        result = pooled(runs, [rows for _, rows in bases])
    except ValueError as e:
        ap.error(str(e))
    labels = [label for label, _ in bases]
    doc = {"command": " ".join(["python", *sys.argv]),
           "baseline": labels[0] if len(labels) == 1 else labels, "pooled": result}
    write_output(a.out, doc)
    print(json.dumps(doc, indent=1))
    return 0

