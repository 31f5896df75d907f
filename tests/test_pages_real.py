"""Saved real-world pages (tests/pages, sources and licences in its MANIFEST.json) read through
deepr's reader from a loopback server, as ``deepr run --search ...`` reads result pages.

Targets (issue 39): at least 95 % of the hand-annotated main-text snippets kept, at most 2 % of
the boilerplate snippets (navigation, sidebars, footers, forms) leaked, and no native crash when
many readers extract at once. The page-reading benchmark (docs/benchmarks.md) measures the same on the whole set at full size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from page_set import manifest, read_pages, score, serve

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def pages() -> list[dict]:
    return manifest()


def test_the_set_is_real_licensed_and_small(pages) -> None:
    assert len(pages) >= 20 and sum(p["bytes"] for p in pages) < 5_000_000
    assert all(p["bytes"] < 200_000 and p["source"] and p["licence"] and p["url"] for p in pages)
    assert all(len(p["main"]) >= 3 and p["boilerplate"] for p in pages)
    assert len({p["layout"] for p in pages}) >= 15


def test_main_text_is_kept_and_boilerplate_left_out(pages, tmp_path) -> None:
    with serve(pages) as site:
        records = read_pages(site.port, [p["name"] for p in pages], tmp_path)
    s = score(pages, records)
    assert not s["failed"], s["failed"]
    assert s["recall"] >= 0.95, s["missed"]
    assert s["leakage"] <= 0.02, s["leaked"]


STRESS = """
import json, tempfile
from pathlib import Path
from page_set import manifest, read_pages, serve, stress
pages = [p for p in manifest() if p["name"] in {names!r}]
names = [p["name"] for p in pages]
with serve(pages) as site, tempfile.TemporaryDirectory() as d:
    alone = read_pages(site.port, names, Path(d), tag="alone")
    out = stress(site.port, names, Path(d), {passes}, {rounds}, expect=alone)
print(json.dumps(out))
"""


def test_many_concurrent_readers_never_crash_and_agree(pages) -> None:
    """20 readers at once, 3 rounds, in a child process: a native crash (SIGSEGV, SIGABRT) fails
    this test instead of killing pytest. Every concurrent read must equal the lone read. The
    smallest pages keep it to seconds; the page-reading benchmark runs the whole set."""
    names = [p["name"] for p in sorted(pages, key=lambda p: p["bytes"])[:5]]
    code = STRESS.format(names=names, passes=20, rounds=3)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=TESTS.parent, env=env)
    assert proc.returncode == 0, f"reader process ended with status {proc.returncode}: {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["errors"] == [] and out["pages_read"] == 20 * 3 * len(names)
    assert out["pages_ok"] == out["pages_read"] and out["differs"] == [], out
