"""A prompt larger than the model's context is trimmed, evidence first, or fails before it is sent."""

from __future__ import annotations

from dataclasses import dataclass, replace

from deepr.llm.base import LLM, run_sync
from deepr.roles import Recorder, Role, TaggedReply, context_length, perform, prompt_tokens, trim_evidence


class Small(LLM):
    """A model with a small context that refuses (like a real server) any prompt over it."""

    name = "small"

    def __init__(self, context: int | None, reply: str = "<answer>Lava is molten rock [N1-R1].</answer>"):
        super().__init__()
        self.context_length, self.reply, self.sent = context, reply, []

    async def _achat(self, messages, *, max_tokens=None, **kw):
        if self.context_length is not None:
            assert prompt_tokens(self, messages) + (max_tokens or 0) <= self.context_length, "over context"
        self.sent.append(messages)
        return self.reply


@dataclass
class Ask:
    evidence: list[str]
    note: str = ""


def _msgs(a: Ask):
    lines = "\n".join(f"[N1-R{i}] Source {i}: {t}" for i, t in enumerate(a.evidence, start=1))
    return [{"role": "system", "content": "Answer from the evidence, citing ids in brackets."},
            {"role": "user", "content": f"Question: what is lava?{a.note}\nEvidence:\n{lines}\nAnswer:"}]


WRITE = Role(name="writer", action="answer", output=TaggedReply("answer"), messages=_msgs,
             extractive=lambda a: "Lava is rock.", max_tokens=100, fallback=None)
LONG = "molten rock that flows from a volcano and cools into basalt " * 40  # ~2,400 characters


def test_a_prompt_over_the_context_is_sent_with_its_evidence_shortened_first():
    llm, rec = Small(600), Recorder()
    out = run_sync(perform(WRITE, Ask([LONG, LONG, LONG]), llm=llm, rec=rec))
    assert out.ok and out.by == "llm"
    sent = llm.sent[0][1]["content"]
    # every evidence item is still there (ids kept), each one shorter
    assert all(f"[N1-R{i}]" in sent for i in (1, 2, 3)) and sent.count("…") == 3
    assert sent.startswith("Question: what is lava?") and sent.endswith("Answer:")
    assert prompt_tokens(llm, llm.sent[0]) + 100 <= 600
    trimmed = [d for d in rec.decisions if "trimmed" in d["what"]]
    assert trimmed and trimmed[0]["tokens_before"] > trimmed[0]["tokens_after"] and trimmed[0]["context"] == 600
    assert rec.turns[0].messages[1]["content"] == sent  # the trajectory holds what was sent


def test_when_shortening_is_not_enough_the_lowest_ranked_items_are_dropped():
    msgs = _msgs(Ask(["x " * 200] * 30))
    out = trim_evidence(msgs, 11000)  # more than shortening every item to ~80 characters saves
    body = out[1]["content"]
    assert "[N1-R1]" in body and "[N1-R30]" not in body and body.endswith("Answer:")


def test_the_roles_own_shrink_runs_before_generic_trimming():
    role = replace(WRITE, shrink=lambda a, step: replace(a, evidence=a.evidence[:-1]) if a.evidence else None)
    llm = Small(400)
    out = run_sync(perform(role, Ask([LONG[:600]] * 6), llm=llm, rec=Recorder()))
    assert out.ok
    sent = llm.sent[0][1]["content"]
    assert "…" not in sent and "[N1-R1]" in sent and "[N1-R6]" not in sent  # whole items dropped, none cut


def test_a_prompt_that_cannot_fit_fails_before_it_is_sent_with_a_clear_recorded_reason():
    llm, rec = Small(300), Recorder()
    out = run_sync(perform(WRITE, Ask([], note=" Background: " + LONG), llm=llm, rec=rec))
    assert out.by == "failed" and llm.sent == [] and rec.calls == []
    assert "writer/answer" in out.error and "context of 300 tokens" in out.error and "max_tokens 100" in out.error
    assert rec.failures[0]["reason"] == out.error
    assert rec.turns[0].ok is False


def test_the_users_max_tokens_leaves_room_and_no_context_means_no_trimming():
    llm = Small(None)
    assert context_length(llm) is None
    run_sync(perform(WRITE, Ask([LONG] * 3), llm=llm, rec=Recorder()))
    assert "…" not in llm.sent[0][1]["content"]
    whole = prompt_tokens(llm, _msgs(Ask([LONG] * 3)))
    plain, capped = Small(whole + 50), Small(whole + 50)
    capped.gen.max_tokens = 20  # --max-tokens 20 caps the role's 100: the whole prompt fits
    for m in (plain, capped):
        run_sync(perform(WRITE, Ask([LONG] * 3), llm=m, rec=Recorder()))
    assert "…" in plain.sent[0][1]["content"] and "…" not in capped.sent[0][1]["content"]


def test_a_backend_tokenizer_is_used_when_it_has_one():
    llm = Small(None)
    llm.count_tokens = lambda messages: 7
    assert prompt_tokens(llm, _msgs(Ask([LONG]))) == 7


def test_a_reask_that_would_overflow_the_context_is_not_sent():
    whole = prompt_tokens(Small(None), _msgs(Ask(["short evidence about lava"])))
    llm, rec = Small(whole + 100 + 10, reply=""), Recorder()  # the first ask fits, the re-ask would not
    out = run_sync(perform(WRITE, Ask(["short evidence about lava"]), llm=llm, rec=rec))
    assert len(llm.sent) == 1 and out.by == "failed"
    assert "empty" in out.error and "re-ask would not fit the model's context" in out.error
