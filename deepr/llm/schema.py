"""Role schemas in the subset of JSON Schema that strict structured outputs accept.

OpenAI's strict mode (and the grammar engines vLLM, SGLang and llama.cpp use) take a subset of
JSON Schema: every object lists all its properties as required and forbids others, an optional
field is a required nullable one, and some keywords (``default``, ``minLength``/``maxLength``,
``minProperties``, ``patternProperties``, ``uniqueItems``, ...) are refused or ignored. pydantic
writes all of those, so :func:`strict_schema` rewrites a model's schema into the subset, and
:func:`drop_nulls` undoes the nullable encoding before the reply is validated by the same model,
whose own constraints (lengths included) then apply in code.
"""

from __future__ import annotations

from typing import Any

# Keywords strict structured outputs do not take; the model's validation still enforces them.
UNSUPPORTED = frozenset({"default", "title", "minLength", "maxLength", "minProperties", "maxProperties",
                         "patternProperties", "propertyNames", "unevaluatedProperties", "uniqueItems",
                         "contains", "minContains", "maxContains", "unevaluatedItems", "examples"})


def _nullable(node: dict[str, Any]) -> dict[str, Any]:
    if node.get("type") == "null" or any(o.get("type") == "null" for o in node.get("anyOf", [])):
        return node
    if isinstance(node.get("type"), str) and "enum" not in node and "const" not in node:
        return {**node, "type": [node["type"], "null"]}
    return {"anyOf": [node, {"type": "null"}]}


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (e.g. pydantic's ``model_json_schema()``) in the strict subset: see the module
    docstring. A property that was optional becomes required and nullable."""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for k, v in node.items():
            if k in UNSUPPORTED:
                continue
            # maps of names to schemas: the names are data, never keywords
            out[k] = {n: walk(s) for n, s in v.items()} if k in ("properties", "$defs") else walk(v)
        if out.get("type") == "object" or "properties" in out:
            out.pop("description", None)  # a model class's docstring: notes for developers, not the model
            props = out.get("properties", {})
            required = set(node.get("required", []))
            out["properties"] = {k: (v if k in required else _nullable(v)) for k, v in props.items()}
            out["required"] = list(props)
            out["additionalProperties"] = False
        if "allOf" in out and len(out["allOf"]) == 1:  # pydantic wraps a described $ref in allOf
            inner = out.pop("allOf")[0]
            out = {**inner, **{k: v for k, v in out.items() if k != "description"}}
        return out

    return walk(schema)


def drop_nulls(value: Any) -> Any:
    """A strict reply with its null fields left out again, so defaults apply on validation."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value
