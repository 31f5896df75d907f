"""Replies a capable model can send must never break deepr (issue 39, model half): each test
plays one reply the format allows and checks deepr refuses, re-asks or records it."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.agent import RunConfig, run_agent
from deepr.cli import app
from deepr.llm.stub_server import Raw, StubServer

from fake_model import CompetentModel, in_process

QUESTION = "How do volcanic eruptions affect the climate and the people living nearby?"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tree_helpers import volcano_docs

    path = tmp_path_factory.mktemp("replies") / "volcano.jsonl"
    path.write_text("".join(d.model_dump_json() + "\n" for d in volcano_docs()), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tools(corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    from deepr.corpus import ResearchTools, open_retriever

    return ResearchTools(open_retriever(str(corpus), retriever="bm25", cache_dir=tmp_path_factory.mktemp("ix"),
                                        progress=False), k=4)


def run(mode: str, tools, **overrides):
    return run_agent(QUESTION, tools=tools.fresh(), llm=in_process(CompetentModel(), **overrides),
                     config=RunConfig(mode=mode))


def failures(res) -> list[dict]:
    return res.trace.model_extra.get("failures", [])


# -- 2, 15: tools mode ---------------------------------------------------------------------


def test_tools_mode_refuses_an_uncited_answer_given_before_any_search(tools):
    res = run("tools", tools, agent_step=lambda p: "<think>I know this.</think><answer>Volcanoes cool the climate "
                                                   "for years after large eruptions.</answer>")
    assert any(f["where"] == "agent/answer" for f in failures(res)), failures(res)
    assert res.trace.citations, "the fallback searched and cited what it found"
    assert res.trace.tools, "code made the searches the model skipped"


def test_tools_mode_refuses_an_answer_empty_once_its_cite_tags_go():
    from deepr.agent.tools_agent import parse_step

    step = parse_step('<answer><cite id=""></cite> </answer>')
    assert step.kind == "invalid" and "empty" in step.reason


def test_tools_mode_searches_the_whole_question_without_an_ellipsis(tools):
    from deepr.extractive.tools import ExtractivePolicy

    long_q = ("What were the causes, the immediate human consequences and the long-term climatic effects of the "
              "great eruptions of Tambora in 1815 and Krakatoa in 1883 on the farming communities of Europe, Asia "
              "and North America during the following decade?")
    policy = ExtractivePolicy(None, long_q, 10)
    assert policy.queries[0] == long_q and all("…" not in q for q in policy.queries)


# -- 3: decor --------------------------------------------------------------------------------


def test_decor_refuses_stop_with_empty_memory_and_an_uncited_answer(tools):
    res = run("decor", tools, decor_planner_plan=lambda p: "<think>Done.</think><search>STOP</search>",
              decor_answerer_answer=lambda p: "<think>x</think><answer>euC</answer>")
    wheres = {f["where"] for f in failures(res)}
    assert "decor_planner/plan" in wheres and "decor_answerer/answer" in wheres, wheres
    assert "euC" not in res.answer
    reasons = " ".join(f["reason"] for f in failures(res))
    assert "STOP is not possible" in reasons and "nothing to cite" in reasons


# -- 4: brackets that are not evidence ids ---------------------------------------------------


def _junk_answer(p):
    real = next(iter(p.evidence))
    return (f"<answer>Eruptions cool the climate [N4] and [S1] as [section-1] shows [R1] [n0.1]. "
            f"{p.cited([real], 1)}</answer>")


def test_bracket_tokens_that_are_not_ids_are_refused_and_never_reach_the_report(tools):
    res = run("dag", tools, answerer_final=_junk_answer)
    assert any("not evidence ids" in f["reason"] for f in failures(res)), failures(res)
    for junk in ("[N4]", "[S1]", "[section-1]", "[R1]", "[n0.1]"):
        assert junk not in res.markdown


def test_the_renderer_emits_only_evidence_brackets():
    from deepr.evidence.citations import Catalog, stray_brackets
    from deepr.agent.render import ReportDoc, Section, render_markdown
    from deepr.records import Hit

    cat = Catalog()
    [cid] = cat.add_hits("S1", [Hit(id="d#1", doc_id="d", title="Doc [draft]", text="Lava flows.", score=1.0)])
    body = f"Lava flows [{cid}]. See [N4], [R1] and [the appendix] or [docs](https://x.org/a)."
    md, cites, _ = render_markdown(ReportDoc("What [N2] is lava?", [Section("Answer", body)]), cat)
    assert set(cites) == {cid}
    import re

    groups = re.findall(r"\[([^\[\]\n]*)\]", md)
    assert groups and all(g == cid for g in groups), md
    assert stray_brackets(f"[{cid}] [N4]") == ["[N4]"]


# -- 5: concurrent refusals of the regex style -----------------------------------------------


def test_concurrent_regex_refusals_advance_the_fallback_once():
    from deepr.llm import get_llm
    from deepr.llm.base import OutputFormat

    def reply(body):
        if "grammar" in body:
            return Raw(json.dumps({"error": {"message": "grammar is not supported"}}), status=400)
        return "<answer>ok</answer>"

    with StubServer(reply, latency=0.3) as srv:
        llm = get_llm("openai:fake", base_url=srv.base_url, cache=False, max_concurrency=16)
        fmt = OutputFormat("answer", regex=r"<answer>[^<]+</answer>")

        async def many():
            return await asyncio.gather(*(llm.achat([{"role": "user", "content": f"q{i}"}], fmt=fmt)
                                          for i in range(16)))

        asyncio.run(many())
        llm.close()
        unformatted = [b for b in srv.requests if "grammar" not in b and "structured_outputs" not in b]
        assert unformatted == [], f"{len(unformatted)} of {len(srv.requests)} requests went out with no format"


# -- 6: exit codes ---------------------------------------------------------------------------


def test_eval_with_one_metric_unscorable_exits_3(tmp_path):
    """Item b has no gold answer: its em fails, its support is scored, and the command exits 3
    (some metric failed), not 4 (nothing succeeded)."""
    items, gold = tmp_path / "items.jsonl", tmp_path / "gold.jsonl"
    items.write_text("".join(json.dumps({
        "id": i, "query": "What is lava?", "report": "Lava is molten rock [N1-R1].", "answer": "molten rock",
        "citations": {"N1-R1": {"doc_id": "d", "text": "Lava is molten rock."}}}) + "\n" for i in ("a", "b")))
    gold.write_text(json.dumps({"id": "a", "answers": ["molten rock"]}) + "\n")
    r = CliRunner().invoke(app, ["eval", str(items), "--metric", "support,em", "--gold", str(gold),
                                 "--out", str(tmp_path / "s.jsonl")])
    rows = {row["id"]: row for row in map(json.loads, (tmp_path / "s.jsonl").read_text().splitlines())}
    assert rows["b"]["support"] is not None and "em" in rows["b"]["failures"], rows["b"]
    assert rows["a"]["em"] == 1.0
    assert r.exit_code == 3, r.output


# -- 7: content null with tool_calls ---------------------------------------------------------


def test_a_reply_of_tool_calls_without_text_is_reasked():
    from deepr.llm import get_llm
    from deepr.roles import Recorder, Role, TaggedReply, perform

    null = {"id": "x", "object": "chat.completion", "created": 0, "model": "fake",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "search", "arguments": "{}"}}]}}]}
    role = Role(name="answerer", action="final", messages=lambda a: [{"role": "user", "content": "Say it."}],
                output=TaggedReply("answer"), extractive=lambda a: "fallback")
    with StubServer([null, "<answer>Lava is molten rock.</answer>"]) as srv:
        llm = get_llm("openai:fake", base_url=srv.base_url, cache=False)
        out = asyncio.run(perform(role, None, llm=llm, rec=Recorder(), max_reasks=1))
        llm.close()
    assert out.by == "llm" and out.value == "Lava is molten rock." and out.attempts == 2


# -- 8: warp outline titles ------------------------------------------------------------------


def test_warp_refuses_junk_outline_titles():
    from deepr.agent.warp import DEEPEN, INITIALIZE
    from deepr.roles import judge_reply

    junk = {"name": "initialize", "title": "Volcanic eruptions and climate",
            "sections": [{"title": "1 chamber rises volcanic press volcanic @", "plan": "x"},
                         {"title": "1 p", "plan": "y"}]}
    _, why = judge_reply(INITIALIZE, None, json.dumps(junk), [])
    assert why and "section number" in why
    good = {**junk, "sections": [{"title": "Eruption mechanics", "plan": "How magma rises."},
                                 {"title": "1815 eruption of Tambora", "plan": "The year without a summer."}]}
    assert judge_reply(INITIALIZE, None, json.dumps(good), [])[1] is None
    assert DEEPEN.check is not None
    # names that are short or hold symbols are titles; a lone letter behind a digit is not
    from deepr.agent.warp import title_problems

    assert title_problems(["AT&T", "Wi-Fi standards", "3C 273", "1990"]) == []
    assert title_problems(["a b", "1 p"]) and len(title_problems(["a b", "1 p"])) == 2


# -- 9: claims of the report's frame ----------------------------------------------------------


REPORT = """# What is lava?

> Written by the extractive writer because the model's replies failed their checks: answer (reasons in the sidecar's failures).

## Question

> What is lava and how hot does it get?

## Answer

Lava is molten rock expelled by a volcano during an eruption [N1-R1].

## Research plan

| node | type | query / need | inputs |
|---|---|---|---|
| N1 | search | lava temperature [N1-R1] | |

Waves: {N1} [N1-R1]

## References

- [N1-R1] Lava (snippet of `lava`)
"""


def test_claim_metrics_score_only_the_reports_own_claims():
    from deepr.agent.support import check_support
    from deepr.rewards.rubric_reward import extract_claims
    from deepr.text import report_prose

    rep = asyncio.run(check_support(REPORT, {"N1-R1": "Lava is molten rock expelled by a volcano."}))
    assert [r["text"] for r in rep.rows] == ["Lava is molten rock expelled by a volcano during an eruption."]
    claims = [c.text for c in extract_claims(report_prose(REPORT), ["N1-R1"])]
    assert claims == ["Lava is molten rock expelled by a volcano during an eruption."], claims


# -- 11: nothing listening -------------------------------------------------------------------


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_a_refused_connection_fails_fast_and_writes_no_report(tmp_path, corpus):
    from deepr.llm import get_llm
    from deepr.llm.base import LLMError

    url = f"http://127.0.0.1:{_closed_port()}/v1"
    llm = get_llm("openai:fake", base_url=url, cache=False)
    t0 = time.monotonic()
    with pytest.raises(LLMError, match="connection refused"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 3 and llm.usage.retries == 0
    llm.close()
    out = tmp_path / "r.md"
    r = CliRunner().invoke(app, ["run", QUESTION, "--out", str(out), "--corpus", str(corpus), "--llm", "openai:fake",
                                 "--base-url", url, "--no-cache"])
    assert r.exit_code == 4, r.output
    assert "connection refused" in r.output and "timed out" not in r.output
    assert not out.exists() and not out.with_suffix(".json").exists()


# -- 1: model text through rich --------------------------------------------------------------


def test_verify_shows_markup_like_model_text_as_text(tmp_path, corpus):
    from deepr.data.tree_roles import TreeRoles  # noqa: F401  (the data stage's modules import cleanly)

    fake = CompetentModel()
    tagged = "unsupported_claim[/evidence]"

    def audit(p):
        return {"decision": "KEEP", "error_tags": [tagged, "[bold]x"], "major_issues": [], "justification": "ok",
                "fix_plan": "", "revised_question": None, "revised_rubrics": None}

    from fake_model import ROLES

    d = tmp_path
    (d / "topics.txt").write_text("Volcano\n")
    with StubServer(fake) as srv:
        m = ["--llm", "openai:fake", "--base-url", srv.base_url, "--no-cache"]
        runner = CliRunner()
        assert runner.invoke(app, ["build-trees", "--corpus", str(corpus), "--topics", str(d / "topics.txt"),
                                   "--out", str(d / "t.jsonl"), *m]).exit_code == 0
        assert runner.invoke(app, ["synthesize-rubrics", str(d / "t.jsonl"), "--out", str(d / "p.jsonl"),
                                   *m]).exit_code == 0
        saved = ROLES["verify_audit"]
        ROLES["verify_audit"] = audit
        try:
            for _ in range(2):  # the tag table re-reads every audited pair on a re-run
                r = runner.invoke(app, ["verify", str(d / "p.jsonl"), "--out", str(d / "v.jsonl"), *m])
                assert r.exit_code == 0, r.output
        finally:
            ROLES["verify_audit"] = saved
    assert "unsupported_claim[/evidence]" in r.output and "[bold]x" in r.output
