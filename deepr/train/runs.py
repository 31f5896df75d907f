"""Training runs, whatever the trainer (SFT or any GRPO stage): the output folder and --resume,
Ctrl-C that checkpoints before it stops, the data fingerprint a resumed run must match, and the
tokenizer every trainer loads (a chat template is required).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

META = "deepr_meta.json"
METRICS, ROLLOUTS = "metrics.jsonl", "rollouts.jsonl"
# The logs a run appends to as it goes, each with what its rows' "step" counts from: a metrics row
# carries the step it closes (1-based), a rollout row the step it was sampled in (0-based).
STEP_LOGS = ((METRICS, 1), (ROLLOUTS, 0))


def fingerprint(rows: Sequence[dict[str, Any]]) -> str:
    """Content hash of the training rows: a resumed run must see the same data."""
    return hashlib.sha256(json.dumps(list(rows), sort_keys=True).encode("utf-8")).hexdigest()[:16]


# --- output folder, resume and Ctrl-C ---------------------------------------------------------


def check_out(out: Path, resume: bool, data_fp: str) -> bool:
    """Decide whether to resume; refuse to mix two runs in one folder. Returns 'resume now'."""
    from transformers.trainer_utils import get_last_checkpoint

    meta_file = out / META
    if not out.exists() or not any(out.iterdir()):
        return False
    meta = json.loads(meta_file.read_text(encoding="utf-8")) if meta_file.is_file() else {}
    if not resume:
        raise ValueError(f"{out} already holds a training run ({meta.get('status', 'unknown status')}); pass "
                         "--resume to continue it, or choose another --out")
    if meta.get("data_fingerprint") not in (None, data_fp):
        raise ValueError(f"{out}: the training data changed since this run began (fingerprint "
                         f"{meta['data_fingerprint']} -> {data_fp}); resume with the same --data and --role, "
                         "or choose another --out")
    set_aside_incomplete_checkpoints(out)
    last = get_last_checkpoint(str(out))
    # with no checkpoint the run starts over at step 0, and every step row is written again
    drop_rows_past(out, int(Path(last).name.rsplit("-", 1)[1]) if last else 0)
    return last is not None


def drop_rows_past(out: Path, step: int) -> None:
    """Rows of steps after checkpoint ``step``: a killed run logged them, no checkpoint holds them,
    and the resumed run writes them again, so keeping them would count those steps twice."""
    from deepr.io import atomic_open

    for name, base in STEP_LOGS:
        path = out / name
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if (at := _row_step(line)) is None or at - base < step]
        if len(kept) < len(lines):
            with atomic_open(path) as f:
                f.writelines(kept)


def _row_step(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None  # a torn last line or a foreign row is left as it is
    return step if isinstance(step, int) else None


def set_aside_incomplete_checkpoints(out: Path) -> list[Path]:
    """A kill mid-save leaves ``checkpoint-N`` without its trainer state (written last); rename
    it so that resuming starts from the last complete checkpoint instead of failing on it."""
    moved = []
    for ckpt in sorted(out.glob("checkpoint-*")):
        try:
            json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            dest = ckpt.with_name(f"incomplete-{ckpt.name}-{int(time.time())}")
            ckpt.rename(dest)
            moved.append(dest)
    return moved


def stop_callback() -> Any:
    from transformers import TrainerCallback

    class StopOnInterrupt(TrainerCallback):
        """After a Ctrl-C: finish the step, save a checkpoint, stop."""

        requested = False

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            if self.requested:
                control.should_save = True
                control.should_training_stop = True
            return control

    return StopOnInterrupt()


@contextmanager
def graceful_interrupt(callback: Any) -> Iterator[None]:
    """First Ctrl-C asks the trainer to checkpoint and stop; a second one aborts at once.
    Only for a single process: ranks of a distributed run could disagree on the step."""
    single = int(os.environ.get("WORLD_SIZE", "1")) <= 1
    if not single or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if callback.requested:
            raise KeyboardInterrupt
        callback.requested = True
        print("\ninterrupt: finishing this step and saving a checkpoint (Ctrl-C again aborts at once)",
              file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model)
    except OSError as e:
        raise FileNotFoundError(f"cannot load a tokenizer from {model!r} ({e}); give a model folder, or a hub "
                                "name with network access") from None
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer of {model!r} has no chat template; SFT on chat examples needs one "
                         "(use an instruct/chat model, or set tokenizer.chat_template and save it)")
    return tok


def fit(trainer: Any, out: Path, stop: Any, resume_now: bool, record: Any) -> str:
    """Train (Ctrl-C stops cleanly at a step), then save the adapter (or model) and tokenizer on rank
    0; ``record(status)`` writes deepr_meta.json there before ("running") and after. Every trainer,
    SFT or a GRPO stage, ends here, so outputs look the same whatever trained them."""
    from deepr.train.memory import lean_lm_head, return_freed_memory_to_os

    return_freed_memory_to_os()
    main = trainer.is_world_process_zero()
    if main:
        out.mkdir(parents=True, exist_ok=True)
        record("running")
    with graceful_interrupt(stop), lean_lm_head():
        trainer.train(resume_from_checkpoint=True if resume_now else None)
    status = "interrupted" if stop.requested else "done"
    if main:
        if status == "done":
            trainer.save_model(str(out))
            trainer.processing_class.save_pretrained(str(out))
        record(status)
    return status


# --- run records ------------------------------------------------------------------------------


def write_run_meta(config: Any, **fields: Any) -> None:
    """``deepr_meta.json`` of an SFT or GRPO run: what it is (``fields``), whether it saved an
    adapter, every setting under one name each, when and with which library versions."""
    from deepr.io import redact, versions, write_json

    write_json(config.out / META, {**fields, "adapter": not config.full, "config": redact(config.flat()),
                                   "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions()})


def metrics_callback(path: Path) -> Any:
    """A TrainerCallback appending every log row (all reward sub-terms TRL collected) to ``path``."""
    from transformers import TrainerCallback

    class MetricsLog(TrainerCallback):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            if not logs or not state.is_world_process_zero:
                return
            row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            self.rows.append(row)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())

    return MetricsLog()
