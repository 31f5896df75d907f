"""Retrieval server benchmark: `deepr serve-index` under concurrent clients, and recall kept through
the server and Milvus Lite, each against a baseline measured in the same run (``--corpus``: the
wiki by default, or one whose documents carry a description).

    python bench/serve_index.py [--clients 32] [--per-client 200] [--skip-milvus]
    python bench/serve_index.py --shared-clients     # clients sharing one server ("shared_clients")

1. Throughput: ``--clients`` concurrent aiohttp clients each post ``--per-client`` single-query
   ``POST /retrieve`` requests (topk 10, hybrid), distinct queries, empty embedding cache; the
   baseline is one process running ``search_many`` on the same queries in batches of ``--clients``.
2. Quality: recall@10 on bench/retrieval.py's test queries (an article's description -> that
   article), hybrid, locally, through the server and through Milvus Lite.
3. ``--shared-clients``: a two-process ``deepr grpo --stage planner`` (tiny model) and ``deepr run
   --queries --parallel 8`` against one server: its query count against the clients' logged
   searches; each client's peak RSS (VmHWM) against the index on disk, the server, and the same
   clients opening the corpus locally. Each mode keeps the other's part of serve_index.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _common import RESULTS, ROOT, child_env, free_port, peak_rss_mb, read_json, timed, write_json


def query_sets(docs) -> tuple[list[tuple[str, str]], list[str]]:
    """(bench/retrieval.py's test queries: (description, doc id), every description in corpus order)."""
    from retrieval import split_queries

    return split_queries(docs)[1], list(dict.fromkeys(d.description for d in docs if d.description))


def recall_at_10(r, test: list[tuple[str, str]], batch: int = 64) -> float:
    hits = 0
    for s in range(0, len(test), batch):
        part = test[s:s + batch]
        for (_, target), found in zip(part, r.search_many([q for q, _ in part], k=10, mode="hybrid")):
            hits += any(h.doc_id == target for h in found)
    return hits / len(test)


@contextlib.contextmanager
def serving(corpus: str, cache_dir: str | None, log: dict):
    """A `deepr serve-index` on a free port: yields its URL and process; ``log["summary"]``: its "served" line."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "deepr", "serve-index", "--corpus", corpus, "--port", str(port)]
    proc = subprocess.Popen(cmd + (["--cache-dir", cache_dir] if cache_dir else []), env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
        if proc.poll() is not None:
            raise SystemExit(f"serve-index exited: {proc.stdout.read()}")
    else:
        proc.kill()
        raise SystemExit("serve-index did not come up in 300 s")
    try:
        yield url, proc
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        log["summary"] = next((ln for ln in out.splitlines() if ln.startswith("served ")), None)


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
    _, wall, _ = timed(lambda: [r.search_many(queries[s:s + batch], k=10, mode="hybrid")
                                for s in range(0, len(queries), batch)])
    return {"queries": len(queries), "batch": batch, "wall_s": wall, "qps": len(queries) / wall}


def milvus_recall(corpus: str, test, cache_dir: str | None, db: Path) -> dict:
    from deepr.corpus import get_embedder, open_retriever
    from deepr.corpus.milvus import load_to_milvus

    spec = f"milvus:{db}"
    counts, load_s, _ = timed(lambda: load_to_milvus(corpus, spec, embedder=get_embedder(None, use="index"),
                                                     cache_dir=cache_dir))
    return {"load_s": load_s, "counts": counts, "recall@10": recall_at_10(open_retriever(spec), test)}


# --- --shared-clients: training processes and a parallel run sharing one server -------------------

QUESTIONS = ["What causes earthquakes?", "How do volcanoes affect the climate?",
             "Who was Adam Smith and what did he write?", "How does an abacus work?",
             "What is the history of the aircraft carrier?", "What causes acid rain?",
             "How did ancient Greek architecture influence later buildings?", "What is abiogenesis?"]
GRPO_CONFIG = {"lora_r": 4, "lora_alpha": 8, "zero_advantage": "off", "save_steps": 100, "mini_batch_prompts": 2,
               "max_completion_length": 400, "rollout_formats": "schema"}  # schema: a random model's G0 is a plan


def label_of(proc) -> str:
    """'grpo rank N' for a torchrun worker (its LOCAL_RANK), the launcher, or the deepr command."""
    try:
        rank, cmd = proc.environ().get("LOCAL_RANK"), proc.cmdline()
    except Exception:  # noqa: BLE001  already gone
        return "?"
    if "torch.distributed.run" in cmd:
        return "torchrun launcher"
    if rank is not None:
        return f"grpo rank {rank}"
    return "deepr " + next((c for c in cmd if c in ("run", "grpo", "serve-index")), "?")


def run_clients(cmds: dict[str, list[str]], env: dict) -> dict[str, float]:
    """Start every command at once and wait; each process's peak RSS (MB) by label, polled every 0.1 s."""
    import threading

    import psutil

    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for cmd in cmds.values()]
    roots, labels, peaks, stop = [psutil.Process(p.pid) for p in procs], {}, {}, threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for root in roots:
                try:
                    tree = [root, *root.children(recursive=True)]
                except psutil.Error:  # the command has exited
                    continue
                for p in tree:
                    mb = peak_rss_mb(p.pid)
                    if mb is not None:
                        labels.setdefault(p.pid, label_of(p))
                        peaks[p.pid] = max(peaks.get(p.pid, 0.0), mb)
            stop.wait(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    errs = [p.communicate(timeout=1800)[1] for p in procs]
    stop.set()
    watcher.join()
    for name, p, err in zip(cmds, procs, errs):
        if p.returncode != 0:
            raise SystemExit(f"{name} exited {p.returncode}: {err[-3000:]}")
    return {labels[pid]: round(mb, 1) for pid, mb in sorted(peaks.items())}


def client_inputs(work: Path) -> dict[str, Path]:
    """The tiny random model, two verified pairs for the planner stage, the questions for `deepr run`."""
    from deepr.records import QRPair, RubricItem
    from deepr.train.tiny import build_tiny_model, wiki_texts

    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny"
    if not (model / "config.json").is_file():
        build_tiny_model(model, corpus_texts=wiki_texts(300) or None, vocab_size=1500)
    rub = RubricItem(id="R1", type="factual", description="Plate boundaries cause earthquakes", weight=1.0,
                     source_leaf_ids=["L1"], evidence=["Most earthquakes occur at plate boundaries."])
    pairs, queries, config = work / "verified.jsonl", work / "queries.jsonl", work / "grpo.json"
    pairs.write_text("".join(QRPair(id=f"p{i}", tree_id="t", question=q, selected_leaf_ids=[], rubrics=[rub],
                                    decision="KEEP").model_dump_json() + "\n" for i, q in enumerate(QUESTIONS[:2])))
    queries.write_text("".join(json.dumps({"id": f"q{i}", "question": q}) + "\n" for i, q in enumerate(QUESTIONS)))
    config.write_text(json.dumps(GRPO_CONFIG))
    return {"model": model, "pairs": pairs, "queries": queries, "config": config}


def logged_searches(grpo_out: Path, runs_out: Path) -> dict[str, int]:
    """The searches each client recorded: GRPO's rollouts.jsonl (every rank's rollouts), the run's traces."""
    grpo = sum(json.loads(x).get("searches", 0) for x in (grpo_out / "rollouts.jsonl").read_text().splitlines())
    run = 0
    for path in runs_out.rglob("*.json"):
        trace = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(trace, dict) and "tools" in trace:  # a blank query is never sent
            run += sum(1 for t in trace["tools"] if t["tool"] == "search" and str(t.get("query") or "").strip())
    return {"grpo": grpo, "run": run}


def client_commands(corpus: list[str], inputs: dict[str, Path], out: Path, grpo_steps: int) -> dict[str, list[str]]:
    """A two-process GRPO planner run and an 8-wide `deepr run --queries`, both searching ``corpus``."""
    py = [sys.executable, "-m"]
    grpo = [*py, "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "deepr", "grpo",
            "--stage", "planner", "--model", str(inputs["model"]), "--data", str(inputs["pairs"]),
            "--out", str(out / "grpo"), "--config", str(inputs["config"]), "--max-steps", str(grpo_steps),
            "--num-generations", "2", "--prompts-per-step", "2", "--lr", "1e-3", "--k", "2", *corpus]
    run = [*py, "deepr", "run", "--queries", str(inputs["queries"]), "--parallel", "8", "--out", str(out / "runs"),
           *corpus]
    return {"grpo": grpo, "run": run}


def shared_clients(args: argparse.Namespace) -> dict:
    """Both clients against one server: its query count against their logs, their peak RSS against the index."""
    import httpx

    from deepr.corpus.embcache import cache_root

    work = Path(args.work) / "clients"
    shutil.rmtree(work / "out", ignore_errors=True)
    cache = str(cache_root(args.cache_dir))
    inputs = client_inputs(work)
    # the clients' own cache: an index built or loaded there would show; it holds the exported embedders, as a
    # user's does (GRPO's reward embeds on each rank; that model is not the index, and exporting it is a one-off)
    client_cache = work / "out" / "client-cache"
    env = child_env(OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", DEEPR_CACHE=str(client_cache))
    if (cache_root(None) / "embedders").is_dir():
        shutil.copytree(cache_root(None) / "embedders", client_cache / "embedders")
    log: dict = {}
    with serving(args.corpus, cache, log) as (url, proc):
        stats = httpx.get(url + "/v1/stats").json()
        before, index = stats["served"]["queries"], Path(stats["index"])  # the folder the server loaded
        index_mb = sum(f.stat().st_size for f in index.rglob("*") if f.is_file()) / 2 ** 20
        print("two-process grpo + run --parallel 8 against the server ...", file=sys.stderr)
        clients = run_clients(client_commands(["--corpus", url], inputs, work / "out", args.grpo_steps), env)
        served = httpx.get(url + "/v1/stats").json()["served"]["queries"] - before
        server_peak = peak_rss_mb(proc.pid)
    logged = logged_searches(work / "out" / "grpo", work / "out" / "runs")
    res = {"corpus": args.corpus, "index_dir": str(index), "index_on_disk_mb": round(index_mb, 1),
           "server_peak_rss_mb": server_peak, "client_peak_rss_mb": clients,
           "client_over_index": {k: round(v / index_mb, 2) for k, v in clients.items()},
           "searches": {"server_counted": served, "clients_logged": logged},
           "client_cache_has_index": (client_cache / "index").exists(), "server_log_summary": log["summary"]}
    if not args.skip_local:
        print("baseline: the same two clients with the corpus opened locally ...", file=sys.stderr)
        # both find the server's index through DEEPR_CACHE (grpo has no --cache-dir)
        local = client_commands(["--corpus", args.corpus], inputs, work / "out" / "local", args.grpo_steps)
        res["local_peak_rss_mb"] = run_clients(local, {**env, "DEEPR_CACHE": cache})
        res["served_over_local"] = {k: round(v / res["local_peak_rss_mb"][k], 3) for k, v in clients.items()
                                    if res["local_peak_rss_mb"].get(k)}
    res["client_over_server"] = {k: round(v / server_peak, 2) for k, v in clients.items()}
    res["targets"] = {"server_counts_every_search": served == sum(logged.values()) and logged["grpo"] > 0
                      and logged["run"] > 0,
                      "no_client_loads_the_index": not res["client_cache_has_index"],
                      "each_client_rss_below_index_size": all(v < index_mb for v in clients.values())}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--per-client", type=int, default=200)
    ap.add_argument("--corpus", default="wiki", help="corpus to serve; its documents' descriptions are the queries")
    ap.add_argument("--cache-dir", default=None, help="deepr cache with the corpus's index (default: $DEEPR_CACHE)")
    ap.add_argument("--work", default=str(ROOT / ".bench-work" / "serve-index"), help="folder for the Milvus Lite file")
    ap.add_argument("--skip-milvus", action="store_true")
    ap.add_argument("--shared-clients", action="store_true", help="measure clients sharing one server instead (3.)")
    ap.add_argument("--grpo-steps", type=int, default=2, help="--shared-clients: GRPO steps")
    ap.add_argument("--skip-local", action="store_true", help="--shared-clients: no local-corpus baseline run")
    ap.add_argument("--out", default=str(RESULTS / "serve_index.json"))
    args = ap.parse_args()
    old = read_json(args.out)  # each mode keeps the other's part of the file
    res: dict = {"load_avg_start": os.getloadavg(), "cores": len(os.sched_getaffinity(0))}
    if args.shared_clients:
        res = {**res, **shared_clients(args), "load_avg_end": os.getloadavg()}
        write_json(args.out, {**old, "shared_clients": res})
        print(json.dumps({k: res[k] for k in ("index_on_disk_mb", "server_peak_rss_mb", "client_peak_rss_mb",
                                              "searches", "targets")}, indent=2))
        return

    from deepr.corpus import open_retriever
    from deepr.corpus.remote import RemoteRetriever

    res.update(clients=args.clients, per_client=args.per_client)
    local = open_retriever(args.corpus, cache_dir=args.cache_dir, progress=True)
    test, pool = query_sets(local.documents)
    need = args.clients * args.per_client
    if len(pool) < need:
        raise SystemExit(f"{len(pool)} distinct queries, {need} needed; lower --clients or --per-client")
    load, log = pool[:need], {}
    with serving(args.corpus, args.cache_dir, log) as (url, _):
        print(f"{args.clients} clients x {args.per_client} queries ...", file=sys.stderr)
        res["server"] = asyncio.run(clients(url, load, args.clients, args.per_client))
        print("baseline: one process, batched ...", file=sys.stderr)
        res["baseline_one_process"] = baseline(local, load, args.clients)
        res["throughput_ratio"] = res["server"]["qps"] / res["baseline_one_process"]["qps"]
        print("recall@10: local and through the server ...", file=sys.stderr)
        res["recall@10"] = {"local_hybrid": recall_at_10(local, test),
                            "server_hybrid": recall_at_10(RemoteRetriever(url, mode="hybrid"), test),
                            "queries": len(test)}
    res["server_log_summary"] = log["summary"]
    if not args.skip_milvus:
        print("Milvus Lite: load the wiki corpus, then recall@10 ...", file=sys.stderr)
        db = Path(args.work) / "corpus.db"
        db.parent.mkdir(parents=True, exist_ok=True)
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
    write_json(args.out, {**res, **{k: old[k] for k in ("shared_clients",) if k in old}})
    print(json.dumps({k: res[k] for k in ("server", "baseline_one_process", "throughput_ratio", "recall@10",
                                          "targets")}, indent=2))


if __name__ == "__main__":
    main()
