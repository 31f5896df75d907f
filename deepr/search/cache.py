"""Disk cache for searches and page fetches.

Each entry is one JSON file named by the SHA-256 of its key (kind, provider, query or URL,
parameters); API keys are never part of a key or a value. Writes go to a temporary file in
the same folder and are renamed into place, so two processes sharing a cache never see a
half-written entry (the last complete write wins). Modes: ``use`` (read fresh entries,
write new ones), ``refresh`` (never read, always write), ``off``, and ``replay`` (read only,
ignoring age; a miss raises :class:`CacheMiss` so a replayed run cannot silently reach the
network). Failed fetches are never stored.

Example::

    python -c "from deepr.search.cache import DiskCache; c = DiskCache('/tmp/c'); \
c.put(('search','x','q',{}), [1]); print(c.get(('search','x','q',{})))"
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("use", "refresh", "off", "replay")
_MISSING = object()


class CacheMiss(LookupError):
    """``--search-cache replay`` needed something that was never cached."""


def cache_key(parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class DiskCache:
    """JSON entries under ``root`` with a time-to-live in seconds (None = never stale)."""

    def __init__(self, root: str | Path, mode: str = "use", ttl: float | None = 7 * 86400):
        if mode not in MODES:
            raise ValueError(f"--search-cache {mode!r}: expected one of {', '.join(MODES)}")
        self.root, self.mode, self.ttl = Path(root), mode, ttl
        self.hits = self.misses = 0

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, parts: Any, default: Any = _MISSING) -> Any:
        """The cached value, or ``default`` (``None`` if not given); replay raises on a miss."""
        if self.mode in ("off", "refresh"):
            return None if default is _MISSING else default
        key = cache_key(parts)
        try:
            entry = json.loads(self._path(key).read_text(encoding="utf-8"))
            fresh = self.mode == "replay" or self.ttl is None or time.time() - entry["stored_at"] <= self.ttl
            if fresh:
                self.hits += 1
                return entry["value"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        self.misses += 1
        if self.mode == "replay":
            kind = parts[0] if isinstance(parts, (list, tuple)) and parts else "entry"
            what = parts[2] if isinstance(parts, (list, tuple)) and len(parts) > 2 else parts
            raise CacheMiss(f"--search-cache replay: no cached {kind} for {what!r} in {self.root}; "
                            "run once without replay to fill the cache")
        return None if default is _MISSING else default

    def put(self, parts: Any, value: Any) -> None:
        if self.mode in ("off", "replay"):
            return
        path = self._path(cache_key(parts))
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps({"stored_at": time.time(), "key": parts, "value": value}, ensure_ascii=False)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
