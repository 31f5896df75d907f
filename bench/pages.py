"""Real-page benchmark: extraction quality, crashes under concurrency, and what serialising costs.

    python bench/pages.py [--passes 20] [--rounds 3] [--repeats 3]

tests/pages (saved real pages with annotated main-text and boilerplate snippets), served on
127.0.0.1 and read through deepr's reader (``deepr run --search``'s fetch + extraction):

- quality: main-text recall and boilerplate leakage for trafilatura's three modes; deepr's is ``chosen``;
- crashes: ``--rounds`` child processes in which ``--passes`` threads read the set at once (a native
  crash is a negative exit status, counted), with deepr's extraction lock and without it;
- cost: extracting the set ``--repeats`` times from 8 threads with the lock, from a 2-process pool
  (start-up counted, and not), and from 8 threads without the lock; medians, ratios to the lock.

Writes bench/results/pages.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from _common import RESULTS, ROOT, write_json

sys.path.insert(0, str(ROOT / "tests"))

MODES = {"favor_precision": {"favor_precision": True}, "default": {}, "favor_recall": {"favor_recall": True}}
_CHILD = """
import contextlib, json, sys, tempfile
from pathlib import Path
sys.path[:0] = [{root!r}, {tests!r}]
import deepr.search.extract as ex
from page_set import manifest, serve, stress
if {unlocked!r}:
    ex.LOCK = contextlib.nullcontext()
pages = manifest()
with serve(pages) as site, tempfile.TemporaryDirectory() as d:
    print(json.dumps(stress(site.port, [p["name"] for p in pages], Path(d), {passes}, 1)))
"""


def quality() -> dict:
    import deepr.search.extract as ex
    from page_set import manifest, read_pages, score, serve

    pages, chosen, out = manifest(), dict(ex.SETTINGS), {}
    base = {k: v for k, v in chosen.items() if not k.startswith("favor_")}
    with serve(pages) as site, tempfile.TemporaryDirectory() as d:
        for name, extra in MODES.items():
            ex.SETTINGS = {**base, **extra}
            s = score(pages, read_pages(site.port, [p["name"] for p in pages], Path(d), tag=name))
            out[name] = {**s, "chosen": ex.SETTINGS == chosen}
    ex.SETTINGS = chosen
    return out


def crashes(passes: int, rounds: int, unlocked: bool) -> dict:
    """Each round in its own child process; a native crash is a negative exit status."""
    runs = []
    for _ in range(rounds):
        code = _CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"), unlocked=unlocked, passes=passes)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
        row = {"returncode": p.returncode, "seconds": round(time.perf_counter() - t0, 1)}
        if p.returncode == 0:
            row.update(json.loads(p.stdout.strip().splitlines()[-1]))
        else:
            row["stderr_tail"] = p.stderr[-300:]
        runs.append(row)
    return {"passes": passes, "rounds": rounds, "lock": not unlocked,
            "native_crashes": sum(1 for r in runs if r["returncode"] < 0),
            "other_failures": sum(1 for r in runs if r["returncode"] > 0),
            "pages_read": sum(r.get("pages_read", 0) for r in runs),
            "pages_not_ok": sum(r.get("pages_read", 0) - r.get("pages_ok", 0) for r in runs),
            "not_ok_reasons": [f for r in runs for f in r.get("failed", [])][:20], "runs": runs}


def _extract(body: bytes, ctype: str) -> int:
    from deepr.search.reader import extract

    return len(extract(body, ctype)[1])


def _warm(_: int) -> int:
    import trafilatura  # noqa: F401 (a worker's start-up: imports)

    return os.getpid()


def cost(repeats: int) -> dict:
    import deepr.search.extract as ex
    from page_set import manifest

    jobs = [(p["body"], f"text/html; charset={p['charset']}") for p in manifest()]

    def threads(lock: object) -> float:
        ex.LOCK = lock
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda j: _extract(*j), jobs))
        return time.perf_counter() - t0

    def processes() -> tuple[float, float]:
        import multiprocessing as mp

        t0 = time.perf_counter()
        with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(_warm, range(2)))
            t1 = time.perf_counter()
            list(pool.map(_extract, *zip(*jobs)))
            t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    real_lock = ex.LOCK
    _extract(*jobs[0])  # imports out of the timings
    lock, unlocked, proc_all, proc_warm = [], [], [], []
    for _ in range(repeats):
        lock.append(threads(real_lock))
        unlocked.append(threads(contextlib.nullcontext()))
        a, w = processes()
        proc_all.append(a)
        proc_warm.append(w)
    ex.LOCK = real_lock
    med = {k: round(statistics.median(v), 3) for k, v in
           {"threads_with_lock": lock, "threads_without_lock": unlocked, "process_pool_2_with_start": proc_all,
            "process_pool_2_warm": proc_warm}.items()}
    return {"pages": len(jobs), "repeats": repeats, "median_seconds": med,
            "ratio_to_lock": {k: round(v / med["threads_with_lock"], 3) for k, v in med.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "pages.json")
    a = ap.parse_args()
    res = {"machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()}, "quality": quality()}
    print(json.dumps({k: {m: (v["recall"], v["leakage"]) for m, v in res["quality"].items()}
                      for k in ["quality"]}), flush=True)
    res["cost"] = cost(a.repeats)
    print(json.dumps(res["cost"]), flush=True)
    res["crashes_with_lock"] = crashes(a.passes, a.rounds, unlocked=False)
    res["crashes_without_lock"] = crashes(a.passes, a.rounds, unlocked=True)
    for k in ("crashes_with_lock", "crashes_without_lock"):
        print(k, {x: res[k][x] for x in ("native_crashes", "other_failures", "pages_read", "pages_not_ok",
                                         "not_ok_reasons")}, flush=True)
    write_json(a.out, res, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
