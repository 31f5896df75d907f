"""The index-build encoder on onnxruntime: the BERT of deepr/corpus/npbert.py as an ONNX graph.

Input: a mean-pooled BERT sentence-transformers folder (all-MiniLM-L6-v2, the default); output:
float32 unit vectors, the same as sentence-transformers' (fp32: cosine >= 0.999, tested in
tests/test_retrieval.py) or from int8 weights (``quantize=True``: dynamic quantisation, faster,
cosine ~0.99; its retrieval recall is in docs/benchmarks.md).

Why: embedding the corpus is almost all of an index build. With int8 weights this runs in
0.43x the CPU time of torch bf16 (as fast as torch's own int8, with vectors much closer to
float32: cosine 0.992 vs 0.972 at worst; docs/benchmarks.md), and the graph is
built here from the model's own safetensors weights, so there is no torch export step, no
torch import, and nothing extra to download. In float32 it is no faster than torch, so deepr
uses it for int8 only. Needs the ``onnx`` extra (onnxruntime + onnx); without it deepr falls
back to the torch encoder.

Example::

    python -c "from deepr.corpus.onnxbert import OnnxBert; from deepr.corpus.embed import default_model_path; \
m = OnnxBert.load(default_model_path()); print(m.encode(['a cat']).shape)"
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from deepr.corpus.npbert import NumpyBert, usable_cores

OPSET = 17  # LayerNormalization is a standard op from 17 on
# Texts per onnxruntime call: the int8 MatMuls quantise their input per call and the
# feed-forward layer's activations of 16 x ~100 tokens x 1536 floats nearly fit a core's L2;
# 64-text batches cost ~15 % more CPU per wiki passage (224 wiki passages: 5.71 CPU s at 64, 4.95 at 16)
BATCH = 16


def available() -> bool:
    """True when onnxruntime and onnx import (the ``onnx`` extra is installed)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx"))


class _Graph:
    """A small helper that names nodes and initializers as they are added."""

    def __init__(self):
        from onnx import helper, numpy_helper

        self.h, self.nh = helper, numpy_helper
        self.nodes: list = []
        self.inits: list = []
        self.n = 0

    def const(self, arr: np.ndarray, name: str | None = None) -> str:
        self.n += 1
        name = name or f"c{self.n}"
        self.inits.append(self.nh.from_array(np.asarray(arr, order="C"), name))  # keeps 0-d arrays 0-d
        return name

    def op(self, kind: str, *inputs: str, **attrs: Any) -> str:
        self.n += 1
        out = f"{kind.lower()}{self.n}"
        self.nodes.append(self.h.make_node(kind, list(inputs), [out], **attrs))
        return out

    def ms(self, kind: str, *inputs: str, **attrs: Any) -> str:
        """onnxruntime's own fused kernels (com.microsoft domain)."""
        return self.op(kind, *inputs, domain="com.microsoft", **attrs)


def build_model(bert: NumpyBert, fused: bool = True):
    """The encoder as an ONNX ModelProto: (input_ids int64 [B,N], attention_mask float [B,N])
    -> mean-pooled hidden states float [B,D] (not normalised), the maths of NumpyBert.forward."""
    from onnx import TensorProto, helper

    g = _Graph()
    h, dim = bert.heads, bert.dim
    d = dim // h
    scale = np.float32(1.0 / np.sqrt(d))
    i64 = lambda *v: g.const(np.array(v, dtype=np.int64))  # noqa: E731
    f32 = lambda v: g.const(np.array(v, dtype=np.float32))  # noqa: E731

    def ln(x: str, w: np.ndarray, b: np.ndarray) -> str:
        return g.op("LayerNormalization", x, g.const(w), g.const(b), axis=-1, epsilon=bert.eps)

    def dense(x: str, w: np.ndarray, b: np.ndarray) -> str:
        return g.op("Add", g.op("MatMul", x, g.const(w)), g.const(b))

    n_len = g.op("Slice", g.op("Shape", "input_ids"), i64(1), i64(2))
    pos = g.op("Slice", g.const(bert._get("embeddings.position_embeddings.weight")), i64(0), n_len, i64(0))
    x = g.op("Add", g.op("Gather", g.const(bert._get("embeddings.word_embeddings.weight")), "input_ids"), pos)
    x = g.op("Add", x, g.const(bert._get("embeddings.token_type_embeddings.weight")[0]))
    x = ln(x, bert._get("embeddings.LayerNorm.weight"), bert._get("embeddings.LayerNorm.bias"))
    # additive mask [B,1,1,N]: 0 on tokens, -1e9 on padding
    bias = g.op("Unsqueeze", g.op("Mul", g.op("Sub", f32(1.0), "attention_mask"), f32(-1e9)), i64(1, 2))
    mask32 = g.op("Cast", "attention_mask", to=TensorProto.INT32)
    for L in bert.layers:
        if fused:
            x = _fused_layer(g, x, mask32, L, h, bert.eps)
            continue
        w, b = L["qkv_w"].copy(), L["qkv_b"].copy()
        w[:, :dim] *= scale  # fold the 1/sqrt(d) into the query projection
        b[:dim] *= scale
        qkv = g.op("Transpose", g.op("Reshape", dense(x, w, b), i64(0, 0, 3, h, d)), perm=[2, 0, 3, 1, 4])
        q, k, v = (g.op("Gather", qkv, g.const(np.array(j, dtype=np.int64)), axis=0) for j in range(3))  # each [B,h,N,d]
        s = g.op("Softmax", g.op("Add", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), bias), axis=-1)
        ctx = g.op("Reshape", g.op("Transpose", g.op("MatMul", s, v), perm=[0, 2, 1, 3]), i64(0, 0, dim))
        x = ln(g.op("Add", x, dense(ctx, L["o_w"], L["o_b"])), L["ln1_w"], L["ln1_b"])
        f = dense(x, L["i_w"], L["i_b"])
        f = g.op("Mul", g.op("Mul", f, f32(0.5)), g.op("Add", f32(1.0), g.op("Erf", g.op("Mul", f, f32(1 / np.sqrt(2))))))
        x = ln(g.op("Add", x, dense(f, L["f_w"], L["f_b"])), L["ln2_w"], L["ln2_b"])
    m3 = g.op("Unsqueeze", "attention_mask", i64(2))
    summed = g.op("ReduceSum", g.op("Mul", x, m3), i64(1), keepdims=0)
    count = g.op("Max", g.op("ReduceSum", "attention_mask", i64(1), keepdims=1), f32(1.0))
    g.nodes.append(helper.make_node("Div", [summed, count], ["pooled"]))
    graph = helper.make_graph(
        g.nodes, "deepr_bert",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", dim])], g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)], producer_name="deepr")


def _fused_layer(g: _Graph, x: str, mask32: str, L: dict, heads: int, eps: float) -> str:
    """One BERT layer from onnxruntime's fused ops: Attention (qkv projection, masked softmax,
    context), SkipLayerNormalization (residual + bias + LayerNorm) and BiasGelu."""
    ctx = g.ms("Attention", x, g.const(L["qkv_w"]), g.const(L["qkv_b"]), mask32, num_heads=heads)
    x = g.ms("SkipLayerNormalization", g.op("MatMul", ctx, g.const(L["o_w"])), x, g.const(L["ln1_w"]),
             g.const(L["ln1_b"]), g.const(L["o_b"]), epsilon=eps)
    f = g.ms("BiasGelu", g.op("MatMul", x, g.const(L["i_w"])), g.const(L["i_b"]))
    return g.ms("SkipLayerNormalization", g.op("MatMul", f, g.const(L["f_w"])), x, g.const(L["ln2_w"]),
                g.const(L["ln2_b"]), g.const(L["f_b"]), epsilon=eps)


def _session(model_bytes: bytes, threads: int, spin: bool = False):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    # Idle worker threads sleep instead of spinning: with another process on the cores, spinning
    # cost ~20 % more CPU and more wall time (docs/benchmarks.md: index build, "onnx int8, spinning")
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    opts.log_severity_level = 3  # no warnings about unused initializers on stderr
    return ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])


def _quantised(model) -> bytes:
    """int8 weights for every MatMul with a constant operand (per output channel)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    # its advice to run onnxruntime's pre-processing first is for exported graphs; this one is built lean
    hush = lambda rec: not rec.getMessage().startswith("Please consider to run pre-processing")  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="deepr-onnx-") as tmp, _filtered(root, hush):
        src, dst = Path(tmp, "fp32.onnx"), Path(tmp, "int8.onnx")
        onnx.save(model, src)
        # the fused ops' outputs have no inferred type; they are all float
        quantize_dynamic(src, dst, per_channel=True, weight_type=QuantType.QInt8,
                         op_types_to_quantize=["MatMul", "Attention"],
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        return dst.read_bytes()


@contextlib.contextmanager
def _filtered(logger: logging.Logger, keep: Callable[[logging.LogRecord], bool]) -> Iterator[None]:
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def padded(encs: list) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask of tokenizer encodings, right-padded to the longest."""
    width = max(len(e.ids) for e in encs)
    ids = np.zeros((len(encs), width), dtype=np.int64)
    mask = np.zeros((len(encs), width), dtype=np.float32)
    for r, e in enumerate(encs):
        ids[r, : len(e.ids)] = e.ids
        mask[r, : len(e.ids)] = 1.0
    return ids, mask


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


class OnnxBert:
    """NumpyBert's tokeniser and weights, run by onnxruntime; ``encode`` as NumpyBert.encode.

    ``threads`` worker threads each run whole batches on one core (onnxruntime releases the
    GIL and a session may be run from several threads at once), instead of one batch split
    over the cores operator by operator: the small matrices of a 16-text batch left the
    split workers waiting on each other, and on a busy machine on a descheduled one.
    """

    def __init__(self, bert: NumpyBert, *, quantize: bool = False, threads: int | None = None,
                 fused: bool = True, spin: bool = False, split_ops: bool = False):
        self.bert, self.dim, self.quantize = bert, bert.dim, quantize
        model = build_model(bert, fused)
        data = _quantised(model) if quantize else model.SerializeToString()
        cores = threads or usable_cores()
        # split_ops: the former way (one batch at a time over all cores), kept for the benches
        self.workers = 1 if split_ops else cores
        self.session = _session(data, cores if split_ops else 1, spin)

    @classmethod
    def load(cls, folder: str | Path, max_seq_length: int | None = None, *, quantize: bool = False,
             threads: int | None = None, fused: bool = True, spin: bool = False,
             split_ops: bool = False) -> OnnxBert:
        return cls(NumpyBert.load(folder, max_seq_length), quantize=quantize, threads=threads, fused=fused,
                   spin=spin, split_ops=split_ops)

    def encode(self, texts: list[str], batch_size: int = BATCH) -> np.ndarray:
        """Unit vectors in input order. Texts are tokenised once, sorted by token count and cut
        into batches of ``batch_size``, so a batch pads to within a few tokens of its texts."""
        encs = self.bert.tok.encode_batch(texts)
        order = sorted(range(len(texts)), key=lambda i: -len(encs[i].ids))
        batches = [order[s: s + batch_size] for s in range(0, len(order), batch_size)]
        return run_batches(encs, batches, self._forward, self.dim, self.workers)

    def _forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
