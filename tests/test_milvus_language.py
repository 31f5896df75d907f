"""Milvus collections in the corpus's language: the BM25 analyzer follows it (jieba for Chinese;
deepr's own bigrams where Milvus Lite has no analyzer, Japanese), the collection records it, and
a search that asks for another language is refused."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from deepr.cli import app
from lang_corpora import JA_DOCS, JA_QUESTIONS, ZH_DOCS, ZH_QUESTIONS, write_jsonl

pytest.importorskip("pymilvus")
pytest.importorskip("milvus_lite")


def _load(table, tmp_path, embedder, name: str, **kw) -> tuple[str, dict]:
    from deepr.corpus.milvus import load_to_milvus

    spec = f"milvus:{tmp_path / name}.db"
    corpus = write_jsonl(tmp_path / f"{name}.jsonl", table)
    return spec, load_to_milvus(str(corpus), spec, embedder=embedder, cache_dir=tmp_path / "cache", **kw)


@pytest.fixture(scope="module")
def zh(embedder, tmp_path_factory) -> str:
    spec, counts = _load(ZH_DOCS, tmp_path_factory.mktemp("zh"), embedder, "zh")
    assert counts["language"] == "zh" and counts["analyzer"] == "jieba"
    return spec


@pytest.mark.parametrize("mode", ["bm25", "hybrid"])
def test_a_chinese_collection_ranks_the_relevant_document_first(zh, embedder, mode):
    from deepr.corpus import open_retriever

    r = open_retriever(zh, retriever=mode, embedder=embedder)
    assert r.language == "zh" and r.describe()["language"] == "zh"
    assert r.meta["language"] == "zh" and r.meta["analyzer"] == "jieba"
    assert len(ZH_QUESTIONS) >= 5
    for question, want in ZH_QUESTIONS.items():
        hits = r.search(question, k=3)
        assert hits and hits[0].doc_id == want, (mode, question, [h.doc_id for h in hits])
    assert r.search("为什么是什么", k=3, mode="bm25") == []  # question and function words alone match nothing


def test_japanese_falls_back_to_deepr_bigrams_and_ranks_the_relevant_document_first(embedder, tmp_path):
    from deepr.corpus import open_retriever

    spec, counts = _load(JA_DOCS, tmp_path, embedder, "ja")
    assert counts["language"] == "ja" and counts["analyzer"] == "deepr"  # Milvus Lite has no Japanese analyzer
    r = open_retriever(spec, retriever="bm25", embedder=embedder)
    for question, want in JA_QUESTIONS.items():
        hits = r.search(question, k=3)
        assert hits and hits[0].doc_id == want, (question, [h.doc_id for h in hits])


def test_a_collection_refuses_a_search_or_load_in_another_language(zh, embedder, tmp_path):
    from deepr.corpus import open_retriever
    from deepr.corpus.milvus import load_to_milvus

    with pytest.raises(ValueError, match=r"loaded as Chinese \(zh, BM25 analyzer jieba\).*searched as English"):
        open_retriever(zh, retriever="bm25", embedder=embedder, language="en")
    assert open_retriever(zh, retriever="bm25", embedder=embedder, language="zh").language == "zh"
    r = CliRunner().invoke(app, ["search", "火山为什么会喷发", "--corpus", zh, "-r", "bm25", "--language", "ja"])
    assert r.exit_code == 2 and "cannot be searched as Japanese" in r.output, r.output
    spec, _ = _load(ZH_DOCS, tmp_path, embedder, "forced", language="zh")
    corpus = write_jsonl(tmp_path / "more.jsonl", ZH_DOCS)
    with pytest.raises(ValueError, match="loaded as zh, this load is en"):
        load_to_milvus(str(corpus), spec, embedder=embedder, cache_dir=tmp_path / "cache", language="en")


def test_english_collections_keep_their_analyzer_and_meta():
    from bm25s.stopwords import STOPWORDS_EN

    from deepr.corpus.milvus import analyzer, bm25_body, collection_language

    # the analyzer every English collection was created with before languages were recorded
    stop = {"type": "stop", "stop_words": sorted(STOPWORDS_EN)}
    assert analyzer("en") == ("standard", {"tokenizer": "standard", "filter": ["lowercase", stop]})
    assert bm25_body("Volcanoes erupt.", "en") == "Volcanoes erupt." and collection_language({"format": 1}) == "en"
    assert bm25_body("火山が噴火", "ja") == "x706bx5c71 x5674x706b"  # one ASCII word per bigram
