"""What a real OpenAI-compatible server brings, played by loopback stubs: a base URL without /v1,
the context and slots a server reports, control characters inside JSON strings, and the format
ladder walked per call while 32 calls run side by side."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.llm import LLMError, OutputFormat, get_llm
from deepr.llm.base import run_sync
from deepr.llm.parse import extract_json
from deepr.llm.stub_server import Raw, StubServer
from deepr.roles import Recorder, context_length, perform

sys.path.insert(0, str(Path(__file__).parent))
from test_roles_context import LONG, WRITE, Ask  # noqa: E402

USER = [{"role": "user", "content": "Name the river that flows through London."}]
PLAN = OutputFormat("plan", json_schema={"type": "object", "properties": {"q": {"type": "string"}},
                                         "required": ["q"]})
TAGGED = OutputFormat("search", regex=r"<search>[^<]{3,80}</search>")
CONTEXT = 8192


def llm_for(srv: StubServer, spec: str = "openai:stub", **kw):
    return get_llm(spec, base_url=srv.base_url, cache=False, **kw)


def over_context(body: dict) -> bool:
    """The stub plays a server of CONTEXT tokens: one token per 3 characters errs low for English,
    so a prompt deepr fitted by its own estimate passes and one it did not fit is refused."""
    chars = sum(len(m["content"]) for m in body["messages"])
    return chars // 3 + body["max_tokens"] > CONTEXT


def context_server(body: dict):
    if over_context(body):
        return Raw(json.dumps({"error": {"message": "the request exceeds the available context size"}}), status=400)
    return "<answer>Lava is molten rock [N1-R1].</answer>"


# -- 4: a base URL without /v1 ---------------------------------------------------------------

def test_a_base_url_without_v1_stops_at_the_first_404_with_the_hint():
    with StubServer(reply="ok") as srv:
        root = srv.base_url.removesuffix("/v1")
        llm = get_llm("openai:stub", base_url=root, cache=False)
        with pytest.raises(LLMError, match=r"404.*is `/v1` missing\?"):
            llm.chat(USER)
        t0 = time.monotonic()
        with pytest.raises(LLMError, match="is `/v1` missing"):
            llm.chat(USER)  # the run is stopped: no second request, no retries
        assert time.monotonic() - t0 < 0.5 and llm.usage.retries == 0 and srv.n_requests == 0
        assert llm.unreachable and "/v1" in llm.unreachable


def test_deepr_run_without_v1_writes_no_report_and_exits_4(tmp_path):
    from deepr.cli import app
    from tree_helpers import volcano_docs

    corpus = tmp_path / "volcano.jsonl"
    corpus.write_text("".join(d.model_dump_json() + "\n" for d in volcano_docs()), encoding="utf-8")
    out = tmp_path / "r.md"
    with StubServer(reply="ok") as srv:
        r = CliRunner().invoke(app, ["run", "How do volcanoes erupt?", "--out", str(out), "--corpus", str(corpus),
                                     "--llm", "openai:stub", "--base-url", srv.base_url.removesuffix("/v1"),
                                     "--no-cache"])
    assert r.exit_code == 4, r.output
    assert "is `/v1` missing?" in r.output and "Traceback" not in r.output
    assert not out.exists() and not out.with_suffix(".json").exists()


# -- 5: the context the server reports --------------------------------------------------------

@pytest.mark.parametrize("server", [
    {"model_info": {"max_model_len": CONTEXT}},  # vLLM's /v1/models
    {"props": {"default_generation_settings": {"n_ctx": CONTEXT}}},  # llama.cpp's /props
    {"props": {"n_ctx": CONTEXT}},  # older llama.cpp builds
], ids=["vllm", "llama.cpp", "llama.cpp-old"])
def test_the_servers_context_is_read_and_prompts_are_fitted_to_it(server):
    with StubServer(reply=context_server, **server) as srv:
        llm = llm_for(srv)
        assert context_length(llm) == CONTEXT
        role = replace(WRITE, max_tokens=4096)
        out = run_sync(perform(role, Ask([LONG] * 30), llm=llm, rec=Recorder()))  # ~24,000 tokens of evidence
        assert out.ok, out.error
        assert srv.statuses == [200] and not over_context(srv.requests[0])
        rec = Recorder()
        stuck = run_sync(perform(role, Ask([], note=" Background: " + LONG * 10), llm=llm, rec=rec))
    assert stuck.by == "failed" and srv.n_requests == 1  # nothing to trim: refused before it is sent
    assert f"context of {CONTEXT} tokens" in stuck.error and "\n" not in stuck.error


def test_the_context_option_of_the_spec_and_a_max_tokens_past_it(caplog):
    with StubServer(reply=context_server) as srv:  # a server that says nothing of its context
        assert context_length(llm_for(srv)) is None
        llm = llm_for(srv, f"openai:stub,context_length={CONTEXT}")
        assert llm.config.model == "stub" and context_length(llm) == CONTEXT
        prompt = [{"role": "user", "content": "word " * 4000}]  # about 5,000 tokens
        assert llm.chat(prompt, max_tokens=4096) == "<answer>Lava is molten rock [N1-R1].</answer>"
        assert srv.requests[0]["max_tokens"] < 4096 and not over_context(srv.requests[0])
        assert "lowered" in caplog.text
    with StubServer(reply="ok", model_info={"max_model_len": 4096}) as srv:  # the smaller one counts
        assert context_length(llm_for(srv, f"openai:stub,context_length={CONTEXT}")) == 4096


# -- 6: a server with one slot -----------------------------------------------------------------

def test_a_one_slot_server_gets_one_call_at_a_time(caplog):
    props = {"total_slots": 1, "default_generation_settings": {"n_ctx": CONTEXT}}
    with StubServer(reply=lambda b: b["messages"][-1]["content"], latency=0.15, props=props) as srv:
        llm = llm_for(srv, max_concurrency=8)
        prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(6)]
        outs = asyncio.run(llm.abatch(prompts))
        assert outs == [f"question {i}" for i in range(6)]
        assert srv.max_in_flight == 1 and llm.describe()["max_concurrency"] == 1
    assert caplog.text.count("1 slot(s)") == 1
    with StubServer(reply="ok", latency=0.15, props={"total_slots": 4}) as srv:
        asyncio.run(llm_for(srv, max_concurrency=8).abatch(prompts))
        assert srv.max_in_flight == 4


# -- 7: a raw control character inside a JSON string -----------------------------------------------

@pytest.fixture
def converter(monkeypatch):
    import deepr.llm.openai_backend as ob

    monkeypatch.setattr(ob, "has_schema_converter", lambda: True)
    monkeypatch.setattr(ob, "schema_to_gbnf", lambda schema: "root ::= object")


def test_a_raw_control_character_in_a_json_string_is_still_json(caplog, converter):
    replies = ['{"q": "line one\nline two"}',  # the model wrote a raw newline inside the string
               {"id": "x", "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": "{\"q\": \"tab\there\"}"}}]}]

    def reply(body):  # llama-cpp-python: json_schema refused with a 500, the grammar honoured
        if body.get("response_format", {}).get("type") == "json_schema":
            return Raw(json.dumps({"message": "'response_format' type should be 'json_object'"}), status=500)
        return replies[sum("grammar" in b for b in srv.requests) - 1]

    with StubServer(reply=reply) as srv:
        llm = llm_for(srv)
        first, second = llm.chat(USER, fmt=PLAN), llm.chat(USER, fmt=PLAN, seed=1)
        raw = Raw('{"id": "x", "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", '
                  '"content": "{\\"q\\": \\"bell\x07\\"}"}}]}')  # the envelope itself carries a raw control char
        replies.append(raw)
        third = llm.chat(USER, fmt=PLAN, seed=2)
        styles = [("grammar" in b, b.get("response_format", {}).get("type")) for b in srv.requests]
    assert styles == [(False, "json_schema"), (True, None), (True, None), (True, None)]  # never moved to json_object
    assert [o.constrained for o in (first, second, third)] == [True, True, True]
    assert [extract_json(o)["q"] for o in (first, second, third)] == ["line one\nline two", "tab\there", "bell\x07"]
    assert "not JSON" not in caplog.text and llm.usage.failures == 0


# -- 65.4: the format ladder is walked per call ---------------------------------------------------

def test_32_concurrent_calls_each_walk_their_own_format_ladder(caplog):
    """Calls 0, 3, 6... refuse every regex style, calls 1, 4, 7... refuse only the grammar field (and
    answer that refusal late), the rest take the grammar. Each call's requests show its own ladder:
    a call refused at the grammar tries vLLM's field next, whatever the calls beside it learned."""
    def kind(body: dict) -> int:
        return int(body["messages"][-1]["content"].split()[-1]) % 3

    def reply(body):
        k = kind(body)
        if "grammar" in body and k in (0, 1) or "structured_outputs" in body and k == 0:
            if k == 1:
                time.sleep(0.3)  # the calls that refuse everything have learned the end of the ladder by now
            return Raw(json.dumps({"error": {"message": "unknown field: grammar / structured_outputs"}}), status=400)
        return "<search>tides and moons</search>"

    with StubServer(reply=reply) as srv:
        llm = llm_for(srv, max_concurrency=32)
        prompts = [[{"role": "user", "content": f"search for call {i}"}] for i in range(32)]
        outs = asyncio.run(llm.abatch(prompts, fmt=TAGGED))
        ladders: dict[int, list[str | None]] = {}
        for b in srv.requests:
            style = "gbnf" if "grammar" in b else "vllm" if "structured_outputs" in b else None
            ladders.setdefault(int(b["messages"][-1]["content"].split()[-1]), []).append(style)
    expected = {0: ["gbnf", "vllm", None], 1: ["gbnf", "vllm"], 2: ["gbnf"]}
    assert ladders == {i: expected[i % 3] for i in range(32)}
    assert [o.constrained for o in outs] == [i % 3 != 0 for i in range(32)]
    assert caplog.text.count("refused regex formats") == 1 and llm.usage.failures == 0
