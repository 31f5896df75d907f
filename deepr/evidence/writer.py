"""The extractive writer: an MMR summary of cited evidence covering key points.

Used by every mode when no language model is configured, and as the recorded fallback
when a model's section never passes its checks. Each selected sentence keeps the id of
the snippet it came from, so the text is cited by construction.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import numpy as np

from deepr.text.lang import HAS_UNSPACED
from deepr.text import join_sentences, strip_citations

from deepr.evidence.citations import cited_ids
from deepr.evidence.env import Ctx, shares_words
from deepr.evidence.extract import mmr, split_sentences
from deepr.evidence.phrases import phrases

MIN_RELEVANCE = 0.25  # below this a sentence is off-topic filler, better left out
RELATIVE_FLOOR = 0.6  # ... and so is one far below the best match
# An ellipsis ends a sentence only after a non-ASCII character, so English ones ("wait…") stay as before.
_END = re.compile(r"((?:[.!?。！？；]|(?<=[^\x00-\x7f])…+)[\"'”’)」』）]*)\s*$")


def cite(sentence: str, cid: str) -> str:
    """Attach ``[cid]`` before the sentence's final punctuation, after a space in a language
    that separates words (``… plates [N1-R1].``), directly in one that does not (``…边界[N1-R1]。``)."""
    sentence = sentence.strip()
    m = _END.search(sentence)
    body, end = (sentence[:m.start()].rstrip(), m.group(1)) if m else (sentence, "")
    gap = "" if body and HAS_UNSPACED.match(body[-1]) else " "
    return f"{body}{gap}[{cid}]{end}"


def no_evidence(ctx: Ctx) -> str:
    """The note for a part with no evidence, in the run's question's language."""
    return phrases(ctx.tracer.query)["no_evidence"]


_LEADING_CITE = re.compile(r"^((?:\s*\[[^\[\]]+\])+)\s*")


def cited_sentences(text: str) -> list[str]:
    """Sentences of an already-cited text; a marker written after the full stop ("claim. [N1-R2]")
    is moved back onto the sentence it closes instead of opening the next one."""
    out: list[str] = []
    for s in split_sentences(text):
        m = _LEADING_CITE.match(s)
        if m and cited_ids(m.group(1)) and out:
            out[-1] = f"{out[-1]} {m.group(1).strip()}"
            s = s[m.end():]
        if s.strip():
            out.append(s.strip())
    return out


# A sentence opening with one of these points back to the one before it ("It occurs after
# autumn ..." is about the season its article named first): quoted alone it names nothing, or
# the wrong thing once it follows another source's sentence.
_LEANS_BACK = re.compile(r"^[\"'“‘(]*(?:it|its|this|these|those|they|their|them|he|his|him|she|her|such|"
                         r"the latter|the former)\b", re.I)
MAX_LEAD = 2  # earlier sentences a quote may carry to reach the one that names its subject


def leans_back(sentence: str) -> bool:
    """Whether ``sentence`` opens with a pronoun that refers to an earlier sentence."""
    return bool(_LEANS_BACK.match(sentence.strip()))


def _key(sentence: str) -> str:
    return " ".join(strip_citations(sentence).split())


def _with_lead(sents: Sequence[str], j: int) -> list[str] | None:
    """Sentence ``j`` with the sentences before it that it needs (back to one that does not lean
    back), or None when its source holds none: a quote must say what it is about."""
    start = j
    while start > 0 and j - start < MAX_LEAD and leans_back(sents[start]):
        start -= 1
    return None if leans_back(sents[start]) else list(sents[start:j + 1])


def _shares_id(a: str, b: str) -> bool:
    return bool(set(cited_ids(a)) & set(cited_ids(b)))


def _long_enough(plain: str) -> bool:
    """A sentence, not a fragment: over 20 characters (about four English words), or over 8 in
    a script without spaces, where each character carries about a word's worth."""
    return len(plain) > (8 if HAS_UNSPACED.search(plain) else 20)


def candidates(ctx: Ctx, ids: Sequence[str], cited_texts: Iterable[str] = (),
               avoid: Iterable[str] = ()) -> list[tuple[str, str]]:
    """(plain text, cited text) pairs from sources ``ids`` and already-cited texts.

    A candidate is self-contained: a source sentence that opens with a pronoun comes with the
    sentence(s) before it (and is left out when its source starts with it); in ``cited_texts``
    (earlier sections) it comes with the sentence before it when that one cites the same
    source. Sentences of ``cited_texts`` are kept only where they carry a citation; a candidate
    holding a sentence of ``avoid`` (texts used elsewhere in the report) is left out.
    """
    skip = {_key(s) for a in avoid for s in cited_sentences(a)}
    out: dict[str, str] = {}

    def add(group: Sequence[str], cited: Sequence[str]) -> None:
        if _long_enough(_key(group[-1])) and not any(_key(g) in skip for g in group):
            out.setdefault(" ".join(_key(g) for g in group), join_sentences(cited))

    for text in cited_texts:
        sents = cited_sentences(text)
        for j, s in enumerate(sents):
            if not cited_ids(s):
                continue
            group = sents[j - 1:j + 1] if j and leans_back(_key(s)) and _shares_id(sents[j - 1], s) else [s]
            add(group, group)
    for cid in ids:
        plain = [" ".join(s.split()) for s in ctx.sentences(cid)]
        for j in range(len(plain)):
            group = _with_lead(plain, j)
            if group is not None:
                add(group, [cite(g, cid) for g in group])
    return list(out.items())


def join(texts: Iterable[str], seen: set[str] | None = None) -> str:
    """Selected candidates as one paragraph, each sentence once: a sentence already written (in
    this paragraph or, via ``seen``, elsewhere in the report) is not repeated, and a sentence
    whose lead is already in this paragraph follows that lead instead of standing apart."""
    seen = set() if seen is None else seen
    out: list[str] = []
    keys: list[str] = []
    for text in texts:
        sents = cited_sentences(text)
        for j, s in enumerate(sents):
            k = _key(s)
            if k in keys or k in seen:
                continue
            lead = _key(sents[j - 1]) if j else None
            if lead is not None and lead not in keys and lead in seen:
                break  # its lead stands elsewhere in the report: the rest would name nothing
            at = keys.index(lead) + 1 if lead in keys else len(out)
            out.insert(at, s)
            keys.insert(at, k)
    seen.update(keys)
    return join_sentences(out)


def select(ctx: Ctx, cands: Sequence[tuple[str, str]], targets: Sequence[str], k: int,
           chosen: Sequence[int] = (), floor: float = MIN_RELEVANCE) -> list[int]:
    """Indices of ``k`` candidates: the best sentence for each target first, then MMR."""
    targets = [t for t in targets if t and t.strip()]
    if not cands or not targets or k <= 0:
        return []
    svec = ctx.encode([c[0] for c in cands])
    sim = np.clip(svec @ ctx.encode(list(targets)).T, 0.0, 1.0)
    # a question written without spaces: a sentence sharing none of its words is off-topic (the
    # question's words, not a node's key points, which are evidence sentences of any topic)
    shared = shares_words([c[0] for c in cands], [ctx.tracer.query], fallback=False)
    if shared is not None:
        sim[~np.asarray(shared)] = 0.0
    relevance = 0.5 * sim[:, 0] + 0.5 * sim.max(axis=1)
    picked = list(chosen)
    out: list[int] = []
    for t in range(1, sim.shape[1]):  # cover each key point with its best unused sentence
        order = [int(i) for i in np.argsort(-sim[:, t], kind="stable") if int(i) not in picked]
        if order and sim[order[0], t] >= 0.3 and len(out) < k:
            picked.append(order[0])
            out.append(order[0])
    # Relative floor: once a strong match exists, weak ones are filler even above the absolute floor.
    floor = max(floor, RELATIVE_FLOOR * float(relevance.max())) if floor > 0 else 0.0
    out += mmr(relevance, svec, k - len(out), lam=0.8, chosen=picked, min_relevance=floor)
    return out


def write(ctx: Ctx, targets: Sequence[str], ids: Sequence[str], k: int, *,
          cited_texts: Iterable[str] = (), avoid: Iterable[str] = ()) -> str:
    """One extractive paragraph answering ``targets[0]`` and covering ``targets[1:]``."""
    cands = candidates(ctx, ids, cited_texts, avoid)
    picked = select(ctx, cands, targets, k)
    return (join(cands[i][1] for i in picked) or no_evidence(ctx)) if picked else no_evidence(ctx)


def write_by_parts(ctx: Ctx, question: str, parts: Sequence[str], ids: Sequence[str], k: int, *,
                   cited_texts: Iterable[str] = ()) -> str:
    """An answer with one paragraph per sub-question (a single question: one paragraph)."""
    if len(parts) < 2:
        return write(ctx, [question], ids, k, cited_texts=cited_texts)
    cands = candidates(ctx, ids, cited_texts)
    used: list[int] = []
    paragraphs = []
    seen: set[str] = set()  # sentences of earlier paragraphs: a pair's lead may be one of them
    per = max(2, k // len(parts))
    for part in parts:
        picked = select(ctx, cands, [part, question], per, chosen=used)
        used += picked
        body = join((cands[i][1] for i in picked), seen) or no_evidence(ctx)
        paragraphs.append(f"**{part.strip()}** {body}")
    return "\n\n".join(paragraphs)
