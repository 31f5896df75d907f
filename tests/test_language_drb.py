"""DeepResearch Bench's Chinese tasks: FACT statements, ``[n]`` markers, reference lists, RACE's
cleaning and the export of a Chinese deepr report, on written samples."""

from __future__ import annotations

import asyncio
import zlib

import numpy as np

from deepr.rewards.fact import extract_pairs, fact_check
from deepr.rewards.judges import Judge
from deepr.rewards.race import clean_article
from deepr.search.drb import article_from_report, cited_statements, group_statements, parse_references

ARTICLE = """# 火山与印刷术

火山喷发是因为地下的岩浆比周围的岩石轻而上升[1]。活字印刷术由北宋的毕昇发明[2][3]。疫苗让免疫系统提前认识病原体。[4]
岩浆房的压力不断升高；最终岩浆冲出地表[1]。这一句没有引用。

## 参考文献

[1] 火山 https://example.org/volcano
[2] 印刷术 https://example.org/print
[3] 毕昇 https://example.org/bisheng
[4] 疫苗 https://example.org/vaccine
"""


def test_fact_statements_of_a_chinese_article_keep_their_citations():
    _, body = parse_references(ARTICLE)
    got = [(p.statement, p.source) for p in extract_pairs(body)]
    assert got == [("火山喷发是因为地下的岩浆比周围的岩石轻而上升。", "1"), ("活字印刷术由北宋的毕昇发明。", "2"),
                   ("活字印刷术由北宋的毕昇发明。", "3"), ("疫苗让免疫系统提前认识病原体。", "4"),
                   ("最终岩浆冲出地表。", "1")]


def test_drb_statements_and_reference_list_of_a_chinese_article():
    refs, body = parse_references(ARTICLE)
    assert refs[2] == {"url": "https://example.org/print", "title": "印刷术"} and "参考文献" not in body
    statements = cited_statements(body)
    assert statements == [("火山喷发是因为地下的岩浆比周围的岩石轻而上升。", [1]), ("活字印刷术由北宋的毕昇发明。", [2, 3]),
                          ("疫苗让免疫系统提前认识病原体。", [4]), ("最终岩浆冲出地表。", [1])]
    groups, missing = group_statements(statements, refs)
    assert groups["https://example.org/volcano"] == ["火山喷发是因为地下的岩浆比周围的岩石轻而上升。", "最终岩浆冲出地表。"]
    assert missing == []


def _bigram_embed(texts):
    out = np.zeros((len(texts), 256), dtype=np.float32)
    for i, t in enumerate(texts):
        for a, b in zip(t, t[1:]):
            out[i, zlib.crc32((a + b).encode()) % 256] += 1.0
        out[i, 0] += 1e-3
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def test_fact_check_judges_chinese_statements_against_their_sources():
    store = {"1": "火山喷发是因为地下深处的岩浆比周围的岩石轻，会向上运动。", "2": "活字印刷术是北宋时期毕昇发明的。"}
    report = "火山喷发是因为岩浆比周围的岩石轻[1]。香蕉是一种蓝色的金属[2]。"
    r = asyncio.run(fact_check(report, store, Judge(None, _bigram_embed)))
    assert [(p.statement, p.verdict) for p in r.pairs] == [("火山喷发是因为岩浆比周围的岩石轻。", "supported"),
                                                            ("香蕉是一种蓝色的金属。", "unsupported")]


def test_race_cleans_a_chinese_article():
    clean = clean_article(ARTICLE)
    assert "参考文献" not in clean and "example.org" not in clean and "[1]" not in clean
    assert "活字印刷术由北宋的毕昇发明。" in clean


def test_a_chinese_deepr_report_exports_with_numbered_markers():
    report = ("# 火山为什么会喷发\n\n## 回答\n\n岩浆比岩石轻[N1-R1]。印刷术由毕昇发明[N1-R2]。\n\n"
              "## 参考文献\n\n- [N1-R1] 火山: “…” (段落 `volcano#0`)\n")
    cites = {"N1-R1": {"doc_id": "volcano", "title": "火山", "url": "https://example.org/v"},
             "N1-R2": {"doc_id": "printing", "title": "印刷术", "url": "https://example.org/p"}}
    article = article_from_report(report, cites)
    assert "岩浆比岩石轻[1]。印刷术由毕昇发明[2]。" in article and "N1-R1" not in article
    assert "## 参考文献" in article and "References" not in article
    refs, body = parse_references(article)
    assert [r["url"] for r in refs.values()] == ["https://example.org/v", "https://example.org/p"]
    assert cited_statements(body) == [("岩浆比岩石轻。", [1]), ("印刷术由毕昇发明。", [2])]
