"""Cold-start benchmark: what a user waits for when typing `deepr search` / `deepr run`.

    python bench/cold_start.py [--repeats 3] [--passages 1000] [--limit N]
    python bench/cold_start.py --equality-only --passages 1000   # the vectors check alone

Each command runs in a fresh process against an index built beforehand (``--cache-dir``): imports
+ corpus and index load + one query; medians and ratios to cold ``deepr search --retriever bm25``
in the same run: `deepr --help`, bm25 and hybrid search, an offline ``deepr run`` (extractive),
``import sentence_transformers``; the heavy modules each imported (``-X importtime``); equality:
cosine of the fp32 vectors (``Embedder.encode``) to sentence-transformers' on ``--passages`` wiki
passages (goal >= 0.999), the index's int8 passage vectors beside, not gated.

Writes bench/results/cold_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, ROOT, child_env, read_json, write_json

QUERY = "who designed the Eiffel Tower"
HEAVY = ("torch", "sentence_transformers", "transformers", "faiss", "bm25s", "tokenizers")


def deepr_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "from deepr.cli import main; main()", *args]


def timed_run(cmd: list[str]) -> float:
    t = time.perf_counter()
    out = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return time.perf_counter() - t


def imported(cmd: list[str]) -> dict:
    """Heavy top-level modules the command imported, with their cumulative import seconds."""
    out = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], env=child_env(), capture_output=True,
                         text=True, cwd=ROOT)
    found = {}
    for line in out.stderr.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[2] in HEAVY:
            found[parts[2]] = int(parts[1]) / 1e6
    return found


def equality(n: int) -> dict:
    """Cosine of the embedder's vectors to sentence-transformers' on ``n`` passages spread evenly
    over the whole wiki corpus."""
    from sentence_transformers import SentenceTransformer

    from deepr.corpus import ChunkConfig, chunk_documents, load_documents
    from deepr.corpus.embed import Embedder, default_model_path, get_embedder
    from deepr.corpus.index import embed_text

    texts = [embed_text(p) for p in chunk_documents(load_documents("wiki"), ChunkConfig())]
    texts = texts[:: max(1, len(texts) // n)][:n]
    ref = SentenceTransformer(default_model_path(), device="cpu").encode(texts, normalize_embeddings=True)
    index = get_embedder(use="index")
    encoders = {"fp32 (queries, rewards)": Embedder(precision="fp32").encode,
                f"index passages, {index.name} (not gated)": index.encode_passages}
    out: dict = {"passages": len(texts), "goal_min": 0.999}
    for name, enc in encoders.items():
        cos = (enc(texts) * ref).sum(1)
        out[name] = {"cos_min": float(cos.min()), "cos_mean": float(cos.mean())}
        if "not gated" not in name:
            out[name]["ok"] = bool(cos.min() >= 0.999)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--passages", type=int, default=1000, help="passages for the equality check")
    ap.add_argument("--limit", type=int, default=None, help="wiki documents to index (default: all)")
    ap.add_argument("--cache-dir", default=str(ROOT / ".bench-work" / "cold-start"))
    ap.add_argument("--out", default=str(RESULTS / "cold_start.json"))
    ap.add_argument("--equality-only", action="store_true",
                    help="only the equality check, written into --out beside its earlier timings")
    args = ap.parse_args()
    if args.equality_only:
        res = read_json(args.out)
        res["equality"] = {"load_avg_start": os.getloadavg(), **equality(args.passages)}
        write_json(args.out, res)
        print("equality:", json.dumps(res["equality"], indent=1))
        return

    lim = ["--limit", str(args.limit)] if args.limit else []
    common = ["--corpus", "wiki", "--cache-dir", args.cache_dir, *lim]
    res: dict = {"load_avg_start": os.getloadavg(), "cores": len(os.sched_getaffinity(0)), "query": QUERY}
    print("building / reusing the index ...", file=sys.stderr)
    res["index_s"] = timed_run(deepr_cmd("index", *common))
    report_dir = Path(tempfile.mkdtemp(prefix="deepr-cold-"))
    cases = {
        "help": deepr_cmd("--help"),  # what every command pays before it starts
        "search bm25": deepr_cmd("search", QUERY, "--retriever", "bm25", *common),
        "search hybrid": deepr_cmd("search", QUERY, "--retriever", "hybrid", *common),
        "run offline (extractive)": deepr_cmd("run", QUERY, "--llm", "extractive", "--out", str(report_dir / "r.md"),
                                              *common),
        "import sentence_transformers": [sys.executable, "-c", "import sentence_transformers"],
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(args.repeats):  # interleaved, so a burst of load hits every case alike
        for name, cmd in cases.items():
            times[name].append(timed_run(cmd))
            print(f"  {name} #{r + 1}: {times[name][-1]:.2f} s", file=sys.stderr)
    base = statistics.median(times["search bm25"])
    res["cold_s"] = {k: {"median": statistics.median(v), "runs": v, "ratio_to_bm25": statistics.median(v) / base}
                     for k, v in times.items()}
    res["goals"] = {"hybrid / bm25 <= 2": res["cold_s"]["search hybrid"]["ratio_to_bm25"],
                    "run / bm25 <= 4": res["cold_s"]["run offline (extractive)"]["ratio_to_bm25"]}
    res["imports"] = {k: imported(cases[k]) for k in ("search bm25", "search hybrid", "run offline (extractive)")}
    print("equality check ...", file=sys.stderr)
    res["equality"] = equality(args.passages)
    res["load_avg_end"] = os.getloadavg()
    write_json(args.out, res)
    print(json.dumps({k: res[k] for k in ("cold_s", "imports", "equality", "load_avg_end")}, indent=1))


if __name__ == "__main__":
    main()
