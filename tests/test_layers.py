"""Layers run one way (docs/architecture.md, "Layers"): every import in deepr/, at module level or
inside a function, goes to a package on the same floor or below, and no two packages import each
other. The floors are written here from the page, not derived from the code."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "deepr"

FLOORS = [  # lowest first; a package may import its own floor and the floors below
    {"records", "io", "activity", "text", "_version"},
    {"corpus", "llm"},
    {"roles"},
    {"evidence"},
    {"search"},
    {"extractive"},
    {"agent", "data"},
    {"rewards"},
    {"train", "eval"},
    {"profiles"},
    {"api", "learn"},
    {"cli", "__main__", "deepr"},
]
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}


def _unit(parts: list[str]) -> str:
    """The floor unit a dotted module name (without 'deepr.') belongs to: its package, or itself."""
    if not parts or parts == ["__init__"]:
        return "deepr"
    return parts[0].removesuffix(".py")


def _is_module(name: str) -> bool:
    return (ROOT / f"{name}.py").is_file() or (ROOT / name).is_dir()


def imports() -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, 'file:line') for every deepr import in deepr/."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("").parts
        src = _unit(list(rel))
        package = list(rel[:-1]) if rel[-1] != "__init__" else list(rel[:-1])
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = package[: len(package) - node.level + 1]
                    targets = [".".join(["deepr", *base, *([node.module] if node.module else [])])]
                else:
                    targets = [node.module or ""]
                if targets[0] == "deepr":  # `from deepr import x`: a module x, else the package root
                    targets = [f"deepr.{a.name}" if _is_module(a.name) else "deepr" for a in node.names]
            else:
                continue
            for t in targets:
                if t == "deepr" or t.startswith("deepr."):
                    dst = _unit(t.split(".")[1:])
                    if dst != src:
                        out.append((src, dst, f"{path.relative_to(ROOT.parent)}:{node.lineno}"))
    return out


def test_every_package_is_on_a_floor():
    units = {_unit(list(p.relative_to(ROOT).with_suffix("").parts)) for p in ROOT.rglob("*.py")}
    assert units - FLOOR.keys() == set(), "put each new package on a floor here and in docs/architecture.md"


def test_no_import_goes_up_a_floor():
    up = [f"{where}: {src} (floor {FLOOR[src]}) imports {dst} (floor {FLOOR[dst]})"
          for src, dst, where in imports() if FLOOR.get(dst, -1) > FLOOR[src]]
    assert up == []


def test_no_two_packages_import_each_other():
    pairs = {(s, d) for s, d, _ in imports()}
    both = sorted({tuple(sorted(p)) for p in pairs if (p[1], p[0]) in pairs})
    assert both == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The walk itself: a lazy import inside a function counts as much as one at the top."""
    pkg = tmp_path / "deepr"
    (pkg / "llm").mkdir(parents=True)
    (pkg / "llm" / "x.py").write_text("def f():\n    from deepr.agent.dag import run\n    return run\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    assert imports() == [("llm", "agent", "deepr/llm/x.py:2")]
