"""The engine seam: role modules declare the model's turn; the extractive engine lives in
deepr/extractive, and only deepr/llm, that package and the role executor know which engine runs."""

from __future__ import annotations

import ast
import asyncio
import importlib
import pkgutil
from pathlib import Path

import deepr
from deepr.roles import Role

ROOT = Path(deepr.__file__).parent
ROLE_PACKAGES = ("deepr.agent", "deepr.data", "deepr.rewards")


def _modules(package: str) -> list[str]:
    pkg = importlib.import_module(package)
    return [f"{package}.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if not m.ispkg]


def _roles() -> list[tuple[str, str, Role]]:
    found = []
    for name in (m for p in ROLE_PACKAGES for m in _modules(p)):
        module = importlib.import_module(name)
        found += [(name, attr, v) for attr, v in vars(module).items() if isinstance(v, Role)]
    return found


def test_every_role_names_its_implementation_in_the_extractive_package():
    roles = _roles()
    # the agent's dag, decor, warp, tools and support roles and the data stages' ones
    assert len(roles) >= 20
    assert {name for name, _, _ in roles} >= {"deepr.agent.planner", "deepr.agent.decor", "deepr.agent.warp",
                                               "deepr.agent.tools_agent", "deepr.data.tree_roles",
                                               "deepr.data.rubrics", "deepr.data.verify"}
    elsewhere = [f"{name}.{attr}: {role.extractive.__module__}.{role.extractive.__qualname__}"
                 for name, attr, role in roles if not role.extractive.__module__.startswith("deepr.extractive.")]
    assert elsewhere == []
    # plain references, not lambdas: reading the role shows where its implementation is
    assert [f"{n}.{a}" for n, a, r in roles if r.extractive.__name__ == "<lambda>"] == []


def test_the_extractive_package_imports_no_role_module():
    role_modules = {name for name, _, _ in _roles()}
    imports = {}
    for path in sorted((ROOT / "extractive").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        names |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                  for a in n.names}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imports[path.name] = sorted(names & role_modules)
    assert {k: v for k, v in imports.items() if v} == {}


def test_the_engine_is_chosen_by_the_spec_and_is_no_backend():
    """``--llm extractive`` builds no model: stages pass ``llm=None`` down to the executor."""
    import deepr.extractive
    import deepr.llm
    from deepr.llm import get_llm
    from deepr.llm.replay import ReplayLLM
    from deepr.roles import engine_info, engine_label

    assert get_llm("extractive") is None and get_llm(" extractive ") is None
    assert not hasattr(deepr.llm, "ExtractiveLLM")
    model = ReplayLLM([])
    assert engine_label(None) == "extractive" and engine_label(model).startswith("llm:replay")
    assert engine_info(None)["backend"] == "extractive" and engine_info(None)["model"] is None
    # nothing for callers to branch on: the package holds the role implementations only
    assert [n for n, v in vars(deepr.extractive).items() if callable(v) and not n.startswith("_")] == []


def test_perform_without_a_model_records_the_implementation_s_reply():
    from deepr.roles import JSONReply, Recorder, RoleFailed, perform

    def reply(a: dict) -> dict:
        if not a["ok"]:
            raise RoleFailed("nothing to say")
        return {"x": a["x"]}

    role = Role(name="probe", action="say", messages=lambda a: [{"role": "user", "content": "say"}],
                output=JSONReply(), extractive=reply, result=lambda a, v: v["x"] * 2)
    rec = Recorder()
    out = asyncio.run(perform(role, {"ok": True, "x": 21}, llm=None, rec=rec))
    assert (out.value, out.by, rec.engines["extractive"]) == (42, "extractive", 1)
    assert rec.turns[-1].completion == '{"x": 21}' and rec.turns[-1].model_extra["extractive"] is True
    out = asyncio.run(perform(role, {"ok": False}, llm=None, rec=rec))
    assert (out.value, out.by, out.error) == (None, "failed", "nothing to say")
    assert rec.failures[-1]["reason"] == "nothing to say" and rec.engines["failed"] == 1


def test_the_architecture_page_lists_every_role_under_its_module():
    doc = (ROOT.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    listed = {}
    for line in doc.splitlines():
        if line.startswith("- `") and "`: " in line and line.split("`")[1].endswith(".py"):
            module = "deepr." + line.split("`")[1].removesuffix(".py").replace("/", ".")
            listed[module] = {r.strip() for r in line.split("`: ", 1)[1].split(",")}
    declared: dict[str, set[str]] = {}
    for name, _, role in _roles():
        if role.messages.__module__ == name:  # declared here, not imported from another module
            declared.setdefault(name, set()).add(f"{role.name}.{role.action}")
    assert listed == declared
