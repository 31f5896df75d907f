"""A BERT sentence encoder in plain numpy: query embeddings without importing torch.

Input: a sentence-transformers model folder whose network is a BERT encoder with mean
pooling (all-MiniLM-L6-v2, the default, is one); output: the same float32 unit vectors that
sentence-transformers gives (cosine >= 0.9999 in tests/test_retrieval.py), computed with the
``tokenizers`` and ``safetensors`` packages and numpy matrix products.

Why: ``import sentence_transformers`` costs ~7 s on a small machine, more than everything else
a ``deepr search`` does. Loading this encoder costs ~0.1 s (numpy + the Rust tokenizer + a
90 MB memory-mapped weight file), and one query is a few milliseconds.

Example::

    python -c "from deepr.corpus.npbert import NumpyBert; from deepr.corpus.embed import default_model_path; \
m = NumpyBert.load(default_model_path()); print(m.encode(['a cat']).shape)"
"""

from __future__ import annotations

import json
import os
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


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    x = x - mu
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x * (w / np.sqrt(var + eps)) + b


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7): numpy has no erf, and scipy costs an import
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
               + 0.254829592) * t * np.exp(-a * a)
    return s * y


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x * np.float32(0.7071067811865476)))


_CONTROLLER = None  # threadpoolctl.ThreadpoolController, built on first use; False without threadpoolctl


def _one_blas_thread(active: bool):
    """One BLAS thread for multi-text batches: OpenBLAS workers spin while waiting, and on a
    busy machine that made a 100-passage batch ~5x slower than one thread. A single query's
    matrices are too small for OpenBLAS to thread, so it skips the threadpoolctl import."""
    import contextlib

    global _CONTROLLER
    if not active:
        return contextlib.nullcontext()
    if _CONTROLLER is None:
        try:
            from threadpoolctl import ThreadpoolController  # installed with sentence-transformers' scikit-learn
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

    def tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask), padded to the longest text of this batch."""
        return padded(self.tok.encode_batch(texts))

    def forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Mean-pooled last hidden states (not normalised), shape (batch, dim)."""
        b, n = ids.shape
        x = self._get("embeddings.word_embeddings.weight")[ids]
        x = x + self._get("embeddings.position_embeddings.weight")[:n] + self._get("embeddings.token_type_embeddings.weight")[0]
        x = _layer_norm(x, self._get("embeddings.LayerNorm.weight"), self._get("embeddings.LayerNorm.bias"), self.eps)
        h, d = self.heads, self.dim // self.heads
        bias = ((1.0 - mask) * np.float32(-1e9))[:, None, None, :]
        scale = np.float32(1.0 / np.sqrt(d))
        for L in self.layers:
            qkv = (x.reshape(b * n, -1) @ L["qkv_w"] + L["qkv_b"]).reshape(b, n, 3, h, d)
            q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3) for j in range(3))
            s = (q * scale) @ k.transpose(0, 1, 3, 2) + bias
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            ctx = (s @ v).transpose(0, 2, 1, 3).reshape(b * n, -1)
            x = _layer_norm(x + (ctx @ L["o_w"] + L["o_b"]).reshape(b, n, -1), L["ln1_w"], L["ln1_b"], self.eps)
            f = _gelu(x.reshape(b * n, -1) @ L["i_w"] + L["i_b"]) @ L["f_w"] + L["f_b"]
            x = _layer_norm(x + f.reshape(b, n, -1), L["ln2_w"], L["ln2_b"], self.eps)
        return (x * mask[:, :, None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1.0)

    def encode(self, texts: list[str], batch_size: int = 32, workers: int = 1) -> np.ndarray:
        """Unit vectors in input order; batches are formed from token-length-sorted texts to limit
        padding, and run on up to ``workers`` threads (a lone batch is split to feed two)."""
        encs = self.tok.encode_batch(texts)
        order = sorted(range(len(texts)), key=lambda i: -len(encs[i].ids))
        lengths = [len(e.ids) for e in encs]
        batches = [[order[r] for r in rows] for rows in _batches([lengths[i] for i in order], batch_size)]
        with _one_blas_thread(len(texts) > 1):
            return run_batches(encs, _spread(batches, lengths, workers), self.forward, self.dim, workers)


# A batch pads every text to its longest; a new batch starts once padding would exceed this share
# of the real tokens. Rewards embed a few texts of very different lengths per call (a 4-token
# query beside a 60-token joined node text): one batch spent about half its work on padding
# (bench/rplan_profile.py counts both).
PAD_SLACK = 1.25


def _batches(lengths: list[int], size: int) -> list[list[int]]:
    """Positions 0..n-1 of texts sorted longest first, cut into batches of at most ``size``."""
    out: list[list[int]] = []
    for i, n in enumerate(lengths):
        cur = out[-1] if out else None
        if cur and len(cur) < size and lengths[cur[0]] * (len(cur) + 1) <= PAD_SLACK * (
                sum(lengths[j] for j in cur) + n):
            cur.append(i)
        else:
            out.append([i])
    return out


def padded(encs: list) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask of tokenizer encodings, right-padded to the longest (shared
    with the ONNX encoder, which feeds the same batches)."""
    width = max(len(e.ids) for e in encs)
    ids = np.zeros((len(encs), width), dtype=np.int64)
    mask = np.zeros((len(encs), width), dtype=np.float32)
    for r, e in enumerate(encs):
        ids[r, : len(e.ids)] = e.ids
        mask[r, : len(e.ids)] = 1.0
    return ids, mask


def _spread(batches: list[list[int]], lengths: list[int], workers: int) -> list[list[int]]:
    """Split the costliest batch until every worker has one: the cached reward calls embed ~5
    new texts at a time, one batch that would leave the other cores idle. A batch (rows in
    token-length order, longest first) is cut where its two parts cost most evenly, a part
    costing its rows times its longest row's tokens: the call lasts as long as its slowest part."""
    batches = list(batches)

    def cost(rows: list[int]) -> int:
        return len(rows) * lengths[rows[0]]

    while len(batches) < workers:
        big = max(batches, key=cost, default=[])
        if len(big) < 2:
            break
        cut = min(range(1, len(big)), key=lambda k: max(cost(big[:k]), cost(big[k:])))
        batches.remove(big)
        batches += [big[:cut], big[cut:]]
    return batches


def run_batches(encs: list, batches: list[list[int]], forward, dim: int, workers: int = 1) -> np.ndarray:
    """Unit vectors, one row per encoding: ``forward(ids, mask)`` of each batch of rows, on up
    to ``workers`` threads, each running whole batches on one core. numpy's matrix products and
    onnxruntime's sessions release the GIL, and threads that block (unlike BLAS or OpenMP workers, which spin at every
    operator's barrier) cost nothing when the machine is busy: the call just takes longer."""
    out = np.empty((len(encs), dim), dtype=np.float32)

    def run(rows: list[int]) -> None:
        out[rows] = forward(*padded([encs[i] for i in rows]))

    if workers > 1 and len(batches) > 1:
        from concurrent.futures import ThreadPoolExecutor

        # longest batches first, handed out one at a time: the workers finish together
        with ThreadPoolExecutor(min(workers, len(batches)), thread_name_prefix="deepr-bert") as pool:
            list(pool.map(run, batches))
    else:
        for rows in batches:
            run(rows)
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.maximum(norms, 1e-12)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
