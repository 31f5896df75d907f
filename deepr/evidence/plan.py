"""Typed DAG research plans (DecomposeR §3.3): validation and wave order.

A plan has search nodes {id, query, key_points}, aggregate nodes {id, need, key_points,
inputs} and exactly one answer node {id, need, inputs}. ``inputs`` are the edges: node v
lists the nodes whose output it consumes. The validator returns every problem it finds,
each naming the node, so a planner can be re-asked with a precise message.
"""

from __future__ import annotations

import json
import re
from collections import deque
from typing import Any

from pydantic import ValidationError

from deepr.records import Plan, PlanNode

NODE_TYPES = ("search", "aggregate", "answer")
_ID_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,31}$")


def _coerce(obj: Any) -> tuple[dict | None, list[str]]:
    """Accept a Plan, a dict, or JSON text; return a dict or the reason it is not one."""
    if isinstance(obj, Plan):
        return obj.model_dump(), []
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError as e:
            return None, [f"plan is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"]
    if isinstance(obj, list):
        obj = {"nodes": obj}
    if not isinstance(obj, dict):
        return None, [f"plan must be a JSON object with a 'nodes' list, got {type(obj).__name__}"]
    if not isinstance(obj.get("nodes"), list) or not obj["nodes"]:
        return None, ["plan needs a non-empty 'nodes' list"]
    return obj, []


def _node_errors(nodes: list[PlanNode]) -> list[str]:
    errors: list[str] = []
    seen: set[str] = set()
    for n in nodes:
        if not _ID_RE.match(n.id):
            errors.append(f"node id {n.id!r} is not valid: use a letter then letters/digits, e.g. N3")
        if n.id in seen:
            errors.append(f"node id {n.id!r} is used more than once; ids must be unique")
        seen.add(n.id)
        if n.type not in NODE_TYPES:
            errors.append(f"node {n.id}: type {n.type!r} is not allowed; use one of {', '.join(NODE_TYPES)}")
            continue
        if n.type == "search":
            if not (n.query or "").strip():
                errors.append(f"search node {n.id} needs a non-empty 'query'")
            if n.inputs:
                errors.append(f"search node {n.id} must not have inputs (search nodes are sources)")
        else:
            if not (n.need or "").strip():
                errors.append(f"{n.type} node {n.id} needs a non-empty 'need'")
            if not n.inputs:
                errors.append(f"{n.type} node {n.id} has no inputs; list the nodes it consumes")
    for n in nodes:
        repeated = sorted({src for src in n.inputs if n.inputs.count(src) > 1})
        if repeated:
            # a repeated id is not a second edge; rewards that count edges would pay for it
            errors.append(f"node {n.id} lists input {', '.join(map(repr, repeated))} more than once; "
                          "list each input once")
        for src in n.inputs:
            if src not in seen:
                errors.append(f"node {n.id} lists input {src!r}, which is not a node id")
            elif src == n.id:
                errors.append(f"node {n.id} lists itself as an input")
    answers = [n.id for n in nodes if n.type == "answer"]
    if len(answers) != 1:
        errors.append(f"plan must have exactly one answer node, found {len(answers)}"
                      + (f" ({', '.join(answers)})" if answers else ""))
    return errors


def _children(nodes: list[PlanNode]) -> dict[str, list[str]]:
    """Distinct direct children of every node (a repeated input is one edge)."""
    out: dict[str, list[str]] = {n.id: [] for n in nodes}
    for n in nodes:
        for src in dict.fromkeys(n.inputs):
            if src in out and src != n.id:
                out[src].append(n.id)
    return out


def parents_of(node: PlanNode) -> list[str]:
    """Distinct direct parents of ``node`` in input order (a repeated input is one edge)."""
    return list(dict.fromkeys(node.inputs))


def _cycle(nodes: list[PlanNode]) -> list[str] | None:
    """Return one cycle as a list of ids, or None (iterative DFS with colours)."""
    children = _children(nodes)
    colour = {nid: 0 for nid in children}
    for start in children:
        if colour[start]:
            continue
        stack = [(start, iter(children[start]))]
        path = [start]
        colour[start] = 1
        while stack:
            nid, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[nid] = 2
                stack.pop()
                path.pop()
            elif colour[nxt] == 1:
                return path[path.index(nxt):] + [nxt]
            elif colour[nxt] == 0:
                colour[nxt] = 1
                stack.append((nxt, iter(children[nxt])))
                path.append(nxt)
    return None


def _structure_errors(nodes: list[PlanNode]) -> list[str]:
    errors: list[str] = []
    cycle = _cycle(nodes)
    if cycle:
        return [f"plan has a cycle: {' -> '.join(cycle)}; edges must form a DAG"]
    children = _children(nodes)
    answer = next(n for n in nodes if n.type == "answer")
    if children[answer.id]:
        errors.append(f"answer node {answer.id} must not feed other nodes (used by {', '.join(children[answer.id])})")
    reaches = _ancestors(nodes, answer.id) | {answer.id}
    for n in nodes:
        if n.type == "aggregate" and n.id not in reaches:
            errors.append(f"aggregate node {n.id} does not lead to the answer node {answer.id}")
    if len(nodes) > 1:
        unconnected = [n.id for n in nodes if n.id not in _component(nodes, answer.id)]
        if unconnected:
            errors.append(f"plan is not connected: {', '.join(unconnected)} are cut off from the answer node")
    return errors


def _ancestors(nodes: list[PlanNode], nid: str) -> set[str]:
    by_id = {n.id: n for n in nodes}
    seen: set[str] = set()
    todo = deque(by_id[nid].inputs)
    while todo:
        cur = todo.popleft()
        if cur in seen or cur not in by_id:
            continue
        seen.add(cur)
        todo.extend(by_id[cur].inputs)
    return seen


def _component(nodes: list[PlanNode], start: str) -> set[str]:
    adj: dict[str, set[str]] = {n.id: set() for n in nodes}
    for n in nodes:
        for src in n.inputs:
            if src in adj:
                adj[n.id].add(src)
                adj[src].add(n.id)
    seen, todo = {start}, [start]
    while todo:
        for nxt in adj[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def validate_plan(obj: Any) -> tuple[Plan | None, list[str]]:
    """Check a plan (JSON text, dict or Plan). Returns (plan, []) or (None, every error found)."""
    data, errors = _coerce(obj)
    if data is None:
        return None, errors
    try:
        plan = Plan.model_validate(data)
    except ValidationError as e:
        msgs = []
        for err in e.errors()[:10]:
            loc = ".".join(str(p) for p in err["loc"])
            msgs.append(f"field {loc}: {err['msg']}")
        return None, msgs
    errors = _node_errors(plan.nodes)
    if errors:
        return None, errors
    errors = _structure_errors(plan.nodes)
    return (None, errors) if errors else (plan, [])


def is_valid(obj: Any) -> bool:
    return validate_plan(obj)[0] is not None


def answer_node(plan: Plan) -> PlanNode:
    return next(n for n in plan.nodes if n.type == "answer")


def nodes_of(plan: Plan, kind: str) -> list[PlanNode]:
    return [n for n in plan.nodes if n.type == kind]


def waves(plan: Plan) -> list[list[str]]:
    """Aggregate nodes in topological waves: a wave holds every aggregate whose aggregate
    parents are all in earlier waves (search results are available from the start)."""
    by_id = {n.id: n for n in plan.nodes}
    pending = [n.id for n in plan.nodes if n.type == "aggregate"]
    done: set[str] = set()
    out: list[list[str]] = []
    while pending:
        ready = [nid for nid in pending
                 if all(by_id[p].type == "search" or p in done for p in by_id[nid].inputs)]
        if not ready:  # only reachable with an unvalidated plan
            raise ValueError(f"plan has a cycle among aggregate nodes {pending}; validate it first")
        out.append(ready)
        done.update(ready)
        pending = [nid for nid in pending if nid not in done]
    return out


def children_map(plan: Plan) -> dict[str, list[str]]:
    return _children(plan.nodes)
