"""Benchmark: what one model call costs the client's CPU, layer by layer.

`deepr run --queries --parallel P` against a server with a fixed latency L keeps its questions in
step: every reply of a wave arrives together and is handled on one interpreter before the next
wave leaves, so the wall time over the critical-path bound grows with the CPU each call costs the
client (bench/throughput.py, docs/scaling.md). This bench measures the part of that CPU no agent
code can remove: sending one chat request and decoding its reply, at C calls in flight against
the loopback stub (deepr/llm/stub_server.py, in this process), with the client in a subprocess so
its CPU is its own. Four clients, each adding a layer:

- ``aiohttp``: a bare ``aiohttp`` POST and ``json()`` (the transport alone, the floor);
- ``sdk-aiohttp``: the openai SDK's ``AsyncOpenAI.post`` over its ``DefaultAioHttpClient``
  (deepr's default transport), reply decoded as JSON (``cast_to=object``, as deepr does);
- ``sdk-httpx``: the same over the SDK's default httpx transport;
- ``deepr``: deepr's openai backend (``LLM.achat``: request building, usage accounting, the
  reply's checks of finish reason and content) over its default transport.

    python bench/client_floor.py                      # 1,000 calls, 64 in flight, 200 ms
    python bench/client_floor.py --calls 500 --in-flight 32 --kinds aiohttp,deepr
    python bench/client_floor.py --chain 4 --in-flight 32 --repeats 5 --out bench/results/client_floor_chain.json

``--chain 4 --in-flight 32`` times the shape of `deepr run --queries --mode dag --parallel 32`
with no agent in it: 32 questions of 4 dependent calls each, started together, against the bound
of 4 x the latency (``wall_over_bound``: the target is 1.2). ``--work-ms W`` adds W ms of CPU
after each reply, standing in for the agent's work between calls.

Writes bench/results/client_floor.json: CPU ms per call of each client, and the budget: with P
questions in step, a call's client CPU beyond L / P seconds is time the model waits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("aiohttp", "sdk-aiohttp", "sdk-httpx", "deepr")
# A request the size of a dag planner call (system prompt, question, evidence) and a JSON reply.
SYSTEM, USER = "You plan research. " * 100, "Question and evidence. " * 150
REPLY = json.dumps({"nodes": [{"id": f"n{i}", "query": "a query of seven words here", "needs": []}
                              for i in range(6)]})


async def _client(kind: str, base_url: str):
    """An async callable making one chat call with client ``kind``, and its closer."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    body = {"model": "stub", "messages": messages, "max_tokens": 640, "temperature": 0}
    if kind == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def call():
            async with session.post(f"{base_url}/chat/completions", json=body) as r:
                return (await r.json())["choices"][0]["message"]["content"]
        return call, session.close
    if kind.startswith("sdk"):
        import openai

        extra = {"http_client": openai.DefaultAioHttpClient()} if kind == "sdk-aiohttp" else {}
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, **extra)

        async def call():
            reply = await client.post("/chat/completions", body=body, cast_to=object)
            return reply["choices"][0]["message"]["content"]
        return call, client.close
    from deepr.llm import get_llm

    llm = get_llm("openai:stub", base_url=base_url, cache=False, max_concurrency=1024)

    async def call():
        return str(await llm.achat(messages, max_tokens=640, temperature=0))

    async def close():
        llm.close()
    return call, close


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _busy(ms: float) -> None:
    """Hold the interpreter for ``ms`` of CPU, as an agent's work between two calls does."""
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass


async def _measure(kind: str, base_url: str, calls: int, in_flight: int, chain: int = 0, work_ms: float = 0.0,
                   latency: float = 0.2) -> dict:
    call, close = await _client(kind, base_url)
    gate = asyncio.Semaphore(in_flight)

    async def one():
        async with gate:
            return await call()

    async def in_step():  # one question: ``chain`` dependent calls, ``work_ms`` of CPU after each reply
        got = []
        for _ in range(chain):
            got.append(await call())
            _busy(work_ms)
        return got
    await asyncio.gather(*[one() for _ in range(in_flight)])  # connections opened, imports done
    cpu0, t0 = _cpu(), time.perf_counter()
    if chain:  # ``in_flight`` questions start together and stay in step, as `deepr run --queries` does
        replies = [r for q in await asyncio.gather(*[in_step() for _ in range(in_flight)]) for r in q]
    else:
        replies = await asyncio.gather(*[one() for _ in range(calls)])
    cpu, wall = _cpu() - cpu0, time.perf_counter() - t0
    await close()
    # Every client reads the reply's text back, and it must be the stub's: a call that did not
    # round-trip (or read nothing) would make its CPU per call meaningless.
    if wrong := sum(r != REPLY for r in replies):
        raise SystemExit(f"{kind}: {wrong} of {len(replies)} replies are not the stub's reply")
    out = {"cpu_ms_per_call": round(1000 * cpu / len(replies), 3), "wall_s": round(wall, 3)}
    if chain:  # the critical-path bound: one chain of calls, every question overlapped
        out["wall_over_bound"] = round(wall / (chain * latency), 3)
    return out


def child(kind: str, base_url: str, calls: int, in_flight: int, chain: int, work_ms: float, latency: float) -> None:
    print(json.dumps(asyncio.run(_measure(kind, base_url, calls, in_flight, chain, work_ms, latency))))


def run_kind(kind: str, base_url: str, a) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", kind, "--base-url", base_url,
                               "--calls", str(a.calls), "--in-flight", str(a.in_flight), "--chain", str(a.chain),
                               "--work-ms", str(a.work_ms), "--latency", str(a.latency)],
                              capture_output=True, text=True, env=env, timeout=600)
    except subprocess.TimeoutExpired:
        calls = a.in_flight * a.chain if a.chain else a.calls
        return {"error": [f"{kind}: {calls} calls did not finish in 600 s"]}
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--in-flight", type=int, default=64)
    p.add_argument("--latency", type=float, default=0.2)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--chain", type=int, default=0,
                   help="instead of --calls independent calls: --in-flight questions of CHAIN dependent calls "
                        "each, started together (dag's shape: 4), timed against the bound CHAIN x latency")
    p.add_argument("--work-ms", type=float, default=0.0,
                   help="with --chain: CPU milliseconds of stand-in agent work after each reply")
    p.add_argument("--repeats", type=int, default=2, help="runs of each client, alternated")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/client_floor.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--base-url", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child, a.base_url, a.calls, a.in_flight, a.chain, a.work_ms, a.latency)
        return 0
    kinds = [k for k in a.kinds.split(",") if k]
    if bad := [k for k in kinds if k not in KINDS]:
        p.error(f"--kinds: unknown {', '.join(bad)}; choose from {', '.join(KINDS)}")
    from deepr.llm.stub_server import StubServer

    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    with StubServer(reply=REPLY, latency=a.latency) as srv:
        for _ in range(a.repeats):
            for k in kinds:
                runs[k].append(run_kind(k, srv.base_url, a))
                print(k, runs[k][-1], flush=True)
        most = srv.max_in_flight
    result = {
        "command": "python bench/client_floor.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "calls": a.in_flight * a.chain if a.chain else a.calls, "in_flight": a.in_flight, "latency_s": a.latency,
        **({"chain": a.chain, "work_ms_per_call": a.work_ms} if a.chain else {}), "most_in_flight_at_stub": most,
        "load_average_at_end": round(os.getloadavg()[0], 2),
        # With P questions in step each wave's replies share one interpreter for L seconds.
        "budget_ms_per_call_at_in_flight": round(1000 * a.latency / a.in_flight, 3),
        "runs": runs,
        "cpu_ms_per_call_mean": {k: round(sum(r["cpu_ms_per_call"] for r in v) / len(v), 3)
                                 for k, v in runs.items() if v and all("cpu_ms_per_call" in r for r in v)},
    }
    if a.chain:
        result["wall_over_bound_mean"] = {k: round(sum(r["wall_over_bound"] for r in v) / len(v), 3)
                                          for k, v in runs.items() if v and all("wall_over_bound" in r for r in v)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("cpu_ms_per_call_mean", "wall_over_bound_mean") if k in result}))
    return 0 if all("error" not in r for v in runs.values() for r in v) else 1


if __name__ == "__main__":
    sys.exit(main())
