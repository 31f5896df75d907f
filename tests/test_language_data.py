"""The data stages in the corpus's language (issue 69): every prompt of build-trees,
synthesize-rubrics and verify asks the model to write in it, driven through the loopback fake
model (tests/fake_model.py) on a small Chinese corpus, while English prompts carry no such
sentence; the extractive engine's sub-queries and pairs take their words from the language's table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.cli import app
from deepr.io import read_jsonl
from deepr.llm.stub_server import StubServer
from deepr.text.lang import write_in

from fake_model import CompetentModel
from lang_corpora import ZH_DOCS, write_jsonl

ROLES = {"root_query_write", "decompose_split", "ground_judge", "extract_quote", "gate_judge",
         "synthesize_pair", "verify_audit"}
ZH_NOTE = write_in("", "zh")
ZH_LEAVES = {
    "n0.1.1": ["火山喷发的原因是地下深处的岩浆比周围的岩石轻，会向上运动并在岩浆房中积聚。"],
    "n0.1.2": ["当岩浆房里的压力超过上方岩石的强度时，岩浆就冲出地表，形成喷发。"],
    "n0.2.1": ["大多数火山位于板块边界，例如环太平洋火山带。"],
    "n0.2.2": ["日本有一百一十一座活火山，富士山也是其中之一。"],
    "n0.3": ["火山喷出的火山灰和气体会遮挡阳光，使全球气温在一两年内下降。"],
}


def deepr(*args: object) -> None:
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, f"deepr {' '.join(map(str, args))} exited {r.exit_code}:\n{r.output}"


def zh_tree():
    """A Chinese evidence tree as build-trees writes them: five leaves, one statement each."""
    from deepr.records import SupportingDoc, Tree, TreeNode, TreeStats

    def node(nid, parent, query, children=(), statements=()):
        st = list(statements) or ["火山是地壳上的开口，地下的岩浆、火山灰和气体从这里喷出。"]
        return TreeNode(id=nid, parent=parent, depth=nid.count("."), query=query, children=list(children),
                        supporting_docs=[SupportingDoc(doc_id=f"D{nid}", snippet_id=f"D{nid}#0", statements=st)],
                        statements=st, stop_reason=None if children else "max_depth")

    nodes = [node("n0", None, "火山及其喷发", ["n0.1", "n0.2", "n0.3"]),
             node("n0.1", "n0", "火山喷发的原因", ["n0.1.1", "n0.1.2"]),
             node("n0.2", "n0", "火山的分布", ["n0.2.1", "n0.2.2"]),
             node("n0.3", "n0", "火山喷发对气候的影响", statements=ZH_LEAVES["n0.3"])]
    nodes += [node(lid, lid.rsplit(".", 1)[0], q, statements=ZH_LEAVES[lid]) for lid, q in
              (("n0.1.1", "岩浆为什么上升"), ("n0.1.2", "岩浆房的压力"), ("n0.2.1", "板块边界上的火山"),
               ("n0.2.2", "日本的活火山"))]
    return Tree(id="tree-volcano-zh", topic="火山", root_id="n0", nodes=nodes,
                stats=TreeStats(nodes=8, leaves=5, depth=2))


def role_of(body: dict) -> str:
    return ((body.get("response_format") or {}).get("json_schema") or {}).get("name", "")


def asks_for(body: dict, note: str) -> bool:
    """The request's prompt closes a user message with ``note`` (a re-ask follows it, unchanged)."""
    return any(m.get("role") == "user" and str(m.get("content", "")).endswith(note) for m in body["messages"])


@pytest.fixture(scope="module")
def served():
    with StubServer(CompetentModel()) as srv:
        yield srv


def _run_stages(srv: StubServer, corpus: Path, topics: str, trees: Path | None, d: Path) -> list[dict]:
    """build-trees on ``corpus``, synthesize-rubrics on ``trees`` (default: those built), verify;
    every request the fake model received meanwhile."""
    start, model = len(srv.requests), ["--llm", "openai:fake", "--base-url", srv.base_url, "--no-cache"]
    (d / "topics.txt").write_text(topics, encoding="utf-8")
    deepr("build-trees", "--corpus", corpus, "--topics", d / "topics.txt", "--out", d / "trees.jsonl",
          "--cache-dir", d / "cache", *model)
    # the fake reads English only: its pairs of a Chinese tree fail their checks, the extractive engine's stand in
    deepr("synthesize-rubrics", trees or d / "trees.jsonl", "--out", d / "pairs.jsonl", "--fallback", "extractive",
          "--allow-fallback",
          *model)
    deepr("verify", d / "pairs.jsonl", "--out", d / "verified.jsonl", "--allow-fallback", *model)
    return srv.requests[start:]


def test_every_data_stage_prompt_asks_for_the_chinese_of_its_corpus(served, tmp_path):
    (tmp_path / "zh_trees.jsonl").write_text(zh_tree().model_dump_json() + "\n", encoding="utf-8")
    sent = _run_stages(served, write_jsonl(tmp_path / "zh.jsonl", ZH_DOCS), "火山\n长城\n", tmp_path / "zh_trees.jsonl",
                       tmp_path)
    assert ROLES <= {role_of(b) for b in sent}
    assert "Chinese" in ZH_NOTE and [role_of(b) for b in sent if not asks_for(b, ZH_NOTE)] == []
    [pair] = list(read_jsonl(tmp_path / "pairs.jsonl"))
    written = [pair["question"], *(m["output"] for m in pair["merge_trace"]),
               *(r["description"] for r in pair["rubrics"])]
    assert not [t for t in written if re.search(r"[A-Za-z]{2,}", t)], written  # no English scaffolding


def test_english_data_stage_prompts_carry_no_language_sentence(served, tmp_path):
    from tree_helpers import volcano_docs

    corpus = tmp_path / "volcano.jsonl"
    corpus.write_text("".join(d.model_dump_json() + "\n" for d in volcano_docs()), encoding="utf-8")
    sent = _run_stages(served, corpus, "Volcano\nPlate tectonics\n", None, tmp_path)
    assert ROLES <= {role_of(b) for b in sent}
    assert not [b for b in sent if "Write everything you produce in" in json.dumps(b["messages"])]


def test_the_corpus_language_of_the_retriever_names_the_language_a_title_alone_would_not():
    from deepr.data.topics import SeedTopic
    from deepr.data.tree_roles import ROOT_QUERY, TreeAsk, TreeRoles

    seed = SeedTopic(id="tree-sakura", title="桜")  # Han only: read alone it is Chinese
    ask = lambda language: TreeAsk(TreeRoles(None, None, language=language), seed=seed)  # noqa: E731
    assert ROOT_QUERY.messages(ask("ja"))[-1]["content"].endswith(write_in("", "ja"))
    assert ROOT_QUERY.messages(ask(None))[-1]["content"].endswith(ZH_NOTE)
    assert "Write everything" not in json.dumps(ROOT_QUERY.messages(ask("en")))


def test_extractive_sub_queries_and_pairs_take_their_words_from_the_language_table(tmp_path):
    from deepr.evidence.phrases import phrases_in
    from deepr.extractive.trees import _shape

    assert _shape("板块构造", "comparison", "火山", 11, phrases_in("zh")) == "板块构造与火山的比较"
    assert _shape("Plate tectonics", "comparison", "Volcano", 11) == "Plate tectonics compared with Volcano"
    assert _shape("lava flows", "risks", "Volcano", 11) == "Volcano: lava flows"
    (tmp_path / "trees.jsonl").write_text(zh_tree().model_dump_json() + "\n", encoding="utf-8")
    deepr("synthesize-rubrics", tmp_path / "trees.jsonl", "--out", tmp_path / "pairs.jsonl", "--llm", "extractive")
    [pair] = list(read_jsonl(tmp_path / "pairs.jsonl"))
    descriptions = [r["description"] for r in pair["rubrics"]]
    assert sum(d.startswith("回答指出：") for d in descriptions) == len(ZH_LEAVES)
    assert pair["question"].endswith("？")
    assert not re.search(r"[A-Za-z]{2,}", pair["question"] + "".join(descriptions))
