"""The small profile's per-call formats of the dataset roles (tree building, rubric synthesis,
the verify audit): bounded real-word queries, document numbers that exist, statements chosen
among a document's own sentences, rubric pairs whose structure code fixes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepr.data import rubrics, tree_roles
from deepr.data.tree_roles import FACETS, OPENERS, REQUIRED_FACETS, TreeAsk, _root_limit, facet_group
from deepr.data.verify import AUDIT, AUDIT_TAGS, AuditAsk
from deepr.llm.base import OutputFormat
from deepr.records import Hit
from deepr.profiles.formats import (PHRASE, QUERY_WORD, content_words, literal, search_query, text, vocab_size,
                                    word_alternation)
from deepr.profiles.rubrics_strict import distinct_statements, strict_format, strict_messages, strict_plan
from deepr.text import split_sentences

# The words a root query may add to its seed's title when the seed has no description: broad
# aspects of a topic as a whole. Free words gave "Hip-hop is a genre of music that's-arapitcally",
# and its children searched for the invented word.
ROOT_WORDS = ("history", "origins", "development", "culture", "society", "influence", "impact", "role",
              "science", "economics", "politics", "technology", "evolution", "significance", "overview",
              "characteristics", "legacy", "and", "its", "of", "in", "the")


def _root_format(a: TreeAsk) -> OutputFormat:
    """The seed's title and a few words about it: SmolLM2 otherwise wrote "What isoodieh-hijabah"
    for "Hip-hop", and every child then repeated it (issue 14). The added words come from the
    seed's description, or are broad aspects (``ROOT_WORDS``)."""
    title, limit = " ".join(a.seed.title.split()), _root_limit(a)
    n = len(title.split())
    if '"' in title or n + 1 >= limit:
        return _json("root_query", {"query": _str(search_query((2, limit - 1)))}, distinct_words=True)
    # distinct words (SmolLM2 wrote "Domestic turkey in the science of science"), so no more
    # of them than there are: past that, the ban on a repeat gives way (see SIBLING_WORDS)
    own = content_words([a.seed.description or ""], skip=title.split())
    words = word_alternation(own) if len(own) >= 2 else "(?:" + "|".join(ROOT_WORDS) + ")"
    most = min(6, vocab_size(words) or 6, limit - 1 - n)  # ROOT_WORDS hold stop words, which may repeat
    return _json("root_query", {"query": _str(rf"{literal(title)}(?: {words}){{1,{most}}}")}, distinct_words=True)


def _str(pattern: str) -> dict[str, Any]:
    return {"type": "string", "pattern": f"^{pattern}$"}


def _json(name: str, props: dict[str, Any], distinct_words: bool = False) -> OutputFormat:
    return OutputFormat(name, json_schema={"type": "object", "properties": props, "required": list(props),
                                           "additionalProperties": False}, distinct_words=distinct_words)


def _sentences(hit: Hit) -> list[str]:
    return list(dict.fromkeys(s.strip() for s in split_sentences(hit.text or "") if 20 <= len(s.strip()) <= 400))


# Most words of its own a sibling query adds after its opener and the topic. The decoder keeps a
# query from naming a word twice, and a sibling's share of the shown words is small: SmolLM2 used
# its share up, wrote a space, and every word the grammar then allowed was banned, so the ban gave
# way ("... meleagris raised fowl meleagris raised").
SIBLING_WORDS = 3


def _child_words(a: TreeAsk, part: tuple[int, int] = (0, 1)) -> str:
    """The words a child query may add after its facet opener: those of the
    statements and evidence shown in the prompt, less the words of the topic (the query holds
    it already) and of the parent's and ancestors' queries (with them SmolLM2 wrote "Hip-hop
    music" under "Hip-hop music", dropped as redundant), or any real word when they are too
    few; with ``part``, one sibling's share of them (formats.content_words)."""
    ctx, r = a.ctx, a.roles
    shown = [f"{h.title} {h.text[:r.snippet_chars // 2]}" for h in (ctx.hits[i] for i in ctx.support)]
    skip = [w for q in (ctx.root_topic, ctx.query, *ctx.path) for w in content_words([q], most=99)]
    words = content_words([*ctx.statements[:8], *shown], part=part, skip=skip)
    return word_alternation(words) if len(words) >= (1 if part[1] > 1 else 3) else QUERY_WORD


def _child(a: TreeAsk, facets: Sequence[str], words: str, least: int = 0, most: int | None = None) -> dict[str, Any]:
    """A child sub-query: its facet first, then a query opening with that facet's words and the
    tree's topic, then ``least`` to ``most`` of ``words`` (no more than there are). Without the
    topic SmolLM2 wrote "Statistics on 1983" under "Hip-hop", and grounding found an article on
    statistics."""
    topic = " ".join(a.ctx.root_topic.split())
    def one(f: str) -> dict[str, Any]:
        opener = "(?:" + "|".join(OPENERS[f]) + ")"
        rest = max(1, a.roles.max_words - max(len(o.split()) for o in OPENERS[f]))
        n, count = len(topic.split()), vocab_size(words) or rest
        hi = max(least, 1, min(rest - n, count, most or rest))
        tail = (rf" {literal(topic)}(?: {words}){{{least},{hi}}}" if topic and '"' not in topic and n < rest
                else rf"(?: {words}){{1,{max(1, min(rest, count))}}}")
        return {"type": "object", "required": ["facet", "query"], "additionalProperties": False,
                "properties": {"facet": {"const": f}, "query": _str(opener + tail)}}
    return {"anyOf": [one(f) for f in facets]} if len(facets) > 1 else one(facets[0])


def _decompose_format(a: TreeAsk) -> OutputFormat:
    """Children with facets from the prompt's list, each sibling with facets and words of its
    own: it opens with its facet's words, so no two can be the same query, and adds at least one
    word no sibling may use, so no two differ by their openers alone (with the tree's topic in
    every child, SmolLM2 wrote one query twice, then "Comparison of Hip-hop culture" beside
    "Statistics on Hip-hop culture", cosine 0.85: redundant). Where three or more are allowed
    the first three are the required comparison, risks and quantitative facets, so the facet
    check holds by construction. The root must split (a one-leaf tree is rejected anyway): it
    gets at least three children, or ``min_leaves``, within the branching limit, so some
    survive grounding."""
    hi = max(1, a.limit)
    lo = min(hi, max(3, a.roles.min_leaves)) if a.ctx.depth == 0 and a.roles.min_leaves >= 2 else 1
    arr: dict[str, Any] = {"type": "array", "minItems": lo, "maxItems": hi, "items": _child(a, FACETS, _child_words(a))}
    groups: list[Sequence[str]] = []
    if hi >= 3:
        groups = [[f for f in FACETS if facet_group(f) == g] for g in REQUIRED_FACETS]
        # past the required three, each child gets its own share of the other facets
        others = [f for f in FACETS if facet_group(f) is None]
        extra = min(hi - 3, len(others))
        groups += [others[k::extra] for k in range(extra)]
    elif hi == 2:
        groups = [FACETS[0::2], FACETS[1::2]]
    if groups:
        arr["prefixItems"] = [_child(a, g, _child_words(a, (k, len(groups))), least=1, most=SIBLING_WORDS)
                              for k, g in enumerate(groups)]
        if len(groups) >= hi:
            arr["items"] = False
    # no word twice in a query: SmolLM2 wrote "Comparison of Domestic turkey one domestic one"
    return _json("decompose", {"queries": arr}, distinct_words=True)


def _ground_format(a: TreeAsk) -> OutputFormat:
    """Document numbers that exist, at least one: the documents come ranked by retrieval, and a
    small model that answers [] (its easiest reply) would end every branch. Documents the
    branch's ancestors already use are left out while others remain: SmolLM2 grounded every
    child in the root's article, quoted the root's sentences, and the children were dropped as
    adding nothing new (issue 14)."""
    ctx = a.ctx
    fresh = [k for k, h in enumerate(ctx.hits, start=1) if h.doc_id not in ctx.seen_docs]
    return _json("ground", {"supporting": {
        "type": "array", "minItems": 1, "maxItems": max(1, a.roles.max_docs),
        "items": {"enum": fresh or list(range(1, len(ctx.hits) + 1))}}})



def _gate(a: TreeAsk) -> OutputFormat:
    return _json("gate", {"atomic": {"type": "boolean"}, "reason": _str(PHRASE)})


def _extract(a: TreeAsk) -> OutputFormat | None:
    sentences = _sentences(a.hit)
    return _json("extract", {"statements": {"type": "array", "minItems": 1, "maxItems": max(1, a.roles.max_statements),
                                            "items": {"enum": sentences}}}) if sentences else None


def _audit_format(a: AuditAsk) -> OutputFormat:
    """The strict audit (``--formats strict``): a decision, up to three known tags and a few
    bounded words. Under the reply's own schema SmolLM2 wrote 3,731 tokens for one pair (414 s,
    one reply rejected). Writing revised criteria is left to models that can: the decision is
    KEEP or DROP, and the code checks still drop a kept pair that fails them (``_decide``)."""
    phrase = text(PHRASE)
    return OutputFormat("verify.audit.strict", json_schema={
        "type": "object", "additionalProperties": False,
        "required": ["decision", "error_tags", "major_issues", "justification"],
        "properties": {"decision": {"enum": ["KEEP", "DROP"]},
                       "error_tags": {"type": "array", "maxItems": 3, "items": {"enum": list(AUDIT_TAGS)}},
                       "major_issues": {"type": "array", "maxItems": 2, "items": phrase},
                       "justification": phrase}})



def _synth_precheck(a: Any) -> str | None:
    """No strict pair can be built: say so instead of spending a long generation."""
    if strict_plan(a.compact, a.cfg.n_select, a.cfg.limits) is not None:
        return None
    own = sum(1 for st in distinct_statements(a.compact).values() if st)
    return (f"the tree has {own} leaf/leaves with statements of their own (the others repeat an earlier leaf's); "
            f"a pair selects at least {a.cfg.limits.min_selected} (limits.min_selected)")


STRICT = {
    tree_roles.ROOT_QUERY: _root_format, tree_roles.GATE: _gate, tree_roles.DECOMPOSE: _decompose_format,
    tree_roles.GROUND: lambda a: _ground_format(a) if a.ctx.hits else None, tree_roles.EXTRACT: _extract,
    AUDIT: _audit_format,
    rubrics.SYNTHESIZE: lambda a: strict_format(a.compact, a.cfg.n_select, a.cfg.limits),
}
MESSAGES = {rubrics.SYNTHESIZE: lambda a: strict_messages(a.compact, a.cfg.n_select, a.cfg.limits)}
PRECHECK = {rubrics.SYNTHESIZE: _synth_precheck}
