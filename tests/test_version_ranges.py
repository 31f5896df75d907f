"""pyproject's dependency ranges are the versions CI installs (constraints.txt), not wider, and
constraints.txt pins every package pyproject declares."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, Version]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, ver = line.partition("==")
            out[canonicalize_name(name.strip())] = Version(ver.strip())
    return out


def _requirements() -> list[Requirement]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = list(meta["dependencies"])
    for extra in meta["optional-dependencies"].values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def test_each_pinned_package_admits_only_the_pinned_minor_release() -> None:
    """A declared range holds the pinned version and nothing of another minor release, above
    or below: e.g. trl 1.16.0 pinned, so no 1.15 and no 1.17 (whose private methods deepr would
    be overriding untested)."""
    pins, seen = _pins(), set()
    for req in _requirements():
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            continue
        seen.add(canonicalize_name(req.name))
        spec = req.specifier
        assert spec.contains(pin, prereleases=True), f"{req}: excludes the tested {pin}"
        major, minor = pin.release[0], pin.release[1]
        assert not spec.contains(Version(f"{major}.{minor + 1}.0")), f"{req}: admits the untested next minor"
        if minor > 0:
            assert not spec.contains(Version(f"{major}.{minor - 1}.0")), f"{req}: admits an older minor"
    assert {"trl", "transformers", "peft", "accelerate", "datasets", "sentence-transformers", "torch"} <= seen


# Declared but never installed by CI: llama.cpp's GGUF converter imports it, deepr does not.
NOT_INSTALLED_BY_CI = {"sentencepiece"}


def test_every_declared_package_is_pinned_so_ci_tests_its_range() -> None:
    """A package pyproject admits but constraints.txt does not pin would be tested only at whatever
    CI resolved that day, and its declared lower end never (openai 1.40 was admitted while deepr
    imports httpx2, the transport only openai 3 has)."""
    pins = _pins()
    unpinned = sorted({canonicalize_name(r.name) for r in _requirements()} - set(pins) - NOT_INSTALLED_BY_CI)
    assert not unpinned, f"declared in pyproject.toml but not pinned in constraints.txt: {unpinned}"
