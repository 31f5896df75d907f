"""The plan validator's graph rules at decoding time (deepr/profiles/plan_guard.py): the graph
schema every JSON-schema backend decodes the planner with, and the guard the hf backend and
GRPO's sampler add, so that a plan that parses also validates."""

from __future__ import annotations

import json
import random

import pytest

from deepr.evidence.plan import validate_plan
from deepr.profiles.plan_guard import PlanGuard
from deepr.profiles.small.planner import graph_format

S = '{"id": "N%d", "type": "search", "query": "volcano eruption causes"}'
AGG = '{"id": "N%d", "type": "aggregate", "need": "how they combine", "inputs": [%s]}'
ANS = '{"id": "N%d", "type": "answer", "need": "the report", "inputs": [%s]}'
# a teacher-shaped plan: ids in order, the answer last and reading both aggregates
GOOD = ('{"nodes": [' + ", ".join([S % 1, S % 2, S % 3, AGG % (4, '"N1", "N2"'), AGG % (5, '"N3", "N4"'),
                                   ANS % (6, '"N4", "N5"')]) + "]}")


def _ids(*ids: int) -> str:
    return ", ".join(f'"N{i}"' for i in ids)


@pytest.fixture(scope="module")
def compiled(tok):
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    return xgr, info, {action: compiler.compile_json_schema(json.dumps(graph_format(action == "revise").json_schema),
                                                            any_whitespace=False) for action in ("plan", "revise")}


def test_graph_schema_decodes_teacher_plans_and_refuses_wiring_no_plan_may_have(compiled):
    """Every JSON-schema backend gets the wiring in the schema: node k is Nk, the first node
    searches, inputs name earlier nodes, the one answer node comes last."""
    xgr, _, grammars = compiled

    def accepts(text: str, action: str = "plan") -> bool:
        return xgr.GrammarMatcher(grammars[action]).accept_string(text)

    assert validate_plan(GOOD)[0] is not None and accepts(GOOD)
    assert accepts(GOOD[:-1] + ', "fetch": []}', "revise")
    refused = {
        "an id out of order": '{"nodes": [{"id": "N2"',
        "a reader first": '{"nodes": [{"id": "N1", "type": "aggregate"',
        "an input not yet written": '{"nodes": [' + S % 1 + ', {"id": "N2", "type": "aggregate", "need": "x", '
                                    '"inputs": ["N3"',
        "a node reading itself": '{"nodes": [' + S % 1 + ', {"id": "N2", "type": "answer", "need": "x", '
                                 '"inputs": ["N2"',
        "a node after the answer": '{"nodes": [' + S % 1 + ", " + ANS % (2, _ids(1)) + ", {",
        "a plan without an answer": '{"nodes": [' + S % 1 + ", " + S % 2 + "]",
        "an empty need": '{"nodes": [' + S % 1 + ', {"id": "N2", "type": "answer", "need": "",',
    }
    for why, text in refused.items():
        assert not accepts(text), why


def test_guard_follows_each_inputs_list_and_refuses_what_would_not_validate():
    g = PlanGuard()
    head = '{"nodes": [' + ", ".join([S % 1, S % 2, AGG % (3, _ids(1, 2)), S % 4])
    assert not g.watching(head) and g.viable(head)
    agg = head + ', {"id": "N5", "type": "aggregate", "need": "x", "inputs": ["N1"'
    assert g.watching(agg) and g.watching(head + ', {"id": "N5", "type": "aggregate", "need": "x", "inputs"')
    assert g.viable(agg + ', "N4"]') and g.viable(agg + "]")
    assert not g.viable(agg + ', "N1"')  # an input listed twice
    assert g.viable(agg + ', "N') and not g.viable(agg + ', "N7')  # no earlier id begins "N7"
    answer = head + ', {"id": "N5", "type": "answer", "need": "the report", "inputs": ['
    assert g.viable(answer + '"N3"') and not g.viable(answer + '"N3"]')  # N4 is read by nothing
    assert g.viable(answer + '"N3", "N4"]}]}')
    assert validate_plan(answer + '"N3", "N4"]}]}')[0] is not None
    assert validate_plan(answer + '"N3"]}]}')[0] is None  # what the guard prevented, by the validator
    # eight inputs at most: once the slots left equal the nodes nothing reads, only those may follow
    # (SmolLM2 after SFT listed N6-N9 and N1-N4, and then N5, which nothing read, no longer fitted)
    full = '{"nodes": [' + ", ".join([*(S % i for i in range(1, 8)), AGG % (8, _ids(1, 2)), S % 9])
    full += ', {"id": "N10", "type": "answer", "need": "the report", "inputs": ['  # unread: N3-N9, one slot spare
    assert g.viable(full + '"N1"') and g.viable(full + '"N1", "N3')
    assert not g.viable(full + '"N1", "N2')  # N2 would take the slot N9 needs
    assert validate_plan(full + _ids(1, *range(3, 10)) + "]}]}")[0] is not None
    revision = GOOD[:-1] + ', "fetch": ["N1-R1"]}'
    assert not g.watching(revision) and g.viable(revision)


def _random_plan(grammar, info, guard: PlanGuard | None, rng: random.Random, tok) -> str:
    """A plan decoded by a 'model' that scores tokens at random, under the grammar (and the guard)."""
    import torch

    from deepr.llm.hf_constrain import guard_processor
    xgr = pytest.importorskip("xgrammar")

    matcher = xgr.GrammarMatcher(grammar)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    proc = guard_processor([guard], tok, 0) if guard else None
    closers = torch.tensor([i for i in range(len(tok)) if '"' in tok.decode([i])])
    ids: list[int] = []
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    while not matcher.is_terminated() and len(ids) < 3000:
        scores = torch.randn(1, info.vocab_size, generator=gen)
        scores[0, closers] += 4.0  # strings end soon: the test is about wiring, not text
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(scores, mask)
        if proc is not None:
            scores = proc(torch.tensor([ids], dtype=torch.long), scores)
        nxt = int(scores.argmax())
        assert matcher.accept_token(nxt)
        ids.append(nxt)
    return tok.decode(ids[:-1])  # the grammar's stop token ends it


def test_random_decoding_under_schema_and_guard_always_gives_a_valid_plan(compiled, tok):
    """The property the learning run needs: whatever tokens a model prefers, a plan decoded
    under the graph schema and the guard validates. Without the guard the same random decoder
    writes plans the validator refuses (unread nodes, repeated inputs), so the guard is what
    closes the gap."""
    _, info, grammars = compiled
    rng = random.Random(0)
    unguarded = [validate_plan(_random_plan(grammars["plan"], info, None, rng, tok)) for _ in range(12)]
    assert any(plan is None for plan, _ in unguarded)
    sizes = []
    for action in ("plan", "plan", "revise"):
        for _ in range(8):
            text = _random_plan(grammars[action], info, PlanGuard(), rng, tok)
            plan, errors = validate_plan(text)
            assert plan is not None, (errors, text)
            sizes.append(len(plan.nodes))
    assert max(sizes) >= 4  # readers reading readers, not only two-node plans
