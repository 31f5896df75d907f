"""Retrieval server benchmark: quality kept through `deepr serve-index` and Milvus Lite, and serving
throughput under concurrent clients, each against a baseline measured in the same run (on the wiki
corpus by default; ``--corpus`` another one whose documents carry a description).

    python bench/serve_index.py [--clients 32] [--per-client 200] [--skip-milvus]
    python bench/serve_index.py --corpus small.jsonl --clients 2 --per-client 3 --skip-milvus --out .bench-work/quick.json

1. Throughput: ``--clients`` concurrent clients (one asyncio process, aiohttp) each post
   ``--per-client`` single-query ``POST /retrieve`` requests (Search-R1's shape, topk 10, hybrid)
   to a `deepr serve-index` process on the wiki corpus. Baseline: one process searching the same
   queries in a loop, ``search_many`` in batches of ``--clients`` (batched embeddings). Both start
   with an empty embedding cache and see distinct queries. Reported: errors, p50/p99 latency,
   queries per second and the ratio to the baseline.
2. Quality: bench/retrieval.py's wiki query set (query = an article's description, target = that
   article; the test half), recall@10 of the local index, through the server (deepr's API), and
   through Milvus Lite (`deepr index --to milvus:...` then hybrid search), all hybrid.

Writes bench/results/serve_index.json. The machine may be shared: the load average is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import socket
import statistics
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def query_sets(docs) -> tuple[list[tuple[str, str]], list[str]]:
    """(test half of bench/retrieval.py's (description, doc id) set, every description in corpus order)."""
    test = [(d.description, d.id) for d in docs if d.description and d.text.strip()
            and int(hashlib.sha1(d.id.encode()).hexdigest(), 16) % 2 == 1]
    return test, list(dict.fromkeys(d.description for d in docs if d.description))


def recall_at_10(r, test: list[tuple[str, str]], batch: int = 64) -> float:
    hits = 0
    for s in range(0, len(test), batch):
        part = test[s:s + batch]
        for (_, target), found in zip(part, r.search_many([q for q, _ in part], k=10, mode="hybrid")):
            hits += any(h.doc_id == target for h in found)
    return hits / len(test)


def start_server(corpus: str, port: int, cache_dir: str | None) -> subprocess.Popen:
    import httpx

    cmd = [sys.executable, "-m", "deepr", "serve-index", "--corpus", corpus, "--port", str(port)]
    cmd += ["--cache-dir", cache_dir] if cache_dir else []
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
        if proc.poll() is not None:
            raise SystemExit(f"serve-index exited: {proc.stdout.read()}")
    proc.kill()
    raise SystemExit("serve-index did not come up in 300 s")


async def clients(url: str, queries: list[str], n_clients: int, per_client: int) -> dict:
    import aiohttp

    latencies: list[float] = []
    errors: list[str] = []

    async def one(session, mine: list[str]) -> None:
        for q in mine:
            t = time.perf_counter()
            try:
                async with session.post(url + "/retrieve", json={"queries": [q], "topk": 10,
                                                                 "return_scores": True}) as resp:
                    body = await resp.json()
                    if resp.status != 200 or len(body["result"][0]) != 10:
                        errors.append(f"HTTP {resp.status}")
            except Exception as e:  # noqa: BLE001  counted, the run goes on
                errors.append(type(e).__name__)
            latencies.append(time.perf_counter() - t)

    conn = aiohttp.TCPConnector(limit=n_clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, queries[i * per_client:(i + 1) * per_client]) for i in range(n_clients)))
        wall = time.perf_counter() - t0
    lat = sorted(latencies)
    p50, p99 = statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    return {"requests": len(lat), "errors": len(errors), "error_kinds": sorted(set(errors))[:5], "wall_s": wall,
            "qps": len(lat) / wall, "p50_ms": 1000 * p50, "p99_ms": 1000 * p99, "p99_over_p50": p99 / p50}


def baseline(r, queries: list[str], batch: int) -> dict:
    r.embedder.clear_cache()
    t0 = time.perf_counter()
    for s in range(0, len(queries), batch):
        r.search_many(queries[s:s + batch], k=10, mode="hybrid")
    wall = time.perf_counter() - t0
    return {"queries": len(queries), "batch": batch, "wall_s": wall, "qps": len(queries) / wall}


def milvus_recall(corpus: str, test, cache_dir: str | None, db: Path) -> dict:
    from deepr.corpus import get_embedder, open_retriever
    from deepr.corpus.milvus import load_to_milvus

    spec = f"milvus:{db}"
    t0 = time.perf_counter()
    counts = load_to_milvus(corpus, spec, embedder=get_embedder(None, use="index"), cache_dir=cache_dir)
    load_s = time.perf_counter() - t0
    m = open_retriever(spec)
    return {"load_s": load_s, "counts": counts, "recall@10": recall_at_10(m, test)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--per-client", type=int, default=200)
    ap.add_argument("--corpus", default="wiki", help="corpus to serve; its documents' descriptions are the queries")
    ap.add_argument("--cache-dir", default=None, help="deepr cache with the corpus's index (default: $DEEPR_CACHE)")
    ap.add_argument("--work", default=str(ROOT / ".bench-work" / "serve-index"), help="folder for the Milvus Lite file")
    ap.add_argument("--skip-milvus", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_index.json"))
    args = ap.parse_args()

    from deepr.corpus import open_retriever
    from deepr.corpus.remote import RemoteRetriever

    res: dict = {"load_avg_start": os.getloadavg(), "cores": len(os.sched_getaffinity(0)),
                 "clients": args.clients, "per_client": args.per_client}
    local = open_retriever(args.corpus, cache_dir=args.cache_dir, progress=True)
    test, pool = query_sets(local.documents)
    need = args.clients * args.per_client
    if len(pool) < need:
        raise SystemExit(f"{len(pool)} distinct queries, {need} needed; lower --clients or --per-client")
    load = pool[:need]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server(args.corpus, port, args.cache_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        print(f"{args.clients} clients x {args.per_client} queries ...", file=sys.stderr)
        res["server"] = asyncio.run(clients(url, load, args.clients, args.per_client))
        print("baseline: one process, batched ...", file=sys.stderr)
        res["baseline_one_process"] = baseline(local, load, args.clients)
        res["throughput_ratio"] = res["server"]["qps"] / res["baseline_one_process"]["qps"]
        print("recall@10: local and through the server ...", file=sys.stderr)
        res["recall@10"] = {"local_hybrid": recall_at_10(local, test),
                            "server_hybrid": recall_at_10(RemoteRetriever(url, mode="hybrid"), test),
                            "queries": len(test)}
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        res["server_log_summary"] = next((ln for ln in out.splitlines() if ln.startswith("served ")), None)
    if not args.skip_milvus:
        print("Milvus Lite: load the wiki corpus, then recall@10 ...", file=sys.stderr)
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        db = work / "corpus.db"
        shutil.rmtree(db, ignore_errors=True)  # a fresh load: its time is reported
        m = milvus_recall(args.corpus, test, args.cache_dir, db)
        res["milvus_lite"] = {"load_s": m["load_s"], "passages": m["counts"]["passages"]}
        res["recall@10"]["milvus_lite_hybrid"] = m["recall@10"]
    rec = res["recall@10"]
    res["targets"] = {
        "server_recall_equals_local": rec["server_hybrid"] == rec["local_hybrid"],
        "milvus_within_0.03": None if args.skip_milvus else abs(rec["milvus_lite_hybrid"] - rec["local_hybrid"]) <= 0.03,
        "zero_errors": res["server"]["errors"] == 0,
        "p99_le_3x_p50": res["server"]["p99_over_p50"] <= 3,
        "throughput_ge_0.7x": res["throughput_ratio"] >= 0.7}
    res["load_avg_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: res[k] for k in ("server", "baseline_one_process", "throughput_ratio", "recall@10",
                                          "targets")}, indent=2))


if __name__ == "__main__":
    main()
