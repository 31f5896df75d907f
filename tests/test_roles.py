"""The role seam: one declaration, one executor, one record (deepr.roles)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from pydantic import BaseModel, Field

from deepr.llm.base import LLM, GenDefaults, LLMError, Reply, run_sync
from deepr.llm.schema import strict_schema
from deepr.roles import JSONReply, Recorder, Role, RoleFailed, TaggedReply, body_of, perform


class Keywords(BaseModel):
    keywords: list[str] = Field(min_length=1)


class Scripted(LLM):
    """Replies from a list; keeps the keyword arguments of every call."""

    name = "scripted"

    def __init__(self, replies, gen=None):
        super().__init__(gen=gen)
        self.replies, self.calls = list(replies), []

    async def _achat(self, messages, **kw):
        self.calls.append({"messages": messages, **kw})
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


@dataclass
class Ask:
    topic: str


SEARCH = Role(name="searcher", action="keywords", output=JSONReply(Keywords),
              messages=lambda a: [{"role": "user", "content": f"Keywords for {a.topic}?"}],
              check=lambda a, v: [] if a.topic in " ".join(v["keywords"]) else [f"mention {a.topic}"],
              extractive=lambda a: {"keywords": [a.topic]}, result=lambda a, v: v["keywords"],
              max_tokens=64, temperature=0.0, on_fail="searched for {topic_id} with the topic itself")

ANSWER = Role(name="writer", action="answer", output=TaggedReply("answer", required=True),
              messages=lambda a: [{"role": "user", "content": f"Explain {a.topic}."}],
              extractive=lambda a: f"{a.topic} is a topic.", max_tokens=128, fallback=None)


def go(role, llm, rec=None, **kw):
    rec = rec if rec is not None else Recorder()
    return run_sync(perform(role, Ask("lava"), llm=llm, rec=rec, **kw)), rec


def test_every_call_carries_the_roles_format_and_token_limit():
    llm = Scripted(['{"keywords": ["lava flow"]}'])
    out, rec = go(SEARCH, llm)
    assert out.ok and out.by == "llm" and out.value == ["lava flow"]
    call = llm.calls[0]
    assert call["max_tokens"] == 64 and call["temperature"] == 0.0
    assert call["fmt"].json_schema == strict_schema(Keywords.model_json_schema()) and call["fmt"].regex is None
    tagged = Scripted(["<answer>Lava is molten rock.</answer>"])
    assert go(ANSWER, tagged)[0].value == "Lava is molten rock."
    assert tagged.calls[0]["fmt"].regex and "answer" in tagged.calls[0]["fmt"].regex
    assert tagged.calls[0]["max_tokens"] == 128
    assert [t.completion for t in rec.turns] == ['{"keywords": ["lava flow"]}']


def test_the_users_max_tokens_caps_the_roles_default():
    llm = Scripted(['{"keywords": ["lava"]}'], gen=GenDefaults(max_tokens=32))
    go(SEARCH, llm)
    assert llm.calls[0]["max_tokens"] == 32


def test_reasks_sample_and_name_tags_without_writing_them():
    llm = Scripted(["no tag here", "<answer>Lava is molten rock.</answer>"])
    out, rec = go(ANSWER, llm)
    assert out.ok and out.attempts == 2
    assert llm.calls[0]["temperature"] is None and llm.calls[1]["temperature"] >= 0.5
    reask = llm.calls[1]["messages"][-1]["content"]
    assert "answer tag" in reask and "<answer>" not in reask and "..." not in reask


def test_a_reply_cut_at_max_tokens_is_a_failure_then_the_fallback_is_recorded():
    cut = Reply('{"keywords": ["lava', truncated=True)
    llm = Scripted([cut, cut, cut])
    out, rec = go(SEARCH, llm, topic_id="T1")
    assert out.by == "fallback" and out.value == ["lava"] and not out.ok
    assert "cut at max_tokens (64)" in out.error and "gave up after 3 attempts" in out.error
    assert rec.failures[0]["where"] == "searcher/keywords" and rec.failures[0]["attempts"] == 3
    assert any(d["what"] == "searched for T1 with the topic itself" for d in rec.decisions)
    assert rec.turns[-1].ok is False and rec.engines == {"fallback": 1}
    assert [c.truncated for c in rec.calls] == [True, True, True]


def test_a_cut_reply_names_the_limit_that_cut_it():
    cut = Reply('{"keywords": ["lava', truncated=True)
    out, _ = go(SEARCH, Scripted([cut], gen=GenDefaults(max_tokens=16)), max_reasks=0, topic_id="T1")
    assert "cut at max_tokens (16)" in out.error  # the user's --max-tokens, not the role's 64


def test_a_failed_check_is_reasked_with_its_reason():
    llm = Scripted(['{"keywords": ["basalt"]}', '{"keywords": ["lava tubes"]}'])
    out, rec = go(SEARCH, llm)
    assert out.value == ["lava tubes"] and "mention lava" in llm.calls[1]["messages"][-1]["content"]
    assert rec.turns[0].model_extra["attempts"] == 2


def test_no_fallback_means_a_recorded_failure_with_the_last_reply():
    llm = Scripted(["nothing", "still nothing", LLMError("server gone")])
    out, rec = go(ANSWER, llm)
    assert out.by == "failed" and out.value is None and out.reply == "still nothing"
    assert "model call failed: server gone" in out.error and rec.failures[0]["where"] == "writer/answer"


def test_the_extractive_backend_runs_the_roles_own_implementation_and_records_it():
    out, rec = go(ANSWER, None)
    assert out.by == "extractive" and out.value == "lava is a topic."
    turn = rec.turns[0]
    assert turn.model_extra["extractive"] and body_of(turn.completion, "answer") == "lava is a topic."
    assert turn.messages == [{"role": "user", "content": "Explain lava."}] and rec.calls == []


def test_an_extractive_implementation_that_cannot_answer_is_a_recorded_failure():
    def refuse(a):
        raise RoleFailed("only 1 leaf; need 2")

    role = Role(name="synth", action="pair", output=JSONReply(), messages=lambda a: [],
                extractive=refuse, fallback=None)
    out, rec = go(role, None)
    assert out.by == "failed" and out.error == "only 1 leaf; need 2"
    assert rec.failures == [{"where": "synth/pair", "reason": "only 1 leaf; need 2", "role": "synth",
                             "attempts": 0}]


@pytest.mark.parametrize("reply, reason", [("<answer></answer>", "empty"), ("", "no answer tag"),
                                           ("Lava is molten rock.", "no answer tag")])
def test_an_empty_or_untagged_reply_is_rejected(reply, reason):
    out, _ = go(ANSWER, Scripted([reply] * 3))
    assert out.by == "failed" and reason in out.error


def test_format_regexes_match_the_replies_they_describe():
    import re

    from deepr.agent.tools_agent import STEP_REGEX

    call = '<think>x</think>\n<tool_call>{"name": "search", "arguments": {"query": "a b"}}</tool_call>'
    assert re.fullmatch(STEP_REGEX, call)
    assert re.fullmatch(STEP_REGEX, '<answer><cite id="S1-R1">Rome is old.</cite> More [S1-R2].</answer>')
    assert not re.fullmatch(STEP_REGEX, "Rome is old.")
    regex = TaggedReply("search").fmt("decor_planner.plan").regex
    assert re.fullmatch(regex, "<think>which fact</think>\n<search>Adam Smith books</search>")
    assert not re.fullmatch(regex, "Adam Smith books")


def test_a_backend_failure_records_every_request_it_sent_as_an_attempt():
    """Issue 18.4: the failure entry counts the requests sent (the backend's retries included),
    matching the "failed after N attempts" in its reason instead of saying 1."""
    from deepr.llm import get_llm
    from deepr.llm.stub_server import StubServer

    with StubServer(reply="ok", fail_first=10, fail_status=500) as srv:
        llm = get_llm("openai:stub-model", base_url=srv.base_url, cache=False, max_retries=3, timeout=5.0)
        rec = Recorder()
        out = run_sync(perform(ANSWER, Ask("tides"), llm=llm, rec=rec, max_reasks=2))
        assert srv.n_requests == 4
    assert out.by == "failed" and out.attempts == 4 and "after 4 attempts" in out.error
    assert rec.failures[-1]["attempts"] == 4 and rec.turns[-1].model_extra["attempts"] == 4


# -- what a profile changes about a call (deepr.profiles; --profile, --formats, --reask) -----------

def _profile_with(strict_fmt, *, strict=True, reask="correct"):
    """A profile whose only table entry is ``strict_fmt`` for the test roles."""
    from dataclasses import dataclass

    from deepr.profiles import Profile, Tables

    @dataclass(frozen=True)
    class One(Profile):
        def tables(self):
            return Tables(strict={ANSWER: strict_fmt, SEARCH: strict_fmt})

    return One("test", strict=strict, reask=reask)


def test_a_profiles_per_call_format_applies_only_while_its_strict_formats_are_on():
    from deepr.llm.base import OutputFormat

    fmt = lambda a: OutputFormat("kw", regex=rf'\{{"keywords": \["{a.topic} flow"\]\}}')  # noqa: E731
    loose, strict = Scripted(['{"keywords": ["lava flow"]}']), Scripted(['{"keywords": ["lava flow"]}'])
    go(SEARCH, loose, profile=_profile_with(fmt, strict=False)), go(SEARCH, strict, profile=_profile_with(fmt))
    assert loose.calls[0]["fmt"].json_schema is not None and loose.calls[0]["fmt"].regex is None
    assert strict.calls[0]["fmt"].regex == r'\{"keywords": \["lava flow"\]\}'
    plain = Scripted(['{"keywords": ["lava flow"]}'])
    go(SEARCH, plain)  # no profile: the role's own schema
    assert plain.calls[0]["fmt"].json_schema == strict_schema(Keywords.model_json_schema())


def test_a_strict_format_allows_only_the_acronyms_and_numbers_the_prompt_shows():
    """SmolLM2 looped on capitals no prompt held ("NXI, NXII, NXIII", "LONDON, LONDON"): a strict
    prose format admits the prompt's acronyms and figures and no others; the system prompt's
    own capitals (format instructions) do not count."""
    import re
    from dataclasses import replace

    from deepr.profiles.formats import cited_prose, tagged

    role = replace(ANSWER, messages=lambda a: [
        {"role": "system", "content": "Reply in JSON with IDS."},
        {"role": "user", "content": f"Explain {a.topic}. [E1] NASA saw 3,452 flows in 1969."}])
    llm = Scripted(["<answer>NASA counted 3,452 lava flows in 1969 [E1].</answer>"])
    out, _ = go(role, llm, profile=_profile_with(lambda a: tagged("answer", cited_prose(["E1"], sentences=(1, 1),
                                                                                          words=(4, 12)))))
    rx = llm.calls[0]["fmt"].regex
    assert out.by == "llm" and re.fullmatch(rx, "<answer>NASA counted 3,452 lava flows in 1969 [E1].</answer>")
    for made_up in ("NXI NXII NXIII were lava flows", "The JSON IDS were lava flows", "There were 3,453 lava flows",
                    "LONDON saw lava in 1970"):
        assert not re.fullmatch(rx, f"<answer>{made_up} [E1].</answer>"), made_up
    assert re.fullmatch(rx, "<answer>There were many lava flows in the year [E1].</answer>")


@pytest.mark.parametrize("spec, name, formats, strict", [
    ("smollm2", None, None, True), ("gguf:/m/x.gguf", None, None, True), ("hf:/m/ckpt", None, None, False),
    ("openai:qwen", None, None, False), ("openai:qwen", None, "strict", True), ("smollm2", None, "schema", False),
    ("openai:qwen", "small", None, True), ("smollm2", "default", None, False)])
def test_the_model_spec_picks_the_profile_and_flags_override_it(spec, name, formats, strict):
    from deepr.cli.flags import profile_of

    prof = profile_of(spec, name, formats)
    assert prof.strict is strict
    assert prof.name == (name or ("small" if spec in ("smollm2", "gguf:/m/x.gguf") else "default"))
    assert prof.describe()["name"] == prof.name


def test_the_formats_and_profile_flags_are_checked():
    from deepr.cli.flags import gen_defaults, profile_of

    assert profile_of("openai:x", formats="strict,planner=schema").roles == {"planner": False}
    for bad, says in [("loose", "'loose' is not a mode"), ("strict,planner=auto", "'planner=auto' is not a mode"),
                      ("strict,plannr=schema", "no role 'plannr' has strict formats"),
                      ("strict,schema", "give one mode for all roles")]:
        with pytest.raises(ValueError, match=says):
            gen_defaults(formats=bad)
    with pytest.raises(ValueError, match="--profile 'tiny': unknown profile"):
        profile_of("openai:x", "tiny")


def test_formats_per_role_hold_the_other_roles_to_their_mode():
    """`--formats strict,planner=schema`: the planner decodes by its own schema (its plan's shape
    is the model's), the answerer by the strict per-call format; `schema,answerer=strict` too."""
    from deepr.agent.answerer import FINAL
    from deepr.agent.planner import INITIAL
    from deepr.profiles import get_profile

    for spec, formats in (("openai:x", "strict,planner=schema"), ("openai:x", "schema,answerer=strict"),
                          ("smollm2", "planner=schema")):
        prof = get_profile(spec=spec, formats=formats)
        assert not prof.strict_for(INITIAL.name) and prof.strict_for(FINAL.name), formats
    plain = get_profile(spec="openai:x", formats="strict")
    assert plain.strict_for("planner") and plain.strict_for("answerer")


def test_a_role_made_strict_under_the_default_profile_brings_the_small_decoding_with_it():
    """`--formats schema,answerer=strict` on an hf model: the answerer's cited-prose format carries
    the small profile's repetition rules (SmolLM2 looped in its answers without them), the planner,
    decoding its own schema, none."""
    from types import SimpleNamespace

    from deepr.agent.answerer import FINAL
    from deepr.agent.planner import INITIAL
    from deepr.profiles import SMALL_DECODING, get_profile

    prof = get_profile(spec="hf:/m", formats="schema,answerer=strict")
    assert prof.decoding == {}  # nothing backend-wide: the planner's JSON keeps plain greedy decoding
    msgs = [{"role": "user", "content": "Evidence: [N1-R1] Lava flows. [N2-R1] Ash falls."}]
    fmt = prof.format(FINAL, SimpleNamespace(ids=["N1-R1", "N2-R1"]), msgs)
    assert fmt is not None and fmt.regex and dict(fmt.decoding) == SMALL_DECODING
    assert prof.format(INITIAL, SimpleNamespace(query="lava"), msgs) is None
    # the run's config records it, as it records a profile's backend-wide decoding
    assert prof.describe()["strict_decoding"] == SMALL_DECODING and "strict_decoding" not in get_profile("default").describe()


def test_every_role_a_profile_formats_exists_and_can_be_named_in_the_formats_flag():
    """The small profile's tables name roles that exist (``role.action`` of a declared Role), and
    FORMAT_ROLES, what `--formats ROLE=MODE` accepts, lists every one of them."""
    import importlib
    import pkgutil

    import deepr
    from deepr.profiles import FORMAT_ROLES, SMALL

    declared = set()
    for mod in pkgutil.walk_packages(deepr.__path__, "deepr."):
        if mod.name.startswith(("deepr.train", "deepr.cli", "deepr.profiles")) or mod.name.endswith("__main__"):
            continue  # training, CLI and entry modules import torch/typer or run; they declare no roles
        for value in vars(importlib.import_module(mod.name)).values():
            if isinstance(value, Role):
                declared.add(f"{value.name}.{value.action}")
    tables = SMALL.tables()
    keys = {f"{r.name}.{r.action}" for t in (tables.strict, tables.schema, tables.messages, tables.precheck)
            for r in t}
    assert keys <= declared, sorted(keys - declared)
    assert {k.split(".")[0] for k in keys} <= set(FORMAT_ROLES)
    assert {"planner.plan", "answerer.final", "warp.write", "agent.step", "synthesize.pair"} <= keys


# -- how a refused reply is asked again (Profile.reask, --reask) ----------------------------------

def test_a_resampled_reask_sends_the_same_prompt_with_a_new_seed():
    """A looping reply shown back to a 135M model came back again, or the correction did; a
    resampled re-ask sends the original prompt, sampled, with a seed no earlier attempt used."""
    from deepr.profiles import get_profile

    fine = '{"keywords": ["lava flow"]}'
    resample = Scripted(['{"keywords": ["rock"]}', '{"keywords": ["stone"]}', fine], gen=GenDefaults(seed=7))
    out, rec = go(SEARCH, resample, profile=get_profile("default", reask="resample"))
    assert out.by == "llm" and out.value == ["lava flow"] and out.attempts == 3
    assert rec.rejected == 2 and resample.usage.rejected == 2  # the run's record and the backend's accounting
    prompts = [c["messages"] for c in resample.calls]
    assert prompts[0] == prompts[1] == prompts[2]
    assert [c["seed"] for c in resample.calls] == [7, 8, 9] and [c["temperature"] for c in resample.calls][1:] == [0.7, 0.7]
    correct = Scripted(['{"keywords": ["rock"]}', fine])
    out, _ = go(SEARCH, correct)
    assert out.by == "llm" and len(correct.calls[1]["messages"]) == len(correct.calls[0]["messages"]) + 2
    assert "mention lava" in correct.calls[1]["messages"][-1]["content"]


@pytest.mark.parametrize("spec, reask, style", [
    ("smollm2", None, "resample"), ("gguf:/m/x.gguf", None, "resample"), ("hf:/m/ckpt", None, "correct"),
    ("openai:qwen", None, "correct"), ("smollm2", "correct", "correct"), ("openai:qwen", "resample", "resample")])
def test_reasks_resample_by_default_for_the_built_in_small_models_only(spec, reask, style):
    from deepr.cli.flags import profile_of

    assert profile_of(spec, reask=reask).reask == style
    with pytest.raises(ValueError, match="--reask 'again': choose auto, correct or resample"):
        profile_of(spec, reask="again")
