"""Disk cache of LLM replies: one sqlite file, keyed by the full request.

The key is the sha256 of the canonical JSON of everything that shapes a reply (backend,
model, base URL, messages, sampling settings, seed, ...). Credentials are never part of
the request dict a caller passes, and :func:`request_key` refuses one that has them, so
neither keys nor rows can carry an API key. Only successful replies are stored.

Default location: ``$DEEPR_CACHE/llm.sqlite``, else ``~/.cache/deepr/llm.sqlite``.
The file is in WAL mode, so several processes (shards) can read and write it at once;
inside a process one connection is shared behind a lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

# Substrings of field names that would put a credential into the cache ("max_tokens" is fine).
_FORBIDDEN = ("api_key", "apikey", "authorization", "access_token", "secret", "password")


def default_cache_path() -> Path:
    root = os.environ.get("DEEPR_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "deepr"
    return base / "llm.sqlite"


def request_key(request: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of ``request``; refuses credential-looking fields."""
    bad = [k for k in request if any(m in k.lower() for m in _FORBIDDEN)]
    if bad:
        raise ValueError(f"cache key must not contain credentials (fields {bad}); drop them from the request")
    canon = json.dumps(request, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


class LLMCache:
    """get/put of reply text + token usage by request; safe across threads and processes."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_cache_path()
        if self.path.is_dir():
            self.path = self.path / "llm.sqlite"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30.0,
                                         isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, request TEXT NOT NULL,"
                " reply TEXT NOT NULL, prompt_tokens INTEGER, completion_tokens INTEGER,"
                " created REAL NOT NULL, flags TEXT)")
            columns = {row[1] for row in self._conn.execute("PRAGMA table_info(replies)")}
            if "flags" not in columns:  # a cache file written before replies carried flags
                self._conn.execute("ALTER TABLE replies ADD COLUMN flags TEXT")
        except sqlite3.Error as e:
            raise ValueError(f"cannot open the LLM cache at {self.path} ({e}); pass another cache_dir, "
                             "set DEEPR_CACHE, or turn the cache off (--no-cache)") from None
        self._lock = threading.Lock()

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"the LLM cache {self.path} was closed; create a new LLMCache to use it again")
        return self._conn

    def get(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """The stored ``{"reply", "prompt_tokens", "completion_tokens", "flags"}`` or None
        (``flags``: what the backend knew of the reply, e.g. constrained / truncated)."""
        key = request_key(request)
        with self._lock:
            row = self._db().execute(
                "SELECT reply, prompt_tokens, completion_tokens, flags FROM replies WHERE key = ?", (key,)
            ).fetchone()
        if row is None:
            return None
        return {"reply": row[0], "prompt_tokens": row[1] or 0, "completion_tokens": row[2] or 0,
                "flags": json.loads(row[3]) if row[3] else {}}

    def put(self, request: dict[str, Any], reply: str, *, prompt_tokens: int = 0,
            completion_tokens: int = 0, flags: dict[str, Any] | None = None) -> None:
        key = request_key(request)
        canon = json.dumps(request, sort_keys=True, ensure_ascii=False)
        with self._lock:
            self._db().execute(
                "INSERT OR REPLACE INTO replies (key, request, reply, prompt_tokens, completion_tokens, created,"
                " flags) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (key, canon, reply, prompt_tokens, completion_tokens, time.time(),
                 json.dumps(flags) if flags else None))

    def __len__(self) -> int:
        with self._lock:
            return int(self._db().execute("SELECT COUNT(*) FROM replies").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LLMCache({str(self.path)!r})"
