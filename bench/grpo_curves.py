"""Per-step curves of GRPO runs outside ``make learn``: mean reward, KL to the starting model and
the share of zero-advantage groups, one line per run, from each run's ``metrics.jsonl``
(the figure ``bench/learning.py`` draws for its seeds, for probes and resumed runs).

    python bench/grpo_curves.py "plan-only SFT=runs/grpo/metrics.jsonl" "mixed SFT=runs/grpo2/metrics.jsonl" \\
        --out docs/img/learning_grpo_probes.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.learning_stats import plot_grpo, read_metrics_rows, reward_key  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


if __name__ == "__main__":
    raise SystemExit(main())
