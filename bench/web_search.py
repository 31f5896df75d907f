"""Web search benchmark on loopback fakes (no outside network): issue 19's targets.

    python bench/web_search.py

1. A dag run and a warp run with ``--search searxng:http://127.0.0.1:PORT`` against the fake
   website: every URL in each report's reference list must be a page this run fetched.
2. The same runs under ``--search-cache replay``: zero requests reach the fake provider or site,
   and the report is byte-identical.
3. Fetching 50 pages that each take 200 ms with concurrency 8 (per host 8): wall time against
   the ideal 50/8 × 200 ms (target ≤ 1.3×; 7 waves of 8 make 1.12× the floor), median of 5 runs,
   beside bare httpx against the same asyncio server in the same run.
4. A cached search (fresh process state, disk cache only): median latency (target ≤ 5 ms).

Writes bench/results/web_search.json. The machine may be shared: the load average is recorded.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import search_fakes as F  # noqa: E402


def agent_runs(work: Path) -> dict:
    from typer.testing import CliRunner

    from deepr.cli import app

    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(4)
    site = F.site(trap.getsockname()[1])
    prov = F.providers(site.url)
    out = {}
    try:
        for mode in ("dag", "warp"):
            base = ["run", "How do volcanoes and glaciers shape the land?", "--mode", mode, "--search",
                    f"searxng:{prov.url}/searxng", "--allow-host", f"127.0.0.1:{site.port}",
                    "--cache-dir", str(work / mode)]
            n0 = len(site.requests)
            t0 = time.perf_counter()
            r = CliRunner().invoke(app, [*base, "--out", str(work / mode / "a" / "report.md")])
            live_s = time.perf_counter() - t0
            assert r.exit_code == 0, r.output
            md = (work / mode / "a" / "report.md").read_text(encoding="utf-8")
            fetched = {site.url + q["path"] for q in site.requests[n0:]}
            refs = re.findall(r"<(https?://[^>]+)>", md.split("## References", 1)[1])
            n_site, n_prov = len(site.requests), len(prov.requests)
            t0 = time.perf_counter()
            r2 = CliRunner().invoke(app, [*base, "--out", str(work / mode / "b" / "report.md"),
                                          "--search-cache", "replay"])
            replay_s = time.perf_counter() - t0
            assert r2.exit_code == 0, r2.output
            md2 = (work / mode / "b" / "report.md").read_text(encoding="utf-8")
            out[mode] = {"references": len(refs), "references_fetched": sum(u in fetched for u in refs),
                         "every_reference_fetched": bool(refs) and all(u in fetched for u in refs),
                         "replay_requests": (len(site.requests) - n_site) + (len(prov.requests) - n_prov),
                         "replay_identical": md == md2, "live_run_s": round(live_s, 2),
                         "replay_run_s": round(replay_s, 2)}
    finally:
        site.close()
        prov.close()
        trap.close()
    return out


def concurrent_fetch(work: Path, n: int = 50, latency: float = 0.2, conc: int = 8, reps: int = 5) -> dict:
    """deepr's fetch path against bare httpx on the same asyncio fake server, alternating, ``reps``
    times each; the medians are reported (the machine is shared, single runs are noisy)."""
    from deepr.search import SearchConfig
    from deepr.search.source import SourceRetriever

    site = F.async_site(latency)  # latency is an asyncio.sleep: the server adds ~nothing
    walls, raws, ok = [], [], []
    try:
        for rep in range(reps):
            src = SourceRetriever(SearchConfig(spec="searxng:http://127.0.0.1:9", cache="off", cache_dir=work,
                                               allow_hosts=[f"127.0.0.1:{site.port}"], concurrency=conc,
                                               per_host=conc), embedder=object())
            urls = [f"{site.url}/page/n{rep}x{i}" for i in range(n)]  # fresh URLs: no in-memory reuse
            src.fetch_many([f"{site.url}/page/volcano"])  # warm the client and loop
            t0 = time.perf_counter()
            pages = src.fetch_many(urls)
            walls.append(time.perf_counter() - t0)
            ok.append(sum(p["ok"] for p in pages))
            src.close()
            raws.append(asyncio.run(_raw_httpx(urls, conc)))
    finally:
        site.close()
    ideal = n / conc * latency
    wall, raw = statistics.median(walls), statistics.median(raws)
    return {"pages": n, "ok_per_run": ok, "latency_s": latency, "concurrency": conc, "repetitions": reps,
            "server": "asyncio (tests/search_fakes.py AsyncServer, keep-alive)",
            "wall_s_runs": [round(w, 3) for w in walls], "wall_s_median": round(wall, 3),
            "ideal_s": round(ideal, 3), "ratio": round(wall / ideal, 3), "target_ratio": 1.3,
            "meets_target": wall / ideal <= 1.3 and min(ok) == n,
            "floor_s": round(-(-n // conc) * latency, 3),  # whole waves of `conc` requests: 1.12x
            "raw_httpx_s_runs": [round(r, 3) for r in raws], "raw_httpx_s_median": round(raw, 3),
            "raw_httpx_ratio": round(raw / ideal, 3), "deepr_over_raw_httpx": round(wall / raw, 3)}


def cached_search(work: Path, reps: int = 50) -> dict:
    from deepr.search import SearchConfig
    from deepr.search.source import SourceRetriever

    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    site = F.site(trap.getsockname()[1])
    prov = F.providers(site.url)
    cfg = SearchConfig(spec=f"searxng:{prov.url}/searxng", allow_hosts=[f"127.0.0.1:{site.port}"],
                       cache_dir=work / "cs")
    try:
        first = SourceRetriever(cfg, embedder=object())
        first.search("coral reefs and glaciers", 5)
        first.close()
        times = []
        for _ in range(reps):
            src = SourceRetriever(cfg, embedder=object())  # no in-memory state: disk cache only
            src._run(_noop())  # start its loop thread outside the timed part
            t0 = time.perf_counter()
            hits = src.search("coral reefs and glaciers", 5)
            times.append((time.perf_counter() - t0) * 1000)
            assert hits and src.stats["network_requests"] == 0
            src.close()
    finally:
        site.close()
        prov.close()
        trap.close()
    return {"repetitions": reps, "median_ms": round(statistics.median(times), 3),
            "p95_ms": round(sorted(times)[int(0.95 * reps) - 1], 3), "target_ms": 5.0,
            "meets_target": statistics.median(times) <= 5.0}


async def _noop() -> None:
    return None


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["DEEPR_CACHE"] = str(work / "deepr-cache")
        res = {"load_average": os.getloadavg(), "agent_runs": agent_runs(work),
               "concurrent_fetch": concurrent_fetch(work), "cached_search": cached_search(work)}
    res["load_average_after"] = os.getloadavg()
    out = ROOT / "bench" / "results" / "web_search.json"
    out.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
