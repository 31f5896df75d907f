"""The words a report's code writes around its evidence, one table per language.

A report is written in its question's language: the extractive engine's plan needs, the
headings, the plan table and the notes come from the table of the question's language
(deepr.text.lang.detect_language), never a mix. Languages without a table here use English.
The data stages' extractive engine takes its sub-queries, questions and criteria from the same
table (the ``tree``/``pair`` keys), in its corpus's language.

Example::

    python -c "from deepr.evidence.phrases import phrases; print(phrases('火山为什么会喷发')['answer'])"
"""

from __future__ import annotations

import re
from typing import Any

from deepr.text.lang import detect_language

EN: dict[str, Any] = {
    "question": "Question", "answer": "Answer", "more_findings": "More findings by research step",
    "research_plan": "Research plan", "references": "References", "evidence_gathered": "Evidence gathered",
    "no_sources": "(no sources were cited)", "no_memory": "(no evidence was kept)",
    "plan_header": "| node | type | query / need | inputs |",
    "types": {"search": "search", "aggregate": "aggregate", "answer": "answer"},
    "question_cell": "(the question)",
    "waves": "Answered in waves (nodes of one wave run side by side): {waves}",
    "extractive_note": ("Written without a language model: every sentence below is extracted from the cited "
                        "sources by the extractive backend (retrieval + sentence embeddings)."),
    "fallback_note": ("Written by the extractive writer because the model's replies failed their checks: "
                      "{parts} (the reasons are under failures in the .json trace beside this report, "
                      "and in its .meta.json sidecar)."),
    "need": "What the evidence on {labels} establishes for the question",
    "label_join": " and ", "question_label": "the question", "whole_question": "The question as asked",
    "connect": "How the findings of {a} and {b} connect", "evidence_on": "evidence on {terms}",
    "term_join": ", ", "no_evidence": "No evidence was retrieved for this part.",
    "overview": "Overview", "background": "Background needed for: {q}", "tool_calls": "Tool calls",
    "response": "Response",
    "sources_on": "What the sources say about {title}", "colon": ": ",
    "reference_words": {"passage": "passage", "page_passage": "page passage", "search_result": "search result",
                        "accessed": "accessed"},
    # the data stages' extractive sub-queries (deepr/extractive/trees.py) and pairs (deepr/extractive/rubrics.py)
    "tree_facet": "{anchor}: {phrase}", "tree_compared": "{phrase} compared with {anchor}",
    "pair_questions": (
        "How do {topics} shape our understanding of {root}, and what does the evidence suggest "
        "about how they connect, differ in importance and leave questions open?",
        "What roles do {topics} play in {root}, and how should their causes, consequences and "
        "relative significance be weighed against each other?",
        "Drawing on {topics}, what explains the development and significance of {root}, and "
        "where do these strands agree, conflict or remain uncertain?"),
    "pair_connected": "How are {topic} connected within {root}?",
    "pair_states": "The answer states that {statement}",
    "pair_compares": "The answer compares {a} with {b} and says where they differ.",
    "pair_bears_on": "The answer explains, with cited evidence, how {c} bears on {a}.",
    "pair_concludes": "The answer ends with a conclusion on {root} that weighs {topics} against each other.",
}

ZH: dict[str, Any] = {
    "question": "问题", "answer": "回答", "more_findings": "各研究步骤的其他发现",
    "research_plan": "研究计划", "references": "参考文献", "evidence_gathered": "收集到的证据",
    "no_sources": "（未引用任何来源）", "no_memory": "（未保留任何证据）",
    "plan_header": "| 节点 | 类型 | 检索词 / 需求 | 输入 |",
    "types": {"search": "检索", "aggregate": "汇总", "answer": "回答"},
    "question_cell": "（问题本身）",
    "waves": "分批回答（同一批的节点同时进行）：{waves}",
    "extractive_note": ("本报告未使用语言模型：下面的每一句话都由抽取式后端（检索 + 句向量）"
                        "从所引用的来源中摘出。"),
    "fallback_note": ("由于模型的回复未通过检查，以下部分由抽取式写作器写成：{parts}"
                      "（原因见本报告旁边 .json 追踪文件中的 failures，以及它的 .meta.json 附带文件）。"),
    "need": "关于{labels}的证据对这个问题说明了什么",
    "label_join": "与", "question_label": "问题本身", "whole_question": "问题本身",
    "connect": "{a}与{b}的发现之间有何联系", "evidence_on": "关于{terms}的证据",
    "term_join": "、", "no_evidence": "这一部分没有检索到证据。",
    "overview": "概述", "background": "回答问题所需的背景：{q}", "tool_calls": "工具调用", "response": "答复",
    "sources_on": "来源中关于{title}的内容", "colon": "：",
    "reference_words": {"passage": "段落", "page_passage": "网页段落", "search_result": "检索结果",
                        "accessed": "访问于"},
    "tree_facet": "{anchor}：{phrase}", "tree_compared": "{phrase}与{anchor}的比较",
    "pair_questions": (
        "{topics}如何影响我们对{root}的理解？证据表明它们之间有何联系、重要性有何不同、还有哪些问题悬而未决？",
        "{topics}在{root}中各起什么作用？它们的成因、后果和相对重要性应当如何相互权衡？",
        "结合{topics}，什么解释了{root}的发展与意义？这些线索在哪些方面一致、冲突或仍不确定？"),
    "pair_connected": "{topic}在{root}中有何联系？",
    "pair_states": "回答指出：{statement}",
    "pair_compares": "回答比较{a}与{b}，并指出二者的不同之处。",
    "pair_bears_on": "回答借助所引用的证据，说明{c}对{a}有何影响。",
    "pair_concludes": "回答最后就{root}得出结论，并权衡{topics}各自的分量。",
}

JA: dict[str, Any] = {
    "question": "質問", "answer": "回答", "more_findings": "調査ステップごとのその他の知見",
    "research_plan": "調査計画", "references": "参考文献", "evidence_gathered": "集めた証拠",
    "no_sources": "（引用した情報源はありません）", "no_memory": "（保持した証拠はありません）",
    "plan_header": "| ノード | 種類 | 検索語 / 必要事項 | 入力 |",
    "types": {"search": "検索", "aggregate": "集約", "answer": "回答"},
    "question_cell": "（質問そのもの）",
    "waves": "段階ごとに回答（同じ段階のノードは同時に実行）：{waves}",
    "extractive_note": ("この報告は言語モデルを使わずに書かれた：以下の各文は抽出型バックエンド（検索＋文ベクトル）が"
                        "引用元から抜き出したものである。"),
    "fallback_note": ("モデルの返答が検査に通らなかったため、次の部分は抽出型ライターが書いた：{parts}"
                      "（理由はこの報告の横にある .json トレースの failures と、その .meta.json にある）。"),
    "need": "{labels}についての証拠が質問に対して示すこと",
    "label_join": "と", "question_label": "質問そのもの", "whole_question": "質問そのもの",
    "connect": "{a}と{b}の知見のつながり", "evidence_on": "{terms}についての証拠",
    "term_join": "、", "no_evidence": "この部分については証拠が見つからなかった。",
    "overview": "概要", "background": "質問に答えるための背景：{q}", "tool_calls": "ツール呼び出し", "response": "応答",
    "sources_on": "{title}について情報源が述べること",
    "colon": "：",
    "reference_words": {"passage": "段落", "page_passage": "ページの段落", "search_result": "検索結果", "accessed": "閲覧日"},
    "tree_facet": "{anchor}：{phrase}", "tree_compared": "{phrase}と{anchor}の比較",
    "pair_questions": (
        "{topics}は{root}の理解にどう関わり、証拠はそれらのつながり、重要度の違い、残された問いについて何を示しているか？",
        "{root}において{topics}はそれぞれどんな役割を果たし、その原因、結果、相対的な重要性をどう比べるべきか？",
        "{topics}をもとにすると、{root}の発展と意義は何によって説明され、これらの論点はどこで一致し、対立し、"
        "あるいは不確かなままか？"),
    "pair_connected": "{root}において{topic}はどうつながっているか？",
    "pair_states": "回答は次のことを述べている：{statement}",
    "pair_compares": "回答は{a}と{b}を比較し、どこが異なるかを述べている。",
    "pair_bears_on": "回答は引用した証拠をもとに、{c}が{a}にどう関わるかを説明している。",
    "pair_concludes": "回答は最後に{root}について結論を述べ、{topics}の重みを比べている。",
}

TABLES = {"en": EN, "zh": ZH, "ja": JA}


def phrases(question: str) -> dict[str, Any]:
    """The table of ``question``'s language (English where there is none)."""
    return phrases_in(detect_language(question or ""))


def phrases_in(language: str | None) -> dict[str, Any]:
    """The table of a language code (English where there is none), for callers that know it."""
    return TABLES.get(language or "en", EN)


def join_list(items: list[str] | tuple[str, ...], table: dict[str, Any]) -> str:
    """``a, b and c`` in the table's words (``a、b与c``)."""
    if len(items) == 1:
        return items[0]
    return table["term_join"].join(items[:-1]) + table["label_join"] + items[-1]


def _need_pattern(table: dict[str, Any]) -> re.Pattern[str]:
    head, tail = table["need"].split("{labels}")
    return re.compile(f"^{re.escape(head)}(?P<topics>.+){re.escape(tail)}$")


_NEEDS = [(t, _need_pattern(t)) for t in TABLES.values()]


def need_topics(need: str) -> str | None:
    """The topic list of an extractive aggregate need in any table's words (a heading a reader
    wants, not the instruction the writer was given); None for any other need."""
    for table, pattern in _NEEDS:
        m = pattern.match(need.strip())
        if m:
            topics = [t for t in m.group("topics").split(table["label_join"]) if t != table["question_label"]]
            return table["label_join"].join(topics) or table["whole_question"]
    return None
