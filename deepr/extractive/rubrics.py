"""Extractive (no language model) query–rubric synthesis.

- leaf selection: maximal marginal relevance over leaves (relevance to the root query
  against similarity to the leaves already chosen);
- merge: average-link clustering of the chosen leaves by embedding; one intermediate
  query per cluster, then one final question built from the cluster topics;
- rubrics: one factual criterion per chosen leaf (its statement closest to the leaf's
  query, quoted as evidence) and logical criteria that ask the answer to compare the
  clusters and to weigh them in a conclusion.

Every output says ``backend: extractive``; the question is templated, not written, from the
table of the tree's language (deepr.evidence.phrases), so a Chinese tree's pair has no English words.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from deepr.evidence.phrases import join_list, phrases_in
from deepr.records import RubricItem, Tree, TreeNode
from deepr.roles import RoleFailed
from deepr.text import STOP_WORDS, tok, word_count

Embed = Callable[[list[str]], np.ndarray]


def _phrase(node: TreeNode) -> str:
    return str((node.model_extra or {}).get("phrase") or node.query)


def _lower_first(s: str) -> str:
    first = s.split(" ", 1)[0]
    return s[0].lower() + s[1:] if first.lower() in STOP_WORDS else s


def mmr(rel: np.ndarray, sim: np.ndarray, k: int, lam: float) -> list[int]:
    """Greedy maximal marginal relevance: lam·relevance − (1−lam)·max similarity to chosen."""
    chosen: list[int] = []
    left = list(range(len(rel)))
    while left and len(chosen) < k:
        def score(i: int) -> float:
            red = max((float(sim[i, j]) for j in chosen), default=0.0)
            return lam * float(rel[i]) - (1 - lam) * red
        best = max(left, key=lambda i: (score(i), -i))
        chosen.append(best)
        left.remove(best)
    return chosen


def cluster(sim: np.ndarray, n_clusters: int) -> list[list[int]]:
    """Average-link agglomerative clustering down to ``n_clusters`` groups, in first-member order."""
    groups = [[i] for i in range(sim.shape[0])]
    while len(groups) > max(1, n_clusters):
        best, pair = -2.0, (0, 1)
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                s = float(np.mean([sim[i, j] for i in groups[a] for j in groups[b]]))
                if s > best:
                    best, pair = s, (a, b)
        a, b = pair
        groups[a] = sorted(groups[a] + groups.pop(b))
    return sorted(groups, key=lambda g: g[0])


def _pick_leaves(usable: list[TreeNode], order: list[int], embed: Embed, k: int,
                 max_words: int) -> tuple[list[int], list[list[str]]]:
    """Walk the MMR order; keep a leaf only if it has a statement no kept leaf already uses.

    Branches of one tree often quote the same sentence; two criteria on one sentence
    would be one check counted twice.
    """
    picked: list[int] = []
    statements: list[list[str]] = []
    used: list[set[str]] = []
    for i in order:
        if len(picked) == k:
            break
        n = usable[i]
        fit = [s for s in dict.fromkeys(n.statements) if word_count(s) <= max_words - 5]
        vecs = embed([n.query, *fit])
        ranked = [fit[j] for j in np.argsort(-(vecs[1:] @ vecs[0]), kind="stable")]
        fresh = [s for s in ranked if all(_overlap(tok(s), u) < 0.8 for u in used)]
        if fresh:
            picked.append(i)
            statements.append(fresh)
            used.append(tok(fresh[0]))
    return picked, statements


def _overlap(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a and b else 0.0


def synthesize(tree: Tree, embed: Embed, *, n_select: int, lam: float, max_words: int,
               min_rubrics: int, max_rubrics: int, min_relevance: float = 0.2, table: dict[str, Any] | None = None
               ) -> tuple[dict[str, Any] | None, str | None]:
    """A pair as a dict of the reply shape, or (None, reason); its own words from ``table``
    (a table of deepr.evidence.phrases; English by default)."""
    table = table or phrases_in("en")
    usable = [n for n in tree.nodes if not n.children and
              any(word_count(s) <= max_words - 5 for s in n.statements)]
    if len(usable) < 2:
        return None, f"only {len(usable)} leaves carry a short enough statement; need at least 2"
    root = next(n for n in tree.nodes if n.id == tree.root_id)
    # Relevance is to the root's query and evidence together: a bare topic name is
    # ambiguous ("Turkey"), its evidence says which sense the tree is about.
    anchor = embed([root.query, *root.statements]).mean(axis=0)
    anchor = anchor / (np.linalg.norm(anchor) or 1.0)
    lv = embed([f"{n.query}. {n.statements[0]}" for n in usable])
    rel = lv @ anchor
    order = [i for i in mmr(rel, lv @ lv.T, len(usable), lam) if rel[i] >= min_relevance]
    picked, statements = _pick_leaves(usable, order, embed, n_select, max_words)
    if len(picked) < 2:
        return None, (f"fewer than 2 leaves are on topic (relevance >= {min_relevance}) and hold a "
                      "statement of their own")
    leaves = [usable[i] for i in picked]
    groups = cluster(lv[picked] @ lv[picked].T, (len(leaves) + 1) // 2)
    topics = [join_list([_phrase(leaves[i]) for i in g], table) for g in groups]
    templates = table["pair_questions"]
    template = templates[int(hashlib.sha1(tree.id.encode()).hexdigest(), 16) % len(templates)]
    question = template.format(topics=join_list(topics, table), root=tree.topic)
    selection = [{"leaf_id": n.id, "reason": f"relevance {float(rel[i]):.2f} to the root query and evidence; "
                  f"least similar to the leaves picked before it (MMR, lambda {lam})"}
                 for n, i in zip(leaves, picked)]
    merge = _merge_trace(leaves, groups, topics, question, lv[picked], tree.topic, table)
    rubrics = _rubrics(leaves, statements, groups, topics, question, embed, tree.topic, min_rubrics, table)
    if len(rubrics) < min_rubrics:
        return None, f"only {len(rubrics)} criteria could be grounded in the selected leaves; need {min_rubrics}"
    return {"question": question, "selected_leaf_ids": [n.id for n in leaves], "selection_trace": selection,
            "merge_trace": merge, "rubrics": rubrics[:max_rubrics]}, None


def _merge_trace(leaves: list[TreeNode], groups: list[list[int]], topics: list[str], question: str,
                 vecs: np.ndarray, root: str, table: dict[str, Any]) -> list[dict[str, Any]]:
    steps = []
    for k, (g, topic) in enumerate(zip(groups, topics), start=1):
        if len(g) == 1:
            out, why = leaves[g[0]].query, "a facet of its own: no other chosen leaf is close to it"
        else:
            sims = [float(vecs[i] @ vecs[j]) for i in g for j in g if i < j]
            out = table["pair_connected"].format(topic=topic, root=root)
            why = f"closest chosen leaves by embedding (mean cosine {np.mean(sims):.2f})"
        steps.append({"id": f"M{k}", "inputs": [leaves[i].id for i in g], "output": out, "rationale": why})
    steps.append({"id": f"M{len(groups) + 1}", "inputs": [s["id"] for s in steps], "output": question,
                  "rationale": "joins the cluster topics under the root topic in one question"})
    return steps


def _rubrics(leaves: list[TreeNode], statements: list[list[str]], groups: list[list[int]],
             topics: list[str], question: str, embed: Embed, root: str, min_rubrics: int,
             table: dict[str, Any]) -> list[dict[str, Any]]:
    """One factual criterion per leaf (its best own statement), then the logical ones."""
    out: list[dict[str, Any]] = []
    used: list[set[str]] = []

    def factual(n: TreeNode, s: str) -> None:
        q, v = embed([question, s])
        w = round(float(np.clip(0.5 + 0.5 * float(q @ v), 0.5, 1.0)), 2)
        out.append({"type": "factual", "description": table["pair_states"].format(statement=_lower_first(s)),
                    "weight": w, "source_leaf_ids": [n.id], "evidence": [s]})
        used.append(tok(s))

    for n, st in zip(leaves, statements):
        factual(n, st[0])
    logical = _logical(leaves, groups, topics, root, table)
    for depth in range(1, 3):  # second-best statements only when criteria run short
        for n, st in zip(leaves, statements):
            if len(out) + len(logical) < min_rubrics and len(st) > depth:
                if all(_overlap(tok(st[depth]), u) < 0.8 for u in used):
                    factual(n, st[depth])
    return [RubricItem(id=f"R{k}", **r).model_dump() for k, r in enumerate(out + logical, start=1)]


def _logical(leaves: list[TreeNode], groups: list[list[int]], topics: list[str], root: str,
             table: dict[str, Any]) -> list[dict[str, Any]]:
    """A comparison of the first two clusters, a link from a third, and a weighed conclusion.

    Each uses its own wording: templated twins would be one check counted twice.
    """
    ids = lambda g: [leaves[i].id for i in g]  # noqa: E731
    if len(groups) == 1:  # one cluster: compare its two most distinct members instead
        g = groups[0]
        groups, topics = [[g[0]], g[1:2] or [g[0]]], [_phrase(leaves[g[0]]), _phrase(leaves[(g[1:2] or g)[0]])]
    out = []
    if topics[0] != topics[1]:
        out.append({"type": "logical", "weight": 0.5, "source_leaf_ids": ids(groups[0]) + ids(groups[1]),
                    "evidence": [], "description": table["pair_compares"].format(a=topics[0], b=topics[1])})
    if len(groups) > 2:
        out.append({"type": "logical", "weight": 0.45, "source_leaf_ids": ids(groups[2]) + ids(groups[0]),
                    "evidence": [], "description": table["pair_bears_on"].format(c=topics[2], a=topics[0])})
    out.append({"type": "logical", "weight": 0.4, "source_leaf_ids": [n.id for n in leaves], "evidence": [],
                "description": table["pair_concludes"].format(root=root, topics=join_list(topics, table))})
    return out


def synth_reply(a: Any) -> dict[str, Any]:
    """The synthesis role's reply (deepr.data.rubrics), held to the same checks as a model's."""
    if a.embed is None:
        raise ValueError("the extractive synthesiser needs an embedder")
    lim = a.cfg.limits
    value, error = synthesize(
        a.tree, a.embed, n_select=a.cfg.n_select, lam=a.cfg.mmr_lambda, max_words=lim.max_rubric_words,
        min_rubrics=lim.min_rubrics, max_rubrics=lim.max_rubrics, min_relevance=a.cfg.min_relevance,
        table=phrases_in(a.language))
    if value is None:
        raise RoleFailed(error or "no pair")
    problems = a.problems(value)
    if problems:
        raise RoleFailed("constraint violations: " + "; ".join(problems))
    return value
