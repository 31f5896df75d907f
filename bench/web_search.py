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
5. The hostile cases of the issue's item 6 through ``deepr run --search serper`` (key = a sentinel,
   endpoint = the fake provider): no traceback, the key in no output or written file, no
   connection to the unallowed loopback port, the expected exit status.

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
                    "--cache-dir", str(work / mode), "--seed", "7"]
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
            side = json.loads((work / mode / "a" / "report.json").read_text(encoding="utf-8"))
            passages = [c for c in side["citations"].values() if c.get("kind") == "fetch"]
            out[mode] = {"references": len(refs), "references_fetched": sum(u in fetched for u in refs),
                         "cited_page_passages": len(passages),
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


async def _raw_httpx(urls: list[str], conc: int) -> float:
    """The same GETs with bare httpx and a semaphore: what this machine and server allow."""
    import httpx

    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient() as client:
        await client.get(urls[0])

        async def one(u: str) -> None:
            async with sem:
                await client.get(u)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(u) for u in urls))
        return time.perf_counter() - t0


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


SENTINEL = "sk-bench-SENTINEL-7f3a"
HOSTILE = ["/redirect-private", "/big", "/binary", "/captcha", "/js", "/forbidden", "/empty", "/slow", "/ratelimited"]
MALFORMED = ["BREAK-html", "BREAK-missing", "BREAK-empty", "BREAK-truncated", "BREAK-500"]


def hostile_cases(work: Path) -> dict:
    """Issue item 6's cases through ``deepr run`` with a keyed provider (serper, key = a sentinel):
    no traceback, the key in no output or file, no connection to the unallowed loopback port."""
    from typer.testing import CliRunner

    from deepr.cli import app

    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(0.2)
    site = F.site(trap.getsockname()[1])
    good = f"{site.url}/page/volcano"

    def serper(urls: list[str]) -> dict:
        return {"organic": [{"title": u.rsplit("/", 1)[-1], "link": u, "snippet": "volcano page"} for u in urls]}

    q_mixed, q_bad = "How do volcanoes erupt?", "What do volcano pages hide?"
    prov = F.providers(site.url, fixtures={q_mixed: serper([site.url + h for h in HOSTILE] + [good]),
                                           q_bad: serper([site.url + h for h in HOSTILE[:-1]])})
    env = {"SERPER_API_KEY": SENTINEL, "DEEPR_SERPER_URL": f"{prov.url}/serper"}
    cases = [("hostile pages + one good page", q_mixed, {0}), ("hostile pages only", q_bad, {4}),
             *((f"provider reply {b}", f"volcano {b}", {4}) for b in MALFORMED)]
    out = []
    try:
        for i, (name, query, codes) in enumerate(cases):
            folder = work / "hostile" / str(i)
            r = CliRunner().invoke(app, ["run", query, "--search", "serper", "--allow-host", f"127.0.0.1:{site.port}",
                                         "--cache-dir", str(folder / "cache"), "--out", str(folder / "r.md"),
                                         "--html", "--fetch-timeout", "1", "--seed", "7"], env=env)
            files = [f for f in folder.rglob("*") if f.is_file()]
            leaked = [str(f.relative_to(folder)) for f in files
                      if SENTINEL in f.read_text(encoding="utf-8", errors="replace")]
            try:
                trap.accept()[0].close()
                private = True
            except OSError:
                private = False
            said = " ".join(r.output.split())  # the one-line error, unwrapped from the console width
            side = folder / "r.json"
            failures = json.loads(side.read_text(encoding="utf-8"))["search"]["failures"] if side.exists() else []
            md = (folder / "r.md").read_text(encoding="utf-8") if (folder / "r.md").exists() else ""
            refs = re.findall(r"<(https?://[^>]+)>", md.split("## References", 1)[-1]) if md else []
            out.append({"case": name, "exit_code": r.exit_code, "expected_exit": sorted(codes),
                        "traceback": "Traceback" in r.output or not isinstance(r.exception, (SystemExit, type(None))),
                        "key_in_output": SENTINEL in r.output, "key_in_files": leaked, "private_fetch": private,
                        "references": refs, "recorded_failures": sorted({f["reason"][:70] for f in failures}),
                        "error": said[said.find("error"):][:400] if "error" in said else ""})
    finally:
        site.close()
        prov.close()
        trap.close()
    ok = all(c["exit_code"] in c["expected_exit"] and not c["traceback"] and not c["key_in_output"]
             and not c["key_in_files"] and not c["private_fetch"] for c in out)
    ok = ok and out[0]["references"] and all(u.startswith(f"{site.url}/page/") or u.endswith("/ratelimited")
                                             for u in out[0]["references"])
    return {"cases": out, "meets_target": bool(ok)}


async def _noop() -> None:
    return None


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["DEEPR_CACHE"] = str(work / "deepr-cache")
        res = {"load_average": os.getloadavg(), "agent_runs": agent_runs(work),
               "concurrent_fetch": concurrent_fetch(work), "cached_search": cached_search(work),
               "hostile_cases": hostile_cases(work)}
    res["load_average_after"] = os.getloadavg()
    out = ROOT / "bench" / "results" / "web_search.json"
    out.write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
