"""The arithmetic behind bench/throughput.py and bench/throughput_data.py: the critical-path
bound is only as good as the chains and in-flight counts read from the stub's request log; and
bench/client_floor.py's per-call CPU is only a call's if its clients really round-trip the stub."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import client_floor  # noqa: E402
from throughput import chains, in_flight  # noqa: E402
from throughput_data import with_calls  # noqa: E402


def test_calls_of_one_item_that_overlap_are_one_link_and_items_are_counted_apart():
    log = [(0.0, 0.2, "a"), (0.2, 0.4, "a"), (0.25, 0.45, "a"), (0.5, 0.7, "a"),  # 3 links
           (0.0, 0.2, "b"), (0.05, 0.25, "b")]  # 1 link, beside a's first
    assert chains(log) == {"a": 3, "b": 1}
    # a call that starts as another ends does not overlap it
    assert in_flight(log) == 3 and in_flight([(0.0, 0.2, "x"), (0.2, 0.4, "x")]) == 1


def test_the_serial_run_keeps_the_model_calls_in_flight_that_it_is_given():
    """The data bench runs one record at a time (--concurrency 1) with the model still allowed
    N calls in flight; the override must reach the stage's models by name, wherever the
    argument sits."""
    from deepr.cli import data_opts

    seen: list[int] = []
    wrapped = with_calls(_spy(data_opts.models, seen), 64)
    wrapped("extractive", None, None, None, True, 30.0, 1)
    wrapped("extractive", None, None, None, True, 30.0, concurrency=1)
    assert seen == [64, 64]


def _spy(real, seen):
    import functools
    import inspect

    @functools.wraps(real)
    def spy(*a, **kw):  # the real signature, so with_calls binds as it does on data_opts.models
        seen.append(inspect.signature(real).bind(*a, **kw).arguments["concurrency"])

    return spy


def test_client_floor_measures_each_client_over_real_calls_and_names_an_unknown_one(tmp_path, capsys):
    """Each client must really round-trip the stub (calls in flight, a reply read back), so the
    CPU per call it reports is a call's and not an empty loop's."""
    out = tmp_path / "floor.json"
    rc = client_floor.main(["--calls", "24", "--in-flight", "6", "--latency", "0.02", "--repeats", "1",
                            "--kinds", "aiohttp,deepr", "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["most_in_flight_at_stub"] >= 2
    assert set(result["cpu_ms_per_call_mean"]) == {"aiohttp", "deepr"}
    assert all(v > 0 for v in result["cpu_ms_per_call_mean"].values())
    assert result["budget_ms_per_call_at_in_flight"] == round(1000 * 0.02 / 6, 3)
    with pytest.raises(SystemExit):
        client_floor.main(["--kinds", "aiohttp,curl", "--out", str(out)])
    assert "unknown curl" in capsys.readouterr().err


def test_client_floor_chain_times_questions_in_step_against_the_critical_path(tmp_path):
    """--chain gives dag's shape (questions of dependent calls, started together); CPU after each
    reply is serialised across the questions in step, so it must show in the wall over the bound."""
    def run(work_ms: str) -> dict:
        out = tmp_path / f"chain-{work_ms}.json"
        rc = client_floor.main(["--chain", "3", "--in-flight", "4", "--latency", "0.05", "--repeats", "1",
                                "--kinds", "aiohttp", "--work-ms", work_ms, "--out", str(out)])
        assert rc == 0
        return json.loads(out.read_text())

    idle, busy = run("0"), run("25")
    assert idle["calls"] == busy["calls"] == 12 and idle["chain"] == 3
    assert idle["most_in_flight_at_stub"] >= 2
    assert 1.0 <= idle["wall_over_bound_mean"]["aiohttp"] < busy["wall_over_bound_mean"]["aiohttp"]
    # the first replies arrive together, so their 4 x 25 ms of work runs one after another: at
    # least 0.1 s on top of the 0.15 s bound (later steps overlap, the questions no longer in step)
    assert busy["runs"]["aiohttp"][0]["wall_s"] >= 0.15 + 0.1
