"""The plan validator's graph rules as decoding constraints (``--formats schema``).

After SFT, SmolLM2 wrote plans whose every field had the right shape and still failed
:func:`deepr.evidence.plan.validate_plan` on wiring alone: an aggregate nothing read, a search node
cut off from the answer, an input listed twice, no answer node (sixth learning run: all 3 refused
first plans of 33). Two layers rule those out while the model decodes:

- :func:`graph_schema` (any backend that takes a JSON schema: xgrammar, vLLM, llama.cpp): node k
  has id ``Nk``, the first node is a search, ``inputs`` name earlier nodes only (so no cycle, no
  unknown id, no self-input) and the plan ends with its one answer node;
- :class:`PlanGuard` (the hf backend and GRPO's sampler, which run logits processors): no id twice
  in one ``inputs`` list, and the answer's list does not close before it names every node that no
  other node reads, so every node leads to the answer.

Together a plan that parses validates; what the plan says (queries, needs, which nodes read which)
stays the model's. The teacher plans SFT trains on already have this form (ids in order, answer
last), so the constraints do not move the model off its training data. A revision that drops a
search node renumbers the nodes after it; their searches are not run again, as a search's results
follow its query to its new id (:func:`deepr.agent.dag.changed_search_nodes`).

    OutputFormat("plan", json_schema=graph_schema(_PlanShape.model_json_schema()), guard=PlanGuard())
"""

from __future__ import annotations

import copy
import re
from typing import Any

MAX_INPUTS = 8
_ID = re.compile(r'(?<!\\)"id": "(N[0-9]{1,2})"')
_TYPE = re.compile(r'(?<!\\)"type": "(search|aggregate|answer)"')
_INPUTS = re.compile(r'(?<!\\)"inputs": \[')
_LISTED = re.compile(r'"(N[0-9]{1,2})"')
_INPUTS_KEY = '"inputs": ['


def _node_shapes(model_schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The node schemas of a pydantic plan shape, by the node type each one's ``type`` fixes."""
    shapes = {}
    for d in model_schema.get("$defs", {}).values():
        kind = d.get("properties", {}).get("type", {}).get("const")
        if kind:
            shapes[kind] = {k: v for k, v in d.items() if k not in ("title", "description")}
    missing = {"search", "aggregate", "answer"} - set(shapes)
    if missing:
        raise ValueError(f"plan shape has no node schema for {', '.join(sorted(missing))}")
    return shapes


def graph_schema(model_schema: dict[str, Any]) -> dict[str, Any]:
    """``model_schema`` (a pydantic plan shape's JSON schema) with its ``nodes`` list rewritten as
    one fixed-length list per plan size (the shape's minItems to maxItems nodes): ids in order,
    inputs drawn from the earlier ids, the answer node last and only there."""
    shapes = _node_shapes(model_schema)
    nodes = model_schema["properties"]["nodes"]
    least, most = max(2, nodes.get("minItems", 2)), nodes.get("maxItems", 10)

    def node(kind: str, k: int) -> dict[str, Any]:
        d = copy.deepcopy(shapes[kind])
        d["properties"]["id"] = {"const": f"N{k}"}
        if "inputs" in d["properties"]:
            d["properties"]["inputs"] = {"type": "array", "items": {"enum": [f"N{i}" for i in range(1, k)]},
                                         "minItems": 1, "maxItems": min(MAX_INPUTS, k - 1)}
        return d

    sizes = []
    for n in range(least, most + 1):
        middle = [{"anyOf": [node("search", k), node("aggregate", k)]} for k in range(2, n)]
        items = [node("search", 1), *middle, node("answer", n)]
        sizes.append({"type": "array", "prefixItems": items, "items": False, "minItems": n, "maxItems": n})
    out = {k: copy.deepcopy(v) for k, v in model_schema.items() if k not in ("$defs", "title", "description")}
    out["properties"]["nodes"] = {"anyOf": sizes}
    return out


class PlanGuard:
    """Watches the ``inputs`` lists of a plan being decoded (compact JSON as the schema's grammar
    writes it). :meth:`watching` says whether the next token can break a rule here (so the caller
    checks its candidates); :meth:`viable` whether a reply that starts with ``text`` can still
    validate."""

    def watching(self, text: str) -> bool:
        opened = _open_list(text)
        if opened is not None:
            return True
        # a token may carry the reply from the key into the list ('": ["')
        tail = text[-len(_INPUTS_KEY):]
        return any(tail.endswith(_INPUTS_KEY[:i]) for i in range(2, len(_INPUTS_KEY) + 1))

    def viable(self, text: str) -> bool:
        nodes = _nodes(text)
        read: set[str] = set()
        for k, (nid, kind, body) in enumerate(nodes):
            m = _INPUTS.search(body)
            if m is None:
                continue
            rest = body[m.end():]
            end = rest.find("]")
            listed = _LISTED.findall(rest if end < 0 else rest[:end])
            earlier = [n[0] for n in nodes[:k]]
            if len(set(listed)) < len(listed) or not set(listed) <= set(earlier):
                return False
            unread = {e for e in earlier if e not in read} - set(listed)
            if end < 0:
                free = [e for e in earlier if e not in listed]
                spare = MAX_INPUTS - len(listed) - len(unread)
                if kind == "answer" and spare <= 0:
                    if spare < 0:
                        return False
                    free = [e for e in free if e in unread]  # room is left for these only
                return _partial_ok(rest, free)
            if kind == "answer" and unread:
                return False  # a node nothing reads would be cut off from the answer
            read.update(listed)
        return True


def _nodes(text: str) -> list[tuple[str, str, str]]:
    """(id, type, text) of each node begun in ``text``; type '' while not yet written."""
    starts = list(_ID.finditer(text))
    out = []
    for i, m in enumerate(starts):
        body = text[m.end(): starts[i + 1].start() if i + 1 < len(starts) else len(text)]
        t = _TYPE.search(body)
        out.append((m.group(1), t.group(1) if t else "", body))
    return out


def _open_list(text: str) -> str | None:
    """The text after the last ``"inputs": [`` when that list is still open, else None."""
    last = None
    for last in _INPUTS.finditer(text):
        pass
    if last is None:
        return None
    rest = text[last.end():]
    return None if "]" in rest else rest


def _partial_ok(rest: str, free: list[str]) -> bool:
    """Whether an open list's unfinished tail (``"N1", "N`` …) can still be completed with ids of
    ``free`` (the earlier ids not yet listed)."""
    if rest.count('"') % 2:  # inside an id
        tail = rest[rest.rfind('"'):]
        return any(f'"{f}"'.startswith(tail) for f in free)
    return rest.endswith('"') or bool(free)  # after an id the list may close; else one must follow
