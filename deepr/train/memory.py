"""Memory of CPU training: settings that keep a small model's SFT / GRPO step within a few GB.

Used by :mod:`deepr.train.sft` and :mod:`deepr.train.grpo` around ``trainer.train()``; nothing
here changes what is computed, only where and in which pieces. Peak memory and seconds per step
are measured by the SFT memory benchmark (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Vocabulary columns per LM-head tile on CPU. TRL's default (32768) is sized for a GPU kernel that
# folds a tile in place; its torch fallback makes ~10 temporaries of the tile, so at 3.5k scored
# tokens one backward tile held ~4 GB. 4096 columns keep a tile of 4096 tokens at 64 MB.
CPU_VOCAB_CHUNK = 4096


def checkpointing_args(args_cls: type, on: bool) -> dict[str, Any]:
    """Activation checkpointing settings for a TRL config class, under the name its transformers
    uses (5.x renamed ``gradient_checkpointing``; the old name still works but warns). Non-reentrant:
    the reentrant form gives LoRA's frozen base no gradient path unless inputs are forced to need one."""
    name = ("activation_checkpointing" if "activation_checkpointing" in getattr(args_cls, "__dataclass_fields__", {})
            else "gradient_checkpointing")
    return {name: on, name + "_kwargs": {"use_reentrant": False}}


def return_freed_memory_to_os() -> bool:
    """Make glibc hand freed activation buffers back to the OS (Linux; a no-op elsewhere).

    glibc serves blocks under its dynamic mmap threshold (which climbs to 32 MB) from its heaps.
    A CPU training step allocates and frees per-layer buffers of a few MB; the heaps fragment and
    resident memory grows to several times the live tensors (SmolLM2-135M, one LoRA step at 1.4k
    tokens: 2.9 GB resident after the backward pass, 1.4 GB with this). A fixed threshold of
    256 KiB puts such buffers in their own mappings, which free() unmaps. The environment's
    MALLOC_MMAP_THRESHOLD_ wins when set."""
    if sys.platform != "linux" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 256 * 1024)) and bool(libc.mallopt(m_trim_threshold, 1 << 20))


@contextmanager
def lean_lm_head() -> Iterator[bool]:
    """While training on CPU, let TRL's fused LM head score only the positions that carry loss.

    TRL's SFT and GRPO trainers replace the ``[tokens, vocab]`` logits with a chunked head
    (``trl.trainer.utils.add_fused_lm_head``). On GPUs it projects only the labelled positions
    ("compact"); elsewhere it projects every position, because on compiled accelerators a varying
    count would recompile. CPU eager mode has no such cost, and with a completion-only loss the
    labelled positions are the reply (~50 of 3.5k tokens for a planner example), so scoring all of
    them held ~4.7 GB of tiles at the peak of the backward pass of SmolLM2-135M. The loss is the
    same sum over the same labelled tokens. Yields whether the head was changed (False on a GPU
    machine or a TRL without these hooks, which then trains as before, with more memory)."""
    import torch

    try:
        from trl.trainer import utils as trl_utils
    except ImportError:
        yield False
        return
    original_compact, original_chunk = getattr(trl_utils, "_use_triton", None), getattr(
        trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", None)
    if torch.cuda.is_available() or original_compact is None or original_chunk is None:
        yield False
        return

    def compact(device: Any) -> bool:  # read by the fused head only to choose compact scoring
        return device.type == "cpu" or original_compact(device)

    trl_utils._use_triton = compact
    trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = min(original_chunk, CPU_VOCAB_CHUNK)
    try:
        yield True
    finally:
        trl_utils._use_triton = original_compact
        trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = original_chunk
