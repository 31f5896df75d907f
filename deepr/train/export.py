"""export: merge a trained LoRA adapter into its base model and write a plain checkpoint.

Input: an adapter folder written by ``deepr sft`` or ``deepr grpo`` (adapter_config.json,
adapter weights, usually the tokenizer and ``deepr_meta.json``). The base model is read from
``deepr_meta.json`` (``base_model``) or, failing that, from PEFT's ``adapter_config.json``
(``base_model_name_or_path``); a base that is itself an adapter folder is merged first.
A full fine-tune folder (config.json, no adapter) is re-saved as it is.

Output: a folder that ``AutoModelForCausalLM.from_pretrained`` and ``vllm serve`` load with no
PEFT: config.json, model.safetensors, generation_config.json, the tokenizer with its chat
template, and ``deepr_export.json`` (sources, dtype, and the self-check: the largest
|logit difference| between the written checkpoint and base+adapter on one prompt).
With ``gguf=True`` also ``model-<outtype>.gguf`` through llama.cpp's ``convert_hf_to_gguf.py``
(the ``gguf`` PyPI package writes the file format but has no Hugging Face converter).

    deepr export runs/planner-sft --out runs/planner-merged
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deepr.io import versions, write_json

STAGE = "export"
EXPORT_META = "deepr_export.json"
CHECK_PROMPT = [{"role": "system", "content": "You plan research as a JSON graph."},
                {"role": "user", "content": "How did the printing press change the spread of science in Europe?"}]
_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.05}  # what a faithful cast stays within


class ExportConfig(BaseModel):
    """Settings of ``deepr export``."""

    model_config = ConfigDict(extra="forbid")

    adapter: Path = Field(description="Adapter folder of `deepr sft` / `deepr grpo` (or a full fine-tune folder).")
    out: Path = Field(description="Folder for the merged checkpoint; must be empty or absent.")
    base: str | None = Field(None, description="Base model override; None: read from the adapter's metadata.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype written; 'auto': the base model's own dtype.")
    check: bool = Field(True, description="Reload the written checkpoint and compare its logits with "
                        "base+adapter on one prompt; fail past the dtype's tolerance.")
    gguf: bool = Field(False, description="Also write a GGUF file with llama.cpp's converter.")
    gguf_outtype: str = Field("f16", description="GGUF tensor type passed to the converter (f32, f16, bf16, q8_0).")
    llama_cpp: Path | None = Field(None, description="llama.cpp checkout or its convert_hf_to_gguf.py; None: "
                                   "$LLAMA_CPP_DIR, then convert_hf_to_gguf.py on PATH.")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from None


def resolve_base(adapter: Path) -> str:
    """The base model an adapter was trained on (deepr.llm.hf_backend.adapter_base)."""
    from deepr.llm.hf_adapters import adapter_base

    return adapter_base(adapter, fix="pass --base <model folder>")


def is_adapter(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def load_merged(adapter: Path, base: str | None = None, _depth: int = 0) -> tuple[Any, list[str]]:
    """(fp32 model with every LoRA layer folded in, [sources from base to adapter])."""
    import torch
    from transformers import AutoModelForCausalLM

    if not adapter.is_dir():
        raise FileNotFoundError(f"{adapter}: no such folder (give the --out folder of deepr sft / deepr grpo)")
    if not is_adapter(adapter):
        if not (adapter / "config.json").is_file():
            raise ValueError(f"{adapter}: holds neither a LoRA adapter (adapter_config.json) nor a model "
                             "(config.json)")
        return AutoModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32), [str(adapter)]
    if _depth > 8:
        raise ValueError(f"{adapter}: the chain of adapters on adapters is deeper than 8; is it circular?")
    from peft import PeftModel

    base = base or resolve_base(adapter)
    base_path = Path(base)
    if base_path.is_dir() and is_adapter(base_path):  # e.g. grpo trained from an sft adapter folder
        model, chain = load_merged(base_path, None, _depth + 1)
    else:
        model, chain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), [base]
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return merged, [*chain, str(adapter)]


def load_reference(adapter: Path, base: str | None = None) -> Any:
    """Base + adapter as PEFT runs it (unmerged): what the exported checkpoint must reproduce."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not is_adapter(adapter):
        return AutoModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32)
    base = base or resolve_base(adapter)
    base_path = Path(base)
    inner = load_merged(base_path)[0] if base_path.is_dir() and is_adapter(base_path) else \
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(inner, str(adapter))


def load_export_tokenizer(adapter: Path, chain: list[str]) -> Any:
    """The adapter's own tokenizer (training may have set its chat template), else the base's."""
    from deepr.train.runs import load_tokenizer

    for source in (str(adapter), *reversed(chain)):
        if (Path(source) / "tokenizer_config.json").is_file() or not Path(source).exists():
            try:
                return load_tokenizer(source)
            except (FileNotFoundError, ValueError, OSError):
                continue
    raise ValueError(f"{adapter}: no tokenizer with a chat template in the adapter folder or its base")


def prompt_logits(model: Any, tokenizer: Any) -> Any:
    import torch

    ids = tokenizer.apply_chat_template(CHECK_PROMPT, tokenize=True, return_dict=False, add_generation_prompt=True)
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits.float()


def max_logit_diff(out: Path, adapter: Path, tokenizer: Any, base: str | None = None) -> float:
    """Largest |logit| difference on CHECK_PROMPT: written checkpoint (read in fp32) vs base+adapter."""
    import torch
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    got = prompt_logits(exported, tokenizer)
    del exported
    want = prompt_logits(load_reference(adapter, base).eval(), tokenizer)
    return float((got - want).abs().max())


def _target_dtype(model: Any, name: str) -> Any:
    import torch

    if name != "auto":
        return getattr(torch, name)
    declared = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if declared in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def add_legacy_config_keys(folder: Path) -> None:
    """transformers 5 writes ``dtype`` and ``rope_parameters``; servers built on transformers 4 (many
    vLLM installs) read ``torch_dtype`` and ``rope_theta`` / ``rope_scaling`` and would otherwise
    fall back to a default rope base silently. Write both spellings; transformers 5 reads its own."""
    path = folder / "config.json"
    cfg = _read_json(path)
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def export_model(config: ExportConfig) -> dict[str, Any]:
    """Merge, write, self-check and (optionally) convert to GGUF; returns what deepr_export.json holds."""
    t0 = time.perf_counter()
    if config.out.exists() and any(config.out.iterdir()):
        raise ValueError(f"{config.out} is not empty; choose a new --out (export never overwrites)")
    converter = find_converter(config.llama_cpp) if config.gguf else None  # fail before the slow part
    model, chain = load_merged(config.adapter, config.base)
    tokenizer = load_export_tokenizer(config.adapter, chain)
    dtype = _target_dtype(model, config.dtype)
    model = model.to(dtype)
    model.config.use_cache = True  # training switches it off; servers want it on
    config.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(config.out))
    add_legacy_config_keys(config.out)
    tokenizer.save_pretrained(str(config.out))
    del model
    dtype_name = str(dtype).removeprefix("torch.")
    info: dict[str, Any] = {"stage": STAGE, "adapter": str(config.adapter), "chain": chain, "dtype": dtype_name,
                            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions()}
    if config.check:
        diff = max_logit_diff(config.out, config.adapter, tokenizer, config.base)
        info["check"] = {"prompt": CHECK_PROMPT, "max_abs_logit_diff": diff, "tolerance": _TOLERANCE[dtype_name]}
        if diff > _TOLERANCE[dtype_name]:
            write_json(config.out / EXPORT_META, {**info, "status": "check_failed"})
            raise ValueError(f"{config.out}: the written checkpoint's logits differ from base+adapter by {diff:.3g} "
                             f"(> {_TOLERANCE[dtype_name]} for {dtype_name}); the merge is not faithful")
    info["seconds"] = round(time.perf_counter() - t0, 3)
    write_json(config.out / EXPORT_META, {**info, "status": "done"})
    if converter is not None:
        try:
            info["gguf"] = str(write_gguf(config.out, config.gguf_outtype, converter))
        except RuntimeError as e:  # the checkpoint stands; say what the GGUF step lacked
            write_json(config.out / EXPORT_META, {**info, "status": "done", "gguf_error": str(e)})
            raise
        write_json(config.out / EXPORT_META, {**info, "status": "done"})
    return info


# --- GGUF -------------------------------------------------------------------------------------


def find_converter(llama_cpp: Path | None) -> Path:
    """llama.cpp's convert_hf_to_gguf.py: the flag, then $LLAMA_CPP_DIR, then PATH."""
    candidates: list[Path] = []
    for root in (llama_cpp, os.environ.get("LLAMA_CPP_DIR")):
        if root:
            root = Path(root)
            candidates += [root] if root.suffix == ".py" else [root / "convert_hf_to_gguf.py"]
    on_path = shutil.which("convert_hf_to_gguf.py")
    candidates += [Path(on_path)] if on_path else []
    for c in candidates:
        if c.is_file():
            return c
    tried = ", ".join(str(c) for c in candidates) or "no --llama-cpp, no $LLAMA_CPP_DIR, none on PATH"
    raise FileNotFoundError(
        f"--gguf needs llama.cpp's convert_hf_to_gguf.py (the `gguf` package has no Hugging Face converter); "
        f"tried: {tried}. Get it from a llama.cpp checkout or the llama-cpp-python sdist (`pip download "
        f"--no-deps --no-binary :all: llama-cpp-python`, file vendor/llama.cpp/convert_hf_to_gguf.py) and pass "
        f"--llama-cpp <that folder>; or convert the exported folder yourself later")


def write_gguf(out: Path, outtype: str, script: Path) -> Path:
    """Run llama.cpp's converter on the exported folder; the GGUF lands next to the weights."""
    target = out / f"model-{outtype}.gguf"
    env = dict(os.environ)
    gguf_py = script.parent / "gguf-py"  # a checkout's own gguf-py matches its converter best
    if gguf_py.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(gguf_py), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(script), str(out), "--outfile", str(target), "--outtype", outtype],
                          env=env, capture_output=True, text=True)
    if proc.returncode or not target.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{script} failed (exit {proc.returncode}): {tail[0]}")
    return target
