"""The learning experiment (`make learn`, docs/learning.md) with this repository's result folders:
SFT then GRPO on SmolLM2-135M-Instruct, scored on held-out topics, through the real CLI.

    python bench/learning.py [flags]            # the experiment: bench/results/learning*.{json,md}
    python bench/learning.py episodes ...       # planner episodes: bench/results/plan_episodes.json
    python bench/learning.py answers ...        # final answers: bench/results/answer_probe.json
    python bench/learning.py curves NAME=metrics.jsonl ... --out docs/img/<name>.png

The code is deepr.learn; each subcommand takes --help.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepr.learn.__main__ import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], results=ROOT / "bench" / "results", img=ROOT / "docs" / "img"))
