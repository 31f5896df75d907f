"""Greedy calls that wait for the hf backend's model at the same time are decoded as one batch.

On a CPU a 135M model spends most of each decoding step on per-token overhead, not on the
matrix products, so rows added to a step cost little. A padded batch's prefill, though, cannot
use the causal attention kernel, so long prompts run alone (``batch_max_prompt``); measured in
docs/experiments.md. ``deepr run --queries ... --parallel N`` keeps N questions in flight, so
their calls meet here.

Only calls that decode the same way share a batch: greedy (a sampled call keeps its own seed and
runs alone, so seeded sampling repeats exactly), no stop strings, the same adapter and reply
budget, prompts up to ``batch_max_prompt`` tokens, and all constrained or all not (each row gets
its own grammar); a call with no key runs alone. The first waiting thread that gets the model
decodes its own call together with the compatible calls queued behind it; the others return as
soon as their replies are ready (see :class:`Gate`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepr.llm.base import OutputFormat


@dataclass
class Pending:
    """One call waiting for the model: its prompt ids and, once decoded, its new token ids."""

    ids: list[int]
    key: tuple[Any, ...] | None  # calls with equal keys may share a batch; None: never shared
    fmt: OutputFormat | None
    new: list[int] | None = None
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self.new is not None or self.error is not None


@dataclass
class Queue:
    """Calls waiting for the model, in arrival order."""

    limit: int
    waiting: list[Pending] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, call: Pending) -> None:
        with self.lock:
            self.waiting.append(call)

    def take(self, first: Pending) -> list[Pending]:
        """``first`` and up to ``limit - 1`` queued calls that may share its batch (removed)."""
        with self.lock:
            mates = [] if first.key is None else [c for c in self.waiting if c is not first and c.key == first.key]
            batch = [first] + mates[: self.limit - 1]
            self.waiting = [c for c in self.waiting if all(c is not b for b in batch)]
            return batch


class Gate:
    """The model runs one generation at a time. A waiting call wakes when the model is free or
    when its own reply is ready, whichever comes first: a call decoded in someone else's batch
    returns at once instead of waiting out the generation that starts after that batch."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._busy = False

    def acquire(self, ready: Callable[[], bool] = lambda: False) -> bool:
        """True: the caller now holds the model (release it); False: ``ready()`` came true first."""
        with self._cv:
            while self._busy and not ready():
                self._cv.wait()
            if ready():
                return False
            self._busy = True
            return True

    def release(self) -> None:
        with self._cv:
            self._busy = False
            self._cv.notify_all()


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[Any, Any]:
    """(input_ids, attention_mask) with every prompt right-aligned, as decoder-only generation needs."""
    import torch

    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, n - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, n - len(r):] = 1
    return ids, mask
