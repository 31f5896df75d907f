"""A training cluster's processes sharing one `deepr serve-index` (issue 68's client target):
a two-process `deepr grpo --stage planner` (torchrun, gloo on CPU) and `deepr run --queries
--parallel 8` run at the same time against one server on 127.0.0.1.

The server's own query counter (``/v1/stats``, counted where the searches run) must equal the
searches the clients logged: GRPO's rollouts.jsonl (each rank logs its own rollouts) and the
run's traces. No client may build or load the index: their deepr cache stays without one.

This is bench/serve_index.py --shared-clients at its cheapest (the mini corpus, one GRPO step,
no local-corpus baseline run; ~50 s on two cores); the bench on the wiki corpus adds the peak RSS
comparison with a client that opens the index itself (bench/results/serve_index.json, "shared_clients").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)


def test_grpo_ranks_and_a_parallel_run_share_one_server_and_it_counts_every_search(retriever, mini_corpus, tmp_path):
    out = tmp_path / "clients.json"
    r = subprocess.run([sys.executable, "bench/serve_index.py", "--shared-clients", "--corpus", str(mini_corpus),
                        "--cache-dir", str(retriever.path.parents[1]), "--work", str(tmp_path / "work"),
                        "--grpo-steps", "1", "--skip-local", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["shared_clients"]
    logged, served = res["searches"]["clients_logged"], res["searches"]["server_counted"]
    # schema-constrained rollouts make the random tiny model's G0 a plan, so both clients searched
    assert logged["grpo"] > 0 and logged["run"] > 0
    assert served == logged["grpo"] + logged["run"]
    assert {"grpo rank 0", "grpo rank 1", "deepr run"} <= set(res["client_peak_rss_mb"])
    assert res["client_cache_has_index"] is False
    # the run client holds no index: less than the server process that holds it (~70 vs ~310 MB here)
    assert res["client_peak_rss_mb"]["deepr run"] < res["server_peak_rss_mb"]
    summary = res["server_log_summary"]
    assert summary.startswith("served ") and f"{served} queries" in summary
