"""build-trees: topic sampling, the extractive and LLM tree roles, the builder's limits,
grounding, redundancy, failure recording and concurrency."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from conftest import small_format

from deepr.io import RecordError
from deepr.llm.replay import ReplayLLM
from deepr.records import Document, Hit, Reject, Tree
from deepr.text import coverage
from deepr.data.topics import SeedTopic, load_topics, sample_topics, tree_id
from deepr.extractive.trees import NodeCtx, key_phrases
from deepr.roles import Recorder
from deepr.data.trees import TreeConfig, build_trees, make_roles
from tree_helpers import LexicalRetriever, ScriptedLLM, replier, volcano_docs

TOPICS = [SeedTopic(id=tree_id(t), title=t) for t in ("Volcano", "Plate tectonics", "Mount Vesuvius")]


@pytest.fixture(scope="module")
def volc() -> LexicalRetriever:
    return LexicalRetriever(volcano_docs())


def _check_tree(tree: Tree, cfg: TreeConfig) -> None:
    """The shape every built tree must have."""
    by_id = {n.id: n for n in tree.nodes}
    assert tree.root_id == "n0" and by_id["n0"].parent is None
    for n in tree.nodes:
        assert n.depth <= cfg.max_depth
        assert len(n.children) <= cfg.limit(n.depth)
        assert n.supporting_docs, f"{n.id} has no supporting document"
        for d in n.supporting_docs:
            assert 1 <= len(d.statements) <= 3 and d.snippet_id.startswith(d.doc_id)
        assert n.statements == [s for d in n.supporting_docs for s in d.statements]
        for c in n.children:
            assert by_id[c].parent == n.id and by_id[c].depth == n.depth + 1
        assert (n.stop_reason is None) == bool(n.children)
    leaves = [n for n in tree.nodes if not n.children]
    assert tree.stats.nodes == len(tree.nodes) and tree.stats.leaves == len(leaves)
    assert tree.stats.depth == max(n.depth for n in tree.nodes)


# --- topics ------------------------------------------------------------------------------


def test_sampling_is_stratified_deterministic_and_prefix_stable():
    docs = [Document(id=f"{c}{i}", title=f"{c} topic {i}", text="word " * 40, topic=c)
            for c in "ABC" for i in range(5)] + [Document(id="short", title="Short", text="too short", topic="A")]
    four, nine = sample_topics(docs, 4, seed=1), sample_topics(docs, 9, seed=1)
    assert [t.category for t in nine[:3]] == ["A", "B", "C"]
    assert [t.id for t in nine[:4]] == [t.id for t in four]  # a bigger run extends a smaller one
    assert [t.id for t in sample_topics(docs, 9, seed=1)] == [t.id for t in nine]
    assert {t.id for t in sample_topics(docs, 9, seed=2)}.isdisjoint({t.id for t in nine})  # seed is in the id
    assert "Short" not in {t.title for t in sample_topics(docs, 50)}  # under min_words
    assert len(sample_topics(docs, 50)) == 15


def test_topics_file_formats_and_errors(tmp_path: Path):
    txt = tmp_path / "t.txt"
    txt.write_text("# seeds\nVolcano\n\nPlate tectonics\n")
    assert [t.title for t in load_topics(txt)] == ["Volcano", "Plate tectonics"]
    good = tmp_path / "t.jsonl"
    good.write_text('{"topic": "Volcano", "category": "Geo"}\n{"title": "Lava", "id": "my-lava"}\n')
    assert [(t.title, t.id) for t in load_topics(good)][1] == ("Lava", "my-lava")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"topic": "Volcano"}\n{"topic": 3}\n')
    with pytest.raises(RecordError, match=r"bad.jsonl:2 field 'topic'"):
        load_topics(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"topic": "Volcano"\n')
    with pytest.raises(RecordError, match=r"broken.jsonl:1: not valid JSON"):
        load_topics(broken)
    with pytest.raises(FileNotFoundError):
        load_topics(tmp_path / "missing.txt")


def test_config_rejects_bad_branching():
    with pytest.raises(ValueError, match="branching"):
        TreeConfig(branching=[6, 0, 3])
    assert TreeConfig(branching=[6, 4, 3]).limit(5) == 3


# --- extractive path ----------------------------------------------------------------------


def test_key_phrases_drop_openers_dates_and_demonyms():
    assert key_phrases("Kind of Blue is an album by American musician Miles Davis, released in August "
                       "1959 by Columbia.") == ["Kind of Blue", "Miles Davis", "Columbia"]


def test_extractive_trees_respect_limits_and_are_reproducible(volc, embedder):
    cfg = TreeConfig(max_depth=2, branching=[3, 2])
    results = build_trees(TOPICS[:2], volc, None, cfg, embed=embedder.encode)
    trees = [r for r in results if isinstance(r, Tree)]
    assert len(trees) == 2, [getattr(r, "reason", None) for r in results]
    for t in trees:
        _check_tree(t, cfg)
        assert t.backend == "extractive" and t.stats.llm_calls == 0 and t.stats.retrieval_calls >= t.stats.nodes
        for n in t.nodes:  # statements are sentences of the passage they came from
            for d in n.supporting_docs:
                text = volc.documents[[x.id for x in volc.documents].index(d.doc_id)].text
                assert all(coverage(s, text) >= 0.8 for s in d.statements)
    again = build_trees(TOPICS[:2], volc, None, cfg, embed=embedder.encode)
    strip = lambda r: r.model_dump(exclude={"stats"}) if isinstance(r, Tree) else r.model_dump()  # noqa: E731
    assert sorted(map(json.dumps, map(strip, again))) == sorted(map(json.dumps, map(strip, results)))


def test_tree_without_grounded_root_is_rejected_with_reason(volc, embedder):
    res = build_trees([SeedTopic(id="t-x", title="Quantum chromodynamics lattice")], volc, None,
                      TreeConfig(), embed=embedder.encode)
    assert isinstance(res[0], Reject) and "supports the root query" in res[0].reason


# --- LLM path -----------------------------------------------------------------------------


def _roles(llm, embedder, **kw):
    return make_roles(llm, embedder.encode, TreeConfig(**kw))


def test_the_judging_roles_run_on_the_engine_the_stage_was_given(embedder):
    """Unset, the writing model judges; ``--judge-llm extractive`` (judge=None) keeps gate and
    ground on the extractive engine while the model writes."""
    writer = ReplayLLM([])
    assert make_roles(writer, embedder.encode, TreeConfig()).judge is writer
    split = make_roles(writer, embedder.encode, TreeConfig(), judge=None)
    assert split.llm is writer and split.judge is None
    rec = Recorder()
    out = asyncio.run(split.ground(_ctx(), rec))  # the writer holds no reply: a model call would fail
    assert out.by == "extractive" and rec.turns[-1].model_extra.get("extractive") is True
    assert rec.engines == {"extractive": 1}


def _ctx() -> NodeCtx:
    hits = [Hit(id="Lava#0", doc_id="Lava", title="Lava", text="Lava is molten rock expelled by a volcano.")]
    return NodeCtx(query="Volcano hazards", depth=0, phrase="Volcano", root_topic="Volcano", hits=hits, support=[0])


def test_decompose_parses_fenced_think_reply(embedder):
    reply = ('<think>facets...</think>Here:\n```json\n{"queries": [{"query": "Lava flow speed", '
             '"facet": "quantitative"}, {"query": "Eruption deaths", "facet": "risks"}]}\n```')
    llm = ReplayLLM({"decompose": [reply]})
    out = asyncio.run(_roles(llm, embedder).decompose(_ctx(), 4, rec := Recorder()))
    assert [p.query for p in out.value] == ["Lava flow speed", "Eruption deaths"] and out.error is None
    assert len(rec.calls) == 1


def test_decompose_reasks_on_bad_json_and_violations_then_succeeds(embedder):
    ok = '{"queries": [{"query": "Lava vs basalt", "facet": "comparison"}, {"query": "Eruption deaths", ' \
         '"facet": "risks"}, {"query": "Eruptions per year", "facet": "quantitative"}]}'
    too_many = json.dumps({"queries": [{"query": f"q{i}", "facet": "risks"} for i in range(5)]})
    llm = ReplayLLM({"decompose": ['{"queries": [', too_many, ok]})
    out = asyncio.run(_roles(llm, embedder).decompose(_ctx(), 3, rec := Recorder()))
    assert out.error is None and len(out.value) == 3 and len(rec.calls) == 3
    reasks = [m[-1]["content"] for _, m in llm.calls[1:]]
    assert "do not parse as JSON" in reasks[0] or "no valid JSON" in reasks[0]
    assert "at most 3 are allowed" in reasks[1] and "comparison, quantitative" in reasks[1]


def test_decompose_gives_up_with_reason(embedder):
    llm = ReplayLLM({"decompose": ["no idea"] * 3})
    out = asyncio.run(_roles(llm, embedder, max_reasks=2).decompose(_ctx(), 3, Recorder()))
    assert out.value == [] and "gave up after 3 attempts" in out.error


def test_extract_rejects_statements_not_in_document(embedder):
    invented = '{"statements": ["Unicorns guard every crater on Mars."]}'
    good = '{"statements": ["Lava is molten rock expelled by a volcano."]}'
    llm = ReplayLLM({"extract": [invented, good]})
    out = asyncio.run(_roles(llm, embedder).extract("lava", "Volcano", _ctx().hits[0], Recorder()))
    assert out.value == ["Lava is molten rock expelled by a volcano."]
    assert "not supported by the document" in llm.calls[1][1][-1]["content"]


def test_ground_rejects_unknown_document_numbers(embedder):
    llm = ReplayLLM({"ground": ['{"supporting": [7]}', '{"supporting": [1, 1]}']})
    out = asyncio.run(_roles(llm, embedder).ground(_ctx(), Recorder()))
    assert out.value == [0] and "do not exist" in llm.calls[1][1][-1]["content"]


def test_llm_tree_is_built_concurrently_and_counted(volc, embedder):
    llm = ScriptedLLM(replier(volc.documents), latency=0.02)
    cfg = TreeConfig(max_depth=2, branching=[3, 2])
    [tree] = build_trees(TOPICS[:1], volc, llm, cfg, embed=embedder.encode)
    assert isinstance(tree, Tree), tree
    _check_tree(tree, cfg)
    assert tree.stats.llm_calls == llm.usage.calls and tree.stats.calls_by_role["decompose"] >= 1
    assert llm.max_in_flight >= 3  # siblings and documents were asked at the same time
    assert tree.backend == "scripted" and tree.nodes[0].query == "Volcano formation and effects"


def test_redundant_and_ungrounded_children_are_dropped(volc, embedder):
    base = replier(volc.documents)

    def reply(messages):
        if "You expand" in messages[0]["content"] and "depth 0" in messages[-1]["content"]:
            return json.dumps({"queries": [{"query": "Mount Vesuvius eruption", "facet": "risks"},
                                           {"query": "Mount Vesuvius eruptions", "facet": "comparison"},
                                           {"query": "zzzz qqqq", "facet": "quantitative"}]})
        return base(messages)

    [tree] = build_trees(TOPICS[:1], volc, ScriptedLLM(reply), TreeConfig(max_depth=1, min_leaves=1),
                         embed=embedder.encode)
    assert [n.query for n in tree.nodes[1:]] == ["Mount Vesuvius eruption"]
    assert tree.stats.dropped["redundant"] == 1 and tree.stats.dropped["ungrounded"] == 1


def test_failed_roles_are_recorded_not_raised(volc, embedder):
    base = replier(volc.documents)

    def reply(messages):
        if "You decide whether" in messages[0]["content"]:
            return "I think it is not atomic"  # never JSON: recorded, node expanded anyway
        return base(messages)

    # depth 2: the root's gate is never asked (issue 14), so the failing gate is a depth-1 node's
    [tree] = build_trees(TOPICS[:1], volc, ScriptedLLM(reply), TreeConfig(max_depth=2), embed=embedder.encode)
    assert tree.stats.failures >= 1 and tree.failures[0]["role"] == "gate"
    assert "gave up" in tree.failures[0]["reason"] and len(tree.nodes) > 1
    bad_root = ScriptedLLM(lambda m: "nothing useful")
    [rej] = build_trees(TOPICS[:1], volc, bad_root, TreeConfig(), embed=embedder.encode)
    assert isinstance(rej, Reject) and rej.reason.startswith("root query failed")


# --- CLI ------------------------------------------------------------------------------------


def test_the_root_is_expanded_even_when_the_model_calls_everything_atomic(volc, embedder):
    """A one-leaf tree is rejected, so the root's gate is not asked (issue 14: SmolLM2 judged the
    root atomic and build-trees exited 4); with min_leaves=1 it is, and the tree stops there."""
    base = replier(volc.documents)

    def reply(messages):
        if "You decide whether" in messages[0]["content"]:
            return '{"atomic": true, "reason": "one fact"}'
        return base(messages)

    llm = ScriptedLLM(reply)
    [tree] = build_trees(TOPICS[:1], volc, llm, TreeConfig(max_depth=2, branching=[3, 2]), embed=embedder.encode)
    assert isinstance(tree, Tree) and tree.stats.leaves >= 2, tree
    assert {n.stop_reason for n in tree.nodes if n.depth == 1} == {"atomic"}  # depth 1 is still asked
    assert tree.stats.calls_by_role["gate"] == sum(n.depth == 1 for n in tree.nodes)
    [one] = build_trees(TOPICS[:1], volc, ScriptedLLM(reply), TreeConfig(max_depth=2, min_leaves=1),
                        embed=embedder.encode)
    assert one.stats.nodes == 1 and one.stats.stop_reasons == {"atomic": 1}


def _decompose_fmt(roles, ctx, limit):
    from deepr.data.tree_roles import DECOMPOSE, TreeAsk

    return small_format(DECOMPOSE, TreeAsk(roles, ctx, limit=limit)).json_schema["properties"]["queries"]


def _accepts(schema: dict, value) -> bool:
    """Whether xgrammar (the hf backend's decoder) admits ``value`` under ``schema``."""
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo(["a", "</s>"], stop_token_ids=[1])
    m = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False))
    return m.accept_string(json.dumps(value), debug_print=False) and m.accept_token(1) and m.is_terminated()


def test_strict_root_query_keeps_the_seed_title(embedder):
    from deepr.data.tree_roles import ROOT_QUERY, TreeAsk

    roles = _roles(None, embedder)
    fmt = small_format(ROOT_QUERY, TreeAsk(roles, seed=SeedTopic(id="t", title="Mercury (planet)"))).json_schema
    assert _accepts(fmt, {"query": "Mercury (planet) history and science"})
    # without a description the added words are broad aspects: no invented or stray word
    for bad in ("What isoodieh-hijabah", "Mercury planet orbit", "Mercury (planet)",
                "Mercury (planet) orbit and surface", "Mercury (planet) that's-arapitcally"):
        assert not _accepts(fmt, {"query": bad}), bad
    described = SeedTopic(id="t", title="Mercury (planet)", description="Mercury has the smallest orbit of all.")
    fmt = small_format(ROOT_QUERY, TreeAsk(roles, seed=described)).json_schema
    assert _accepts(fmt, {"query": "Mercury (planet) smallest orbit"})
    assert not _accepts(fmt, {"query": "Mercury (planet) history"})  # the description's words only


def test_strict_child_queries_take_their_words_from_the_evidence_shown(embedder):
    from deepr.data.tree_roles import _decompose_check, TreeAsk

    roles = _roles(None, embedder)
    root = _decompose_fmt(roles, _ctx(), 3)
    # the shown words but the topic's and the parent query's (Lava molten rock expelled), dealt
    # out to the children
    ok = [{"facet": "comparison", "query": "Comparison of Volcano lava expelled"},
          {"facet": "risks", "query": "Risks of Volcano molten"},
          {"facet": "statistics", "query": "Statistics on Volcano rock"}]
    assert _accepts(root, ok) and _decompose_check(TreeAsk(roles, _ctx(), limit=3), {"queries": ok}) == []
    # SmolLM2's queries: an invented word repeated, a query without the topic ("Statistics on
    # 1983" under Hip-hop; grounding matched both to unrelated articles), one with nothing past
    # the topic, and one borrowing a sibling's word ("... Hip-hop culture" twice: redundant)
    # "rock rock": no more words than the share has (a query may not name one twice); "hazards":
    # the parent's word ("Hip-hop music" under "Hip-hop music" was dropped as redundant)
    for bad in ("Statistics on Volcano dejadores dejadores", "Statistics on lava", "Statistics on Volcano",
                "Statistics on Volcano molten", "Statistics on Volcano volcano", "Statistics on Volcano rock rock",
                "Statistics on Volcano hazards"):
        assert not _accepts(root, [*ok[:2], {"facet": "statistics", "query": bad}]), bad


def test_strict_ground_needs_a_document_and_prefers_ones_the_branch_has_not_used(embedder):
    from deepr.data.tree_roles import GROUND, TreeAsk

    roles = _roles(None, embedder)
    hits = [Hit(id=f"{d}#0", doc_id=d, title=d, text=f"{d} text.") for d in ("Lava", "Basalt", "Magma")]
    ctx = NodeCtx(query="Lava types", depth=1, phrase="Lava", root_topic="Volcano", hits=hits, seen_docs={"Lava"})
    arr = small_format(GROUND, TreeAsk(roles, ctx)).json_schema["properties"]["supporting"]
    assert arr["minItems"] == 1 and arr["items"]["enum"] == [2, 3]
    ctx.seen_docs = {"Lava", "Basalt", "Magma"}  # nothing new: any retrieved document may be chosen
    assert small_format(GROUND, TreeAsk(roles, ctx)).json_schema["properties"]["supporting"]["items"]["enum"] == [1, 2, 3]


def test_strict_decompose_format_splits_the_root_and_fixes_the_required_facets(embedder):
    from deepr.data.tree_roles import FACETS, _decompose_check, TreeAsk

    roles = _roles(None, embedder)
    root = _decompose_fmt(roles, _ctx(), 3)
    assert root["minItems"] == 3 and root["maxItems"] == 3
    firsts = [{alt["properties"]["facet"]["const"] for alt in p["anyOf"]} for p in root["prefixItems"]]
    assert firsts == [{"comparison", "alternatives"}, {"risks", "failures"}, {"quantitative data", "statistics"}]
    # any reply the format admits passes the facet check
    reply = {"queries": [{"facet": sorted(f)[0], "query": q} for q, f in
                         zip(["Alternatives to Volcano lava", "Problems with Volcano molten", "Numbers on Volcano rock"],
                             firsts)]}
    assert _decompose_check(TreeAsk(roles, _ctx(), limit=3), reply) == []
    # a child's query opens with its facet's words, so it cannot repeat the parent
    assert _accepts(root, reply["queries"]) and not _accepts(root, [{"facet": "alternatives", "query": "Volcano hazards"},
                                                                   *reply["queries"][1:]])
    deeper = NodeCtx(query="Lava flows", depth=1, phrase="Lava", root_topic="Volcano", hits=_ctx().hits)
    child = _decompose_fmt(roles, deeper, 2)
    assert child["minItems"] == 1 and child["maxItems"] == 2 and child["items"] is False
    first, second = ({alt["properties"]["facet"]["const"] for alt in p["anyOf"]} for p in child["prefixItems"])
    assert first | second == set(FACETS) and not first & second  # two children never share a facet
    pair = [{"facet": "stakeholders", "query": "People involved in Volcano lava"},
            {"facet": "timeline", "query": "History of Volcano flows"}]
    assert _accepts(child, pair) and _accepts(child, pair[:1])
    # SmolLM2's two-child split: the same facet twice, hence the same query twice
    assert not _accepts(child, [pair[0], pair[0]])
    assert _decompose_fmt(_roles(None, embedder, min_leaves=1), _ctx(), 3)["minItems"] == 1


def test_cli_shards_partition_the_topics(tmp_path: Path):
    from typer.testing import CliRunner

    from deepr.cli import app

    topics = tmp_path / "topics.txt"
    topics.write_text("\n".join(f"Topic {i}" for i in range(30)) + "\n")
    counts = []
    for k in (1, 2, 3):
        r = CliRunner().invoke(app, ["build-trees", "--topics", str(topics), "--out", str(tmp_path / "t.jsonl"),
                                     "--dry-run", "--shard", f"{k}/3"])
        assert r.exit_code == 0, r.output
        counts.append(int(next(line for line in r.output.splitlines() if "to do now" in line).split("│")[2]))
    assert sum(counts) == 30 and all(c > 0 for c in counts)


@pytest.mark.parametrize("args,message", [
    (["--branching", "6,x"], "expected comma-separated integers"),
    (["--branching", "6,0"], "give 1 to 12 children per level"),
    (["--topics", "missing.txt"], "no such topics file"),
    (["--shard", "4/3"], "need 1 <= K <= N"),
])
def test_cli_bad_flags_fail_cleanly(tmp_path: Path, args, message):
    from typer.testing import CliRunner

    from deepr.cli import app

    topics = tmp_path / "topics.txt"
    topics.write_text("Volcano\n")
    base = ["build-trees", "--out", str(tmp_path / "t.jsonl"), "--dry-run", "--topics", str(topics)]
    r = CliRunner().invoke(app, base + args)
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


def test_searches_asked_together_go_out_as_one_batch(volc):
    """Nodes that search while another search runs share the next search_many call, and each
    gets back exactly the hits of its own queries (issue 16: the tree's serial part)."""
    import time as _time
    from concurrent.futures import ThreadPoolExecutor

    from deepr.data.trees import SearchBatcher

    sizes: list[int] = []

    class Counting:
        def search_many(self, queries, k):
            sizes.append(len(queries))
            _time.sleep(0.05)  # long enough for the other nodes to queue behind the first call
            return volc.search_many(queries, k)

    pool = ThreadPoolExecutor(max_workers=1)

    async def main():
        loop = asyncio.get_running_loop()
        b = SearchBatcher(Counting(), lambda fn, *a: loop.run_in_executor(pool, fn, *a))
        asks = [["volcano eruption"], ["lava flow", "magma chamber"], ["plate tectonics"], ["ash cloud"]]

        async def late(q):  # asked while the first batch is running: waits for the next call
            await asyncio.sleep(0.02)
            return await b.search(q, 4)

        got = await asyncio.gather(*(b.search(q, 4) for q in asks[:3]), late(asks[3]))
        return asks, got, b.calls

    asks, got, calls = asyncio.run(main())
    pool.shutdown()
    assert calls == 2 and sizes == [4, 1]
    for qs, hits in zip(asks, got):
        assert [[h.id for h in hs] for hs in hits] == [[h.id for h in volc.search(q, 4)] for q in qs]


def test_a_failed_batched_search_reaches_every_waiting_node():
    from deepr.data.trees import SearchBatcher

    class Broken:
        def search_many(self, queries, k):
            raise RuntimeError("index file is gone")

    async def main():
        async def cpu(fn, *a):
            await asyncio.sleep(0)
            return fn(*a)

        b = SearchBatcher(Broken(), cpu)
        return await asyncio.gather(b.search(["a"], 2), b.search(["b"], 2), return_exceptions=True)

    out = asyncio.run(main())
    assert all(isinstance(e, RuntimeError) and "gone" in str(e) for e in out)


def test_strict_children_past_the_required_three_each_get_their_own_facets(embedder):
    from deepr.data.tree_roles import _decompose_check, TreeAsk

    roles = _roles(None, embedder)
    root = _decompose_fmt(roles, _ctx(), 5)
    assert len(root["prefixItems"]) == 5 and root["items"] is False
    facets = [{alt["properties"]["facet"]["const"] for alt in p.get("anyOf", [p])} for p in root["prefixItems"]]
    assert all(not (facets[i] & facets[j]) for i in range(5) for j in range(i + 1, 5))  # disjoint
    five = [{"facet": "comparison", "query": "Comparison of Volcano lava"},  # four words for five:
            {"facet": "risks", "query": "Risks of Volcano molten"},  # the fifth may add any real word
            {"facet": "statistics", "query": "Statistics on Volcano rock"},
            {"facet": "stakeholders", "query": "People involved in Volcano expelled"},
            {"facet": "timeline", "query": "History of Volcano eruptions"}]
    assert _accepts(root, five) and _decompose_check(TreeAsk(roles, _ctx(), limit=5), {"queries": five}) == []
    # SmolLM2 repeated a facet in the 4th and 5th children and wrote one query twice
    assert not _accepts(root, [*five[:4], {"facet": "stakeholders", "query": "People involved in Volcano"}])
