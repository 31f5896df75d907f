"""Per-passage embedding cache: a rebuild embeds only passages that are new or changed.

Input: passage texts and the embedder's name; output: their vectors, from disk where a vector
for exactly that text and model was stored before. One SQLite file per embedder name under
``<cache>/embeddings/`` maps sha256(text)[:16] to the float32 vector. Indexes built with
``deepr index`` fill it in blocks, so it is also what makes an interrupted build resume, and
``deepr index --merge`` loads the vectors of shard files into it (see deepr/corpus/shards.py).

Example::

    python -c "from deepr.corpus.embcache import EmbeddingCache; c = EmbeddingCache('/tmp/c', 'm'); \
print(len(c))"
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from deepr.corpus.sources import slugify


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where deepr caches indexes, vectors and exported embedders (``DEEPR_CACHE``, else ~/.cache/deepr)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("DEEPR_CACHE") or "~/.cache/deepr").expanduser()

LOOKUP_BATCH = 500  # SQLite allows 999 bound parameters per statement


def text_key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()[:16]


class EmbeddingCache:
    """Vectors of one embedder, keyed by text hash; safe to share between processes."""

    def __init__(self, root: str | Path, embedder_name: str):
        folder = Path(root).expanduser() / "embeddings"
        folder.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(embedder_name.encode()).hexdigest()[:8]
        self.path = folder / f"{slugify(embedder_name)[:60] or 'model'}-{digest}.sqlite"
        self.embedder_name = embedder_name
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=60, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS vec (key BLOB PRIMARY KEY, v BLOB NOT NULL)")

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM vec").fetchone()[0])

    def get(self, keys: Sequence[bytes], dim: int) -> dict[bytes, np.ndarray]:
        """Stored vectors for the keys that have one (wrong-sized rows are ignored)."""
        found: dict[bytes, np.ndarray] = {}
        with self._lock:
            for s in range(0, len(keys), LOOKUP_BATCH):
                part = list(keys[s: s + LOOKUP_BATCH])
                rows = self._db.execute(f"SELECT key, v FROM vec WHERE key IN ({','.join('?' * len(part))})", part)
                for k, v in rows:
                    vec = np.frombuffer(v, dtype=np.float32)
                    if vec.shape[0] == dim:
                        found[bytes(k)] = vec
        return found

    def put(self, keys: Sequence[bytes], vecs: np.ndarray) -> None:
        vecs = np.ascontiguousarray(vecs, dtype=np.float32)
        with self._lock, self._db:
            self._db.executemany("INSERT OR REPLACE INTO vec (key, v) VALUES (?, ?)",
                                 [(k, vecs[i].tobytes()) for i, k in enumerate(keys)])

    def close(self) -> None:
        with self._lock:
            self._db.close()
