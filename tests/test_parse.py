"""The reply parser on messy model output, and ask_json's bounded re-ask."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from deepr.llm.base import LLM, LLMError, run_sync
from deepr.llm.parse import JSONExtractError, ask_json, extract_json, parse_reply, strip_thinking


class Answer(BaseModel):
    answer: str
    confidence: float = Field(ge=0, le=1)


class Scripted(LLM):
    """Replies from a list, recording every conversation it was sent."""

    name = "scripted"

    def __init__(self, replies):
        super().__init__()
        self.replies = list(replies)
        self.seen = []

    async def _achat(self, messages, **kw):
        self.seen.append(messages)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


@pytest.mark.parametrize("text", [
    '{"answer": "Paris", "confidence": 0.9}',
    '<think>The user wants {json}. Let me think [a, b]</think>\n{"answer": "Paris", "confidence": 0.9}',
    'Sure! Here is the JSON:\n```json\n{"answer": "Paris", "confidence": 0.9}\n```\nHope it helps.',
    'reasoning without an opening tag </think> {"answer": "Paris", "confidence": 0.9}',
    'Result: {"answer": "Paris", "confidence": 0.9} and that is {not json}.',
    '```\n{"answer": "Paris", "confidence": 0.9}\n```',
])
def test_extracts_json_from_messy_replies(text):
    assert extract_json(text, "object") == {"answer": "Paris", "confidence": 0.9}


def test_strip_thinking_drops_unclosed_block():
    assert strip_thinking('{"a": 1} <think>and then I') == '{"a": 1}'
    assert strip_thinking("<THINK>x</THINK>y") == "y"


def test_extract_prefers_wanted_kind_and_explains_failures():
    assert extract_json('ids [1, 2] then {"k": 3}', "object") == {"k": 3}
    assert extract_json('{"k": 3} then [1, 2]', "array") == [1, 2]
    with pytest.raises(JSONExtractError, match="do not parse"):
        extract_json('{"answer": "Paris",}', "object")
    with pytest.raises(JSONExtractError, match="no JSON"):
        extract_json("I cannot help with that.")
    with pytest.raises(JSONExtractError, match="empty"):
        extract_json("<think>only thoughts</think>")


def test_parse_reply_reports_schema_and_check_errors():
    value, err = parse_reply('{"answer": "x", "confidence": 3}', Answer)
    assert value is None and "confidence" in err
    value, err = parse_reply('{"answer": "x", "confidence": 0.3}', Answer,
                             check=lambda a: [] if a.confidence > 0.5 else ["confidence must exceed 0.5"])
    assert value is None and "confidence must exceed 0.5" in err


def test_ask_json_reasks_with_the_error_then_succeeds():
    llm = Scripted(["no json here", '{"answer": "Paris"}', '<think>ok</think>{"answer": "Paris", "confidence": 1}'])
    res = run_sync(ask_json(llm, [{"role": "user", "content": "Capital of France?"}], Answer, role="qa"))
    assert res.ok and res.value == Answer(answer="Paris", confidence=1.0)
    assert res.attempts == 3 and len(res.replies) == 3
    # the second request carries the first reply and the reason it failed
    second = llm.seen[1]
    assert second[-2] == {"role": "assistant", "content": "no json here"}
    assert "no JSON object found" in second[-1]["content"]
    assert "confidence" in llm.seen[2][-1]["content"]  # the schema error is named


def test_ask_json_gives_up_with_a_recorded_reason():
    llm = Scripted(["{bad", "{bad", "{bad", "never asked"])
    res = run_sync(ask_json(llm, [{"role": "user", "content": "q"}], Answer, max_reasks=2))
    assert not res.ok and res.value is None
    assert res.attempts == 3 and "gave up after 3 attempts" in res.error
    assert llm.replies == ["never asked"]


def test_ask_json_records_call_failure_without_reasking():
    llm = Scripted([LLMError("HTTP 400: context too long"), '{"answer": "a", "confidence": 0}'])
    res = run_sync(ask_json(llm, [{"role": "user", "content": "q"}], Answer))
    assert not res.ok and res.attempts == 1
    assert "model call failed" in res.error and "context too long" in res.error


def test_run_sync_works_inside_a_running_loop():
    import asyncio

    async def outer():
        llm = Scripted(['{"answer": "a", "confidence": 0.5}'])
        return llm.chat([{"role": "user", "content": "q"}])

    assert asyncio.run(outer()) == '{"answer": "a", "confidence": 0.5}'
