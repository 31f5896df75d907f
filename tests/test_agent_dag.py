"""dag mode end to end: the extractive engine offline, and recorded LLM replies with bad turns."""

from __future__ import annotations

import json

import pytest

from deepr.agent import RunConfig, cited_ids, replay_waves, run_agent
from deepr.llm.replay import ReplayLLM
from deepr.evidence.plan import validate_plan, waves

QUERY = "How did ancient Greek architecture influence later buildings?"


@pytest.fixture(scope="module")
def tools(retriever):
    from deepr.corpus import ResearchTools

    return ResearchTools(retriever, k=5)


def resolves_to_trace(result) -> None:
    """Every id cited in the report is a catalogued snippet/page that a tool call in the trace produced."""
    trace = result.trace
    produced = {i for t in trace.tools for i in t.get("ids", [])} | {t["id"] for t in trace.tools if "id" in t}
    cited = set(cited_ids(result.markdown))
    assert cited, "the report cites nothing"
    assert cited == set(trace.citations), "report ids and sidecar citations differ"
    assert cited <= produced, f"cited ids no tool call produced: {cited - produced}"
    for cid, c in trace.citations.items():
        assert c.text.strip() and c.doc_id


@pytest.fixture(scope="module")
def extractive_run(tools):
    return run_agent(QUERY, tools=tools, llm=None, config=RunConfig(), html=True)


def test_extractive_dag_report_is_cited_and_says_no_llm(extractive_run):
    r = extractive_run
    resolves_to_trace(r)
    assert "Written without a language model" in r.markdown
    assert "## Answer" in r.markdown and "## References" in r.markdown
    refs = r.markdown.split("## References", 1)[1]
    assert set(cited_ids(refs)) == set(r.trace.citations)  # nothing uncited listed, nothing cited missing


def test_extractive_dag_trace_replays_plan_and_waves(extractive_run):
    trace = extractive_run.trace
    assert [p["turn"] for p in trace.plans] == ["initial", "revised"]
    for p in trace.plans:
        assert validate_plan(p["plan"])[0] is not None
    assert replay_waves(trace) == trace.model_extra["waves"]
    plan = validate_plan(trace.plans[-1]["plan"])[0]
    wave_turns = [t for t in extractive_run.trajectory.turns if t.action == "wave"]
    assert [sorted(json.loads(t.completion)) for t in wave_turns] == [sorted(w) for w in waves(plan)]


def test_extractive_dag_reuses_unchanged_search_nodes(extractive_run):
    trace = extractive_run.trace
    rerun = next(d for d in trace.model_extra["decisions"] if "rerun" in d)
    node_searches = [t["node"] for t in trace.tools if t["tool"] == "search" and t["node"] != "planner"]
    for nid in rerun["reused"]:
        assert node_searches.count(nid) == 1, f"{nid} was searched again although unchanged"
    fetched = [t for t in trace.tools if t["tool"] == "browse" and not t.get("refused")]
    assert 1 <= len(fetched) <= 4 and all("-F" in t["id"] for t in fetched)


def test_extractive_dag_trajectory_turns_are_tagged(extractive_run):
    turns = extractive_run.trajectory.turns
    assert [(t.role, t.action) for t in turns][:2] == [("planner", "plan"), ("planner", "revise")]
    assert turns[-1].action == "final" and turns[-1].completion.startswith("<answer>")
    for t in turns:
        assert t.messages[0]["role"] == "system" and t.messages[-1]["role"] == "user" and t.ok


def test_html_is_self_contained_with_the_plan_graph(extractive_run):
    page = extractive_run.html
    assert "<svg" in page and page.count("<rect") == len(extractive_run.trace.plans[-1]["plan"]["nodes"])
    assert "<script" not in page and "http://" not in page.split("<svg", 1)[1].split("</svg>")[0].replace(
        "http://www.w3.org/2000/svg", "")
    some = next(iter(extractive_run.trace.citations))
    assert f'href="#ref-{some}"' in page and f'id="ref-{some}"' in page


# --- recorded LLM replies ---------------------------------------------------------------------

PLAN_WITH_CYCLE = json.dumps({"nodes": [
    {"id": "N1", "type": "search", "query": "Parthenon Acropolis", "key_points": ["what it is"]},
    {"id": "N2", "type": "aggregate", "need": "x", "inputs": ["N1", "N3"]},
    {"id": "N3", "type": "aggregate", "need": "y", "inputs": ["N2"]},
    {"id": "N4", "type": "answer", "need": "z", "inputs": ["N3"]}]})
PLAN_G0 = {"nodes": [
    {"id": "N1", "type": "search", "query": "Acropolis of Athens Parthenon", "key_points": ["what it is"]},
    {"id": "N2", "type": "search", "query": "neoclassical architecture", "key_points": ["revival"]},
    {"id": "N3", "type": "aggregate", "need": "Greek forms", "key_points": ["columns"], "inputs": ["N1", "N2"]},
    {"id": "N4", "type": "answer", "need": "How Greek architecture shaped later buildings", "inputs": ["N3"]}]}
PLAN_G1 = {"nodes": [
    PLAN_G0["nodes"][0],
    {"id": "N2", "type": "search", "query": "Academic art neoclassicism", "key_points": ["revival"]},
    {"id": "N5", "type": "search", "query": "ancient Roman architecture", "key_points": ["arches"]},
    {"id": "N3", "type": "aggregate", "need": "Greek forms", "key_points": ["columns"], "inputs": ["N1", "N2"]},
    {"id": "N6", "type": "aggregate", "need": "Roman transmission", "key_points": ["arches"], "inputs": ["N5", "N1"]},
    {"id": "N4", "type": "answer", "need": "How Greek architecture shaped later buildings", "inputs": ["N3", "N6"]}],
    "fetch": ["N1-R2"]}


def good_wave() -> str:
    return json.dumps({"N3": "The Acropolis holds the Parthenon [N1-R1], which later styles echoed [N1-R2].",
                       "N6": "Roman builders carried the forms on [N5-R1], drawing on Greek models [N1-R1]."})


def replay_replies() -> dict[str, list[str]]:
    return {
        "planner": [PLAN_WITH_CYCLE, json.dumps(PLAN_G0),
                    json.dumps({**PLAN_G1, "fetch": ["N9-R1"]}), "```json\n" + json.dumps(PLAN_G1) + "\n```"],
        "answerer": ["I think the answer is that the Greeks mattered.",  # not parseable: no JSON
                     json.dumps({"N3": "Claim [N1-R9].", "N6": "Claim [N5-R1]."}),  # unknown id N1-R9
                     "<think>checking ids</think>" + good_wave(),
                     "<answer>Greek temple forms [N1-R1] passed through Rome [N5-R1] to later buildings "
                     "[N1-R2].</answer>"],
    }


@pytest.fixture(scope="module")
def replay_run(tools):
    llm = ReplayLLM(replay_replies())
    return run_agent(QUERY, tools=tools, llm=llm, config=RunConfig()), llm


def test_replay_planner_is_reasked_with_the_validator_message(replay_run):
    result, llm = replay_run
    planner_calls = [m for role, m in llm.calls if role == "planner"]
    assert "cycle" in planner_calls[1][-1]["content"]  # the re-ask carries the validator's words
    assert "N9-R1, which no search returned" in planner_calls[3][-1]["content"]
    assert [p["plan"]["nodes"][0]["id"] for p in result.trace.plans] == ["N1", "N1"]
    assert result.trace.plans[-1]["fetch"] == ["N1-R2"]


def test_replay_reruns_only_new_or_modified_search_nodes(replay_run):
    trace = replay_run[0].trace
    rerun = next(d for d in trace.model_extra["decisions"] if "rerun" in d)
    assert rerun["rerun"] == ["N2", "N5"] and rerun["reused"] == ["N1"]
    searched = [t["node"] for t in trace.tools if t["tool"] == "search"]
    assert searched.count("N1") == 1 and searched.count("N2") == 2 and searched.count("N5") == 1
    browse = [t for t in trace.tools if t["tool"] == "browse"]
    assert browse[0]["id"] == "N1-F1" and browse[0]["requested"] == "N1-R2"


def test_replay_unparseable_and_unknown_id_replies_are_reasked(replay_run):
    result, llm = replay_run
    answer_calls = [m for role, m in llm.calls if role == "answerer"]
    assert "no JSON object" in answer_calls[1][-1]["content"]
    assert "unknown citation ids N1-R9" in answer_calls[2][-1]["content"]
    wave = next(t for t in result.trajectory.turns if t.action == "wave")
    assert wave.ok and wave.model_extra["attempts"] == 3 and wave.messages == answer_calls[0]
    assert "N1-R9" not in result.markdown
    resolves_to_trace(result)


def test_replay_trace_audits_every_model_call(replay_run):
    result, llm = replay_run
    calls = result.trace.calls
    assert len(calls) == len(llm.calls) == 8
    assert [c.role for c in calls].count("planner") == 4
    assert all(c.prompt_hash and c.reply and c.latency_s >= 0 and c.prompt_tokens > 0 for c in calls)
    assert result.trace.model_extra["waves"] == [["N3", "N6"]] == replay_waves(result.trace)
    assert "Written without a language model" not in result.markdown
    assert "Greek temple forms [N1-R1]" in result.markdown


def test_replay_wave_that_never_validates_falls_back_and_is_recorded(tools):
    bad = json.dumps({"N3": "Claim [Q1-R1].", "N6": "Claim [Q1-R1]."})
    llm = ReplayLLM({"planner": [json.dumps(PLAN_G0), json.dumps({**PLAN_G1, "fetch": []})],
                     "answerer": [bad, bad, bad, "no citations at all", "still none", "nope"]})
    result = run_agent(QUERY, tools=tools, llm=llm, config=RunConfig())
    failures = result.trace.model_extra["failures"]
    assert [f["where"] for f in failures] == ["answerer/wave", "answerer/final"]
    assert "unknown citation ids Q1-R1" in failures[0]["reason"]
    assert "extractive writer" in result.markdown and "N3, N6" in result.markdown
    assert [t.ok for t in result.trajectory.turns if t.role == "answerer"] == [False, False]
    resolves_to_trace(result)


def test_replay_exhausted_planner_falls_back_to_extractive_plan(tools):
    result = run_agent(QUERY, tools=tools, llm=ReplayLLM({"planner": []}), config=RunConfig(fetch_limit=0))
    assert result.trace.plans[0]["by"] == "extractive-fallback"
    assert "replay exhausted" in result.trace.model_extra["failures"][0]["reason"]


def test_scaffold_and_search_rounds_extractive(tools):
    cfg = RunConfig(search_rounds=2, rubric_scaffold=True, max_cycles=2)
    result = run_agent(QUERY, tools=tools, llm=None, config=cfg)
    extra = result.trace.model_extra
    kinds = [r["kind"] for r in extra["rubrics"]]
    assert kinds[0] == "persistent" and "ephemeral" in kinds
    assert 1 <= extra["cycles"] <= 2
    consolidated = [t for t in result.trace.tools if t["tool"] == "consolidate"]
    assert consolidated and all(t["rounds"] in (1, 2) and len(t["ids"]) <= 10 for t in consolidated)
    assert any(t.role == "rubric" for t in result.trajectory.turns)
    resolves_to_trace(result)


LONG_QUESTION = """I am preparing a briefing on natural disasters for a city council.

Over the last centuries earthquakes, tsunamis, floods and cyclones have killed millions of people, and the way \
societies prepare for them has changed a great deal. I want both the history and the lessons learned, with a \
focus on Asia and European examples for comparison.

Please cover:
1. Which were the deadliest earthquakes in China, and why were they so deadly?
2. What happened in the 2004 Indian Ocean earthquake and tsunami?
3. How did the 1755 Lisbon earthquake change European thinking?
4. What role did floods and cyclones such as the 1931 China floods or the 1970 Bhola cyclone play?
"""


def test_long_multi_part_question_gets_a_node_and_a_paragraph_per_part(tools):
    result = run_agent(LONG_QUESTION, tools=tools, llm=None, config=RunConfig())
    resolves_to_trace(result)
    plan = result.trace.plans[0]["plan"]
    queries = [n["query"] for n in plan["nodes"] if n["type"] == "search"]
    assert any("Lisbon" in q for q in queries) and any("Indian Ocean" in q for q in queries)
    answer = result.markdown.split("## Answer", 1)[1].split("## Findings", 1)[0]
    assert answer.count("**") >= 8  # one bold sub-question lead per part
    assert "> 1. Which were the deadliest earthquakes in China" in result.markdown  # the question, quoted


def test_non_english_question_runs(tools):
    result = run_agent("Wie funktionieren Flugzeugtriebwerke, und welche Rolle spielen Flughäfen im Luftverkehr?",
                       tools=tools, llm=None, config=RunConfig())
    resolves_to_trace(result)
    assert validate_plan(result.trace.plans[-1]["plan"])[0] is not None


def test_replay_scaffold_gaps_drive_replanning_and_search_agent_reasks(tools):
    done = json.dumps({"done": True, "queries": []})
    llm = ReplayLLM({
        "planner": [json.dumps(PLAN_G0), json.dumps({**PLAN_G0, "fetch": []}), json.dumps({**PLAN_G1, "fetch": []})],
        "searcher": [json.dumps({"done": False, "queries": ["Acropolis of Athens Parthenon"]}),  # N1 repeats itself
                     json.dumps({"done": False, "queries": ["Parthenon temple"]}), done,  # N1, then N2
                     done, done],  # cycle 2: N2 (modified) and N5 (new)
        "rubric": [json.dumps({"criteria": [{"name": "coverage", "description": "covers Greek forms",
                                             "guidance": "cite the temples"}]}),
                   json.dumps({"sufficient": False, "gaps": [{"name": "Roman link", "description": "no Roman evidence",
                                                              "query": "ancient Roman architecture"}]}),
                   json.dumps({"sufficient": True, "gaps": []})],
        "answerer": [good_wave(), "<answer>Greek forms [N1-R1] reached Rome [N5-R1].</answer>"],
    })
    cfg = RunConfig(search_rounds=2, rubric_scaffold=True, max_cycles=3)
    result = run_agent(QUERY, tools=tools, llm=llm, config=cfg)
    assert all(llm.remaining(role) == 0 for role in ("planner", "searcher", "rubric", "answerer"))
    searcher = [m for role, m in llm.calls if role == "searcher"]
    assert "was already run" in searcher[1][-1]["content"]
    replan = [m for role, m in llm.calls if role == "planner"][2]
    assert "Roman link" in replan[-1]["content"]  # the gap reached the planner
    extra = result.trace.model_extra
    assert extra["cycles"] == 2 and [p["cycle"] for p in result.trace.plans] == [1, 1, 2]
    assert any(d["what"] == "cycle 2: no evidence gaps left, planning stops" for d in extra["decisions"])
    n1 = next(t for t in result.trace.tools if t["tool"] == "consolidate" and t["node"] == "N1")
    assert n1["rounds"] == 2 and n1["queries"] == ["Acropolis of Athens Parthenon", "Parthenon temple"]
    answer_prompt = [m for role, m in llm.calls if role == "answerer"][0][-1]["content"]
    assert "cite the temples" in answer_prompt  # the persistent rubric conditions the writer
    resolves_to_trace(result)
    # issue 15.10 (DuMate §2.2.3): re-planning sees the persistent rubric as well as the gaps, and the
    # search agents of that cycle get both as guidance; cycle 1 had no rubric yet
    assert "cite the temples" in replan[-1]["content"] and "Persistent criteria" in replan[-1]["content"]
    cycle1, cycle2 = [s_[-1]["content"] for s_ in searcher[:3]], [s_[-1]["content"] for s_ in searcher[3:]]
    assert all("cite the temples" in c and "Roman link" in c for c in cycle2)
    assert not any("cite the temples" in c or "Roman link" in c for c in cycle1)


def test_evidence_of_a_dropped_search_node_stays_citable_in_the_final_answer(tools):
    """Issue 15.10: a revision that drops a search node keeps its evidence: the final answer is shown
    it and may cite it (before, citing it was an unknown id and re-asked)."""
    from deepr.agent.answerer import FINAL, FinalAsk, final_inputs
    from deepr.agent.dag import apply_revision, execute_searches
    from deepr.evidence.env import Ctx
    from deepr.evidence.trace import Tracer
    from deepr.llm.base import run_sync

    ctx = Ctx(None, tools, RunConfig(), Tracer(QUERY, "dag"))
    old = validate_plan({k: v for k, v in PLAN_G0.items()})[0]
    new = validate_plan({"nodes": [PLAN_G0["nodes"][0],
                                   {**PLAN_G0["nodes"][2], "inputs": ["N1"]}, PLAN_G0["nodes"][3]]})[0]
    results: dict = {}
    run_sync(execute_searches(ctx, old, results, only=None))
    n2 = list(results["N2"])
    dropped: dict = {}
    run_sync(apply_revision(ctx, old, new, [], results, cycle=1, dropped=dropped))
    assert set(results) == {"N1"} and dropped == {"N2": n2} and n2
    outputs = {"N3": f"The Parthenon stands on the Acropolis [{results['N1'][0]}]."}
    reply = f"Greek forms spread [{results['N1'][0]}] and came back in a revival [{n2[0]}]."
    ans, ids = final_inputs(ctx, new, outputs, dropped)
    ask = FinalAsk(ctx, QUERY, new, outputs, [], ans, ids)
    assert set(n2) <= set(ids) and FINAL.check(ask, reply) == []
    shown = FINAL.messages(ask)[-1]["content"]
    assert f"[{n2[0]}]" in shown and " ".join(ctx.catalog[n2[0]].text.split())[:30] in " ".join(shown.split())
    _, without = final_inputs(ctx, new, outputs)  # what the answer saw before: the id was unknown
    assert FINAL.check(FinalAsk(ctx, QUERY, new, outputs, [], ans, without), reply)


def test_a_revision_that_renumbers_search_nodes_reuses_their_results(tools):
    """Node ids are positions (the graph schema numbers them), so dropping N2 renames the search
    after it: its results move to the new id without searching again, and the dropped node's
    evidence stays citable. A modified query still searches."""
    from deepr.agent.dag import apply_revision, changed_search_nodes, execute_searches
    from deepr.evidence.env import Ctx
    from deepr.evidence.trace import Tracer
    from deepr.llm.base import run_sync

    s1, s2 = PLAN_G0["nodes"][:2]
    s3 = {"id": "N3", "type": "search", "query": "ancient Roman architecture", "key_points": ["arches"]}
    old = validate_plan({"nodes": [s1, s2, s3, {"id": "N4", "type": "aggregate", "need": "forms",
                                                   "key_points": ["columns"], "inputs": ["N1", "N2", "N3"]},
                                   {"id": "N5", "type": "answer", "need": "how", "inputs": ["N4"]}]})[0]
    new = validate_plan({"nodes": [s1, {**s3, "id": "N2"}, {**s1, "id": "N3", "query": "Parthenon sculptures"},
                                   {"id": "N4", "type": "aggregate", "need": "forms", "key_points": ["columns"],
                                    "inputs": ["N1", "N2", "N3"]},
                                   {"id": "N5", "type": "answer", "need": "how", "inputs": ["N4"]}]})[0]
    assert changed_search_nodes(old, new) == (["N3"], {"N1": "N1", "N2": "N3"})
    ctx = Ctx(None, tools, RunConfig(), Tracer(QUERY, "dag"))
    results: dict = {}
    run_sync(execute_searches(ctx, old, results, only=None))
    before = {k: list(v) for k, v in results.items()}
    page2, page3 = ctx.fetch(before["N2"][0]), ctx.fetch(before["N3"][0])  # fetched in cycle 0
    dropped: dict = {}
    run_sync(apply_revision(ctx, old, new, [before["N3"][4]], results, cycle=1, dropped=dropped))
    assert results["N1"] == before["N1"] and results["N2"] == before["N3"]
    assert results["N3"] and results["N3"] != before["N3"]  # the new query searched
    assert before["N3"][4] not in results["N3"]  # so only the new N2 holds the fetched result
    assert dropped == {"N2": before["N2"] + [page2]}
    # pages follow their search: the writer reading the new N2 sees both pages of the old N3
    fetched = {e.id: e.node for e in ctx.catalog.entries.values() if e.kind == "fetch"}
    assert page3 in fetched and fetched[page3] == "N2" and len(fetched) == 3
    assert [n for cid, n in fetched.items() if cid not in (page2, page3)] == ["N2"]
    assert fetched[page2] == "N2~dropped"
    searched = [t["node"] for t in ctx.tracer.tools if t["tool"] == "search"]
    assert searched == ["N1", "N2", "N3", "N3"]  # one new search, for the modified node
    decision = next(d for d in ctx.tracer.decisions if "rerun" in d)
    assert decision["moved"] == {"N2": "N3"} and decision["rerun"] == ["N3"]


def test_a_dag_run_records_the_dropped_evidence_and_cites_it(tools):
    llm = ReplayLLM({"planner": [json.dumps(PLAN_G0), json.dumps({"nodes": [
        PLAN_G0["nodes"][0], {**PLAN_G0["nodes"][2], "inputs": ["N1"]}, PLAN_G0["nodes"][3]], "fetch": []})],
        "answerer": [json.dumps({"N3": "The Acropolis holds the Parthenon [N1-R1]."}),
                     "<answer>The Parthenon [N1-R1] inspired the neoclassical revival [N2-R1].</answer>"]})
    result = run_agent(QUERY, tools=tools, llm=llm, config=RunConfig())
    assert result.trace.model_extra["dropped"]["N2"][0] == "N2-R1"
    assert "[N2-R1]" in llm.calls[-1][1][-1]["content"] and llm.remaining("answerer") == 0  # accepted first time
    assert "N2-R1" in result.trace.citations
    resolves_to_trace(result)


def test_extractive_dag_with_no_search_results_plans_and_finishes(tools, monkeypatch):
    """A source that returns nothing (a dead web provider, an empty corpus) must not crash the
    planner: the run ends with a valid plan and a report that says it found no evidence."""
    monkeypatch.setattr(tools.retriever, "search", lambda *a, **kw: [])
    r = run_agent(QUERY, tools=tools, llm=None, config=RunConfig())
    assert validate_plan(r.trace.plans[0]["plan"])[0] is not None
    assert r.trace.citations == {}
