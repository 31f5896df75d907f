"""The embedder's ONNX files: exported once per model by the libraries that own each step.

Input: a sentence-transformers model folder (or a model id in the local Hugging Face cache);
output: a folder holding ``model.onnx`` (fp32), ``model_int8.onnx``, ``tokenizer.json`` and
``meta.json`` (pooling, longest input, dimension, the graph's input names).

sentence-transformers loads the model and says what its modules do (tokenizer, longest input,
pooling); ``torch.onnx.export`` writes its transformer as a graph; onnxruntime's transformer
optimiser fuses its attention and normalisation ops in the fp32 file; onnxruntime's dynamic
quantiser writes the int8 copy from the exported graph before that fusion (per-channel weight
scales). Nothing here builds a graph or runs a layer by hand: deepr/corpus/embed.py runs the
files on onnxruntime and pools.

The folder lives under ``$DEEPR_EMBEDDER_CACHE`` (default ``<DEEPR_CACHE>/embedders``), named by
the model's files (names, sizes, modification times), the longest input, and the versions of
torch and onnxruntime; it is written to a temporary folder and renamed, so processes sharing it
never read half an export. The first use of a model pays the export (~10-20 s on 2 cores, with
the torch and sentence-transformers imports); later processes only open the files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

EXPORT_FORMAT = 4  # bump when the files' layout or the export's settings change
POOLINGS = ("mean", "cls")  # what embed.py pools; another mode is refused at export
FUSABLE = ("bert",)  # the optimiser also has a "bert" path for RoBERTa, with other position ids: not checked


def export_root() -> Path:
    env = os.environ.get("DEEPR_EMBEDDER_CACHE")
    if env:
        return Path(env).expanduser()
    from deepr.corpus.embcache import cache_root

    return cache_root() / "embedders"


def _versions() -> str:
    out = []
    for pkg in ("torch", "onnxruntime"):
        try:
            out.append(f"{pkg}={version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg}=none")
    return ",".join(out)


def export_dir(model_ref: str, max_seq: int | None) -> Path:
    """Where ``model_ref``'s export lives; computed from file stats only (no reads, no imports)."""
    path = Path(model_ref).expanduser()
    h = hashlib.sha256(f"{EXPORT_FORMAT}|{max_seq}|{_versions()}".encode())
    if path.is_dir():
        path = path.resolve()
        h.update(str(path).encode())
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            st = f.stat()
            h.update(f"{f.relative_to(path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    else:
        h.update(model_ref.encode())
    return export_root() / f"{path.name or 'model'}-{h.hexdigest()[:16]}"


def ensure_exported(model_ref: str, max_seq: int | None) -> Path:
    """The export folder of ``model_ref``, exported first if this is its first use."""
    target = export_dir(model_ref, max_seq)
    if (target / "meta.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache's export from its other users
    try:
        _export(model_ref, max_seq, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same export first
            if not (target / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _export(model_ref: str, max_seq: int | None, out: Path) -> None:
    import onnx
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from sentence_transformers import SentenceTransformer

    try:
        # eager attention: the graph onnxruntime's BERT optimiser recognises and fuses (below)
        st = SentenceTransformer(model_ref, device="cpu", local_files_only=True,
                                 model_kwargs={"attn_implementation": "eager"})
    except OSError as e:
        raise FileNotFoundError(f"embedder {model_ref!r}: cannot load it offline ({e}); "
                                "pass a local model folder or a model already in the HF cache") from None
    if max_seq:
        st.max_seq_length = max_seq
    transformer, pooling = st[0], st[1] if len(st) > 1 else None
    mode = getattr(pooling, "pooling_mode", None)  # sentence-transformers >= 6; before: the method below
    if mode is None and hasattr(pooling, "get_pooling_mode_str"):
        mode = pooling.get_pooling_mode_str()
    mode = {"cls_token": "cls", "mean_tokens": "mean"}.get(mode, mode)
    if mode not in POOLINGS:
        raise ValueError(f"embedder {model_ref!r}: pooling {mode!r} is not supported (expected one of {POOLINGS})")
    tok = transformer.tokenizer
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"embedder {model_ref!r}: needs a fast (tokenizer.json) tokenizer")
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    sample = tok(["an example", "a second example text"], padding=True, return_tensors="pt")
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in sample]
    graph = _Hidden(transformer.auto_model.eval(), names)
    axes = {n: {0: "batch", 1: "tokens"} for n in [*names, "hidden"]}
    with warnings.catch_warnings(), torch.no_grad():  # the exporter's deprecation notices
        warnings.simplefilter("ignore")
        torch.onnx.export(graph, tuple(sample[n] for n in names), str(out / "model.onnx"), input_names=names,
                          output_names=["hidden"], dynamic_axes=axes, opset_version=17, dynamo=False)
    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # the optimiser's and quantiser's notes, on the root logger
    try:
        # The int8 copy is quantised from the exported graph, before the fusion below: against
        # quantising the fused graph (QAttention, QEmbedLayerNormalization) its passages cost
        # 0.85-0.88x the CPU and its vectors' lowest cosine to sentence-transformers' fp32 rose from
        # 0.988-0.990 to 0.990-0.992 (mean 0.995 both; 256 and 512 wiki passages, interleaved runs).
        # Per-channel scales (one scale per tensor: lower). No setting of onnxruntime's quantisers
        # reached cosine 0.999 at int8's cost: see docs/benchmarks.md.
        quantize_dynamic(out / "model.onnx", out / "model_int8.onnx", weight_type=QuantType.QInt8, per_channel=True,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        _fuse(out / "model.onnx", transformer.auto_model.config)
    finally:
        logging.getLogger().setLevel(quiet)
    for name in ("model.onnx", "model_int8.onnx"):
        _preoptimise(out / name)
    dim = getattr(st, "get_embedding_dimension", None) or st.get_sentence_embedding_dimension
    meta = {"pooling": mode, "max_seq": st.max_seq_length, "dim": int(dim()),
            "inputs": names, "pad_id": tok.pad_token_id or 0, "pad_token": tok.pad_token, "model": model_ref}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


def _fuse(path: Path, config) -> None:
    """onnxruntime's transformer optimiser fuses attention, layer norms and GELU in BERT-family
    graphs, in place: 0.92x the CPU of the plain graph in fp32 (128 wiki passages, one thread).
    The fp32 file only: the int8 copy is quantised from the plain graph (``_export``). Other
    architectures keep the plain graph."""
    if config.model_type not in FUSABLE:
        return
    from onnxruntime.transformers.optimizer import optimize_model

    fused = optimize_model(str(path), model_type="bert", num_heads=config.num_attention_heads,
                           hidden_size=config.hidden_size)
    fused.save_model_to_file(str(path))


def _preoptimise(path: Path) -> None:
    """Store onnxruntime's own graph optimisations (up to the portable "extended" level) in the
    file, so each process opens it with none left to do: a session started in 0.2-0.4 s instead
    of 0.7 s, which a cold `deepr search` pays."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    tmp = path.with_suffix(".opt.onnx")
    opts.optimized_model_filepath = str(tmp)
    ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    tmp.replace(path)


def _hidden_module():
    import torch

    class Hidden(torch.nn.Module):
        """The transformer's last hidden states from positional inputs (the exporter's calling form)."""

        def __init__(self, model: torch.nn.Module, names: list[str]):
            super().__init__()
            self.model, self.names = model, names

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            return self.model(**dict(zip(self.names, inputs))).last_hidden_state

    return Hidden


def _Hidden(model, names):  # noqa: N802 - builds the torch module class on first use only
    return _hidden_module()(model, names)
