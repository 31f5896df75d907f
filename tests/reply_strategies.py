"""Hypothesis strategies for replies valid under a role's format: a JSON value drawn from the
JSON schema (walked here; string patterns and regex formats through ``st.from_regex``), or text
matching a regex format. Schema-driven: whatever schema a role declares is what is drawn from.

hypothesis-jsonschema's ``from_schema`` was tried first: on this machine it took 8 to 47 s for
one example of most role schemas and found the planner's ``prefixItems`` schema unsatisfiable.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)  # any unicode but lone surrogates
MAX_ITEMS = 6


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    while isinstance(schema, dict) and "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def value_of(schema: Any, root: dict[str, Any] | None = None) -> st.SearchStrategy:
    """Values valid under ``schema`` (the subset of JSON Schema deepr's formats use)."""
    root = schema if root is None else root
    s = _resolve(schema, root)
    if s is True or s == {}:
        return st.one_of(st.none(), st.booleans(), st.integers(-5, 5), TEXT)
    if "const" in s:
        return st.just(s["const"])
    if "enum" in s:
        return st.sampled_from(s["enum"])
    for key in ("anyOf", "oneOf"):
        if key in s:
            return st.one_of(*(value_of(o, root) for o in s[key]))
    t = s.get("type")
    if isinstance(t, list):
        return st.one_of(*(value_of({**s, "type": x}, root) for x in t))
    if t == "object" or "properties" in s:
        return _object(s, root)
    if t == "array":
        return _array(s, root)
    if t == "string":
        return _string(s)
    if t == "integer":
        return st.integers(s.get("minimum", -3), s.get("maximum", 1000))
    if t == "number":
        return st.floats(s.get("minimum", -1e6), s.get("maximum", 1e6), allow_nan=False, allow_infinity=False)
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    return st.none()


def _string(s: dict[str, Any]) -> st.SearchStrategy:
    lo, hi = s.get("minLength", 0), s.get("maxLength")
    if "pattern" in s:
        base = st.from_regex(s["pattern"], fullmatch=s["pattern"].endswith("$"))
        return base.filter(lambda x: lo <= len(x) <= (hi if hi is not None else 10**9))
    return st.text(st.characters(blacklist_categories=("Cs",)), min_size=lo, max_size=hi if hi is not None else max(lo, 60))


def _array(s: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy:
    prefix = s.get("prefixItems") or []
    lo, hi = s.get("minItems", 0), s.get("maxItems")
    items = s.get("items", {})
    head = st.tuples(*(value_of(p, root) for p in prefix)).map(list) if prefix else st.just([])
    if items is False:
        return head
    more_lo = max(0, lo - len(prefix))
    more_hi = min(MAX_ITEMS, (hi - len(prefix)) if hi is not None else MAX_ITEMS)
    tail = st.lists(value_of(items, root), min_size=more_lo, max_size=max(more_lo, more_hi))
    return st.tuples(head, tail).map(lambda ht: ht[0] + ht[1])


def _object(s: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy:
    props = s.get("properties", {})
    required = [k for k in s.get("required", []) if k in props]
    optional = {k: value_of(v, root) for k, v in props.items() if k not in required}
    fixed = st.fixed_dictionaries({k: value_of(props[k], root) for k in required}, optional=optional)
    extra = s.get("additionalProperties", True)
    least = s.get("minProperties", 0)
    if isinstance(extra, dict) and (least or not props):
        keys = st.text(st.characters(whitelist_categories=("Lu", "Nd")), min_size=1, max_size=6)
        more = st.dictionaries(keys, value_of(extra, root), min_size=least, max_size=max(least, 4))
        return st.tuples(fixed, more).map(lambda fm: {**fm[1], **fm[0]})
    return fixed


def reply_of(fmt: Any) -> st.SearchStrategy:
    """Reply texts valid under an :class:`~deepr.llm.base.OutputFormat`."""
    if fmt.json_schema is not None:
        return value_of(fmt.json_schema).map(lambda v: json.dumps(v, ensure_ascii=False))
    return st.from_regex(fmt.regex, fullmatch=True)
