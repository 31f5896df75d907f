"""A BERT sentence encoder in plain numpy: query embeddings without importing torch.

Input: a sentence-transformers model folder whose network is a BERT encoder with mean
pooling (all-MiniLM-L6-v2, the default, is one); output: the same float32 unit vectors that
sentence-transformers gives (cosine >= 0.9999 in tests/test_retrieval.py), computed with the
``tokenizers`` and ``safetensors`` packages and numpy matrix products.

Why: ``import sentence_transformers`` costs ~7 s on a small machine, more than everything else
a ``deepr search`` does. Loading this encoder costs ~0.1 s (numpy + the Rust tokenizer + a
90 MB memory-mapped weight file), and one query is a few milliseconds.

Speed: rewards and eval send calls of a few to a few hundred texts, so on a CPU in fp32 every
call but an index's passages comes here (deepr/corpus/embed.py). A call's texts are shared
out by tokens among one thread per core; each thread packs its texts into one pass with no
padding, in scratch arrays it keeps, and numpy's BLAS runs one thread under each of them.
That made reward calls ~2x faster than padded batches in fresh arrays, and faster than torch
at every call size measured (docs/benchmarks.md: embedder calls).

Example::

    python -c "from deepr.corpus.npbert import NumpyBert; from deepr.corpus.embed import default_model_path; \
m = NumpyBert.load(default_model_path()); print(m.encode(['a cat']).shape)"
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
from pathlib import Path

import numpy as np


class Unsupported(Exception):
    """The model folder is not a mean-pooled BERT with safetensors weights and tokenizer.json."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def check_folder(folder: Path) -> dict:
    """The model's config if this encoder can run it, else raise Unsupported with the reason."""
    cfg = _read_json(folder / "config.json")
    if cfg.get("model_type") != "bert" or cfg.get("hidden_act", "gelu") != "gelu":
        raise Unsupported(f"{folder}: not a gelu BERT model")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise Unsupported(f"{folder}: relative position embeddings")
    modules = _read_json(folder / "modules.json")
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules] if isinstance(modules, list) else []
    if kinds[:2] != ["Transformer", "Pooling"] or any(k not in ("Transformer", "Pooling", "Normalize") for k in kinds):
        raise Unsupported(f"{folder}: modules {kinds} (expected Transformer, Pooling[, Normalize])")
    pool_dir = next(m.get("path", "") for m in modules if m.get("type", "").endswith("Pooling"))
    pool = _read_json(folder / pool_dir / "config.json")
    if not pool.get("pooling_mode_mean_tokens") or any(
            pool.get(k) for k in ("pooling_mode_cls_token", "pooling_mode_max_tokens",
                                  "pooling_mode_mean_sqrt_len_tokens")):
        raise Unsupported(f"{folder}: pooling is not plain mean pooling")
    for name in ("model.safetensors", "tokenizer.json"):
        if not (folder / name).is_file():
            raise Unsupported(f"{folder}: no {name}")
    return cfg


_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "F64": np.float64}


def map_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a .safetensors file as read-only memory maps (no copy of the 90 MB file).

    The format is an 8-byte little-endian header size, a JSON header of name -> dtype, shape
    and byte offsets, then the raw data.
    """
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size)
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] not in _DTYPES:
            raise Unsupported(f"{path}: tensor {name} has dtype {t['dtype']}")
        start, end = t["data_offsets"]
        out[name] = raw[start:end].view(_DTYPES[t["dtype"]]).reshape(t["shape"])
    return out


# Rows (tokens) of one forward pass. Bounds a worker thread's scratch arrays (about 11 MB, plus
# the feed-forward's 6 MB) whatever a call holds; one text has at most 512 tokens.
MAX_ROWS = 1024
# The feed-forward runs in chunks of this many rows: its activations are 4x as wide.
FFN_ROWS = 256
# A pass's rows are padded to a multiple of 4: on this machine's OpenBLAS, single-thread sgemm
# of 23 rows by 384x1536 ran at 78 GFLOPS against 108 at 24 rows (31 vs 32: 88 vs 112).
ROW_ALIGN = 4
# Worker threads at most: a call under 64 texts gains nothing past a few, and each thread keeps
# its scratch arrays (~20 MB at most) for the life of the process.
MAX_THREADS = 8

_ERF = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)  # Abramowitz & Stegun 7.1.26


class _Scratch(threading.local):
    """A thread's scratch arrays by name, grown on demand and kept. Allocating the ~20
    temporaries of every layer instead made glibc map and fault in fresh pages on each call:
    the same reward calls took 7.4 s against 5.3 s with malloc's trim and mmap thresholds
    raised (MALLOC_TOP_PAD_), depending on what the process had freed before."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        size = math.prod(shape)
        buf = self.arrays.get(name)
        if buf is None or buf.size < size:
            buf = self.arrays[name] = np.empty(size, dtype=np.float32)
        return buf[:size].reshape(shape)


_SCRATCH = _Scratch()


def _layer_norm_(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float, tmp: np.ndarray) -> None:
    """Layer norm over the last axis, in place; ``tmp`` is scratch of x's shape."""
    x -= x.mean(-1, keepdims=True)
    np.multiply(x, x, out=tmp)
    std = tmp.mean(-1, keepdims=True)
    std += eps
    np.sqrt(std, out=std)
    x /= std
    x *= w
    x += b


def _gelu_(x: np.ndarray, t1: np.ndarray, t2: np.ndarray, t3: np.ndarray) -> None:
    """Exact (erf) GELU in place, ``t1``-``t3`` scratch of x's shape. x*erf(x/sqrt2) is even, so
    gelu(x) = (x + |x| erf(|x|/sqrt2)) / 2 needs erf at u >= 0 only, where A&S 7.1.26 is
    1 - poly(1/(1+p u)) exp(-u^2) (|error| < 1.5e-7; numpy has no erf, scipy costs an import)."""
    np.abs(x, out=t1)
    t1 *= np.float32(0.7071067811865476)
    np.multiply(t1, t1, out=t2)
    np.negative(t2, out=t2)
    np.exp(t2, out=t2)
    t1 *= np.float32(0.3275911)
    t1 += np.float32(1.0)
    np.reciprocal(t1, out=t1)
    np.multiply(t1, np.float32(_ERF[4]), out=t3)
    for a in _ERF[3::-1]:
        t3 += np.float32(a)
        t3 *= t1
    t3 *= t2
    np.subtract(np.float32(1.0), t3, out=t3)
    np.abs(x, out=t1)
    t1 *= t3
    x += t1
    x *= np.float32(0.5)


def _pin_numpy_blas() -> bool:
    """Give numpy's own BLAS one thread for the rest of the process (from the first call that
    runs shares side by side); False where it cannot be told apart from other BLAS libraries,
    or threadpoolctl is missing.

    The encoder's threads each run whole passes, and OpenBLAS workers on top of them spin at
    every product: on a busy machine a 100-passage batch took ~5x one thread's time. Limiting
    around each call instead cost ~5 ms a call, as OpenBLAS restarts its workers when given
    back two: 0.3 s of the 1.4 s that R_plan's cached reward calls took (docs/experiments.md). Only
    numpy's copy is pinned: faiss ships its own, for its searches and k-means."""
    mine = numpy_blas()
    for lib in mine:
        lib.set_num_threads(1)
    return bool(mine)


def numpy_blas() -> list:
    """threadpoolctl's controllers of the BLAS libraries numpy ships (none without threadpoolctl)."""
    try:
        from threadpoolctl import ThreadpoolController  # installed with sentence-transformers' scikit-learn
    except ImportError:
        return []
    root = Path(np.__file__).resolve().parent
    homes = (root, root / ".libs", root / ".dylibs", root.with_name("numpy.libs"))
    return [lib for lib in ThreadpoolController().lib_controllers
            if lib.user_api == "blas" and Path(lib.filepath).resolve().parent in homes]


_CONTROLLER = None  # threadpoolctl.ThreadpoolController, built on first use; False without threadpoolctl


def _one_blas_thread(active: bool):
    """One BLAS thread during a multi-text call, where numpy's BLAS could not be pinned."""
    import contextlib

    global _CONTROLLER
    if not active:
        return contextlib.nullcontext()
    if _CONTROLLER is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _CONTROLLER = False
        else:
            # found once: threadpool_limits() rescans every loaded library on each call
            # (~1.8 ms with torch loaded, as long as a reward's whole cached call)
            _CONTROLLER = ThreadpoolController()
    if _CONTROLLER is False:
        return contextlib.nullcontext()
    return _CONTROLLER.limit(limits=1, user_api="blas")


class NumpyBert:
    """Tokenise, run the BERT layers, mean-pool, L2-normalise: all on the CPU in float32."""

    def __init__(self, weights: dict[str, np.ndarray], cfg: dict, tokenizer, max_seq_length: int):
        self.cfg, self.tok, self.max_seq_length = cfg, tokenizer, max_seq_length
        self.heads = int(cfg["num_attention_heads"])
        self.eps = float(cfg.get("layer_norm_eps", 1e-12))
        self.dim = int(cfg["hidden_size"])
        self.w = {k: v for k, v in weights.items()}
        n = int(cfg["num_hidden_layers"])
        # one fused (in, 3*out) matrix for q, k, v: one matrix product instead of three
        self.layers = []
        for i in range(n):
            p = f"encoder.layer.{i}."
            g = lambda k: self._get(p + k)  # noqa: E731
            qkv_w = np.concatenate([g(f"attention.self.{x}.weight") for x in ("query", "key", "value")]).T
            qkv_b = np.concatenate([g(f"attention.self.{x}.bias") for x in ("query", "key", "value")])
            self.layers.append({
                "qkv_w": np.ascontiguousarray(qkv_w), "qkv_b": qkv_b,
                "o_w": np.ascontiguousarray(g("attention.output.dense.weight").T), "o_b": g("attention.output.dense.bias"),
                "ln1_w": g("attention.output.LayerNorm.weight"), "ln1_b": g("attention.output.LayerNorm.bias"),
                "i_w": np.ascontiguousarray(g("intermediate.dense.weight").T), "i_b": g("intermediate.dense.bias"),
                "f_w": np.ascontiguousarray(g("output.dense.weight").T), "f_b": g("output.dense.bias"),
                "ln2_w": g("output.LayerNorm.weight"), "ln2_b": g("output.LayerNorm.bias"),
            })
        self.word_emb = self._get("embeddings.word_embeddings.weight")
        # every token has type 0: its embedding folds into the position table
        self.pos_emb = self._get("embeddings.position_embeddings.weight") + self._get(
            "embeddings.token_type_embeddings.weight")[0]
        self.emb_ln = self._get("embeddings.LayerNorm.weight"), self._get("embeddings.LayerNorm.bias")

    def _get(self, key: str) -> np.ndarray:
        for k in (key, "bert." + key):
            if k in self.w:
                return self.w[k].astype(np.float32, copy=False)
        raise Unsupported(f"weight {key!r} missing from model.safetensors")

    @classmethod
    def load(cls, folder: str | Path, max_seq_length: int | None = None) -> NumpyBert:
        from tokenizers import Tokenizer

        folder = Path(folder)
        cfg = check_folder(folder)
        st_cfg = _read_json(folder / "sentence_bert_config.json")
        seq = int(max_seq_length or st_cfg.get("max_seq_length") or cfg.get("max_position_embeddings", 512))
        seq = min(seq, int(cfg.get("max_position_embeddings", 512)))
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.no_padding()
        tok.enable_truncation(max_length=seq)
        return cls(map_safetensors(folder / "model.safetensors"), cfg, tok, seq)

    def forward(self, seqs: list[list[int]]) -> np.ndarray:
        """Mean-pooled last hidden states (not normalised) of token id lists, shape (len(seqs), dim).

        The texts' tokens are packed one after another, with no padding: every operation but
        attention works row by row, so the matrix products see all the call's rows at once, and
        attention runs text by text. Arrays come from the thread's scratch, not fresh allocations.
        """
        lens = [len(q) for q in seqs]
        real = sum(lens)
        rows = -(-real // ROW_ALIGN) * ROW_ALIGN
        offs = np.cumsum([0, *lens])
        ids = np.zeros(rows, dtype=np.int64)
        ids[:real] = list(itertools.chain.from_iterable(seqs))
        pos = np.zeros(rows, dtype=np.int64)
        pos[:real] = np.arange(real) - np.repeat(offs[:-1], lens)
        x, y, tmp = (_SCRATCH.get(k, (rows, self.dim)) for k in ("x", "y", "tmp"))
        qkv, ctx = _SCRATCH.get("qkv", (rows, 3 * self.dim)), _SCRATCH.get("ctx", (rows, self.dim))
        ctx[real:] = 0.0  # the alignment rows: attention never writes them
        np.take(self.word_emb, ids, axis=0, out=x)
        np.take(self.pos_emb, pos, axis=0, out=tmp)
        x += tmp
        _layer_norm_(x, *self.emb_ln, self.eps, tmp)
        for L in self.layers:
            np.matmul(x, L["qkv_w"], out=qkv)
            qkv += L["qkv_b"]
            self._attention(qkv, ctx, offs[:-1], lens)
            np.matmul(ctx, L["o_w"], out=y)
            y += L["o_b"]
            y += x
            _layer_norm_(y, L["ln1_w"], L["ln1_b"], self.eps, tmp)
            self._feed_forward(y, x, L)  # x = y + ffn(y)
            _layer_norm_(x, L["ln2_w"], L["ln2_b"], self.eps, tmp)
        return np.add.reduceat(x[:real], offs[:-1], axis=0) / np.asarray(lens, dtype=np.float32)[:, None]

    def _attention(self, qkv: np.ndarray, ctx: np.ndarray, starts: np.ndarray, lens: list[int]) -> None:
        """Each text's rows of ``ctx`` from its own rows of ``qkv`` (no mask: no padding)."""
        h, d = self.heads, self.dim // self.heads
        q3 = qkv.reshape(-1, 3, h, d)
        scale = np.float32(1.0 / math.sqrt(d))
        for o, n in zip(starts, lens):
            block = q3[o:o + n]
            s = _SCRATCH.get("scores", (h, n, n))
            np.matmul(block[:, 0].transpose(1, 0, 2), block[:, 1].transpose(1, 2, 0), out=s)
            s *= scale
            s -= s.max(-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(-1, keepdims=True)
            c = _SCRATCH.get("heads", (h, n, d))
            np.matmul(s, block[:, 2].transpose(1, 0, 2), out=c)
            ctx[o:o + n].reshape(n, h, d)[:] = c.transpose(1, 0, 2)

    def _feed_forward(self, x: np.ndarray, out: np.ndarray, L: dict) -> None:
        """out = x + W2 gelu(W1 x + b1) + b2, FFN_ROWS rows at a time."""
        inner = L["i_w"].shape[1]
        for r in range(0, len(x), FFN_ROWS):
            xs, os_ = x[r:r + FFN_ROWS], out[r:r + FFN_ROWS]
            f, t1, t2, t3 = (_SCRATCH.get(k, (len(xs), inner)) for k in ("ffn", "t1", "t2", "t3"))
            np.matmul(xs, L["i_w"], out=f)
            f += L["i_b"]
            _gelu_(f, t1, t2, t3)
            np.matmul(f, L["f_w"], out=os_)
            os_ += L["f_b"]
            os_ += xs

    def encode(self, texts: list[str], workers: int = 1) -> np.ndarray:
        """Unit vectors in input order. The texts are shared out among up to ``workers`` threads
        (each thread's share packed into passes of at most MAX_ROWS rows)."""
        if not texts:
            return np.empty((0, self.dim), dtype=np.float32)
        seqs = [e.ids for e in self.tok.encode_batch(texts)]
        out = np.empty((len(texts), self.dim), dtype=np.float32)

        def run(part: list[int]) -> None:
            out[part] = self.forward([seqs[i] for i in part])

        parts = _parts([len(q) for q in seqs], workers)
        # a lone share leaves OpenBLAS the idle cores (one 10-token query: 4.5 ms on two BLAS
        # threads, 5.4 ms on one) and a query-only process without the threadpoolctl import
        with _one_blas_thread(len(parts) > 1 and not _blas_pinned()):
            # the pool's threads run even a lone pass: their scratch arrays outlive the call
            list(_pool().map(run, parts))
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


def _parts(lengths: list[int], workers: int) -> list[list[int]]:
    """Text positions shared out among ``workers`` threads by tokens, longest first to the least
    loaded (a call's cost is its busiest thread's), each share cut into passes of <= MAX_ROWS."""
    shares: list[list[int]] = [[] for _ in range(max(1, min(workers, MAX_THREADS, len(lengths))))]
    load = [0] * len(shares)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = load.index(min(load))
        shares[k].append(i)
        load[k] += lengths[i]
    out = []
    for share in shares:
        out.append([])
        rows = 0
        for i in share:
            if out[-1] and rows + lengths[i] > MAX_ROWS:
                out.append([])
                rows = 0
            out[-1].append(i)
            rows += lengths[i]
    return out


_POOL = None  # the encoder's worker threads, started on first use
_BLAS_PINNED: bool | None = None  # None until a call first runs shares side by side


def _pool():
    from concurrent.futures import ThreadPoolExecutor

    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(min(usable_cores(), MAX_THREADS), thread_name_prefix="deepr-bert")
    return _POOL


def _blas_pinned() -> bool:
    global _BLAS_PINNED
    if _BLAS_PINNED is None:
        _BLAS_PINNED = _pin_numpy_blas()
    return _BLAS_PINNED


def _forget_pool() -> None:
    global _POOL
    _POOL = None  # a forked child has none of the parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
