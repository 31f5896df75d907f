"""tools mode (DeepRubric agent): protocol parsing, code-owned citations, re-asks, extractive run."""

from __future__ import annotations

import json

import pytest

from deepr.agent.tools_agent import ToolSession, answer_ids, parse_step, run_tools
from deepr.extractive.tools import cite_tags


def _ctx(retriever, llm, **cfg):
    from deepr.evidence.env import Ctx, RunConfig
    from deepr.evidence.trace import Tracer
    from deepr.corpus.tools import ResearchTools
    from deepr.profiles import get_profile

    # a scripted small model runs under the small profile, its re-ask style as the test sets it
    profile = get_profile("small", reask=getattr(llm, "reask", "correct")) if getattr(llm, "strict_formats", False) else None
    return Ctx(llm=llm, tools=ResearchTools(retriever, k=3), config=RunConfig(**cfg), tracer=Tracer("q", "tools"),
               profile=profile)


def _call(name: str, **args) -> str:
    return f"<think>next</think><tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_parse_step_reads_calls_answers_and_says_why_not():
    assert parse_step(_call("search", query="x")).kind == "tool"
    s = parse_step("<think>a</think><answer>Paris is big.</answer>")
    assert (s.kind, s.answer) == ("answer", "Paris is big.")
    bad = parse_step("<tool_call>{not json}</tool_call>")
    assert bad.kind == "invalid" and "not JSON" in bad.reason
    assert "arguments" in parse_step('<tool_call>{"name": "search", "arguments": [1]}</tool_call>').reason
    assert parse_step("<answer>  </answer>").kind == "invalid"
    assert answer_ids('<cite id="S1-R1">a b</cite> and c [S2-R3].') == ["S1-R1", "S2-R3"]
    assert cite_tags("Rome is old [S1-R2]. Paris too [S2-R1].") == \
        '<cite id="S1-R2">Rome is old.</cite> <cite id="S2-R1">Paris too.</cite>'


def test_session_ids_are_issued_by_code_and_browse_needs_a_search(retriever):

    ctx = _ctx(retriever, None)
    s = ToolSession(ctx)
    refused = s.execute("browse", {"doc_id": "anything"})
    assert "refused" in refused and s.valid == 0
    out = s.execute("search", {"query": "volcano eruption"})
    assert "[S2-R1]" in out and s.shown[:3] == ["S2-R1", "S2-R2", "S2-R3"]
    page = s.execute("browse", {"doc_id": "S2-R1"})
    assert page.startswith("[S3-F1]") and "S3-F1" in s.store()
    assert "unknown tool" in s.execute("open", {}) and "needs" in s.execute("search", {})
    assert s.valid == 2 and set(s.store()) == set(s.shown)


def test_llm_run_rejects_invented_ids_then_accepts(retriever):
    from deepr.llm.replay import ReplayLLM

    hit = retriever.search("volcano eruption", k=1)[0]
    replies = [_call("search", query="volcano eruption"),
               '<think>done</think><answer><cite id="S9-R9">Volcanoes erupt lava often.</cite></answer>',
               f'<think>fix</think><answer><cite id="S1-R1">{hit.text.split(".")[0]}.</cite></answer>']
    llm = ReplayLLM(replies)
    ctx = _ctx(retriever, llm)
    from deepr.llm.base import run_sync

    out = run_sync(run_tools(ctx, "What happens when a volcano erupts?"))
    assert out.tool_calls == 1 and "[S1-R1]" in out.answer and "S9-R9" not in out.answer
    user_msgs = [m["content"] for m in out.transcript if m["role"] == "user"]
    assert user_msgs[1].startswith("<tool_response>") and "S9-R9" in user_msgs[2]
    assert [t.action for t in ctx.tracer.turns] == ["search", "answer", "answer"]


def test_llm_run_turn_limit_forces_an_answer(retriever):
    from deepr.llm.base import run_sync
    from deepr.llm.replay import ReplayLLM

    answer = '<answer><cite id="S1-R1">Short answer here.</cite></answer>'  # cited: issue 14 rejects uncited ones
    replies = [_call("search", query=f"river topic {i}") for i in range(3)] + [answer]
    ctx = _ctx(retriever, ReplayLLM(replies))
    out = run_sync(run_tools(ctx, "Tell me about rivers", max_turns=2))
    assert out.tool_calls == 2 and out.raw_answer == '<cite id="S1-R1">Short answer here.</cite>'
    assert out.answer == "Short answer here [S1-R1]."  # the citation before the full stop, as in dag
    assert "used all your tool calls" in out.transcript[-2]["content"]


def test_extractive_run_cites_only_shown_snippets(retriever):
    from deepr.llm.base import run_sync

    ctx = _ctx(retriever, None)
    out = run_sync(run_tools(ctx, "What causes earthquakes? How are they measured?"))
    assert 2 <= out.tool_calls <= 4
    ids = answer_ids(out.raw_answer)
    assert ids and set(ids) <= set(ctx.catalog.entries) and "<cite id=" in out.raw_answer
    assert any('"browse"' in m["content"] for m in out.transcript if m["role"] == "assistant")


@pytest.mark.parametrize("llm_kind", ["extractive", "replay"])
def test_run_agent_tools_mode_writes_a_cited_report(retriever, tmp_path, llm_kind):
    from deepr.agent import RunConfig, run_agent, write_report
    from deepr.corpus.tools import ResearchTools
    from deepr.llm.replay import ReplayLLM

    if "tools" not in RunConfig.model_fields["mode"].annotation.__args__:
        pytest.skip("deepr run --mode tools is not registered in RunConfig yet")
    hit = retriever.search("earthquake plates", k=1)[0]
    llm = None if llm_kind == "extractive" else ReplayLLM(
        [_call("search", query="earthquake plates"),
         f'<think>ok</think><answer><cite id="S1-R1">{hit.text.split(".")[0]}.</cite></answer>'])
    res = run_agent("What causes earthquakes?", tools=ResearchTools(retriever, k=3), llm=llm,
                    config=RunConfig(mode="tools"))
    paths = write_report(res, tmp_path / "report.md")
    trace = json.loads(paths["trace"].read_text())
    from deepr.evidence.citations import cited_ids

    md_ids = cited_ids(res.markdown)
    assert md_ids and set(md_ids) <= set(trace["citations"]) and trace["mode"] == "tools"
    assert any(t.get("tool") == "search" for t in trace["tools"])


def test_a_failing_model_ends_the_run_with_a_recorded_failure(retriever):
    from deepr.llm.base import run_sync
    from deepr.llm.replay import ReplayLLM

    ctx = _ctx(retriever, ReplayLLM([_call("search", query="volcano eruption")]))  # then the replay runs dry
    out = run_sync(run_tools(ctx, "What happens when a volcano erupts?"))
    assert out.tool_calls == 1 and set(answer_ids(out.raw_answer)) <= set(ctx.catalog.entries)
    assert any(f["where"] == "agent/step" and "replay exhausted" in f["reason"] for f in ctx.tracer.failures)


@pytest.mark.parametrize("llm_kind", ["extractive", "replay"])
def test_cli_run_mode_tools_offline(retriever, tmp_path, monkeypatch, llm_kind):
    from typer.testing import CliRunner

    import deepr.corpus
    from deepr.cli import app

    monkeypatch.setattr(deepr.corpus, "open_retriever", lambda *a, **kw: retriever)  # the session's index
    hit = retriever.search("earthquake plates", k=1)[0]
    spec = "extractive"
    if llm_kind == "replay":
        rec = tmp_path / "replies.jsonl"
        rec.write_text("".join(json.dumps({"reply": r}) + "\n" for r in [
            _call("search", query="earthquake plates"),
            f'<think>ok</think><answer><cite id="S1-R1">{hit.text.split(".")[0]}.</cite></answer>']))
        spec = f"replay:{rec}"
    out = tmp_path / "report.md"
    r = CliRunner().invoke(app, ["run", "What causes earthquakes?", "--mode", "tools", "--out", str(out),
                                 "--llm", spec, "-k", "3"])
    assert r.exit_code == 0, r.output
    trace = json.loads(out.with_suffix(".json").read_text())
    from deepr.evidence.citations import cited_ids

    ids = cited_ids(out.read_text())
    assert trace["mode"] == "tools" and ids and set(ids) <= set(trace["citations"])
    assert "agent tool calls" in r.output


def test_system_prompt_carries_the_long_form_requirements_and_is_shared_by_run_and_rl(retriever):
    """Issue 15.10: 002 App. D's system prompt (multi-round search with gap analysis and cross-source
    checks, a deep structured answer, grounded citations, the think -> one action workflow) is the
    prompt `deepr run --mode tools` sends and the prompt `deepr grpo --stage rubric` trains under."""
    import re

    from deepr.agent.tools_agent import STEP_REGEX, system_prompt
    from deepr.llm.base import run_sync
    from deepr.records import QRPair, RubricItem
    from deepr.train.rubric_stage import rubric_dataset

    text = " ".join(system_prompt(10).split())
    requirements = {
        "several rounds": r"several rounds .* 2 to 4",
        "gap analysis after each result": r"After every result, work out what is still missing",
        "cross-source verification": r"check important facts across sources\. One source or one perspective",
        "depth and mechanisms": r"comprehensive, detailed and in depth.*explains the mechanisms",
        "comparison and synthesis": r"compares perspectives.*coherent narrative",
        "structure": r"markdown headers; write paragraphs of 5 to 8 sentences",
        "uncertainty": r"evidence is thin or sources disagree",
        "grounded cites only": r"<cite id=\"S1-R2\">the claim</cite>.*only ids that tool responses showed",
        "browse only returned documents": r"Only documents an earlier search returned can be opened",
        "workflow": r"<think>\.\.\.</think>, followed by exactly one of",
        "turn limit": r"at most 10 tool calls",
    }
    missing = [name for name, pat in requirements.items() if not re.search(pat, text)]
    assert not missing, missing
    # the workflow the prompt asks for is the one the decoder constrains and the parser reads
    step = '<think>need more</think>\n<tool_call>{"name": "search", "arguments": {"query": "quake faults"}}</tool_call>'
    assert re.fullmatch(STEP_REGEX, step) and parse_step(step).kind == "tool"
    ctx = _ctx(retriever, None)
    out = run_sync(run_tools(ctx, "What causes earthquakes?"))
    run_prompt = out.transcript[0]
    pair = QRPair(id="q", tree_id="t", question="What causes earthquakes?", selected_leaf_ids=[],
                  rubrics=[RubricItem(id="R1", type="factual", description="plates move", weight=1.0)])
    (row,), _ = rubric_dataset([pair], tool_turns=10)
    assert run_prompt == row["prompt"][0] and run_prompt["content"] == system_prompt(10)


def test_after_a_repeated_search_the_format_offers_only_browsing_and_the_answer(retriever):
    import re

    from deepr.llm.base import LLM, run_sync

    hit = retriever.search("volcano eruption", k=1)[0]
    sentence = " ".join(hit.text.split(".")[0].split()[:12]).rstrip(",;")

    class Scripted(LLM):  # a small model that repeats its first search, then follows the format
        strict_formats = True

        def __init__(self, replies):
            super().__init__()
            self.replies, self.formats = list(replies), []

        async def _achat(self, messages, **kw):
            self.formats.append(kw["fmt"].regex if kw.get("fmt") else None)
            return self.replies.pop(0)

    search = _call("search", query="volcano eruption causes")
    llm = Scripted([search, search, _call("browse", doc_id="S1-R1").split("</think>")[1],
                    f'<answer><cite id="S1-R1">{sentence}.</cite></answer>'])
    ctx = _ctx(retriever, llm)
    out = run_sync(run_tools(ctx, "What happens when a volcano erupts?"))
    # "erupts": a follow-up query must carry a term no earlier query had (the question's, here),
    # and every word comes from the question or the titles shown
    probe_search = '<tool_call>{"name": "search", "arguments": {"query": "volcano erupts"}}</tool_call>'
    probe_browse = '<tool_call>{"name": "browse", "arguments": {"doc_id": "S1-R1"}}</tool_call>'
    assert re.fullmatch(llm.formats[1], probe_search)  # before the repeat, searching is allowed
    for invented in ("volcano erupts onearth", "volcano erupts lava", "erupts volcano's's's"):
        assert not re.fullmatch(llm.formats[1], probe_search.replace("volcano erupts", invented)), invented
    after = llm.formats[2]
    assert not re.fullmatch(after, probe_search) and re.fullmatch(after, probe_browse)
    assert out.tool_calls == 2 and "S1-R1" in out.answer and not llm.replies
    assert not any(d.get("fallback") for d in ctx.tracer.decisions)  # the model wrote the answer


class _Scripted:
    """A model that replies from a script and keeps the format of every call."""

    @staticmethod
    def make(replies):
        from deepr.llm.base import LLM

        class Scripted(LLM):
            strict_formats = True

            def __init__(self):
                super().__init__()
                self.replies, self.formats, self.calls = list(replies), [], []

            async def _achat(self, messages, **kw):
                self.formats.append(kw["fmt"].regex if kw.get("fmt") else None)
                self.calls.append({"messages": list(messages), "seed": kw.get("seed")})
                return self.replies.pop(0)

        return Scripted()


def _tool(name: str, **args) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_a_follow_up_search_must_add_a_new_term_and_a_browse_a_new_document(retriever):
    """SmolLM2 (greedy) repeated its first search in every tools run, and each repeat cost a
    refused call (20 % of the calls); it also browsed the same result twice. The format now
    excludes both: a later query carries a word of the question or of a result title that no
    earlier query had, and a browse opens only a search result whose document is not open yet."""
    import re

    from deepr.llm.base import run_sync

    hit = retriever.search("volcano eruption", k=1)[0]
    sentence = " ".join(hit.text.split(".")[0].split()[:12]).rstrip(",;")
    llm = _Scripted.make([_tool("search", query="volcano eruption causes"), _tool("browse", doc_id="S1-R1"),
                          f'<answer><cite id="S1-R1">{sentence}.</cite></answer>'])
    ctx = _ctx(retriever, llm)
    out = run_sync(run_tools(ctx, "What happens when a volcano erupts?"))
    assert out.tool_calls == 2 and not ctx.tracer.failures and "S1-R1" in out.answer
    second, third = llm.formats[1], llm.formats[2]
    search = '<tool_call>{{"name": "search", "arguments": {{"query": "{}"}}}}</tool_call>'
    assert not re.fullmatch(second, search.format("volcano eruption causes"))  # the repeat
    assert not re.fullmatch(second, search.format("eruption causes volcano"))  # no new word either
    assert re.fullmatch(second, search.format("volcano erupts"))  # "erupts": the question's
    # words of the question and the titles shown only: SmolLM2 glued and invented words
    assert not re.fullmatch(second, search.format("volcano erupts suddenly"))
    # at most six words in all: SmolLM2 appended a new word to a long copy of its first query
    assert re.fullmatch(second, search.format("volcano erupts happens volcano happens volcano"))
    assert not re.fullmatch(second, search.format("volcano erupts happens volcano happens volcano happens"))
    # and the new term once: SmolLM2 searched "Algiers Algiers"
    assert not re.fullmatch(second, search.format("volcano erupts erupts"))
    title_word = next(w for c in ctx.tracer.tools[0]["ids"] for w in re.findall(r"[A-Za-z]{4,}", ctx.catalog[c].title)
                      if w.lower() not in {"volcano", "eruption", "causes"})
    assert re.fullmatch(second, search.format(f"{title_word} volcano"))  # a lead from a result title
    browse = '<tool_call>{{"name": "browse", "arguments": {{"doc_id": "{}"}}}}</tool_call>'
    assert re.fullmatch(second, browse.format("S1-R1"))
    others = [c for c in ctx.tracer.tools[0]["ids"] if ctx.catalog[c].doc_id != ctx.catalog["S1-R1"].doc_id]
    assert not re.fullmatch(third, browse.format("S1-R1")) and not re.fullmatch(third, browse.format("S2-F1"))
    assert not others or re.fullmatch(third, browse.format(others[0]))


def test_an_answer_that_copies_a_sentence_of_the_refusal_is_rejected(retriever):
    """Seen from SmolLM2 (hf): its answer opened with "Search for something not yet covered, or
    answer.", a sentence of the loop's refusal of a repeated search, cited to a real id."""
    from deepr.llm.base import run_sync

    hit = retriever.search("volcano eruption", k=1)[0]
    sentence = " ".join(hit.text.split(".")[0].split()[:12]).rstrip(",;")
    search = _tool("search", query="volcano eruption causes")
    echo = (f'<answer><cite id="S1-R1">Search for something not yet covered, or answer.</cite> '
            f'<cite id="S1-R1">{sentence}.</cite></answer>')
    good = f'<answer><cite id="S1-R1">{sentence}.</cite></answer>'
    llm = _Scripted.make([search, search, echo, good])
    ctx = _ctx(retriever, llm)
    out = run_sync(run_tools(ctx, "What happens when a volcano erupts?"))
    reasons = [f["reason"] for f in ctx.tracer.failures]
    assert any("copied from the correction request" in r for r in reasons), reasons
    assert out.raw_answer == good[8:-9] and not llm.replies


def test_a_resampled_reask_leaves_the_refused_turn_out_of_the_conversation(retriever):
    """With --reask resample (the default for smollm2), a refused tool call is not put back in
    front of the model with its correction: the same conversation is sampled again, seed moved
    on (SmolLM2 answered "Algiers Algiers Algiers ..." to each correction that quoted it)."""
    from deepr.llm.base import run_sync

    hit = retriever.search("volcano eruption", k=1)[0]
    sentence = " ".join(hit.text.split(".")[0].split()[:12]).rstrip(",;")
    llm = _Scripted.make([_tool("search", query="..."), _tool("search", query="volcano eruption causes"),
                          f'<answer><cite id="S1-R1">{sentence}.</cite></answer>'])
    llm.reask = "resample"
    ctx = _ctx(retriever, llm)
    out = run_sync(run_tools(ctx, "What happens when a volcano erupts?"))
    assert out.tool_calls == 1 and "S1-R1" in out.answer
    first, again = llm.calls[0], llm.calls[1]
    assert again["messages"] == first["messages"] and again["seed"] != first["seed"]
    refused = _tool("search", query="...")
    assert not any(m["content"] == refused for m in llm.calls[2]["messages"] if m["role"] == "assistant")
    assert any(m["role"] == "assistant" for m in llm.calls[2]["messages"])  # the accepted search stays
