"""``hf:<path>[,adapter=<role>:<path>...]``: a local transformers chat model.

The model and tokenizer load from a local folder only (``local_files_only=True``). With
adapters, each LoRA adapter is loaded under its role's name and selected per call, so
one base model serves planner, answerer, ... as trained by ``deepr sft`` / ``deepr grpo``;
a role without an adapter runs the bare base model. Prompts are rendered with the
tokenizer's chat template; decoding is greedy at temperature 0 / None and sampled
otherwise. ``generate`` runs in a worker thread behind a lock: one model, one
generation at a time, while the event loop keeps serving other work.

    llm = get_llm("hf:runs/base,adapter=planner:runs/planner-lora")
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deepr.llm.base import LLM, LLMError, Message


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class HFConfig(BaseModel):
    """Settings of a local transformers backend."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Folder with the model weights, config and tokenizer (with a chat template).")
    adapters: dict[str, str] = Field(default_factory=dict, description="Role name -> LoRA adapter folder (peft).")
    max_new_tokens: int = Field(512, ge=1, description="Reply length limit when a call gives no max_tokens.")
    device: str | None = Field(None, description="torch device; None picks cuda when available, else cpu.")
    dtype: str = Field("auto", description="Weight dtype: 'auto' (as saved), 'float32', 'bfloat16' or 'float16'.")
    seed: int | None = Field(None, description="Seeds torch once at load, so a run's sampled replies repeat.")
    max_concurrency: int = Field(8, ge=1, description="Calls admitted at once; generation itself is serialised.")


def _check_folder(path: str, what: str, marker: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{what} folder {p} does not exist; build one with "
                                "`python -m deepr.train.tiny DIR` or train one with `deepr sft`")
    if not (p / marker).is_file():
        raise ValueError(f"{what} folder {p} has no {marker}; point at the folder save_pretrained wrote")
    return p


class HFLLM(LLM):
    name = "hf"

    def __init__(self, path: str | Path, *, adapters: dict[str, str | Path] | None = None, **kw: Any):
        self.config = HFConfig(path=str(path), adapters={k: str(v) for k, v in (adapters or {}).items()}, **kw)
        super().__init__(max_concurrency=self.config.max_concurrency)
        self._lock = threading.Lock()
        self.tokenizer = self._load_tokenizer()
        self.model, self.device = self._load_model()

    # -- loading -----------------------------------------------------------------------
    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        p = _check_folder(self.config.path, "model", "config.json")
        # Without these files transformers would quietly build an empty default tokenizer.
        if not any((p / f).is_file() for f in _TOKENIZER_FILES):
            raise ValueError(f"model folder {p} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
                             "save one there with tokenizer.save_pretrained")
        try:
            tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"model folder {p} has no loadable tokenizer ({type(e).__name__}: {e}); "
                             "save one there with tokenizer.save_pretrained") from None
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"the tokenizer in {p} has no chat template; set tokenizer.chat_template "
                             "(e.g. the base model's) and save it again")
        return tok

    def _load_model(self) -> tuple[Any, Any]:
        import torch
        from transformers import AutoModelForCausalLM

        cfg = self.config
        device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = cfg.dtype if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(cfg.path, local_files_only=True, dtype=dtype)
        if cfg.adapters:
            from peft import PeftModel

            roles = list(cfg.adapters)
            folders = {r: _check_folder(cfg.adapters[r], f"adapter for role '{r}'", "adapter_config.json")
                       for r in roles}
            model = PeftModel.from_pretrained(model, str(folders[roles[0]]), adapter_name=roles[0])
            for r in roles[1:]:
                model.load_adapter(str(folders[r]), adapter_name=r)
        model.to(device).eval()
        return model, device

    # -- generation --------------------------------------------------------------------
    @contextlib.contextmanager
    def _adapter_for(self, role: str | None) -> Iterator[None]:
        if not self.config.adapters:
            yield
        elif role in self.config.adapters:
            self.model.set_adapter(role)
            yield
        else:
            with self.model.disable_adapter():
                yield

    def _generate(self, messages: list[Message], role: str | None, temperature: float | None,
                  max_tokens: int | None, stop: Sequence[str] | None) -> tuple[str, int, int]:
        import torch

        tok = self.tokenizer
        enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True).to(self.device)
        kw: dict[str, Any] = {"max_new_tokens": max_tokens or self.config.max_new_tokens,
                              "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
        if temperature:
            kw.update(do_sample=True, temperature=float(temperature))
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if stop:
            kw.update(stop_strings=list(stop), tokenizer=tok)
        n_prompt = int(enc["input_ids"].shape[1])
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit and n_prompt + kw["max_new_tokens"] > limit:
            raise ValueError(f"prompt of {n_prompt} tokens + {kw['max_new_tokens']} new tokens exceeds "
                             f"the model's context of {limit}; shorten the prompt or max_tokens")
        with self._lock, torch.inference_mode(), self._adapter_for(role):
            out = self.model.generate(**enc, **kw)
        new = out[0, n_prompt:]
        eos = set(_as_list(self.model.generation_config.eos_token_id)) | {tok.eos_token_id}
        n_new = next((i + 1 for i, t in enumerate(new.tolist()) if t in eos), len(new))
        text = tok.decode(new[:n_new], skip_special_tokens=True)
        return _cut_at_stop(text, stop), n_prompt, n_new

    async def _achat(self, messages: list[Message], *, role: str | None, temperature: float | None,
                     max_tokens: int | None, stop: Sequence[str] | None, **extra: Any) -> str:
        t0 = time.perf_counter()
        try:
            text, n_prompt, n_new = await asyncio.to_thread(
                self._generate, messages, role, temperature, max_tokens, stop)
        except (RuntimeError, ValueError, TypeError) as e:  # e.g. a prompt longer than the model's context
            self.usage.failures += 1
            raise LLMError(f"{self.config.path}: generation failed for role {role or 'default'} "
                           f"({type(e).__name__}: {e})") from None
        self.usage.add(role=role, prompt_tokens=n_prompt, completion_tokens=n_new,
                       seconds=time.perf_counter() - t0)
        return text

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model": self.config.path, "adapters": dict(self.config.adapters),
                "device": str(self.device), "dtype": self.config.dtype, "seed": self.config.seed}

    def __repr__(self) -> str:
        return f"HFLLM({self.config.path!r}, adapters={self.config.adapters!r})"

    def close(self) -> None:
        self.model = None
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _cut_at_stop(text: str, stop: Sequence[str] | None) -> str:
    cuts = [text.index(s) for s in stop or () if s and s in text]
    return text[: min(cuts)] if cuts else text
