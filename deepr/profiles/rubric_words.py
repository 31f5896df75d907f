"""Distinct criterion descriptions by construction, for synthesize-rubrics' strict format.

The duplicate check (:func:`deepr.roles.rubric_checks.duplicate_pairs`) rejects two criteria whose
content words overlap (Jaccard) at 0.8 or more. SmolLM2 under the strict format kept writing one
description for two slots. Seen on a Chronology leaf: R3's evidence opened "Chronology is the
science", R4's "It is also the"; R4 then repeated R3's words, and all 3 attempts failed the check.
So each description is built from closed vocabularies instead of free words:

- a factual description opens with a short window of its own statement that holds up to 3
  content tokens no other criterion can write ("exclusive"), and goes on only with words of its
  statement and a few link words (``LINK_WORDS``);
- the logical description opens with a reasoning phrase (``LOGIC_OPENINGS``) and goes on only
  with link words, reasoning words and the words of the topic and root query.

A token of one criterion's statement that no other criterion's vocabulary contains can only
appear in that criterion. With ``e_i`` and ``e_j`` such tokens forced into two descriptions that
share at most ``s`` tokens, their Jaccard is at most ``s / (s + e_i + e_j)``: with 3 + 3 forced
and at most 24 words, below 0.8. :func:`overlap_bound` gives that bound for a planned set. The
check itself is unchanged and still runs on every reply.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from deepr.text import tok

# A description's words are whole words of the text they come from; a word mixing letters and
# digits ("B12", "n0.2") is left out, as formats.WORD does, so no id-like word can be written.
_TOKEN = re.compile(r"[^\W_]+(?:['-][^\W_]+)*")
_MIXED = re.compile(r"[A-Za-z][0-9]|[0-9](?!s\b)[A-Za-z]")
LINK_WORDS = ("the", "a", "an", "of", "in", "on", "at", "to", "for", "by", "with", "and", "or", "as", "is",
              "was", "are", "were", "that", "its", "their", "from", "answer", "states", "mentions", "notes")
LOGIC_OPENINGS = ("Compares and weighs", "Weighs and contrasts", "Contrasts and relates", "Relates and compares")
LOGIC_WORDS = ("how", "why", "whether", "because", "while", "both", "differ", "differences", "together",
               "relation", "causes", "effects", "significance", "sources", "against", "each", "other")
FORCED = 3  # exclusive tokens forced into each description
MAX_STEPS = 6  # words (each with an optional link word) after a description's opening


def clean_words(s: str) -> list[str]:
    return [w for w in _TOKEN.findall(s) if not _MIXED.search(w)]


def _toks(words: Sequence[str]) -> set[str]:
    return tok(" ".join(words))


def _alternation(words: Sequence[str]) -> str:
    unique = sorted(dict.fromkeys(words), key=lambda w: (-len(w), w))
    return "(?:" + "|".join(unique) + ")"


def statement_vocab(statement: str) -> list[str]:
    return list(dict.fromkeys([*clean_words(statement), *LINK_WORDS]))


def logic_vocab(context: str) -> list[str]:
    return list(dict.fromkeys([*clean_words(context), *LINK_WORDS, *LOGIC_WORDS]))


def forced_window(statement: str, exclusive: set[str], most_words: int = 12) -> list[str]:
    """The shortest run of the statement's words holding min(FORCED, available) exclusive tokens
    (fewer when no run of ``most_words`` holds that many); its first 4 words when none is exclusive."""
    words = clean_words(statement)
    per_word = [tok(w) & exclusive for w in words]
    available = len(set().union(*per_word)) if per_word else 0
    for need in range(min(FORCED, available), 0, -1):
        best: tuple[int, int] | None = None
        for a in range(len(words)):
            seen: set[str] = set()
            for b in range(a, min(len(words), a + most_words)):
                seen |= per_word[b]
                if len(seen) >= need:
                    if best is None or b - a < best[1] - best[0]:
                        best = (a, b)
                    break
        if best:
            return words[best[0]:best[1] + 1]
    return words[:4]


def exclusive_tokens(pools: Sequence[Sequence[str]], context: str) -> list[list[set[str]]]:
    """For each factual slot (its pool of alternative statements) and each statement: the tokens
    of the statement that neither another slot's vocabulary nor the logical one can write."""
    slot_toks = [set().union(*(_toks(statement_vocab(s)) for s in pool)) if pool else set() for pool in pools]
    logic = _toks(logic_vocab(context)) | _toks(LOGIC_OPENINGS)
    out = []
    for i, pool in enumerate(pools):
        others = logic.union(*(t for j, t in enumerate(slot_toks) if j != i))
        out.append([tok(s) - others for s in pool])
    return out


def _steps(content: Sequence[str], links: Sequence[str], lo: int, hi: int) -> str:
    """``lo`` to ``hi`` steps, each up to two link words then a content word: link words cannot
    run on (SmolLM2 filled a description with "the the the ...")."""
    link = _alternation(links)
    return rf"(?:,? (?:{link} ){{0,2}}{_alternation(content)}){{{lo},{hi}}}"


def _content(words: Sequence[str]) -> list[str]:
    links = {w.lower() for w in LINK_WORDS}
    return [w for w in dict.fromkeys(words) if w.lower() not in links]


def factual_pattern(statement: str, exclusive: set[str], hi: int) -> str:
    window = forced_window(statement, exclusive)
    content = _content(clean_words(statement))
    # a step writes up to three words; a short tail keeps a greedy small model from looping
    room = max(0, min(MAX_STEPS, (hi - len(window)) // 3))
    lo = min(room, max(0, 4 - len(window)))
    if not content:
        return rf"{' '.join(window)}\.?"
    return rf"{' '.join(window)}{_steps(content, LINK_WORDS, lo, room)}\.?"


def logic_openings(pools: Sequence[Sequence[str]]) -> list[str]:
    """The reasoning openings none of whose content tokens a factual vocabulary can write."""
    factual = set().union(*(_toks(statement_vocab(s)) for pool in pools for s in pool))
    keep = [o for o in LOGIC_OPENINGS if not tok(o) & factual]
    return keep or list(LOGIC_OPENINGS)


def logical_pattern(pools: Sequence[Sequence[str]], context: str, hi: int) -> str:
    opening = "(?:" + "|".join(logic_openings(pools)) + ")"
    content = _content([*clean_words(context), *LOGIC_WORDS])
    # 2 to 4 steps: a reasoning phrase, not a list (SmolLM2 looped "against in a against in a ...")
    return rf"{opening}{_steps(content, LINK_WORDS, 2, max(2, min(4, (hi - 3) // 3)))}\.?"


def overlap_bound(pools: Sequence[Sequence[str]], context: str, hi: int) -> float:
    """The largest Jaccard any two descriptions of these slots can reach, over every choice of
    statements (see the module doc); the logical slot counts as one more slot. Two descriptions
    share at most the tokens both vocabularies hold, and no more than the shorter's free words."""
    excl = exclusive_tokens(pools, context)
    logic = _toks(logic_vocab(context)) | _toks(LOGIC_OPENINGS)
    factual = set().union(*(_toks(statement_vocab(s)) for pool in pools for s in pool))
    e_logic = min(len(tok(o) - factual) for o in logic_openings(pools))
    # (vocabulary tokens, forced exclusive tokens) per choice, grouped by slot
    slots = [[(_toks(statement_vocab(s)), len(tok(" ".join(forced_window(s, e))) & e)) for s, e in zip(pool, es)]
             for pool, es in zip(pools, excl)] + [[(logic, e_logic)]]
    worst = 0.0
    for i in range(len(slots)):
        for j in range(i + 1, len(slots)):
            for (vi, ei) in slots[i]:
                for (vj, ej) in slots[j]:
                    shared = min(len(vi & vj), hi - min(ei, ej))
                    total = shared + ei + ej
                    worst = max(worst, shared / total if total else 1.0)
    return worst


QUESTION_OPENERS = ("How", "What", "Why", "Which", "To what extent")
QUESTION_WORDS = ("do", "does", "did", "can", "between", "about", "how", "why", "what", "which", "compare",
                  "differ", "relate", "explain", "shape", "affect")


def question_pattern(statements: Sequence[str], context: str, lo: int, hi: int) -> str:
    """The question: a question word, then words of the selected leaves' statements, the topic and
    a few question words (SmolLM2's free question ended in "thes-saysitagfthn?")."""
    content = _content([*clean_words(context), *(w for s in statements for w in clean_words(s))])
    links = [*LINK_WORDS, *QUESTION_WORDS]
    steps_hi = max(lo, (hi - 3) // 3)
    return rf"(?:{'|'.join(QUESTION_OPENERS)}){_steps(content or list(QUESTION_WORDS), links, max(1, lo - 1), steps_hi)}\?"
