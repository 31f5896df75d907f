"""Benchmark: do the data stages keep a served model busy?

The data-stage half of bench/throughput.py (same stub, same measures). Each stage is first run
with ``--llm extractive`` while a driver records every role turn (prompt messages -> the
extractive engine's reply, and which record's :class:`~deepr.roles.Recorder` made it); then
the stage runs over ``--llm openai:stub`` against a loopback OpenAI-compatible stub
(deepr/llm/stub_server.py, a thread per request, no concurrency limit) that answers each prompt
with its recorded reply after a fixed latency (default 200 ms). A prompt the recording never
saw is a miss, counted.

Stages, each on the previous stage's extractive output: ``build-trees`` (--trees topics,
bm25, --max-depth 2 by default), ``synthesize-rubrics`` (one pair per tree), ``verify`` (one
verdict per pair). Per stage:

- the critical-path bound: a serial run (one record at a time, the model still allowed
  --in-flight calls, so a record's independent calls overlap) gives each record's chain of
  dependent calls (calls of one record that overlap in time are one link); the bound at
  ``--concurrency C`` is the larger of the longest chain and all calls over C, times the latency;
- wall seconds of ``deepr <stage> --llm openai:stub --no-cache --concurrency C``, and batch
  seconds (first call's arrival to last call's answer, so start-up is outside it);
- deepr's CPU ms per model call: user + system CPU of the process beyond a one-record run's,
  over the calls beyond that run's;
- peak RSS (polled every 50 ms), the largest number of calls in flight at the stub, misses.

    python bench/throughput_data.py                       # 32 trees, concurrency 64
    python bench/throughput_data.py --records 64 --stages verify --concurrency 64

Writes bench/results/throughput_data.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from throughput import Log, batch_seconds, chains, in_flight, key, measure  # noqa: E402

STAGES = ("build-trees", "synthesize-rubrics", "verify")


def drive(argv: list[str]) -> None:
    """In a subprocess: run one deepr command with ``--record-turns FILE`` (every role turn, with
    its record) and/or ``--calls N`` (the model's calls in flight, whatever --concurrency says, so
    --concurrency 1 gives one record at a time whose own calls still overlap)."""
    import deepr.cli.data_opts as data_opts
    from deepr.roles import Recorder

    record_to, calls = None, None
    while argv and argv[0] in ("--record-turns", "--calls"):
        flag, value, argv = argv[0], argv[1], argv[2:]
        record_to, calls = (value, calls) if flag == "--record-turns" else (record_to, int(value))
    turns: list[list] = []
    if record_to:
        original, ids = Recorder.turn, iter(range(1 << 30))

        def turn(self, role, action, messages, completion, **kw):  # type: ignore[no-untyped-def]
            rid = self.__dict__.setdefault("_bench_record", f"r{next(ids)}")  # id() is reused once freed
            turns.append([key(list(messages)), completion, role, rid])
            return original(self, role, action, messages, completion, **kw)

        Recorder.turn = turn  # type: ignore[method-assign]
    if calls:
        data_opts.models = with_calls(data_opts.models, calls)
    sys.argv = ["deepr", *argv]
    from deepr.cli import main

    try:
        main()
    finally:
        if record_to:
            Path(record_to).write_text(json.dumps(turns))


def with_calls(models, calls: int):
    """``data_opts.models`` (the models of every data stage) built with ``calls`` in flight,
    whatever --concurrency is."""
    import inspect

    sig = inspect.signature(models)

    def built(*a, **kw):  # type: ignore[no-untyped-def]
        bound = sig.bind(*a, **kw)
        bound.arguments["concurrency"] = calls
        return models(*bound.args, **bound.kwargs)

    return built


def run_cmd(args: list, env: dict, driver: list | None = None) -> subprocess.Popen:
    head = [sys.executable, __file__, "--drive", *map(str, driver)] if driver is not None else \
        [sys.executable, "-m", "deepr"]
    return subprocess.Popen([*head, *map(str, args)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def stage_args(stage: str, inp: Path, out: Path, a) -> list:
    if stage == "build-trees":
        return ["build-trees", "--corpus", a.corpus, "--topics", inp, "--out", out, "--retriever", "bm25",
                "--max-depth", a.max_depth, "--branching", a.branching, "--cache-dir", a.cache]
    if stage == "synthesize-rubrics":
        return ["synthesize-rubrics", inp, "--out", out]
    return ["verify", inp, "--out", out]


def record(stage: str, inp: Path, tmp: Path, a, env: dict, tag: str = "") -> tuple[Path, dict]:
    """The stage's extractive output and its turns: key -> (reply, role, record)."""
    out, turns = tmp / f"{stage}{tag}.extractive.jsonl", tmp / f"{stage}{tag}.turns.json"
    p = run_cmd([*stage_args(stage, inp, out, a), "--llm", "extractive"], env, ["--record-turns", turns])
    log = p.communicate()[0]
    if p.returncode not in (0, 3):  # 3: some records rejected (counted in the output's sidecar)
        raise SystemExit(f"extractive {stage} failed ({p.returncode}):\n{log[-2000:]}")
    return out, {k: (reply, role, rec) for k, reply, role, rec in json.loads(turns.read_text())}


class TreeLog(Log):
    """build-trees' replies: the extractive engine's decompose replies over-propose (it prunes its
    own candidates later) and fail the model path's checks, so a tree is answered by
    bench/tree_concurrency.py's Responder (a valid reply per role, chosen from the prompt).
    A call's record is the count of root-query calls so far: exact in the serial run, where
    each tree starts with its root query once the previous tree is done."""

    def __init__(self, titles: list[str], latency: float):
        from tree_concurrency import Responder

        super().__init__({}, latency)
        # decompose proposes "<title> <facet>": titles of words only pass its "real words" check
        worded = [t for t in titles if re.fullmatch(r"[A-Za-z][A-Za-z' -]+", t) and len(t) > 5]
        self.responder, self.trees = Responder(worded, 0.0), 0

    def __call__(self, body: dict) -> str:
        reply = self.responder(body)
        if self.responder.served[-1][2] == "ground":  # support only documents the prompt lists
            listed = re.findall(r"^\[(\d+)\]", body["messages"][-1]["content"], re.M)
            reply = json.dumps({"supporting": [int(k) for k in listed[:2]]})
        now = time.perf_counter()
        with self.lock:
            self.trees += self.responder.served[-1][2] == "root_query"
            self.calls.append((now - self.latency, now, f"tree {self.trees}"))
        return reply


def stub_run(stage: str, inp: Path, table: dict, a, tmp: Path, env: dict, concurrency: int, tag: str,
             limit: int | None = None, serial: bool = False) -> dict:
    from deepr.llm.stub_server import StubServer

    log = TreeLog(a.titles, a.latency) if stage == "build-trees" else Log(table, a.latency)
    out = tmp / f"{stage}.{tag}.jsonl"
    args = [*stage_args(stage, inp, out, a), "--llm", "openai:stub", "--api-key", "k", "--no-cache",
            "--concurrency", concurrency, "--timeout", "120", *(["--limit", limit] if limit else [])]
    with StubServer(reply=log, latency=a.latency) as srv:
        t0 = time.perf_counter()
        proc = run_cmd([*args, "--base-url", srv.base_url], env, ["--calls", a.in_flight] if serial else None)
        res, cpu, wall, tail = measure(proc, out, t0)
    if proc.returncode not in (0, 3):
        raise SystemExit(f"{stage} over the stub ({tag}) failed ({proc.returncode}):\n{tail}")
    batch = batch_seconds(log.calls)
    written = len(out.read_text().splitlines()) if out.is_file() else 0
    return {"wall_s": round(wall, 2), "batch_s": round(batch, 2), "cpu_s": round(cpu, 2), "calls": len(log.calls),
            "exit": proc.returncode, "records_written": written, "misses": log.misses,
            "max_in_flight": in_flight(log.calls), **res, "_calls": log.calls}


def bench_stage(stage: str, inp: Path, table: dict, a, tmp: Path, env: dict) -> dict:
    serial = stub_run(stage, inp, table, a, tmp, env, 1, "serial", serial=True)
    chain = chains(serial.pop("_calls"))
    base = stub_run(stage, inp, table, a, tmp, env, a.in_flight, "one", limit=1)
    base.pop("_calls")
    r = stub_run(stage, inp, table, a, tmp, env, a.in_flight, "batch")
    r.pop("_calls")
    longest, total = max(chain.values()), r["calls"]
    bound = max(longest, total / a.in_flight) * a.latency
    extra = max(r["calls"] - base["calls"], 1)
    r.update(bound_s=round(bound, 2), batch_over_bound=round(r["batch_s"] / bound, 3),
             wall_over_bound=round(r["wall_s"] / bound, 3),
             deepr_cpu_ms_per_call=round(1000 * max(r["cpu_s"] - base["cpu_s"], 0) / extra, 2))
    links = sorted(chain.values())
    return {**({"recorded_turns": len(table)} if table else {}), "records_with_calls": len(chain),
            "chain_links": {"longest": longest, "mean": round(sum(links) / len(links), 2)},
            "serial_run": {k: serial[k] for k in ("wall_s", "batch_s", "calls", "misses", "max_in_flight")},
            "one_record_run": base, f"concurrency {a.in_flight}": r}


def topics_file(a, out: Path) -> Path:
    """build-trees' seeds: the first --records titles (the stub answers any topic)."""
    out.write_text("".join(t + "\n" for t in [t for t in a.titles if len(t) > 3][:a.records]))
    return out


def extractive_trees(a, tmp: Path, env: dict) -> Path:
    """synthesize-rubrics' input: extractive trees from sampled topics, enough of them (about half
    of the topics the extractive engine tries make a tree of two leaves or more) for --records pairs."""
    out = tmp / "trees.extractive.jsonl"
    p = run_cmd(["build-trees", "--corpus", a.corpus, "--n-trees", a.records * 2, "--out", out, "--retriever",
                 "bm25", "--cache-dir", a.cache, "--llm", "extractive"], env)
    log = p.communicate()[0]
    if not out.is_file() or len(out.read_text().splitlines()) < a.records:
        raise SystemExit(f"extractive build-trees made fewer than {a.records} trees ({p.returncode}):\n{log[-2000:]}")
    return out


def paired_only(trees: Path, pairs: Path, tmp: Path, a, env: dict) -> tuple[Path, Path, dict]:
    made = {json.loads(x)["tree_id"] for x in pairs.read_text().splitlines()}
    kept = [x for x in trees.read_text().splitlines() if json.loads(x)["id"] in made]
    out = tmp / "trees.paired.jsonl"
    out.write_text("".join(x + "\n" for x in kept))
    pairs2, table = record("synthesize-rubrics", out, tmp, a, env, ".paired")  # turns of exactly these trees
    return out, pairs2, table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=32, help="trees built (and so pairs and verdicts)")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--concurrency", dest="in_flight", type=int, default=64)
    p.add_argument("--latency", type=float, default=0.2)
    p.add_argument("--max-depth", type=int, default=2)
    p.add_argument("--branching", default="3,2,2")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "throughput_data.json")
    p.add_argument("--keep", type=Path, help="work in this (new) folder and keep it, to read the stages' outputs")
    a = p.parse_args(argv)
    from conftest import wiki_rows

    wanted = a.stages.split(",")
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s) if a.keep is None else a.keep
        tmp.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "DEEPR_CACHE": str(tmp / "cache"), "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        a.corpus, a.cache = tmp / "corpus.jsonl", tmp / "index"
        a.corpus.write_text("".join(json.dumps(r) + "\n" for r in wiki_rows(40)))
        a.titles = [json.loads(x)["title"] for x in a.corpus.read_text().splitlines()]
        res, counts = {}, {}
        if "build-trees" in wanted:
            res["build-trees"] = bench_stage("build-trees", topics_file(a, tmp / "topics.txt"), {}, a, tmp, env)
            print("build-trees", json.dumps(res["build-trees"]), flush=True)
        later = [s for s in STAGES[1:] if STAGES.index(s) <= max(STAGES.index(w) for w in wanted)]
        inp = extractive_trees(a, tmp, env) if later else tmp  # topic-coherent trees: their pairs pass
        for stage in later:
            counts[stage] = len(inp.read_text().splitlines())
            out, table = record(stage, inp, tmp, a, env)
            if stage == "synthesize-rubrics":  # the trees the extractive run made a pair of: a clean
                inp, out, table = paired_only(inp, out, tmp, a, env)  # replay (a rejected one is re-asked)
                counts[stage] = len(inp.read_text().splitlines())
            if stage in wanted:
                res[stage] = {"records_in": counts[stage], **bench_stage(stage, inp, table, a, tmp, env)}
                print(stage, json.dumps(res[stage]), flush=True)
            inp = out
    doc = {"latency_s": a.latency, "records": a.records, "concurrency": a.in_flight,
           "trees": {"max_depth": a.max_depth, "branching": a.branching, "retriever": "bm25"},
           "stages": res, "load_average_at_end": round(os.getloadavg()[0], 2)}
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--drive"]:
        drive(sys.argv[2:])
    else:
        raise SystemExit(main())
