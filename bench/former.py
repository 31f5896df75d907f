"""deepr's code as it was at an earlier commit, for baselines timed in the same process.

    from former import module_at, numpy_blas_threads
    old = module_at("0709be9", "deepr/corpus/npbert.py")   # that commit's numpy encoder

Needs a git clone with history (the benches run from one).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_at(commit: str, path: str) -> types.ModuleType:
    """The module at ``path`` as committed in ``commit``, imported under a name of its own."""
    try:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{path}"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"the baseline needs {path} at commit {commit}: run the bench from a git clone with history ({e})")
    name = f"former_{commit}_{Path(path).stem}"
    mod = types.ModuleType(name)
    mod.__file__ = f"{commit}:{path}"
    sys.modules[name] = mod
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)  # noqa: S102  our own code, from our own history
    return mod


@contextlib.contextmanager
def numpy_blas_threads(n: int) -> Iterator[None]:
    """numpy's BLAS on ``n`` threads for a while. The numpy encoder pins it to one for good once
    it runs; encoders before it ran with OpenBLAS's default (one thread per core) and limited it
    around each call, which is part of what they cost."""
    from deepr.corpus.npbert import numpy_blas

    libs = numpy_blas()
    before = [lib.num_threads for lib in libs]
    for lib in libs:
        lib.set_num_threads(n)
    try:
        yield
    finally:
        for lib, k in zip(libs, before):
            lib.set_num_threads(k)
