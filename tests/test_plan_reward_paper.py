"""R_plan against an independent reading of DecomposeR App. A.5, Eq. 17–24.

The reference below is written from the paper's text alone (it calls no deepr code): Valid(G) is
"parses and satisfies the typed-DAG constraints", C_rub / C_search the weighted best clamped
cosine from each rubric item to the non-answer nodes' fields / the search queries, D_search one
minus the mean clamped cosine over query pairs (0 under two queries), f(k) = max(0, 1 − 1/max(k, 1)),
d_par one minus the mean pairwise clamped cosine among the answer's aggregate parents' node texts
(a node's fields joined), r_fan / r_int the fractions of search nodes with ≥ 2 children and of
aggregate nodes with ≥ 2 parents. Random plans (valid and broken ones) are scored by both; every
term must agree within 3e-3.
"""

from __future__ import annotations

import random
import zlib
from functools import lru_cache

import numpy as np

N_PLANS = 120
TOL = 3e-3
WORDS = ("plate tectonics fault quake magma volcano ash climate cooling aerosol tsunami wave coast "
         "damage risk city building code history record energy seismic mantle crust eruption").split()
TERMS = ("plan_reward", "C_rub", "Q_search", "C_search", "D_search", "E_graph", "B_synth", "I_cross", "B_search",
         "d_par", "r_fan", "r_int")


def word_embed(texts):
    """A fixed embedder: each word a random ±1 direction in 48 dims, a text the sum of its words
    (some pairs have negative cosines, so the clamps matter)."""
    out = np.zeros((len(texts), 48), dtype=np.float64)
    for i, t in enumerate(texts):
        for w in t.lower().split():
            out[i] += _word(w)
    return out


@lru_cache(maxsize=None)
def _word(w: str) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(w.encode())).choice([-1.0, 1.0], 48)


# --- the reference, from the paper's text --------------------------------------------------------------


@lru_cache(maxsize=None)
def _cos(a: str, b: str) -> float:
    u, v = word_embed([a, b])
    den = np.linalg.norm(u) * np.linalg.norm(v)
    return max(0.0, float(u @ v / den)) if den else 0.0


def _f(k: int) -> float:
    return max(0.0, 1 - 1 / max(k, 1))


def _fields(n: dict) -> list[str]:
    # DecomposeR App. A.5: "fields(n) be the non-empty query, key_points, and need fields" — that order.
    return [t for t in [n.get("query"), *(n.get("key_points") or []), n.get("need")] if t]


def _valid(nodes: list[dict]) -> bool:
    """Typed DAG: unique ids; search nodes have a query and no inputs; aggregate / answer nodes have
    a need and inputs naming other nodes; exactly one answer node, feeding nothing; no cycle."""
    ids = [n["id"] for n in nodes]
    if len(set(ids)) != len(ids) or sum(n["type"] == "answer" for n in nodes) != 1:
        return False
    for n in nodes:
        ins = n.get("inputs") or []
        if n["type"] == "search" and (ins or not n.get("query")):
            return False
        if n["type"] != "search" and (not ins or not n.get("need") or any(i not in ids or i == n["id"] for i in ins)):
            return False
    ans = next(n["id"] for n in nodes if n["type"] == "answer")
    if any(ans in (n.get("inputs") or []) for n in nodes):
        return False
    state: dict[str, int] = {}
    by_id = {n["id"]: n for n in nodes}

    def acyclic(nid: str) -> bool:
        if state.get(nid) == 1:
            return False
        if state.get(nid) == 2:
            return True
        state[nid] = 1
        ok = all(acyclic(p) for p in by_id[nid].get("inputs") or [])
        state[nid] = 2
        return ok

    return all(acyclic(i) for i in ids)


def _coverage(rubrics: list[dict], texts: list[str]) -> float:
    num = sum(r["weight"] * max((_cos(r["description"], c) for c in texts), default=0.0) for r in rubrics)
    return num / sum(r["weight"] for r in rubrics)


def _mean_pair(texts: list[str]) -> float:
    pairs = [(i, j) for i in range(len(texts)) for j in range(i + 1, len(texts))]
    return sum(_cos(texts[i], texts[j]) for i, j in pairs) / len(pairs)


def reference(plan: dict, rubrics: list[dict]) -> dict[str, float]:
    nodes = plan["nodes"]
    if not _valid(nodes):
        return dict.fromkeys(TERMS, 0.0)
    ans = next(n for n in nodes if n["type"] == "answer")
    searches = [n for n in nodes if n["type"] == "search"]
    aggs = [n for n in nodes if n["type"] == "aggregate"]
    c_rub = _coverage(rubrics, [c for n in nodes if n is not ans for c in _fields(n)])
    queries = [n["query"] for n in searches]
    c_search = _coverage(rubrics, queries)
    d_search = 1 - _mean_pair(queries) if len(queries) >= 2 else 0.0
    q_search = 0.5 * c_search + 0.5 * d_search
    by_id = {n["id"]: n for n in nodes}
    parents = [by_id[i] for i in ans["inputs"] if by_id[i]["type"] == "aggregate"]
    d_par = 1 - _mean_pair([" ".join(_fields(p)) for p in parents]) if len(parents) >= 2 else 1.0
    b_synth = _f(len(parents)) * d_par
    children = {n["id"]: sum(n["id"] in (m.get("inputs") or []) for m in nodes) for n in nodes}
    r_fan = sum(children[s["id"]] >= 2 for s in searches) / len(searches) if searches else 0.0
    r_int = sum(len(a["inputs"]) >= 2 for a in aggs) / len(aggs) if aggs else 0.0
    i_cross = 0.5 * (r_fan + r_int)
    b_search = _f(len(searches))
    e_graph = 0.4 * b_synth + 0.4 * i_cross + 0.2 * b_search
    return {"plan_reward": 0.4 * c_rub + 0.3 * q_search + 0.3 * e_graph, "C_rub": c_rub, "Q_search": q_search,
            "C_search": c_search, "D_search": d_search, "E_graph": e_graph, "B_synth": b_synth, "I_cross": i_cross,
            "B_search": b_search, "d_par": d_par, "r_fan": r_fan, "r_int": r_int}


# --- random plans ----------------------------------------------------------------------------------------


def _phrase(rng: random.Random, lo: int = 2, hi: int = 5) -> str:
    return " ".join(rng.sample(WORDS, rng.randint(lo, hi)))


def random_plan(rng: random.Random) -> dict:
    searches = [{"id": f"S{i}", "type": "search", "query": _phrase(rng),
                 "key_points": [_phrase(rng, 1, 3) for _ in range(rng.randint(0, 2))]}
                for i in range(1, rng.randint(1, 5) + 1)]
    aggs: list[dict] = []
    for i in range(1, rng.randint(0, 4) + 1):
        pool = [n["id"] for n in searches + aggs]
        aggs.append({"id": f"A{i}", "type": "aggregate", "need": _phrase(rng),
                     "key_points": [_phrase(rng, 1, 3) for _ in range(rng.randint(0, 2))],
                     "inputs": rng.sample(pool, rng.randint(1, min(3, len(pool))))})
    used = {i for n in aggs for i in n["inputs"]}
    loose = [n["id"] for n in searches + aggs if n["id"] not in used]  # every branch reaches the answer
    extra = rng.sample([n["id"] for n in aggs], rng.randint(0, len(aggs))) if aggs else []
    answer = {"id": "ANS", "type": "answer", "need": _phrase(rng), "inputs": list(dict.fromkeys(loose + extra))}
    nodes = searches + aggs + [answer]
    if rng.random() < 0.1:  # a broken graph: a cycle, a search node with inputs, or a second answer
        kind = rng.randrange(3)
        if kind == 0 and aggs:
            aggs[0]["inputs"] = [*aggs[0]["inputs"], aggs[-1]["id"]] if len(aggs) > 1 else ["A1"]
        elif kind == 1:
            searches[0]["inputs"] = ["ANS"]
        else:
            nodes.append({"id": "ANS2", "type": "answer", "need": "again", "inputs": [searches[0]["id"]]})
    return {"nodes": nodes}


def test_plan_reward_agrees_with_the_papers_equations_on_random_plans():
    from deepr.rewards.plan_reward import plan_rewards

    rng = random.Random(38)
    items = []
    for _ in range(N_PLANS):
        rubrics = [{"id": f"R{j}", "type": "factual", "description": _phrase(rng, 3, 6),
                    "weight": round(rng.uniform(0.1, 1.0), 2)} for j in range(rng.randint(1, 4))]
        items.append((random_plan(rng), rubrics))
    got = plan_rewards(items, word_embed)
    worst = dict.fromkeys(TERMS, 0.0)
    valid = 0
    for (plan, rubrics), r in zip(items, got):
        want = reference(plan, rubrics)
        assert r.valid == _valid(plan["nodes"]), (plan, r.errors)
        valid += r.valid
        for t in TERMS:
            if r.valid or t == "plan_reward":
                worst[t] = max(worst[t], abs(getattr(r, t) - want[t]))
    print("max |deepr - reference| per term over", N_PLANS, "plans:", {t: f"{v:.2e}" for t, v in worst.items()})
    assert valid >= 90 and N_PLANS - valid >= 5  # both kinds are exercised
    assert max(worst.values()) < TOL, worst
