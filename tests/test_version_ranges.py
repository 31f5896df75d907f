"""pyproject's dependency ranges are the versions CI installs (constraints.txt), not wider."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, Version]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, ver = line.partition("==")
            out[name.strip().lower()] = Version(ver.strip())
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
        pin = pins.get(req.name.lower())
        if pin is None:
            continue
        seen.add(req.name.lower())
        spec = req.specifier
        assert spec.contains(pin, prereleases=True), f"{req}: excludes the tested {pin}"
        major, minor = pin.release[0], pin.release[1]
        assert not spec.contains(Version(f"{major}.{minor + 1}.0")), f"{req}: admits the untested next minor"
        if minor > 0:
            assert not spec.contains(Version(f"{major}.{minor - 1}.0")), f"{req}: admits an older minor"
    assert {"trl", "transformers", "peft", "accelerate", "datasets", "sentence-transformers", "torch"} <= seen
