"""Citation support: every cited claim is checked against the snippet it cites (deepr.agent.support)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.agent.support import check_support, role_judge
from deepr.extractive.support import overlap_verdict
from deepr.cli import app
from deepr.eval.evaluate import EvalContext, item_from_record, score_item
from deepr.llm.replay import ReplayLLM
from deepr.rewards.judges import Judge

PRINTING = ("Movable type made of metal was introduced in Europe in the fifteenth century, and printed "
            "books spread quickly through the trading cities of the Rhine.")
PAPER = "Paper was first made in China from mulberry bark and hemp, and papermaking reached Samarkand by 751."
SOURCES = {"N1-R1": PRINTING, "N1-R2": PAPER}
INVENTED = "In 1507, Johannes Gutenberg invented the printing press in Mainz [N1-R1]."
REPORT = ("## Answer\n" + INVENTED + " Paper was first made in China from mulberry bark [N1-R2]. "
          "Printed books spread through the trading cities of the Rhine [N1-R1]. Lava is hot [N7-R7].\n\n"
          "## References\n- [N1-R1] Printing (snippet of `printing`)\n- [N1-R2] Paper (snippet of `paper`)\n")


def check(report=REPORT, sources=SOURCES, **kw):
    return asyncio.run(check_support(report, sources, **kw))


def test_an_invented_fact_behind_a_real_id_is_flagged_by_the_overlap_check():
    r = check()
    d = r.as_dict()
    assert d["checked_by"] == "overlap" and d["claims"] == 4  # reference-list entries are not claims
    bad = {row["text"]: row for row in d["unsupported_claims"]}
    gutenberg = bad["In 1507, Johannes Gutenberg invented the printing press in Mainz."]
    assert gutenberg["ids"] == ["N1-R1"]
    assert "1507" in gutenberg["reason"] and "gutenberg" in gutenberg["reason"]
    assert "no source text: N7-R7" in bad["Lava is hot."]["reason"]
    assert d["supported"] == 2 and d["unsupported"] == 2 and d["support"] == 0.5


def test_overlap_accepts_a_close_paraphrase_and_grades_a_loose_one():
    assert overlap_verdict("Papermaking reached Samarkand by 751", PAPER)["verdict"] == "supported"
    assert overlap_verdict("Paper was made from hemp in China", PAPER)["verdict"] == "supported"
    loose = overlap_verdict("Paper from China changed religious scholarship, trade ledgers and poetry", PAPER)
    assert loose["verdict"] in ("partial", "unsupported") and "content words" in loose["reason"]
    assert overlap_verdict("Paper reached Samarkand by 900", PAPER)["verdict"] == "unsupported"  # wrong year


def test_a_judge_model_decides_entailment_and_a_failed_judgement_is_unchecked_not_a_verdict():
    replies = [json.dumps({"verdict": "unsupported", "unsupported_part": "1507, Johannes Gutenberg"}),
               json.dumps({"verdict": "Supported"})]
    llm = ReplayLLM({"judge": replies})
    r = check(REPORT.replace(" Printed books spread through the trading cities of the Rhine [N1-R1].", ""),
              judge=role_judge(llm), judge_name="replay")
    rows = {row["text"][:10]: row for row in r.rows}
    assert r.checked_by == "replay"
    assert rows["In 1507, J"]["verdict"] == "unsupported" and rows["In 1507, J"]["reason"] == "1507, Johannes Gutenberg"
    assert rows["Paper was "]["verdict"] == "supported"
    assert rows["Lava is ho"]["verdict"] == "unsupported"  # no source text: the judge is not asked
    assert [c[0] for c in llm.calls] == ["judge"] * 2 and "Johannes Gutenberg" in llm.calls[0][1][1]["content"]


def test_a_judge_that_never_answers_leaves_claims_unchecked():
    r = check("Paper was made in China [N1-R2].", judge=role_judge(ReplayLLM({"judge": ["x", "y", "z"]})))
    assert r.rows[0]["verdict"] == "unchecked" and "gave up" in r.rows[0]["reason"] and r.support is None


def test_deepr_eval_support_metric_offline_and_with_a_judge(tmp_path):
    rec = {"id": "a", "query": "Who printed first?", "report": REPORT, "citations": SOURCES}
    score = asyncio.run(score_item(item_from_record(rec, "mem"), ["support"], EvalContext(judge=Judge(None))))
    assert score.failures == {} and score.model_extra["support"] == 0.5
    assert score.model_extra["support_unsupported"] == 2 and score.model_extra["support_by"] == "overlap"
    inp = tmp_path / "r.jsonl"
    inp.write_text(json.dumps(rec) + "\n")
    replay = tmp_path / "judge.jsonl"
    replay.write_text("".join(json.dumps({"reply": json.dumps({"verdict": v})}) + "\n"
                              for v in ("unsupported", "supported", "partial")))
    out = tmp_path / "s.jsonl"
    r = CliRunner().invoke(app, ["eval", str(inp), "--metric", "support", "--judge-llm", f"replay:{replay}",
                                 "--out", str(out), "--no-cache"])
    assert r.exit_code == 0, r.output
    s = json.loads(out.read_text().splitlines()[0])
    assert s["support_by"].startswith("llm:replay") and s["support_claims"] == 4
    assert s["support_unsupported"] == 2 and s["support_partial"] == 1 and s["support"] == pytest.approx(1 / 4)  # 1 of 4; the id without text counts
    assert "support" in r.output


def test_a_run_trace_reports_citation_support(retriever, tmp_path):
    from deepr.agent import RunConfig, run_agent, write_report
    from deepr.corpus import ResearchTools

    result = run_agent("How did ancient Greek architecture influence later buildings?",
                       tools=ResearchTools(retriever, k=5), llm=None, config=RunConfig())
    paths = write_report(result, tmp_path / "report.md")
    support = json.loads(Path(paths["trace"]).read_text())["support"]
    assert support["checked_by"] == "overlap" and support["claims"] >= 3
    # the extractive writer quotes its evidence: its claims are backed
    assert support["support"] >= 0.9, support["unsupported_claims"]
    assert all(set(row["ids"]) <= set(result.trace.citations) for row in support["rows"])


def test_the_offline_citation_metric_gives_an_invented_claim_no_support(embedder):
    from deepr.rewards.rubric_reward import citation_reward

    store = {"N1-R1": PRINTING}
    claims = ["In 1507, Johannes Gutenberg invented the printing press [N1-R1].",
              "Movable type made of metal was introduced in Europe in the fifteenth century [N1-R1]."]
    r = asyncio.run(citation_reward("Who printed first?", " ".join(claims), store, Judge(None, embedder.encode)))
    rows = {c["text"][:8]: c for c in r.claims}
    assert rows["In 1507,"]["recall"] == 0.0 and rows["In 1507,"]["f1"] == 0.0
    assert rows["Movable "]["recall"] == 1.0


def test_a_marker_written_after_the_full_stop_cites_the_sentence_before_it():
    report = ("Paper was first made in China from mulberry bark. [N1-R2] In 1507, Johannes Gutenberg invented "
              "the printing press. [N1-R1]\n[N1-R2] Papermaking reached Samarkand by 751.")
    rows = {r["text"][:8]: r for r in check(report).rows}
    assert rows["Paper wa"]["ids"] == ["N1-R2"] and rows["Paper wa"]["verdict"] == "supported"
    assert rows["In 1507,"]["ids"] == ["N1-R1"] and rows["In 1507,"]["verdict"] == "unsupported"
    assert rows["Papermak"]["ids"] == ["N1-R2"] and rows["Papermak"]["verdict"] == "supported"


def test_a_replayed_model_answer_that_invents_a_fact_behind_a_real_id_is_flagged_in_report_json(retriever):
    from test_agent_dag import PLAN_G0, PLAN_G1, QUERY, good_wave

    from deepr.agent import RunConfig, run_agent
    from deepr.corpus import ResearchTools

    final = ("<answer>In 1507, Johannes Gutenberg invented the printing press in Mainz [N1-R1]. "
             "Roman builders carried Greek temple forms on to later buildings [N5-R1].</answer>")
    llm = ReplayLLM({"planner": [json.dumps(PLAN_G0), json.dumps(PLAN_G1)], "answerer": [good_wave(), final]})
    result = run_agent(QUERY, tools=ResearchTools(retriever, k=5), llm=llm, config=RunConfig())
    assert "Gutenberg" in result.answer  # the model's answer was accepted: its ids are real
    support = result.trace.model_extra["support"]
    bad = [c for c in support["unsupported_claims"] if "Gutenberg" in c["text"]]
    assert bad and bad[0]["ids"] == ["N1-R1"] and "1507" in bad[0]["reason"]
    assert any("citation support" in d["what"] for d in result.trace.model_extra["decisions"])
