"""The default profile's formats are what a capable model and every server accept; small-model
machinery lives in deepr/profiles only.

Every role's default JSON schema (its own reply shape, :func:`deepr.llm.schema.strict_schema`)
is checked against the rules OpenAI documents for strict structured outputs ("Supported
schemas" in the Structured Outputs guide):

- the root is an object, not ``anyOf``;
- every object sets ``additionalProperties: false`` and lists all its properties as required
  (an optional field is a required nullable one);
- only supported keywords: ``type``, ``properties``, ``required``, ``additionalProperties``,
  ``items``, ``enum``, ``const``, ``anyOf``, ``$ref``/``$defs``, ``description``, and the
  type-specific ``pattern``, ``format``, ``minimum``/``maximum``/``exclusiveMinimum``/
  ``exclusiveMaximum``/``multipleOf``, ``minItems``/``maxItems`` (no ``default``,
  ``minLength``/``maxLength``, ``minProperties``, ``patternProperties``, ``uniqueItems``, ...);
- at most 5,000 object properties in all and at most 10 levels of nesting;
- at most 120,000 characters for all property names, definition names, enum and const values
  together; at most 1,000 enum values in all, and at most 15,000 characters for the values of
  one enum with more than 250 of them.

Each schema is then compiled by the grammar engines vLLM and SGLang use, as installed here
(xgrammar, llguidance, outlines-core), and converted to GBNF with llama-cpp-python's converter
(:func:`deepr.llm.gbnf.schema_to_gbnf`), which llama.cpp's own parser must accept when the
library and SmolLM2's vocabulary are installed. Each tagged (regex) format is converted to GBNF
and compiled by xgrammar and llguidance the same way.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import pkgutil
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import deepr
from deepr.roles import JSONReply, Role

PACKAGES = ("deepr.agent", "deepr.data", "deepr.rewards", "deepr.eval")
SUPPORTED = {"type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf", "$ref",
             "$defs", "description", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
             "exclusiveMaximum", "multipleOf", "minItems", "maxItems"}
# a wave's reply shape is built from the wave (its node ids); every other default is static
WAVE_ASK = SimpleNamespace(wave=["N5", "N6"])


def _modules():
    for pkg in PACKAGES:
        root = importlib.import_module(pkg)
        yield root
        for info in pkgutil.iter_modules(root.__path__, pkg + "."):
            yield importlib.import_module(info.name)


def _roles() -> dict[str, Role]:
    return {f"{m.__name__}.{attr}": v for m in _modules() for attr, v in vars(m).items() if isinstance(v, Role)}


def default_schemas() -> dict[str, dict]:
    """Each role's default JSON schema, and each judgement's (``schema=`` in rewards/eval)."""
    out = {name: role.output.fmt(name, WAVE_ASK).json_schema for name, role in _roles().items()
           if isinstance(role.output, JSONReply)}
    for mod in _modules():
        for ref in re.findall(r"\bschema=([A-Za-z_][\w.]*)", Path(mod.__file__).read_text()):
            obj = mod
            for part in ref.split("."):
                obj = getattr(obj, part, None)
            if isinstance(obj, type) and hasattr(obj, "model_json_schema"):
                out[f"{mod.__name__}.{ref}"] = JSONReply(obj).fmt(ref).json_schema
    return out


def default_regexes() -> dict[str, str]:
    return {name: fmt.regex for name, role in _roles().items()
            if (fmt := role.output.fmt(name, WAVE_ASK)).regex is not None}


def strict_problems(schema: dict) -> list[str]:
    """What OpenAI's strict structured outputs would refuse in ``schema`` (see the module docstring)."""
    problems, counts = [], {"props": 0, "chars": 0, "enums": 0}
    if schema.get("type") != "object" or "anyOf" in schema:
        problems.append("the root is not an object")

    def walk(node, depth, where):
        if isinstance(node, list):
            for v in node:
                walk(v, depth, where)
            return
        if not isinstance(node, dict):
            return
        problems.extend(f"{where}: unsupported keyword {k!r}" for k in node if k not in SUPPORTED)
        if "properties" in node or node.get("type") == "object":
            props = node.get("properties", {})
            counts["props"] += len(props)
            counts["chars"] += sum(map(len, props))
            if node.get("additionalProperties") is not False:
                problems.append(f"{where}: additionalProperties is not false")
            if set(node.get("required", [])) != set(props):
                problems.append(f"{where}: not every property is required")
            if depth > 10:
                problems.append(f"{where}: nested deeper than 10 levels")
            for name, sub in props.items():
                walk(sub, depth + 1, f"{where}.{name}")
        for key in ("items", "anyOf"):
            if key in node:
                walk(node[key], depth, f"{where}[{key}]")
        for name, sub in node.get("$defs", {}).items():
            counts["chars"] += len(name)
            walk(sub, 0, f"$defs.{name}")
        if "enum" in node:
            values = [str(v) for v in node["enum"]]
            counts["enums"] += len(values)
            counts["chars"] += sum(map(len, values))
            if len(values) > 250 and sum(map(len, values)) > 15_000:
                problems.append(f"{where}: an enum of {len(values)} values over 15,000 characters")
        if "const" in node:
            counts["chars"] += len(str(node["const"]))

    walk(schema, 1, "$")
    if counts["props"] > 5000:
        problems.append(f"{counts['props']} object properties (at most 5,000)")
    if counts["chars"] > 120_000:
        problems.append(f"{counts['chars']} characters of names and values (at most 120,000)")
    if counts["enums"] > 1000:
        problems.append(f"{counts['enums']} enum values (at most 1,000)")
    return problems


SCHEMAS = default_schemas()
REGEXES = default_regexes()


def test_the_lists_cover_every_role_and_judgement():
    for must in ("deepr.agent.planner.INITIAL", "deepr.agent.planner.REVISE", "deepr.agent.answerer.WAVE",
                 "deepr.data.rubrics.SYNTHESIZE", "deepr.data.verify.AUDIT", "deepr.data.tree_roles.DECOMPOSE",
                 "deepr.agent.warp.DEEPEN", "deepr.rewards.judges._Score04", "deepr.rewards.race._RaceReply"):
        assert must in SCHEMAS, must
    assert {"deepr.agent.answerer.FINAL", "deepr.agent.decor.PLAN", "deepr.agent.tools_agent.STEP"} <= set(REGEXES)
    assert len(SCHEMAS) >= 25 and len(REGEXES) >= 6


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_default_schema_meets_openai_strict_rules(name):
    assert strict_problems(SCHEMAS[name]) == []


def test_the_checker_refuses_what_strict_mode_refuses():
    """The rules above are not vacuous: pydantic's own schemas and the small profile's plan
    graph break them."""
    from deepr.profiles.small.planner import graph_format
    from deepr.records import PlanNode

    raw = strict_problems(PlanNode.model_json_schema())
    assert any("not every property is required" in p for p in raw) and any("'title'" in p for p in raw)
    assert strict_problems({"anyOf": [{"type": "object"}]})
    assert any("minLength" in p for p in strict_problems(
        {"type": "object", "properties": {"a": {"type": "string", "minLength": 3}}, "required": ["a"],
         "additionalProperties": False}))
    assert strict_problems(graph_format(False).json_schema)  # small-model machinery stays out of the default


def test_the_planners_default_schema_is_its_own_typed_shape():
    """Typed nodes and nothing else: the graph rules are the validator's (and a re-ask's)."""
    for action in ("INITIAL", "REVISE"):
        schema = SCHEMAS[f"deepr.agent.planner.{action}"]
        assert len(json.dumps(schema)) <= 4000
        node = schema["$defs"]["PlanNodeShape"]
        assert node["properties"]["type"]["enum"] == ["search", "aggregate", "answer"]
        assert "pattern" not in json.dumps(schema)


def test_a_strict_reply_with_nulls_parses_as_the_role_expects():
    """Optional fields come back as nulls from a strict server; the role reads them as left out."""
    from deepr.agent.planner import INITIAL

    reply = json.dumps({"nodes": [
        {"id": "N1", "type": "search", "query": "volcano eruption causes", "need": None, "key_points": [], "inputs": []},
        {"id": "N2", "type": "answer", "query": None, "need": "why volcanoes erupt", "key_points": [],
         "inputs": ["N1"]}]})
    value, error = INITIAL.output.parse(reply)
    assert error is None and INITIAL.check(None, value) == []
    assert "need" not in value["nodes"][0] and "query" not in value["nodes"][1]


# -- the grammar engines -----------------------------------------------------------------------


def test_every_default_schema_compiles_with_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b", "{", "}", '"', "</s>"], stop_token_ids=[5]))
    for name, schema in SCHEMAS.items():
        compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)  # raises on what it cannot compile
    for name, rx in REGEXES.items():
        compiler.compile_grammar(xgr.Grammar.from_regex(rx))


def test_every_default_schema_compiles_with_llguidance():
    llg = pytest.importorskip("llguidance")
    bad = {name: err for name, schema in SCHEMAS.items()
           if (err := llg.LLMatcher.validate_grammar(llg.grammar_from("json_schema", json.dumps(schema))))}
    bad.update({name: err for name, rx in REGEXES.items()
                if (err := llg.LLMatcher.validate_grammar(llg.grammar_from("regex", rx)))})
    assert bad == {}


def test_every_default_schema_compiles_with_outlines_core():
    pytest.importorskip("outlines_core")
    from outlines_core.json_schema import build_regex_from_schema

    for name, schema in SCHEMAS.items():
        assert re.compile(build_regex_from_schema(json.dumps(schema))), name


def test_every_default_format_converts_to_gbnf_and_llama_cpp_parses_it():
    from deepr.llm.gbnf import regex_to_gbnf, schema_to_gbnf

    for rx in REGEXES.values():
        assert "root ::=" in regex_to_gbnf(rx)
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama_cpp is not installed (pip install 'deepr[llamacpp]'): the GBNF parse is not checked")
    from test_llm_llamacpp import _gguf, _vocab

    if _gguf() is None:
        pytest.skip("the SmolLM2 GGUF is not installed (deepr[smollm2]): llama.cpp's parser needs a vocabulary")
    import llama_cpp

    bad = []
    with _vocab() as parse:
        grammars = {**{n: schema_to_gbnf(s) for n, s in SCHEMAS.items()},
                    **{n: regex_to_gbnf(r) for n, r in REGEXES.items()}}
        for name, grammar in grammars.items():
            sampler = parse(grammar)  # NULL when llama.cpp's parser rejects the grammar
            if sampler:
                llama_cpp.llama_sampler_free(sampler)
            else:
                bad.append(name)
    assert bad == []


# -- where the small-model machinery lives ----------------------------------------------------


SMALL_MACHINERY = ("deepr.profiles", "deepr.llm.hf_constrain")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_no_role_or_stage_module_imports_small_model_machinery():
    root = Path(deepr.__file__).parent
    found = {str(p.relative_to(root)): sorted(m for m in _imports(p) if m.startswith(SMALL_MACHINERY))
             for pkg in ("agent", "data", "train") for p in (root / pkg).glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_package_root_holds_few_modules():
    root = Path(deepr.__file__).parent
    assert len([p for p in root.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]) <= 5


def test_no_module_imports_itself_back_through_others():
    """No circle among deepr's module-level imports (an import inside a function is a deliberate
    late binding, e.g. a heavy library or a backend chosen at run time, and is left out)."""
    import sys

    root = Path(deepr.__file__).parent
    mods = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in root.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.parse(path.read_text()).body:
            # ``from pkg import module`` depends on that module; ``from pkg import name`` on pkg
            names = ([f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                      for a in node.names] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for target in filter(None, map(resolve, (n for n in names if n.startswith("deepr")))):
                if target != mod and not mod.startswith(target + "."):  # its own package's __init__
                    edges[mod].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = [stack.pop()]
            while comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in mods:
        if v not in index:
            visit(v)
    assert circles == []
