"""Property test over every role's format (issue 39): replies drawn valid under the format the
role sent (tests/reply_strategies.py), plus edge kinds (maximal sizes, empty, unicode, cut at
max_tokens, null content, think blocks), judged by the role executor on real inputs captured
from runs of every mode and of the data stages. Invariants: no exception escapes; a refusal
always carries a reason and is recorded; no empty or uncited answer is accepted; an accepted
text shows no bracket that is not an evidence id it was given."""

from __future__ import annotations

import asyncio
import json
import re
import string
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from typer.testing import CliRunner

import deepr.roles as roles_mod
from deepr.agent import RunConfig, run_agent
from deepr.agent.citations import cited_ids, normalize, stray_brackets
from deepr.llm.base import LLM, Reply
from deepr.llm.stub_server import StubServer
from deepr.roles import Recorder, judge_reply, perform

from fake_model import CompetentModel, in_process
from reply_strategies import reply_of

QUESTION = "How do volcanic eruptions affect the climate and the people living nearby?"
# Roles whose accepted text is an answer or evidence paragraph: it must cite and be non-empty.
CITING = {"answerer/final", "answerer/wave", "decor_answerer/answer", "decor_filter/filter", "warp/write",
          "condenser/condense"}
EXAMPLES = 90  # per role: about 25 roles, so > 2,000 generated replies with the perform and edge tests
FEWER = {"planner/plan": 20, "planner/revise": 20}  # their query patterns make drawing slow (~0.5 s a reply)
COUNT: Counter = Counter()


class Script(LLM):
    name = "script"

    def __init__(self, reply: Reply | str):
        super().__init__()
        self.reply = reply

    async def _achat(self, messages, **kw):
        return self.reply


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """(role, input, messages, format sent) of the first call of each role, from real runs."""
    from deepr.corpus import ResearchTools, open_retriever
    from tree_helpers import volcano_docs

    seen: dict[str, tuple] = {}
    real = roles_mod._ask

    async def spy(role, inp, messages, llm, rec, *a, **kw):
        policy = a[4] if len(a) > 4 else kw.get("policy")  # the call's profile (None: the default formats)
        seen.setdefault(f"{role.name}/{role.action}", (role, inp, messages,
                                                       roles_mod._format(role, inp, policy, messages)))
        return await real(role, inp, messages, llm, rec, *a, **kw)

    d = tmp_path_factory.mktemp("props")
    corpus = d / "volcano.jsonl"
    corpus.write_text("".join(x.model_dump_json() + "\n" for x in volcano_docs()), encoding="utf-8")
    (d / "topics.txt").write_text("Volcano\n", encoding="utf-8")
    roles_mod._ask = spy
    try:
        tools = ResearchTools(open_retriever(str(corpus), retriever="bm25", cache_dir=d / "ix", progress=False), k=4)
        for cfg in (RunConfig(mode="dag", search_rounds=2, rubric_scaffold=True), RunConfig(mode="warp"),
                    RunConfig(mode="decor", memory_limit=64), RunConfig(mode="tools")):
            run_agent(QUESTION, tools=tools.fresh(), llm=in_process(CompetentModel()), config=cfg)
        run_agent(QUESTION, tools=tools.fresh(), llm=in_process(CompetentModel(), warp_expand=lambda p: {
            "name": "expand", "position": "section-1", "subsections": [{"title": "Eruption mechanics", "plan": "How."},
                                                                     {"title": "Climate records", "plan": "What."}]}),
                  config=RunConfig(mode="warp", force_expand=1))
        with StubServer(CompetentModel()) as srv:
            m = ["--llm", "openai:fake", "--base-url", srv.base_url, "--no-cache"]
            cli = CliRunner()
            for args in (["build-trees", "--corpus", corpus, "--topics", d / "topics.txt", "--out", d / "t.jsonl"],
                         ["synthesize-rubrics", d / "t.jsonl", "--out", d / "p.jsonl"],
                         ["verify", d / "p.jsonl", "--out", d / "v.jsonl"]):
                r = cli.invoke(__import__("deepr.cli", fromlist=["app"]).app, [str(x) for x in args] + m)
                assert r.exit_code == 0, r.output
    finally:
        roles_mod._ask = real
    return seen


def test_every_role_was_captured(captured):
    want = {"planner/plan", "planner/revise", "answerer/wave", "answerer/final", "warp/search", "warp/initialize",
            "warp/write", "warp/expand", "decor_planner/plan", "decor_filter/filter", "decor_answerer/answer",
            "agent/step", "root_query/write", "gate/judge", "decompose/split", "ground/judge", "extract/quote",
            "synthesize/pair", "verify/audit"}
    assert want <= set(captured), want - set(captured)


def _check_accepted(key: str, role, inp, messages, value) -> None:
    """An accepted value of a citing role cites, is not empty and holds only evidence brackets."""
    if key not in CITING:
        return
    texts = value.get("facts", []) if isinstance(value, dict) and "facts" in value else (
        list(value.values()) if isinstance(value, dict) else [value])
    shown = set(re.findall(r"\[([A-Za-z][A-Za-z0-9_.\-]*?-[RF][0-9]+)\]", " ".join(m["content"] for m in messages)))
    for t in texts:
        flat = normalize(str(t))
        assert re.sub(r"\[[^\]]*\]", "", flat).strip(), f"{key}: accepted an empty text {t!r}"
        assert cited_ids(flat), f"{key}: accepted an uncited text {t!r}"
        assert set(cited_ids(flat)) <= shown, f"{key}: accepted ids it was not shown {t!r}"
        assert stray_brackets(flat) == [], f"{key}: accepted non-evidence brackets {t!r}"


def _judge(key: str, entry: tuple, reply: str) -> None:
    role, inp, messages, _ = entry
    value, reason = judge_reply(role, inp, reply, messages)
    COUNT["judged"] += 1
    if reason is None:
        COUNT["accepted"] += 1
        _check_accepted(key, role, inp, messages, value)
    else:
        assert isinstance(reason, str) and reason.strip(), f"{key}: a refusal without a reason"


ROLE_KEYS = ["planner/plan", "planner/revise", "answerer/wave", "answerer/final", "warp/search", "warp/initialize",
             "warp/write", "warp/expand", "decor_planner/plan", "decor_filter/filter", "decor_answerer/answer",
             "condenser/condense", "agent/step", "searcher/search", "rubric/persistent", "rubric/ephemeral",
             "root_query/write", "gate/judge", "decompose/split", "ground/judge", "extract/quote", "synthesize/pair",
             "verify/audit"]


@pytest.mark.parametrize("key", ROLE_KEYS)
def test_replies_valid_under_the_format_sent_are_judged_without_error(captured, key):
    if key not in captured:
        pytest.skip(f"{key} is not called in these runs")
    entry = captured[key]

    @settings(max_examples=FEWER.get(key, EXAMPLES), deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(reply=reply_of(entry[3]))
    def prop(reply: str) -> None:
        _judge(key, entry, reply)

    prop()


EDGES = {
    "empty": lambda good: "",
    "whitespace": lambda good: " \n\t ",
    "think only": lambda good: "<think>I should answer [N1-R1].</think>",
    "unclosed think": lambda good: "<think>never closed " + good,
    "think then valid": lambda good: "<think>plan it</think>\n" + good,
    "unicode": lambda good: good.replace("a", "ä").replace("e", "🌋"),
    "maximal": lambda good: good[: len(good) // 2] + ("lava " * 6000) + good[len(good) // 2:],
    "cut": lambda good: good[: len(good) // 2],
    "null content": lambda good: "",  # what the backend passes on for content null + tool_calls
}


@pytest.mark.parametrize("key", ROLE_KEYS)
def test_edge_kinds_are_refused_or_used_through_perform(captured, key):
    if key not in captured:
        pytest.skip(f"{key} is not called in these runs")
    role, inp, messages, fmt = captured[key]
    good = CompetentModel()(__import__("fake_model").request_body(messages, fmt))
    for kind, make in EDGES.items():
        text = make(good)
        reply = Reply(text, truncated=kind == "cut")
        rec = Recorder()
        # the fields a role's failure note names come from its caller (wave, step, position ...)
        extra = {f: "x" for _, f, _, _ in string.Formatter().parse(role.on_fail) if f and f not in ("role", "action")}
        out = asyncio.run(perform(role, inp, llm=Script(reply), rec=rec, max_reasks=0, **extra))
        COUNT["performed"] += 1
        assert out.by in ("llm", "fallback", "failed"), (kind, out.by)
        if out.by == "llm":
            assert kind not in ("empty", "whitespace", "null content", "cut"), f"{key}: accepted a {kind} reply"
            _check_accepted(key, role, inp, messages, judge_reply(role, inp, text, messages)[0])
        else:
            assert rec.failures and all(f["reason"].strip() for f in rec.failures), f"{key} {kind}: unrecorded"


def test_tools_loop_never_accepts_an_uncited_answer(captured):
    from deepr.agent.tools_agent import _answer_problem, parse_step

    role, inp, messages, fmt = captured["agent/step"]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(reply=reply_of(fmt))
    def prop(reply: str) -> None:
        COUNT["judged"] += 1
        step = parse_step(reply)
        if step.kind == "answer" and _answer_problem(step, inp.session, 10) is None:
            from deepr.agent.tools_agent import answer_ids

            ids = answer_ids(step.answer)
            assert ids and set(ids) <= set(inp.session.shown), reply

    prop()


def test_generated_reply_count():
    """The issue's target: at least 2,000 generated replies judged, with no exception."""
    total = COUNT["judged"] + COUNT["performed"]
    print(f"\nreplies judged {COUNT['judged']} (accepted {COUNT['accepted']}), performed {COUNT['performed']}")
    if total == 0:
        pytest.skip("run with the rest of this module")
    assert total >= 2000, COUNT


@pytest.mark.parametrize("mode", ["decor", "tools"])  # dag: drawing its plan schema takes minutes
def test_random_valid_replies_end_to_end_through_the_cli(captured, tmp_path, mode):
    """A few whole runs on a server whose every reply is drawn valid under the format sent:
    exit status per the README's table (never 1), and a written report cites only its map."""
    import warnings

    from deepr.cli import app
    from deepr.llm.base import OutputFormat
    from deepr.llm.stub_server import Raw
    from tree_helpers import volcano_docs

    def reply(body):
        if "grammar" in body:
            return Raw(json.dumps({"error": {"message": "grammar is not supported"}}), status=400)
        js = ((body.get("response_format") or {}).get("json_schema") or {}).get("schema")
        regex = (body.get("structured_outputs") or {}).get("regex")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            COUNT["end to end"] += 1
            return reply_of(OutputFormat("x", json_schema=js, regex=regex if js is None else None)).example() \
                if (js or regex) else "<answer>free text</answer>"

    corpus = tmp_path / "volcano.jsonl"
    corpus.write_text("".join(x.model_dump_json() + "\n" for x in volcano_docs()), encoding="utf-8")
    out = tmp_path / "r.md"
    with StubServer(reply) as srv:
        r = CliRunner().invoke(app, ["run", QUESTION, "--mode", mode, "--out", str(out), "--corpus", str(corpus),
                                     "--llm", "openai:fake", "--base-url", srv.base_url, "--no-cache",
                                     "--max-reasks", "1"])
    assert r.exit_code in (0, 3, 4), r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    if out.exists():
        md = out.read_text(encoding="utf-8")
        cites = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))["citations"]
        groups = re.findall(r"\[([^\[\]\n]*)\]", md)
        assert all(t in cites for g in groups for t in re.split(r"[,;\s]+", g.strip()) if t), groups
