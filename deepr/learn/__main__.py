"""``python -m deepr.learn [episodes|answers|curves] ...``: the learning experiment and its probes.

    python -m deepr.learn [flags]                 # the experiment (make learn); --help for its flags
    python -m deepr.learn episodes CKPT... --questions q.jsonl   # held-out R_plan as GRPO scores it
    python -m deepr.learn answers hf:<model>      # model-written final answers on the teacher's prompts
    python -m deepr.learn curves NAME=run/metrics.jsonl ... --out grpo.png   # GRPO runs per step
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def curves(argv: list[str]) -> int:
    """Per-step mean reward, KL and zero-advantage share of GRPO runs, one line a run (PNG)."""
    from deepr.learn.stats import plot_grpo, read_metrics_rows, reward_key

    ap = argparse.ArgumentParser(prog="curves", description=curves.__doc__)
    ap.add_argument("runs", nargs="+", help="NAME=path/to/metrics.jsonl")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    runs = {}
    for spec in a.runs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"{spec!r}: give NAME=path/to/metrics.jsonl")
        try:
            rows = read_metrics_rows(path)
        except (OSError, ValueError) as e:
            raise SystemExit(f"{name}: {e}") from None
        if not any(reward_key(rows) in r for r in rows):  # the key the figure's reward panel reads
            raise SystemExit(f"{path}: no step with a reward (not a deepr grpo metrics.jsonl, or no step finished)")
        runs[name] = rows
    print(plot_grpo(runs, a.out))
    return 0


def main(argv: list[str] | None = None, results: Path | None = None, img: Path | None = None) -> int:
    """Dispatch on the first word; ``results`` and ``img`` are the default output folders."""
    argv = sys.argv[1:] if argv is None else argv
    out = results or Path("learn-results")
    if argv[:1] == ["episodes"]:
        from deepr.learn.episodes import main as episodes

        return episodes(argv[1:], results=out)
    if argv[:1] == ["answers"]:
        from deepr.learn.answers import main as answers

        answers(argv[1:], results=out)
        return 0
    if argv[:1] == ["curves"]:
        return curves(argv[1:])
    from deepr.learn.pipeline import main as experiment

    return experiment(argv, results=results, img=img)


if __name__ == "__main__":
    raise SystemExit(main())
