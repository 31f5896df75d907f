"""``hf:<path>[,adapter=<role>:<path>...]``: a local transformers chat model.

The model and tokenizer load from a local folder only (``local_files_only=True``). With
adapters, each LoRA adapter is loaded under its role's name and selected per call, so
one base model serves planner, answerer, ... as trained by ``deepr sft`` / ``deepr grpo``;
a role without an adapter runs the bare base model. ``hf:<adapter folder>`` (a folder with
``adapter_config.json``) reads its base model from ``deepr_meta.json`` (else from
``adapter_config.json``) and applies the adapter to the role(s) recorded there, or to every
role when none is recorded (a plain peft adapter; hf_adapters.py).

Prompts are rendered with the tokenizer's chat template; decoding is greedy at temperature
0 / None and sampled otherwise (a call's ``seed`` reseeds torch first, so sampled replies
repeat). ``max_tokens`` defaults to ``max_new_tokens``; a reply cut there is flagged
``truncated``. A call with an :class:`OutputFormat` is constrained to it by xgrammar
(see hf_constrain.py) and flagged ``constrained``. ``generate`` runs in a worker thread
behind a gate: one model, one generation at a time, while the event loop keeps serving; greedy
calls that wait at the same time are decoded together as one batch (``batch_size``, hf_batch.py).
The last call's KV cache is kept, and a prompt that starts with the same tokens (the next turn
of a conversation) computes only what follows them (``prefix_cache``).

    llm = get_llm("hf:runs/base,adapter=planner:runs/planner-lora")
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deepr.llm.base import LLM, LLMError, Message, OutputFormat, Reply
from deepr.llm.hf_constrain import StutterBan, guard_processor, penalty_processor, repeat_ban_processor
from deepr.llm.hf_adapters import ALL_ROLES
from deepr.llm.hf_batch import Gate, Pending, Queue, left_padded

log = logging.getLogger("deepr.llm")
# The settings a format may bring for its own calls (OutputFormat.decoding).
REPETITION = ("repetition_penalty", "repetition_window", "no_repeat_ngram", "no_repeat_word")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class HFConfig(BaseModel):
    """Settings of a local transformers backend."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Folder with the model weights, config and tokenizer (with a chat template).")
    adapters: dict[str, str] = Field(default_factory=dict, description="Role name -> LoRA adapter folder (peft).")
    max_new_tokens: int = Field(512, ge=1, description="Reply length limit when a call gives no max_tokens.")
    device: str | None = Field(None, description="torch device; None picks cuda when available, else cpu.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype: 'auto' (as saved), 'float32', 'bfloat16' or 'float16'. bf16 on CPU: "
        "SmolLM2-135M decodes 1.2x and reads a 2k-token prompt 2.1x as fast as in fp32 on one core (memory-"
        "bound matrix-vector products), with different roundings, so greedy replies may differ.")
    seed: int | None = Field(None, description="Seeds torch once at load, so a run's sampled replies repeat.")
    max_concurrency: int = Field(8, ge=1, description="Calls admitted at once; generation itself is serialised.")
    constrain: bool = Field(True, description="Constrain replies to the caller's OutputFormat with xgrammar "
                            "when it is installed (otherwise replies are unconstrained and flagged so).")
    threads: int | None = Field(None, ge=1, description="torch CPU threads while generating; None: 1 on CPU for "
                                "models under 500M parameters (thread syncs cost more than they save on such "
                                "small matmuls: 10x the tokens/s on a loaded 2-core machine, docs/experiments.md), "
                                "else torch's default.")
    repetition_penalty: float | None = Field(None, gt=0, description="Penalty (> 1 discourages) on recent "
                                             "tokens (see repetition_window). None: off. The smollm2 and gguf: "
                                             "specs set 1.1 over 64 tokens, llama.cpp's server defaults "
                                             "(deepr.profiles.SMALL_DECODING).")
    repetition_window: int | None = Field(None, ge=1, description="Penalise only the last this many tokens, "
                                          "prompt included, as llama.cpp's repeat_last_n does; None: every token "
                                          "of the reply and none of the prompt (penalising a whole prompt "
                                          "pushed SmolLM2 into glued non-words).")
    no_repeat_ngram: int | None = Field(None, ge=2, description="No run of this many tokens may occur twice "
                                        "in a reply (transformers' no_repeat_ngram_size, over the reply only and "
                                        "never emptying the format's choices); None: off. The smollm2 and "
                                        "gguf: specs set 6.")
    no_repeat_word: bool = Field(False, description="A word may not follow itself (\"Algiers Algiers\"): "
                                 "the next word may not start with two or more of its letters. The smollm2 and "
                                 "gguf: specs turn it on.")
    top_k: int | None = Field(40, ge=1, description="Sampled calls (temperature > 0, e.g. re-asks) draw from "
                              "the k likeliest tokens the format allows; None: all of them. 40 and min_p 0.05 are "
                              "llama.cpp's server defaults: without them SmolLM2's re-asks at temperature 0.7 "
                              "drew glued non-words from the tail (\"theyrerefining\").")
    min_p: float | None = Field(0.05, gt=0, lt=1, description="Sampled calls drop tokens less likely than this "
                                "share of the likeliest one; None: off (see top_k).")
    kv_cache: str | None = Field(None, description="transformers cache_implementation for generate, e.g. "
                                 "'static'; None keeps the dynamic cache (see docs/experiments.md).")
    prefix_cache: bool = Field(True, description="Keep the last call's KV cache and reuse the part the next "
                               "prompt shares with it (a tools-mode conversation re-sends everything before "
                               "its newest turn), as llama.cpp's server does. Only with the dynamic cache.")
    min_prefix: int = Field(16, ge=1, description="Shared prompt tokens below which the kept cache is not reused.")
    batch_size: int = Field(8, ge=1, description="Greedy calls waiting for the model at the same time are "
                            "decoded together, up to this many (see hf_batch.py); 1: one call at a time.")
    batch_max_prompt: int = Field(1024, ge=1, description="Longest prompt (tokens) a call may have to join a "
                                  "batch. A padded batch's prefill cannot use the causal attention kernel, so "
                                  "long prompts gain nothing from batching on CPU (four 1.8k-2.5k-token "
                                  "prompts: 1.03x the one-by-one wall time, docs/experiments.md).")


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
        self._gate = Gate()  # one generation at a time
        self._constrainer: Any = None
        self._stutter: Any = None  # StutterBan, built on the first call that needs it
        self._warned = False
        self._queue = Queue(self.config.batch_size)
        self._gen_threads: int | None = None
        # (adapter, token ids whose keys/values the cache holds, the cache): see _reuse
        self._kv: tuple[str | None, list[int], Any] | None = None
        self.prefix_hits = 0  # calls that reused a kept cache, and the prompt tokens they skipped
        self.batched_calls = 0  # calls decoded in a batch of two or more
        self.prefix_tokens = 0
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
            names = {r: ("all_roles" if r == ALL_ROLES else r) for r in roles}
            model = PeftModel.from_pretrained(model, str(folders[roles[0]]), adapter_name=names[roles[0]])
            for r in roles[1:]:
                model.load_adapter(str(folders[r]), adapter_name=names[r])
        model.to(device).eval()
        if cfg.threads is None and device.type == "cpu" and sum(p.numel() for p in model.parameters()) < 5e8:
            self._gen_threads = 1
        else:
            self._gen_threads = cfg.threads
        return model, device

    # -- generation --------------------------------------------------------------------
    @contextlib.contextmanager
    def _adapter_for(self, role: str | None) -> Iterator[None]:
        if not self.config.adapters:
            yield
        elif role in self.config.adapters:
            self.model.set_adapter(role)
            yield
        elif ALL_ROLES in self.config.adapters:
            self.model.set_adapter("all_roles")
            yield
        else:
            with self.model.disable_adapter():
                yield

    def _kwargs(self, max_tokens: int | None, temperature: float | None, top_p: float | None,
                stop: Sequence[str] | None) -> dict[str, Any]:
        tok = self.tokenizer
        kw: dict[str, Any] = {"max_new_tokens": max_tokens or self.config.max_new_tokens,
                              "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
        if temperature:
            # transformers applies these after the logits processors, so they pick among the
            # tokens the grammar left and can never empty a row.
            kw.update(do_sample=True, temperature=float(temperature), top_k=self.config.top_k,
                      min_p=self.config.min_p, top_p=float(top_p) if top_p is not None else None)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None, min_p=None)
        if stop:
            kw.update(stop_strings=list(stop), tokenizer=tok)
        if self.config.kv_cache:
            kw["cache_implementation"] = self.config.kv_cache
        return kw

    @property
    def context_length(self) -> int | None:
        """The model's context in tokens: roles trim their evidence to fit it before a call
        (deepr.roles.fit_context) instead of failing in _check_context."""
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if isinstance(n, int) and n > 0 else None

    def count_tokens(self, messages: Sequence[Message]) -> int:
        """Prompt tokens of ``messages`` as this model's chat template lays them out."""
        return len(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                      return_dict=True)["input_ids"])

    def _check_context(self, n_prompt: int, max_new: int) -> None:
        limit = self.context_length
        if limit and n_prompt + max_new > limit:
            raise LLMError(f"prompt of {n_prompt} tokens + {max_new} reply tokens exceeds the model's context "
                           f"of {limit} tokens ({self.config.path}); shorten the prompt or max_tokens")

    def _constrains(self, fmt: OutputFormat | None) -> bool:
        """Whether replies in ``fmt`` are constrained: compiles its grammar now, so a format that
        cannot compile fails its own call and never a batch it would have joined."""
        if fmt is None or not self.config.constrain:
            return False
        if self._constrainer is None:
            from deepr.llm.hf_constrain import INSTALL_HINT, Constrainer

            if not Constrainer.available():
                if not self._warned:
                    self._warned = True
                    log.warning("hf backend: xgrammar is not installed, so replies are not constrained to "
                                "their format; install it with: %s", INSTALL_HINT)
                return False
            self._constrainer = Constrainer(self.tokenizer, int(self.model.config.vocab_size),
                                            _as_list(self.model.generation_config.eos_token_id))
        self._constrainer.compile(fmt)
        return True

    def _generate(self, messages: list[Message], role: str | None, temperature: float | None,
                  max_tokens: int | None, stop: Sequence[str] | None, top_p: float | None = None,
                  seed: int | None = None, fmt: OutputFormat | None = None) -> tuple[Reply, int, int]:
        ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
        kw = self._kwargs(max_tokens, temperature, top_p, stop)
        self._check_context(len(ids), kw["max_new_tokens"])
        constrained = self._constrains(fmt)
        fmt = fmt if constrained else None
        batchable = self.config.batch_size > 1 and not temperature and not stop and len(ids) <= self.config.batch_max_prompt
        # A key of None never shares a batch: sampled calls keep their seed, long prompts their fast prefill.
        # calls sharing a batch share one set of repetition rules (_decode_batch reads the first row's)
        rules = tuple(self._repetition(fmt).items())
        key = (self._adapter_key(role), kw["max_new_tokens"], fmt is not None, rules) if batchable else None
        new = self._decode(Pending(ids, key, fmt), role, kw, seed)
        reply, n_new = self._reply(new, kw["max_new_tokens"], stop, constrained)
        return reply, len(ids), n_new

    def _alone(self, ids: list[int], role: str | None, kw: dict[str, Any], fmt: OutputFormat | None,
               seed: int | None) -> list[int]:
        """One call's new token ids (the caller holds the model's gate); reuses the kept KV cache."""
        import torch

        kw = dict(kw)
        dec = self._repetition(fmt)
        processors = self._penalty(len(ids), dec) + ([self._constrainer.processor(fmt)] if fmt is not None else []) \
            + self._ban(len(ids), [fmt], dec) + self._guard(len(ids), [fmt])
        with torch.inference_mode(), self._adapter_for(role), _threads(self._gen_threads):
            if seed is not None:
                torch.manual_seed(seed)
            cache = self._reuse(role, ids)
            if cache is not None:
                kw["past_key_values"] = cache
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            res = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw,
                                      logits_processor=processors or None, return_dict_in_generate=True)
            out = res.sequences
            self._keep(role, out[0].tolist(), getattr(res, "past_key_values", None))
        return out[0, len(ids):].tolist()

    def _decode(self, call: Pending, role: str | None, kw: dict[str, Any], seed: int | None) -> list[int]:
        """This call's new ids: decoded when the model is free, together with the compatible calls
        waiting beside it, unless another call's batch already decoded it."""
        self._queue.add(call)
        if self._gate.acquire(lambda: call.finished):
            batch = self._queue.take(call)
            try:
                if len(batch) == 1:
                    call.new = self._alone(call.ids, role, kw, call.fmt, seed)
                else:
                    self._decode_batch(batch, role, kw)
            except Exception as e:
                for c in batch[1:]:
                    c.error = e
                raise
            finally:
                self._gate.release()
        if call.error is not None:
            raise call.error
        assert call.new is not None
        return call.new

    def _decode_batch(self, batch: list[Any], role: str | None, kw: dict[str, Any]) -> None:
        import torch

        ids, mask = left_padded([c.ids for c in batch], kw["pad_token_id"])
        fmts = [c.fmt for c in batch]
        dec = self._repetition(fmts[0])  # one for the batch: it is part of the batch key
        processors = self._penalty(ids.shape[1], dec)
        if fmts[0] is not None:
            processors.append(self._constrainer.processor(fmts))
        processors += self._ban(ids.shape[1], fmts, dec) + self._guard(ids.shape[1], fmts)
        with torch.inference_mode(), self._adapter_for(role), _threads(self._gen_threads):
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kw,
                                      logits_processor=processors or None)
        self.batched_calls += len(batch)
        for i, c in enumerate(batch):
            c.new = out[i, ids.shape[1]:].tolist()

    def _repetition(self, fmt: OutputFormat | None) -> dict[str, Any]:
        """A call's repetition settings: each one the spec (or the backend's profile) set, else the
        constrained format's (``OutputFormat.decoding``), else off. Only a format that constrains
        the reply brings its own: without its grammar, the penalties pushed SmolLM2 off the evidence
        ids it was copying and it cited ids it was never shown (docs/learning.md)."""
        own = {k: getattr(self.config, k) for k in REPETITION}
        extra = fmt.decoding if fmt is not None and fmt.decoding else {}
        return {k: own[k] if k in self.config.model_fields_set else extra.get(k, own[k]) for k in REPETITION}

    def _penalty(self, n_prompt: int, dec: dict[str, Any]) -> list[Any]:
        """The repetition penalty's processor, which must come before the grammar's mask."""
        if not dec["repetition_penalty"]:
            return []
        return [penalty_processor(float(dec["repetition_penalty"]), dec["repetition_window"], n_prompt)]

    def _ban(self, n_prompt: int, fmts: list[OutputFormat | None], dec: dict[str, Any]) -> list[Any]:
        """The repeated-run and stutter bans, and the one-word-once ban of the rows whose format
        asks for it (``OutputFormat.distinct_words``), which must come after the grammar's mask
        (they keep a row's last choices)."""
        distinct = [f is not None and f.distinct_words for f in fmts]
        n = dec["no_repeat_ngram"]
        out = [repeat_ban_processor(n, n_prompt)] if n else []
        if (dec["no_repeat_word"] or any(distinct)) and self._stutter is None:
            self._stutter = StutterBan(self.tokenizer)
        if dec["no_repeat_word"]:
            out.append(self._stutter.processor(n_prompt))
        if any(distinct):
            out.append(self._stutter.string_processor(n_prompt, distinct))
        return out

    def _guard(self, n_prompt: int, fmts: list[OutputFormat | None]) -> list[Any]:
        """The processor of the rows' format guards (``OutputFormat.guard``), after the grammar's mask."""
        guards = [f.guard if f is not None else None for f in fmts]
        return [guard_processor(guards, self.tokenizer, n_prompt)] if any(g is not None for g in guards) else []

    def _reply(self, new: list[int], max_new: int, stop: Sequence[str] | None, constrained: bool) -> tuple[Reply, int]:
        tok = self.tokenizer
        eos = set(_as_list(self.model.generation_config.eos_token_id)) | {tok.eos_token_id}
        n_new = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        text = tok.decode(new[:n_new], skip_special_tokens=True)
        cut = _cut_at_stop(text, stop)
        # Cut by the budget: no end-of-turn token and no stop string ended it.
        truncated = n_new >= max_new and new[n_new - 1] not in eos and cut == text
        return Reply(cut, constrained=constrained, truncated=truncated), n_new

    def _adapter_key(self, role: str | None) -> str | None:
        ad = self.config.adapters
        return role if role in ad else (ALL_ROLES if ALL_ROLES in ad else None)

    def _reuse(self, role: str | None, ids: list[int]) -> Any:
        """The kept cache cropped to the prefix ``ids`` shares with it, or None (start afresh).
        At least the prompt's last token is left to compute: generate needs its logits."""
        if not self.config.prefix_cache or self.config.kv_cache or self._kv is None:
            return None
        key, held, cache = self._kv
        self._kv = None  # generate extends the cache in place: it is the new call's from here on
        n = 0
        for a, b in zip(held, ids[:-1]):
            if a != b:
                break
            n += 1
        if key != self._adapter_key(role) or n < self.config.min_prefix:
            return None
        extra = cache.get_seq_length() - n
        try:
            if extra > 0:
                cache.crop(-extra)  # a negative count removes that many tokens (transformers 4.5x and 5.x)
        except (RuntimeError, ValueError):  # layers that cannot roll back (sliding windows, linear attention)
            return None
        self.prefix_hits += 1
        self.prefix_tokens += n
        return cache

    def _keep(self, role: str | None, seq: list[int], cache: Any) -> None:
        if not self.config.prefix_cache or self.config.kv_cache or cache is None or not hasattr(cache, "crop"):
            return
        n = cache.get_seq_length()
        self._kv = (self._adapter_key(role), seq[:n], cache) if 0 < n <= len(seq) else None

    async def _achat(self, messages: list[Message], *, role: str | None, temperature: float | None,
                     max_tokens: int | None, stop: Sequence[str] | None, **extra: Any) -> Reply:
        t0 = time.perf_counter()
        try:
            reply, n_prompt, n_new = await asyncio.to_thread(
                self._generate, messages, role, temperature, max_tokens, stop,
                extra.get("top_p"), extra.get("seed"), extra.get("fmt"))
        except LLMError:
            self.usage.failures += 1
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            self.usage.failures += 1
            raise LLMError(f"{self.config.path}: generation failed for role {role or 'default'} "
                           f"({type(e).__name__}: {e})") from None
        secs = time.perf_counter() - t0
        self.usage.add(role=role, prompt_tokens=n_prompt, completion_tokens=n_new, seconds=secs)
        reply.tokens = (n_prompt, n_new)
        log.debug("hf %s: %d prompt + %d new tokens in %.1f s%s%s", role, n_prompt, n_new, secs,
                  " constrained" if reply.constrained else "", " truncated" if reply.truncated else "")
        return reply

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model": self.config.path, "adapters": dict(self.config.adapters),
                "device": str(self.device), "dtype": self.config.dtype, "seed": self.config.seed,
                "threads": self._gen_threads, "repetition_penalty": self.config.repetition_penalty,
                "repetition_window": self.config.repetition_window, "no_repeat_ngram": self.config.no_repeat_ngram,
                "no_repeat_word": self.config.no_repeat_word,
                "top_k": self.config.top_k,
                "min_p": self.config.min_p}

    def __repr__(self) -> str:
        return f"HFLLM({self.config.path!r}, adapters={self.config.adapters!r})"

    def close(self) -> None:
        self.model, self._kv = None, None
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for one generation, restored afterwards."""
    if not n:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _cut_at_stop(text: str, stop: Sequence[str] | None) -> str:
    cuts = [text.index(s) for s in stop or () if s and s in text]
    return text[: min(cuts)] if cuts else text
