"""What a reader of report.md sees: each sentence once, the question once, readable section
titles and plan, one reference line per source with its text, and files readable like any other."""

from __future__ import annotations

import logging
import os
import re
import stat

from deepr.evidence.citations import Catalog
from deepr.agent.dag import DagOutcome
from deepr.agent.render import ReportDoc, Section, render_markdown
from deepr.agent.runner import _dag_doc
from deepr.records import Hit, Plan, PlanNode

Q = "How did the printing press change science in Europe?"
S1 = "The press spread across Europe within fifty years"
S2 = "Printed journals let scientists check each other's results"
S3 = "Galileo published his findings in cheap printed books"


def _outcome() -> DagOutcome:
    plan = Plan(nodes=[
        PlanNode(id="N1", type="search", query=Q), PlanNode(id="N2", type="search", query="printing press Europe"),
        PlanNode(id="N3", type="aggregate", need="What the evidence on the question and Printing press "
                 "establishes for the question", inputs=["N1", "N2"]),
        PlanNode(id="N4", type="answer", need=Q, inputs=["N3"])])
    return DagOutcome(plan=plan, answer=f"{S1} [N1-R1]. {S2} [N2-R1].",
                      outputs={"N3": f"{S1} [N2-R2]. {S2} [N2-R1]. {S3} [N1-R2]."}, waves=[["N3"]])


def _markdown(sections: list[Section]) -> str:
    cat = Catalog()
    cat.add_hits("N1", [Hit(id="press#0", doc_id="press", title="Printing press", text="The press spread."),
                        Hit(id="galileo#0", doc_id="galileo", title="Galileo", text="Galileo [1] published.")])
    cat.add_hits("N2", [Hit(id="journals#0", doc_id="journals", title="Journals", text="Journals let scientists."),
                        Hit(id="press#0", doc_id="press", title="Printing press", text="The press spread.")])
    return render_markdown(ReportDoc(Q, sections), cat)[0]


def test_findings_repeat_no_answer_sentence_and_titles_name_the_topic():
    _, sections, _ = _dag_doc(_outcome(), Q)
    md = _markdown(sections)
    sentences = [" ".join(re.sub(r"\[[^\]]*\]", "", s).split()) for s in re.split(r"(?<=\.)\s", md)
                 if S1 in s or S2 in s or S3 in s]
    assert sorted(sentences) == sorted({*sentences}), md  # each sentence once
    assert S3 in md  # what the answer left out stays
    _, _, graph = _dag_doc(_outcome(), Q)
    assert [g.label for g in graph.nodes if g.kind == "aggregate"] == ["Printing press"]
    heads = [s.heading for s in sections if s.level == 3]
    assert heads == ["Printing press (N3)"]
    assert "establishes for the question" not in " ".join(heads)


def test_plan_table_and_waves_are_plain_text():
    _, sections, _ = _dag_doc(_outcome(), Q)
    plan = next(s.body for s in sections if s.heading == "Research plan")
    assert Q not in plan and plan.count("(the question)") == 2  # the search for it and the answer node
    assert "{" not in plan and "N3" in plan.split("waves")[-1]


def test_references_one_line_per_passage_with_its_text():
    md = _markdown([Section("Answer", f"{S1} [N1-R1]. {S2} [N2-R1]. The press reached Rome [N2-R2]. "
                                      f"{S3} [N1-R2].")])
    refs = md.split("## References", 1)[1].strip().splitlines()
    assert len(refs) == len({r.split("]")[1] for r in refs})  # no source listed twice
    press = [r for r in refs if "Printing press" in r]
    assert press == ["- [N1-R1, N2-R2] Printing press: “The press spread.” (passage `press#0`)"]
    assert not any("snippet of" in r for r in refs)
    assert "Galileo (1) published" in md  # a source's own brackets never read as a citation


def test_report_files_follow_the_umask(tmp_path):
    from deepr.io import write_text

    old = os.umask(0o022)
    try:
        write_text(tmp_path / "report.md", "x")
        assert stat.S_IMODE((tmp_path / "report.md").stat().st_mode) == 0o644
        os.chmod(tmp_path / "report.md", 0o640)  # a file being replaced keeps its mode
        write_text(tmp_path / "report.md", "y")
        assert stat.S_IMODE((tmp_path / "report.md").stat().st_mode) == 0o640
    finally:
        os.umask(old)


def test_building_a_bm25_index_logs_nothing_below_warning(tmp_path, caplog):
    from deepr.corpus.index import _build_bm25

    caplog.set_level(logging.DEBUG)
    _build_bm25(["the printing press", "movable type in Europe"], tmp_path / "bm25")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("bm25s") and r.levelno < logging.WARNING] == []
