"""The one reader/writer pair for JSONL artefacts, plus resume, shards, rejects and sidecars.

- ``read_jsonl(path, Model)`` yields validated records; a bad line raises
  :class:`RecordError` naming the file, line and field.
- ``write_jsonl(path, records)`` replaces a file atomically (temp file + fsync + rename).
- ``JsonlAppender(path)`` appends one record per line with flush + fsync, so an
  interrupted stage keeps every finished record; on open it cuts a torn last line left
  by a killed process.
- ``done_ids(path)`` is what a resumable stage skips; ``in_shard(id, "K/N")`` splits work
  deterministically across machines.
- ``write_meta(out, ...)`` writes the ``<out>.meta.json`` provenance sidecar.
- ``check_paths(inputs, outputs, out_dirs)`` refuses, before any work, an input that is a
  folder, an output that is or would overwrite an input, and an output location that cannot
  be written; every command calls it first.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

_SECRET_NAMES = {"token", "api_key", "apikey", "secret", "password", "passwd", "authorization"}
_SECRET_SUFFIXES = ("_token", "_api_key", "_apikey", "_secret", "_password")


def is_secret_name(name: str) -> bool:
    """Credential-looking names (api_key, hf_token, client_secret); not max_tokens or tokenizer."""
    k = str(name).lower().lstrip("-").replace("-", "_")
    return k in _SECRET_NAMES or k.endswith(_SECRET_SUFFIXES)


class RecordError(ValueError):
    """A JSONL line that is not valid JSON or does not fit its record type."""

    def __init__(self, path: str | Path, line: int, message: str, field: str | None = None):
        self.path, self.line, self.field = str(path), line, field
        where = f"{path}:{line}" + (f" field '{field}'" if field else "")
        super().__init__(f"{where}: {message}")


def _field_of(err: ValidationError) -> tuple[str | None, str]:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return (loc or None), first.get("msg", str(err))


def parse_line(text: str, model: type[M] | None, path: str | Path, lineno: int) -> M | dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(path, lineno, f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise RecordError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    if model is None:
        return obj
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        field, msg = _field_of(e)
        raise RecordError(path, lineno, msg, field) from None


def read_jsonl(
    path: str | Path, model: type[M] | None = None, *, tolerate_torn_tail: bool = False
) -> Iterator[M | dict]:
    """Yield records of ``path``; blank lines are skipped.

    ``tolerate_torn_tail`` ignores an unterminated, unparseable last line: the mark of a
    writer killed mid-line, which :class:`JsonlAppender` cuts off on its next open.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file (check the path, or run the stage that writes it)")
    if path.is_dir():
        raise ValueError(f"{path}: is a folder; expected a JSONL file")
    with path.open("r", encoding="utf-8") as f:
        lines = f.readlines()
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        torn = lineno == len(lines) and not raw.endswith("\n")
        try:
            yield parse_line(raw, model, path, lineno)
        except RecordError:
            if torn and tolerate_torn_tail:
                return
            raise


def read_records(path: str | Path, model: type[M]) -> list[M]:
    return list(read_jsonl(path, model))


def _dump(record: BaseModel | dict) -> str:
    if isinstance(record, BaseModel):
        return record.model_dump_json(exclude_none=False)
    return json.dumps(record, ensure_ascii=False)


def _open_temp(path: Path) -> tuple[int, str]:
    """A new temp file beside ``path``, created with the mode the finished file should have: the
    mode of the file it replaces, else what any new file gets (0666 less the umask, applied by
    the kernel at creation, so the umask is never read or changed: os.umask() sets it for every
    thread, and /proc cost a read per write)."""
    try:
        keep: int | None = path.stat().st_mode & 0o777
    except OSError:
        keep = None
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        if keep is not None:
            os.chmod(tmp, keep)
        return fd, tmp
    raise FileExistsError(f"could not create a temp file beside {path}")


@contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[Any]:
    """Write to a temp file beside ``path`` and rename it over ``path`` only on success; the
    result is as readable as any other new file (or keeps the mode of the file it replaces)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _open_temp(path)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_jsonl(path: str | Path, records: Iterable[BaseModel | dict]) -> int:
    n = 0
    with atomic_open(path) as f:
        for r in records:
            f.write(_dump(r) + "\n")
            n += 1
    return n


def write_json(path: str | Path, obj: Any) -> None:
    # dumps, not dump: dump hands the file the encoder's small pieces one write call each, a
    # quarter slower on a report's trace (written once per question by `deepr run`).
    text = json.dumps(obj, ensure_ascii=False, indent=2, default=str)
    with atomic_open(path) as f:
        f.write(text + "\n")


def write_text(path: str | Path, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def _cut_torn_tail(path: Path) -> None:
    """Drop bytes after the last newline (a line half-written by a killed process)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        f.seek(keep)
        f.truncate()


class JsonlAppender:
    """Append records one line at a time, flushed and fsynced, so Ctrl-C loses nothing."""

    def __init__(self, path: str | Path, fsync: bool = True):
        self.path = Path(path)
        self.fsync = fsync
        self.count = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _cut_torn_tail(self.path)
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, record: BaseModel | dict) -> None:
        self._f.write(_dump(record) + "\n")
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())
        self.count += 1

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def done_ids(path: str | Path) -> set[str]:
    """Ids already written to an output file (the torn last line, if any, is not done)."""
    path = Path(path)
    if not path.exists():
        return set()
    return {r["id"] for r in read_jsonl(path, tolerate_torn_tail=True) if "id" in r}


# --- shards -------------------------------------------------------------------------


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    """``"K/N"`` (1-based K) → (K, N); None means the whole input."""
    if not spec:
        return None
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard {spec!r}: expected K/N with integers, e.g. 2/8") from None
    if not (n >= 1 and 1 <= k <= n):
        raise ValueError(f"--shard {spec!r}: need 1 <= K <= N")
    return k, n


def in_shard(record_id: str, shard: tuple[int, int] | None) -> bool:
    """Deterministic split by a hash of the id, stable across machines and Python runs."""
    if shard is None:
        return True
    k, n = shard
    h = int.from_bytes(hashlib.sha1(record_id.encode("utf-8")).digest()[:8], "big")
    return h % n == k - 1


# --- rejects and provenance -----------------------------------------------------------


def rejects_path(out: str | Path) -> Path:
    out = Path(out)
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(f"{stem}.rejects.jsonl")


def meta_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".meta.json")


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def redact(obj: Any) -> Any:
    """Replace values of secret-looking keys (api keys, tokens, passwords) by '***'."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    if isinstance(obj, dict):
        return {
            k: ("***" if is_secret_name(k) and v else redact(v))
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [redact(v) for v in obj]
    return obj


_VERSIONED = ("torch", "transformers", "trl", "peft", "sentence-transformers",
              "faiss-cpu", "bm25s", "datasets", "openai", "pydantic")


def versions() -> dict[str, str]:
    """Python's, deepr's and the main libraries' versions, read once per process: a metadata
    lookup scans sys.path (~6 ms a package), and `deepr run --queries` writes a sidecar per
    question (the throughput benchmark: 60 ms a question, a third of its CPU)."""
    return dict(_versions())


@functools.cache
def _versions() -> tuple[tuple[str, str], ...]:
    from deepr._version import __version__

    # deepr's own version from the code that runs (its distribution is deepr-toolkit; a package
    # named "deepr" on the index is another project)
    out = {"python": platform.python_version(), "deepr": __version__}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return tuple(out.items())


def write_meta(
    out: str | Path,
    *,
    stage: str,
    config: Any = None,
    inputs: Iterable[str | Path] = (),
    counts: dict[str, Any] | None = None,
    timings: dict[str, float] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``<out>.meta.json``: resolved config (secrets redacted), input hashes, versions."""
    ins = []
    for p in inputs:
        p = Path(p)
        ins.append({"path": str(p), "sha256": file_sha256(p) if p.is_file() else None})
    meta = {
        "stage": stage,
        "output": str(out),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": redact_argv(sys.argv),
        "config": redact(config) if config is not None else None,
        "inputs": ins,
        "versions": versions(),
        "counts": counts or {},
        "timings": timings or {},
        **(redact(extra) if extra else {}),
    }
    path = meta_path(out)
    write_json(path, meta)
    return path


def redact_argv(argv: list[str]) -> list[str]:
    out, hide_next = [], False
    for a in argv:
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        if a.startswith("--") and is_secret_name(a.split("=", 1)[0]):
            if "=" in a:
                out.append(a.split("=", 1)[0] + "=***")
            else:
                out.append(a)
                hide_next = True
            continue
        out.append(a)
    return out


# --- where a command may write ----------------------------------------------------------


def _same(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def _writable_location(path: Path, flag: str) -> None:
    """The first existing ancestor of ``path`` must be a folder we can write into."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot write into {parent} (permission denied)")


def check_paths(inputs: Iterable[tuple[str, str | Path | None]] = (),
                outputs: Iterable[tuple[str, str | Path | None]] = (),
                out_dirs: Iterable[tuple[str, str | Path | None, Iterable[str]]] = ()) -> None:
    """Refuse a run that would fail late or destroy an input; raises ValueError naming the flag.

    ``inputs``: (flag, file) pairs that must be readable files (a folder is refused; a
    missing file is left to the reader, which names it). ``outputs``: (flag, file) pairs the
    command writes, sidecars included. ``out_dirs``: (flag, folder, names) for commands that
    write a folder; ``names`` are the files it will hold, checked against the inputs too.
    """
    ins = [(f, Path(p)) for f, p in inputs if p is not None]
    for flag, p in ins:
        if p.is_dir():
            raise ValueError(f"{flag} {p}: is a folder; expected a file")
        if p.exists() and not os.access(p, os.R_OK):
            raise ValueError(f"{flag} {p}: cannot read it (permission denied)")
    files = [(f, Path(p)) for f, p in outputs if p is not None]
    for flag, d, names in out_dirs:
        if d is None:
            continue
        d = Path(d)
        if d.exists() and not d.is_dir():
            raise ValueError(f"{flag} {d}: is a file; expected a folder")
        for iflag, p in ins:
            if _same(d, p):
                raise ValueError(f"{flag} {d} is the input {iflag} {p}; choose another output folder")
        if d.is_dir():
            if not os.access(d, os.W_OK | os.X_OK):
                raise ValueError(f"{flag} {d}: cannot write into it (permission denied)")
        else:
            _writable_location(d / "x", flag)
        files += [(flag, d / n) for n in names]
    for flag, out in files:
        for iflag, p in ins:
            if _same(out, p):
                raise ValueError(f"{flag} {out} would overwrite the input {iflag} {p}; choose another output")
        if out.is_dir():
            raise ValueError(f"{flag} {out}: is a folder; expected a file path")
        if out.exists() and not os.access(out, os.W_OK):
            raise ValueError(f"{flag} {out}: cannot write it (permission denied)")
        _writable_location(out, flag)


def require_records(items: list[T], path: str | Path, flag: str = "", what: str = "records") -> list[T]:
    """An input with nothing in it is a mistake (a wrong path, an earlier stage that wrote nothing)."""
    if not items:
        raise ValueError(f"{flag + ' ' if flag else ''}{path}: holds no {what}; nothing to do")
    return items
