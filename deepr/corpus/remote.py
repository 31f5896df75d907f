"""A corpus searched through ``deepr serve-index``: ``--corpus http://HOST:PORT`` in every command.

Input: the server's URL; output: a retriever with the local index's interface (``search``,
``search_many``, ``get_document``, ``get_passage``, ``documents``, ``embedder``, ``describe``),
so ResearchTools, the data stages and the training environments use it unchanged. Hits,
passage ids and documents are the server's own, so citations and traces are the same as with
the corpus opened locally; the embedder is the server's too (``/v1/embed``).

A server that cannot be reached when the corpus is opened is a one-line error (exit 2);
a request that fails later is retried (connection errors and 5xx, with back-off), then raises
:class:`CorpusUnavailable`, and so does every later request at once: the command stops (its
finished records kept, see deepr/cli/app.py) instead of waiting out retries per search.

Example::

    deepr serve-index --corpus wiki --port 8000 &
    deepr search "Mona Lisa painter" --corpus http://127.0.0.1:8000
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from deepr.records import Document, Hit, Passage

RETRIES = 3


class CorpusUnavailable(ConnectionError):
    """The retrieval server or Milvus could not be reached, or failed a request after retries."""


def is_remote(spec: Any) -> bool:
    return isinstance(spec, str) and spec.strip().lower().startswith(("http://", "https://"))


class RemoteEmbedder:
    """The server's embedder: ``encode`` returns the vectors the server's own model gives."""

    def __init__(self, remote: RemoteRetriever, name: str, dim: int | None):
        self._remote, self.name, self._dim = remote, name, dim

    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = int(self.encode(["dimension"]).shape[1])
        return self._dim

    def encode(self, texts: Sequence[str] | str, **_: Any) -> np.ndarray:
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts:
            return np.zeros((0, self._dim or 1), dtype=np.float32)
        data = self._remote._call("POST", "/v1/embed", {"texts": texts})
        return np.asarray(data["vectors"], dtype=np.float32)


class RemoteDocuments:
    """The server's documents: sampled there (``sample_topics``), or read page by page."""

    PAGE = 1000

    def __init__(self, remote: RemoteRetriever, count: int):
        self._remote, self._count = remote, count

    def __len__(self) -> int:
        return self._count

    def sample_topics(self, n: int, seed: int = 0, min_words: int = 30) -> list[dict[str, Any]]:
        """build-trees' seed topics, sampled by the server over all its documents."""
        return self._remote._call("POST", "/v1/seeds", {"n": n, "seed": seed, "min_words": min_words})["topics"]

    def __iter__(self) -> Iterator[Document]:
        raise TypeError("a remote corpus's documents are not listed one by one; sample seed topics "
                        "with sample_topics() (build-trees does) or read a document by id")


class RemoteRetriever:
    """Search and read a corpus served by ``deepr serve-index`` at ``url``."""

    def __init__(self, url: str, *, mode: str | None = None, timeout: float = 120.0):
        import httpx

        self.url = url.strip().rstrip("/")
        self._client = httpx.Client(base_url=self.url, timeout=timeout, trust_env=False)
        self._down: str | None = None  # why the server stopped answering, once it has
        info = self._call("GET", "/v1/stats", retries=1)
        self.info = info
        self.corpus_name = f"{info.get('corpus')}@{self.url}"
        self.mode = mode or info.get("mode") or "hybrid"
        if self.mode not in ("dense", "bm25", "hybrid"):
            raise ValueError(f"--retriever {self.mode!r}: expected one of dense, bm25, hybrid")
        from deepr.corpus.index import FusionConfig

        self.fusion = FusionConfig(**info["fusion"]) if info.get("fusion") else FusionConfig()
        self.embedder = RemoteEmbedder(self, str(info.get("embedder")), info.get("embedder_dim"))
        self.documents = RemoteDocuments(self, int(info.get("documents") or 0))
        self.path, self.built, self.build_seconds = None, False, 0.0

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, *, retries: int = RETRIES) -> Any:
        import httpx

        if self._down:
            raise CorpusUnavailable(self._down)
        last = ""
        for attempt in range(retries):
            try:
                r = self._client.request(method, path, json=body)
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code < 500:
                    return self._answer(r, path)
                last = f"HTTP {r.status_code}"
            if attempt + 1 < retries:
                time.sleep(0.5 * 2 ** attempt)
        self._down = (f"retrieval server {self.url}: {path} failed ({last}); is `deepr serve-index` "
                      "running there?")
        raise CorpusUnavailable(self._down)

    def _answer(self, r: Any, path: str) -> Any:
        try:
            data = r.json()
        except ValueError:
            data = None
        if r.status_code == 404 and isinstance(data, dict) and "error" in data:
            from deepr.corpus.index import UnknownIdError

            raise UnknownIdError(data["error"])
        if r.status_code >= 400:
            why = data.get("error") if isinstance(data, dict) else r.text[:200]
            if r.status_code == 404:
                raise CorpusUnavailable(f"{self.url}{path}: not found; is this a `deepr serve-index` server?")
            raise ValueError(f"retrieval server {self.url}: {why}")
        if data is None:
            raise CorpusUnavailable(f"{self.url}{path}: the answer is not JSON")
        return data

    def search(self, query: str, k: int = 5, mode: str | None = None) -> list[Hit]:
        return self.search_many([query], k, mode)[0]

    def search_many(self, queries: Sequence[str], k: int = 5, mode: str | None = None) -> list[list[Hit]]:
        """Ranked hits per query, as the server's index ranks them; blank queries get []."""
        if k < 1:
            raise ValueError(f"k={k}: ask for at least one result")
        live = [i for i, q in enumerate(queries) if isinstance(q, str) and q.strip()]
        out: list[list[Hit]] = [[] for _ in queries]
        if live:
            data = self._call("POST", "/v1/search", {"queries": [queries[i] for i in live], "k": k,
                                                     "mode": mode or self.mode})
            for i, hits in zip(live, data["hits"]):
                out[i] = [Hit.model_construct(**h) for h in hits]
        return out

    def get_document(self, doc_id: str) -> Document:
        from urllib.parse import quote

        return Document(**self._call("GET", "/v1/document/" + quote(doc_id, safe="")))

    def get_passage(self, pid: str) -> Passage:
        from urllib.parse import quote

        return Passage(**self._call("GET", "/v1/passage/" + quote(pid, safe="")))

    def describe(self) -> dict[str, Any]:
        """What the server said of its corpus when it was opened: a stage's sidecar is written even
        after the server went away (asking again there would replace the stage's error with its own)."""
        info = {k: v for k, v in self.info.items() if k not in ("fusion", "served")}
        return {**info, "mode": self.mode, "server": self.url}

    def close(self) -> None:
        self._client.close()

    def __getstate__(self) -> dict[str, Any]:  # worker processes reconnect on their own
        state = dict(self.__dict__)
        state.pop("_client", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        import httpx

        self.__dict__.update(state)
        self._client = httpx.Client(base_url=self.url, timeout=120.0, trust_env=False)
