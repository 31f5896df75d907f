"""The hf backend's prefix cache: the next turn of a conversation computes only its new tokens,
and replies are the same as without the cache."""

from __future__ import annotations

import pytest

from deepr.llm.hf_backend import HFLLM
from deepr.train.tiny import build_tiny_model

SYSTEM = {"role": "system", "content": "You are a research agent. Search, read the results, then answer "
                                       "with citations. " * 4}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _n_tokens(llm: HFLLM, msgs, **kw) -> int:
    return len(llm.tokenizer.apply_chat_template(msgs, return_dict=True, **kw)["input_ids"])


def _turns(llm: HFLLM) -> list[str]:
    convo = [SYSTEM, {"role": "user", "content": "Which river flows through London?"}]
    replies = []
    for k in range(3):
        reply = llm.chat(convo, max_tokens=12, temperature=0.0)
        replies.append(str(reply))
        convo += [{"role": "assistant", "content": str(reply)},
                  {"role": "user", "content": f"<tool_response>result {k}: the Thames flows east.</tool_response>"}]
    return replies


def test_a_conversation_reuses_the_kept_cache_and_replies_do_not_change(tiny_dir):
    cached = HFLLM(tiny_dir, max_new_tokens=12)
    fresh = HFLLM(tiny_dir, max_new_tokens=12, prefix_cache=False)
    with_cache, without = _turns(cached), _turns(fresh)
    assert with_cache == without
    assert cached.prefix_hits == 2 and fresh.prefix_hits == 0
    # each later turn skipped at least the system prompt and the first question
    first = _n_tokens(cached, [SYSTEM])
    assert cached.prefix_tokens >= 2 * first
    assert cached.usage.prompt_tokens == fresh.usage.prompt_tokens  # accounting counts whole prompts


def test_an_unrelated_prompt_starts_afresh(tiny_dir):
    llm = HFLLM(tiny_dir, max_new_tokens=6)
    llm.chat([SYSTEM, {"role": "user", "content": "Which river flows through London?"}], temperature=0.0)
    other = [{"role": "system", "content": "Score the answer."}, {"role": "user", "content": "Paris is in France."}]
    assert llm.chat(other, temperature=0.0) == HFLLM(tiny_dir, max_new_tokens=6, prefix_cache=False).chat(
        other, temperature=0.0)
    assert llm.prefix_hits == 0


def test_a_repeated_prompt_reuses_all_but_its_last_token(tiny_dir):
    llm = HFLLM(tiny_dir, max_new_tokens=6)
    msgs = [SYSTEM, {"role": "user", "content": "Which river flows through London?"}]
    first, again = llm.chat(msgs, temperature=0.0), llm.chat(msgs, temperature=0.0)
    n_prompt = _n_tokens(llm, msgs, add_generation_prompt=True)
    assert first == again and llm.prefix_hits == 1 and llm.prefix_tokens == n_prompt - 1
