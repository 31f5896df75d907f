"""`deepr run` offline on a Chinese question, and the same run in English: only the relevant
document is cited, citations sit where the language puts them, the scaffolding is the question's."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from deepr.cli import app
from lang_corpora import EN_RUN_DOCS, ZH_RUN_DOCS, write_jsonl


def _run(tmp_path, question: str, table: dict, mode: str = "dag") -> tuple[str, dict]:
    corpus = write_jsonl(tmp_path / "corpus.jsonl", table)
    out = tmp_path / "r" / "report.md"
    r = CliRunner().invoke(app, ["run", question, "--corpus", str(corpus), "--cache-dir", str(tmp_path / "cache"),
                                 "--out", str(out), "--mode", mode])
    assert r.exit_code == 0, r.output
    return out.read_text(encoding="utf-8"), json.loads((tmp_path / "r" / "report.json").read_text(encoding="utf-8"))


def _answer(md: str, heading: str) -> str:
    return md.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0].strip()


def test_a_chinese_question_gets_a_chinese_report_citing_only_its_topic(tmp_path):
    md, side = _run(tmp_path, "火山为什么会喷发", ZH_RUN_DOCS)
    assert side["citations"] and {c["doc_id"] for c in side["citations"].values()} == {"volcano"}
    answer = _answer(md, "回答")
    assert "喷发" in answer and "印刷" not in answer and "疫苗" not in answer
    # every sentence ends "…text[N1-R1]。": no space before the marker, the full stop after it
    markers = list(re.finditer(r"\[[^\]]+\]", answer))
    assert markers and all(answer[m.start() - 1] != " " and answer[m.end():m.end() + 1] in ("。", "[")
                           for m in markers)
    assert " " not in answer  # Chinese sentences follow each other with no space
    # no English words of the code's own: strip ids (citations, node ids, passage ids) and look
    prose = re.sub(r"`[^`]*`|\[[^\]]*\]|\bN\d+\b", "", md)
    assert not re.findall(r"[A-Za-z]{2,}", prose), re.findall(r"[A-Za-z]{2,}", prose)
    assert "## 参考文献" in md and "## 研究计划" in md


def test_the_same_run_in_english_is_unchanged(tmp_path):
    md, side = _run(tmp_path, "Why do volcanoes erupt?", EN_RUN_DOCS)
    assert {c["doc_id"] for c in side["citations"].values()} == {"volcano"}
    answer = _answer(md, "Answer")
    assert "erupt" in answer and "Gutenberg" not in answer
    markers = list(re.finditer(r"\[[^\]]+\]", answer))
    assert markers and all(answer[m.start() - 1] == " " and answer[m.end():m.end() + 1] in (".", "[")
                           for m in markers)
    assert "]. " in answer  # English sentences are separated by a space
    assert "## Research plan" in md and "## References" in md and "What the evidence on" in md
    assert "Written without a language model" in md


def test_a_japanese_question_gets_a_japanese_report_citing_only_its_topic(tmp_path):
    from lang_corpora import JA_DOCS

    md, side = _run(tmp_path, "火山はなぜ噴火するのか？", JA_DOCS)
    assert {c["doc_id"] for c in side["citations"].values()} == {"volcano"}
    answer = _answer(md, "回答")
    assert "噴火が起こる[N" in answer and " " not in answer
    prose = re.sub(r"`[^`]*`|\[[^\]]*\]|\bN\d+\b", "", md)
    assert not re.findall(r"[A-Za-z]{2,}", prose)


@pytest.mark.parametrize("mode", ["warp", "decor", "tools"])
def test_every_mode_writes_a_chinese_question_s_report_in_chinese(tmp_path, mode):
    from lang_corpora import ZH_DOCS

    md, side = _run(tmp_path, "火山为什么会喷发", ZH_DOCS, mode)
    assert side["citations"] and {c["doc_id"] for c in side["citations"].values()} == {"volcano"}
    body = md.split("## 参考文献")[0]
    markers = list(re.finditer(r"\[[A-Z]\d+-R\d+\]", body))
    assert markers and all(body[m.start() - 1] not in " 。" and body[m.end()] in "。[" for m in markers)
    prose = re.sub(r"`[^`]*`|\[[^\]]*\]|\bN\d+\b|\*\*[^*]*\*\*", "", md)
    assert not re.findall(r"[A-Za-z]{2,}", prose), re.findall(r"[A-Za-z]{2,}", prose)
