"""Generate a synthetic corpus of N passages (default 200,000) as deepr corpus JSONL.

    python bench/synthetic_corpus.py --passages 200000 --out /tmp/synth200k.jsonl

Each document recombines sentences of the offline wiki corpus under a made-up title, so word
statistics and lengths look like real passages (one passage per document at deepr's default
chunking), and the output is deterministic for a given ``--seed``. Used by bench/scaling.py.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sentences() -> list[str]:
    from deepr.corpus import load_documents
    from deepr.text import split_sentences

    return [s for d in load_documents("wiki") for s in split_sentences(d.text) if 20 <= len(s) <= 400]


def generate(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    pool = sentences()
    rows = []
    for i in range(n):
        k = rng.randint(2, 5)
        text = " ".join(rng.choice(pool) for _ in range(k))
        rows.append({"id": f"syn{i:08d}", "title": f"Synthetic article {i}", "text": text})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passages", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.out, "w", encoding="utf-8") as f:
        for row in generate(args.passages, args.seed):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {args.passages} documents to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
