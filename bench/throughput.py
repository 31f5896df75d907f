"""Benchmark: does `deepr run --queries` keep a served model busy?

A loopback OpenAI-compatible stub (deepr/llm/stub_server.py, no concurrency limit) answers every
call after a fixed latency (default 200 ms) with the reply the extractive engine gave for the
same prompt (the questions are first run with ``--llm extractive --record``), so the run over the
stub takes the extractive run's path; a prompt the recording never saw is counted as a miss.

For each mode and ``--parallel``, `deepr run --llm openai:stub --no-cache --concurrency 256` records:

- wall seconds, and the batch's seconds (first call's arrival to last call's answer), against the
  critical-path bound: per question, its chain of dependent calls (from the ``--parallel 1`` run:
  overlapping calls of one question are one link) times the latency; at ``--parallel P`` the
  larger of the longest chain and the sum of chains over P;
- deepr's CPU per model call: the process's CPU minus a one-question run's, over the extra calls;
  and, steadier, its CPU within the batch over the batch's calls (``_in_batch``, /proc every 50 ms);
- peak RSS (polled every 50 ms) and RSS when question 8 and 32 had finished; most calls in flight.

    python bench/throughput.py                          # 32 questions, dag and warp, --parallel 1,8,32
    python bench/throughput.py --questions 32 --modes dag --parallel 32 --latency 0.2
Writes bench/results/throughput.json.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import RESULTS, ROOT, child_env, write_json

sys.path.insert(0, str(ROOT / "tests"))


def key(messages: list[dict]) -> str:
    return hashlib.sha1(json.dumps([[m.get("role"), m.get("content")] for m in messages]).encode()).hexdigest()


def questions(n: int, corpus: Path) -> list[dict]:
    """One question per corpus article title: distinct plans and searches. Titles with no word of three
    letters ("3C 273") are skipped, which keeps the questions of bench/results/throughput.json."""
    rows = [json.loads(x) for x in corpus.read_text().splitlines()]
    titles = [r["title"] for r in rows if re.search(r"[^\W\d_]{3}", r["title"])][:n]
    return [{"id": f"q{i}", "question": f"What is known about {t} and why does it matter?"}
            for i, t in enumerate(titles)]


def deepr(args: list, env: dict, profile: Path | None = None) -> subprocess.Popen:
    """``profile``: record the run's stacks with py-spy (collapsed, one file a run) to find its CPU."""
    spy = [str(Path(sys.executable).with_name("py-spy")), "record", "--gil", "-f", "raw", "-r", "250",
           "-o", str(profile), "--"] if profile else []
    return subprocess.Popen([*spy, sys.executable, "-m", "deepr", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def replies_from(traj: Path) -> dict[str, tuple[str, str, str]]:
    """prompt key -> (reply, role, question) of every recorded model turn."""
    from deepr.io import read_jsonl
    from deepr.records import Trajectory

    out = {}
    for t in read_jsonl(traj, Trajectory):
        for turn in t.turns:
            out[key(turn.messages)] = (turn.completion, turn.role, t.query)
    return out


class Log:
    """The stub's reply function: recorded replies, plus when each call ran and for which question."""

    def __init__(self, table: dict, latency: float):
        self.table, self.latency, self.calls, self.misses = table, latency, [], 0
        self.lock = threading.Lock()

    def __call__(self, body: dict) -> str:
        hit = self.table.get(key(body["messages"]))
        now = time.perf_counter()
        with self.lock:
            self.calls.append((now - self.latency, now, hit[2] if hit else None))
            self.misses += hit is None
        return hit[0] if hit else "{}"


def rss_mb(pid: int) -> float:
    """RSS of a process and its children (MB), from /proc."""
    total, pids = 0, [pid]
    with contextlib.suppress(OSError):
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        with contextlib.suppress(OSError):
            total += sum(int(x.split()[1]) for x in Path(f"/proc/{p}/status").read_text().splitlines()
                         if x.startswith("VmRSS:"))
    return total / 1024


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a running process, from /proc (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_between(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """CPU seconds spent between two instants, from (time, cumulative CPU) samples: the last
    sample at or before ``start`` to the first at or after ``end``."""
    before = [c for t, c in samples if t <= start] or [samples[0][1]]
    after = [c for t, c in samples if t >= end] or [samples[-1][1]]
    return after[0] - before[-1]


def watch(proc: subprocess.Popen, reports: Path, done_event: threading.Event) -> dict:
    """Peak RSS, RSS when the 8th and 32nd reports were written, and CPU samples every 50 ms
    (never reaps the child: :func:`measure` must, to read its CPU time)."""
    peak, at, cpu = 0.0, {}, []
    while not done_event.is_set():
        r = rss_mb(proc.pid)
        if (c := proc_cpu_s(proc.pid)) is not None:
            cpu.append((time.perf_counter(), c))
        peak = max(peak, r)
        done = len(reports.read_text().splitlines()) if reports.is_file() else 0
        for n in (8, 32):
            if done >= n and n not in at:
                at[n] = round(r, 1)
        time.sleep(0.05)
    return {"peak_rss_mb": round(peak, 1), "rss_mb_after_question": at, "_cpu_samples": cpu}


def in_flight(calls: list) -> int:
    events = sorted([(s, 1) for s, _, _ in calls] + [(e, -1) for _, e, _ in calls])
    return max(itertools.accumulate(d for _, d in events), default=0)


def chains(calls: list) -> dict[str, int]:
    """Per question: links of its call chain (calls that overlap in time share a link)."""
    by_q: dict[str, list] = {}
    for s, e, q in calls:
        by_q.setdefault(q, []).append((s, e))
    out = {}
    for q, cs in by_q.items():
        cs.sort()
        links, end = 0, -1.0
        for s, e in cs:
            if s >= end:
                links, end = links + 1, e
            else:
                end = max(end, e)
        out[q] = links
    return out


def measure(proc: subprocess.Popen, watched: Path, t0: float) -> tuple[dict, float, float, str]:
    """Reaps ``proc`` (os.wait4: its CPU time) while :func:`watch` samples it against ``watched``'s
    progress: (the RSS fields, its CPU seconds, wall seconds since ``t0``, the tail of its output)."""
    res: dict = {}
    finished = threading.Event()
    mem = threading.Thread(target=lambda: res.update(watch(proc, watched, finished)))
    mem.start()
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    finished.set()
    wall = time.perf_counter() - t0
    mem.join()
    return res, ru.ru_utime + ru.ru_stime, wall, proc.stdout.read()[-2000:]


def one_run(mode: str, parallel: int, qfile: Path, corpus: Path, table: dict, a, tmp: Path, env: dict,
            limit: int | None = None) -> dict:
    from deepr.llm.stub_server import StubServer

    log = Log(table, a.latency)
    out = tmp / f"{mode}-{parallel}-{limit}"
    with StubServer(reply=log, latency=a.latency) as srv:
        t0 = time.perf_counter()
        proc = deepr(["run", "--queries", qfile, "--out", out, "--mode", mode, "--corpus", corpus, "--retriever",
                      "bm25", "--llm", "openai:stub", "--base-url", srv.base_url, "--api-key", "k", "--no-cache",
                      "--concurrency", "256", "--parallel", parallel, "--allow-fallback", "--timeout", "120",
                      *(["--limit", limit] if limit else [])], env,
                     a.profile / f"{mode}-{parallel}-{limit}.txt" if a.profile else None)
        res, cpu, wall, tail = measure(proc, out / "reports.jsonl", t0)
    if proc.returncode not in (0, 3):
        raise SystemExit(f"deepr run {mode} --parallel {parallel} failed ({proc.returncode}):\n{tail}")
    # the batch: first call's arrival to the last call's answer (start-up is outside it)
    start, end = (min(s for s, _, _ in log.calls), max(e for _, e, _ in log.calls)) if log.calls else (0.0, 0.0)
    samples = res.pop("_cpu_samples")
    if log.calls and samples:
        res["deepr_cpu_ms_per_call_in_batch"] = round(1000 * cpu_between(samples, start, end) / len(log.calls), 2)
    return {"wall_s": round(wall, 2), "batch_s": round(end - start, 2), "cpu_s": round(cpu, 2), "calls": len(log.calls),
            "misses": log.misses, "max_in_flight": in_flight(log.calls), **res, "_calls": log.calls}


def bench_mode(mode: str, qfile: Path, corpus: Path, a, tmp: Path, env: dict) -> dict:
    traj = tmp / f"{mode}-traj.jsonl"
    deepr(["run", "--queries", qfile, "--out", tmp / f"{mode}-rec", "--mode", mode, "--corpus", corpus,
           "--retriever", "bm25", "--record", traj, "--parallel", "8"], env).wait()
    table = replies_from(traj)
    base = one_run(mode, 1, qfile, corpus, table, a, tmp, env, limit=1)  # start-up + one question
    rows, chain = {}, None
    for par in a.parallel:
        r = one_run(mode, par, qfile, corpus, table, a, tmp, env)
        calls = r.pop("_calls")
        if chain is None:  # the first (sequential) run gives each question's chain
            chain = chains(calls)
        bound = max(max(chain.values()), sum(chain.values()) / par) * a.latency
        extra_calls = max(r["calls"] - base["calls"], 1)
        r.update(bound_s=round(bound, 2), batch_over_bound=round(r["batch_s"] / bound, 3),
                 deepr_cpu_ms_per_call=round(1000 * max(r["cpu_s"] - base["cpu_s"], 0) / extra_calls, 2))
        rows[f"parallel {par}"] = r
        print(mode, par, json.dumps(r), flush=True)
    base.pop("_calls")
    return {"recorded_turns": len(table), "one_question_run": base, "questions": len(chain or {}),
            "chain_links": {"longest": max(chain.values()), "mean": round(sum(chain.values()) / len(chain), 2)},
            "runs": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--modes", default="dag,warp")
    p.add_argument("--parallel", default="1,8,32")
    p.add_argument("--latency", type=float, default=0.2)
    p.add_argument("--profile", type=Path, default=None,
                   help="folder for py-spy stacks of each run (pip install py-spy), to find costs: the process "
                        "watched is then py-spy, so the CPU and RSS figures are not deepr's")
    p.add_argument("--out", type=Path, default=RESULTS / "throughput.json")
    a = p.parse_args(argv)
    a.parallel = [int(x) for x in a.parallel.split(",")]
    if a.profile:
        a.profile.mkdir(parents=True, exist_ok=True)
    from conftest import wiki_rows

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        env = child_env(DEEPR_CACHE=str(tmp / "cache"), OMP_NUM_THREADS="1")
        corpus = tmp / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(r) + "\n" for r in wiki_rows(15)))
        qfile = tmp / "questions.txt"
        qfile.write_text("".join(q["question"] + "\n" for q in questions(a.questions, corpus)))
        res = {"latency_s": a.latency, "questions": a.questions,
               "modes": {m: bench_mode(m, qfile, corpus, a, tmp, env) for m in a.modes.split(",")},
               "load_average_at_end": round(os.getloadavg()[0], 2)}
    write_json(a.out, res, indent=1)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
