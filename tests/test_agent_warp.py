"""warp mode end to end: drafting and deepening, extractive and with recorded LLM replies."""

from __future__ import annotations

import json

import pytest

from deepr.agent import RunConfig, cited_ids, run_agent
from deepr.llm.replay import ReplayLLM

QUERY = "How does commercial air travel work, from aircraft and engines to airports and air traffic control?"


@pytest.fixture(scope="module")
def tools(retriever):
    from deepr.corpus import ResearchTools

    return ResearchTools(retriever, k=5)


def check_citations(result) -> None:
    produced = {i for t in result.trace.tools for i in t.get("ids", [])}
    cited = set(cited_ids(result.markdown))
    assert cited and cited == set(result.trace.citations) and cited <= produced


def action(name: str, **kw) -> str:
    return "<thought>deciding</thought>\n<action>" + json.dumps({"name": name, **kw}) + "</action>"


def warp_replies() -> list[str]:  # queries of 2+ content words: issue 14 rejects shorter ones
    sections = [{"title": "Aircraft", "plan": "What airplanes are and how they fly"},
                {"title": "Airports", "plan": "How airports and air traffic control work"}]
    subs = [{"title": "Engines", "plan": "Aircraft engines"}, {"title": "Airships", "plan": "Lighter than air"}]
    return [
        action("search", keywords=["airplane history", "airport air traffic control"]),    # initialize: search
        "Outline: 1. Aircraft 2. Airports",                                         # initialize: not JSON
        action("initialize", title="Air travel", sections=sections),                # ... re-asked, valid
        action("search", keywords=["airplane flight"]),                             # section 1 search -> S2
        "<content>Airplanes are fixed-wing aircraft [S2-R1] [S9-R9].</content>",   # unknown id S9-R9
        "<content>Airplanes are powered fixed-wing aircraft [S2-R1].</content>",   # ... re-asked, valid
        action("search", keywords=["airport operations"]),                                  # section 2 search -> S3
        "<content>Airports serve airlines [S3-R1], guided by controllers [S3-R2].</content>",
        action("expand", position="section-7", subsections=subs),                  # no such section
        action("expand", position="section-1", subsections=subs),                  # ... re-asked, valid
        action("search", keywords=["aircraft engine"]),                             # 1.1 -> S4
        "<content>Engines provide thrust [S4-R1].</content>",
        action("search", keywords=["airship design"]),                                  # 1.2 -> S5
        "<content>Airships float on lifting gas [S5-R1].</content>",
        action("terminate"),
    ]


@pytest.fixture(scope="module")
def replay_run(tools):
    llm = ReplayLLM(warp_replies())
    return run_agent(QUERY, tools=tools, llm=llm, config=RunConfig(mode="warp")), llm


def test_replay_warp_follows_initialize_draft_deepen(replay_run):
    result, llm = replay_run
    actions = [t.action for t in result.trajectory.turns]
    assert actions == ["search", "initialize", "search", "write", "search", "write", "expand",
                       "search", "write", "search", "write", "terminate"]
    assert len(llm.calls) == len(warp_replies()) and llm.remaining() == 0
    assert "### 1.1 Engines" in result.markdown and "### 1.2 Airships" in result.markdown
    assert result.trace.model_extra["expansions"] == 1
    check_citations(result)


def test_replay_warp_reasks_bad_replies_with_reasons(replay_run):
    result, llm = replay_run
    reasks = [m[-1]["content"] for _, m in llm.calls if m[-1]["content"].startswith("Your previous reply")]
    assert len(reasks) == 3
    assert "no JSON object" in reasks[0]
    assert "unknown citation ids S9-R9" in reasks[1]
    assert "'section-7' cannot be expanded" in reasks[2]
    assert "S9-R9" not in result.markdown


def test_replay_warp_records_drafts_and_the_draft_each_decision_saw(replay_run):
    traj = replay_run[0].trajectory
    assert len(traj.drafts) == 2 and "1.1 Engines" in traj.drafts[1] and "1.1" not in traj.drafts[0]
    decisions = [t for t in traj.turns if t.action in ("expand", "terminate")]
    assert [t.model_extra["draft"] for t in decisions] == [0, 1]
    assert traj.report.startswith("# ")


def test_replay_warp_forced_step_rejects_terminate(tools):
    replies = warp_replies()
    replies[8:10] = [action("terminate"), action("expand", position="section-2",
                                                 subsections=[{"title": "Air traffic control", "plan": "x"},
                                                              {"title": "Airlines", "plan": "y"}])]
    replies[-1:] = []  # after the forced expansion the run stops by itself
    llm = ReplayLLM(replies)
    result = run_agent(QUERY, tools=tools, llm=llm, config=RunConfig(mode="warp", force_expand=1))
    reask = next(m[-1]["content"] for _, m in llm.calls if "terminate is not allowed" in m[-1]["content"])
    assert "section-1" in reask
    assert "### 2.1 Air traffic control" in result.markdown
    assert any("forced expansions" in d["what"] for d in result.trace.model_extra["decisions"])


def test_extractive_warp_force_expand_records_every_draft(tools):
    result = run_agent(QUERY, tools=tools, llm=None, config=RunConfig(mode="warp", force_expand=2))
    traj = result.trajectory
    expands = [t for t in traj.turns if t.action == "expand"]
    assert len(expands) == result.trace.model_extra["expansions"] == 2
    assert len(traj.drafts) == 3
    heads = [{ln for ln in d.splitlines() if ln.startswith("#")} for d in traj.drafts]
    assert heads[0] < heads[1] < heads[2]  # each expansion keeps every section and adds subsections
    assert all(h in result.markdown for h in heads[2] if not h.startswith("# "))
    assert "Written without a language model" in result.markdown
    check_citations(result)


def test_long_multi_part_question_makes_a_section_per_part(tools):
    question = ("For a school project on flight I need a structured overview.\n\n"
                "It should explain the machines, the infrastructure and the history.\n\n"
                "- How do airplanes and airships stay in the air?\n- What does an aircraft engine do?\n"
                "- How do airports and air traffic control keep flights safe?")
    result = run_agent(question, tools=tools, llm=None, config=RunConfig(mode="warp", max_expansions=1))
    outline = result.trace.model_extra["outline"]
    assert [s["plan"] for s in outline[:3]] == ["How do airplanes and airships stay in the air?",
                                                "What does an aircraft engine do?",
                                                "How do airports and air traffic control keep flights safe?"]
    assert result.trace.model_extra["expansions"] <= 1
    check_citations(result)


def test_search_and_write_are_conditioned_on_the_whole_current_draft(replay_run):
    """Issue 15.10: the state of every WARP action holds the current draft D (003 §2.2), so a later
    section's search and write see what earlier sections already say, in full."""
    turns = replay_run[0].trajectory.turns
    first_body = "Airplanes are powered fixed-wing aircraft [S2-R1]."
    at = next(k for k, t in enumerate(turns) if t.action == "write")
    before = [t.messages[-1]["content"] for t in turns[:at + 1] if t.action in ("search", "write")]
    after = [t.messages[-1]["content"] for t in turns[at + 1:] if t.action in ("search", "write")]
    assert len(after) == 6 and all("Current draft:" in m and first_body in m for m in after)
    assert not any(first_body in m for m in before)  # nothing leaks in before it was written
    engines = next(t for t in turns if t.action == "write" and "Engines" in t.messages[-1]["content"])
    assert "Airports serve airlines [S3-R1], guided by controllers [S3-R2]." in engines.messages[-1]["content"]


def test_deepen_asks_for_two_to_seven_subsections_and_accepts_them(tools):
    """Issue 15.10: the deepen prompt and its check agree with the outline reward's 2–7 range."""
    from deepr.evidence.env import Ctx
    from deepr.evidence.trace import Tracer
    from deepr.agent.warp import DEEPEN, DeepenAction, Item, WarpAsk, WarpRun

    run = WarpRun(Ctx(None, tools, RunConfig(mode="warp"), Tracer(QUERY, "warp")), QUERY)
    run.outline.add_sections([{"title": "Aircraft", "plan": "a"}, {"title": "Airports", "plan": "b"}])
    assert "into 2 to 7 subsections" in DEEPEN.messages(WarpAsk(run))[-1]["content"]

    def expand(n: int) -> list[str]:
        subs = [Item(title=f"Part {i}", plan="p") for i in range(n)]
        return run.deepen_check(DeepenAction(name="expand", position="section-1", subsections=subs), False)

    assert expand(6) == [] and expand(7) == []
    assert expand(8) == ["give 2 to 7 subsections, not 8"] and expand(1) == ["give 2 to 7 subsections, not 1"]
