"""Deterministic text tools behind the extractive roles of the agent (the extractive engine).

Sub-question splitting, distinctive terms, clustering of retrieval results and maximal
marginal relevance (MMR) over sentence embeddings. Everything here is pure: embeddings
come in as arrays (rows L2-normalised), so the same inputs always give the same output.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

from deepr.text.lang import HAS_UNSPACED, function_word
from deepr.text import STOP_WORDS, split_sentences, word_count, words

__all__ = ["split_sentences", "content_terms", "sub_questions", "distinctive_terms", "cluster",
           "mmr", "shorten", "approx_tokens", "focus_query", "anchored_query", "FRAMING"]

# Words that frame a request rather than name its subject; a search for them finds nothing useful.
FRAMING = frozenset("""compare comparison contrast explain describe discuss summarise summarize overview
idea ideas main role roles impact effects effect way ways kind kinds type types important importance
significance give list please cover need want write report short long make makes made famous""".split())
_ENTITY = re.compile(r"(?<![.!?]\s)(?<!^)\b[A-Z][\w'’-]+(?:\s+[A-Z][\w'’-]+)*")

CHARS_PER_WORD = 1.6  # a Chinese word is one to three characters, most often two or one
_LIST_ITEM = re.compile(r"^\s*(?:[-*+•]|\(?\d{1,2}[.)]|\(?[a-hA-H][.)])\s+")
_QUESTION_END = re.compile(r"(?<=[?？])\s*")


def content_terms(text: str) -> list[str]:
    """Content words in first-seen order (lower-cased, stop-words and 1-letter words dropped)."""
    seen: dict[str, None] = {}
    for w in words(text):
        if (len(w) > 1 or not w.isascii()) and w not in STOP_WORDS and (w.isascii() or not function_word(w)):
            seen.setdefault(w, None)
    return list(seen)


def shorten(text: str, max_words: int) -> str:
    """First ``max_words`` words of ``text`` on one line (an ellipsis marks a cut); in a script
    without spaces, where one "part" can be a whole paragraph, about as many words' characters."""
    if HAS_UNSPACED.search(text) and word_count(text) > max_words:
        flat = "".join(text.split()) if not re.search(r"[A-Za-z0-9] [A-Za-z0-9]", text) else " ".join(text.split())
        n = int(max_words * CHARS_PER_WORD)
        return flat if len(flat) <= n else flat[:n].rstrip() + "…"
    parts = " ".join(text.split()).split(" ")
    return " ".join(parts[:max_words]) + (" …" if len(parts) > max_words else "")


def approx_tokens(text: str) -> int:
    """Token estimate without a tokenizer: ~4/3 tokens per word, CJK characters count one each."""
    cjk = sum(1 for ch in text if "\u3040" <= ch <= "\u9fff" or "\uac00" <= ch <= "\ud7af")
    return int(len(text.split()) * 4 / 3) + cjk


def sub_questions(query: str, max_parts: int = 6) -> list[str]:
    """Split a multi-part request into its parts: list items, then separate questions.

    A single question comes back as ``[query]``; a long brief with a list of
    sub-questions comes back as the list (the lead paragraph is not a part of its own).
    """
    lines = [ln.strip() for ln in query.splitlines() if ln.strip()]
    items = [_LIST_ITEM.sub("", ln) for ln in lines if _LIST_ITEM.match(ln)]
    parts = [p for p in items if len(content_terms(p)) >= 2]
    if len(parts) < 2:
        pieces = [p.strip() for p in _QUESTION_END.split(" ".join(lines)) if p.strip()]
        parts = [p for p in pieces if p.endswith(("?", "？")) and len(content_terms(p)) >= 2]
    if len(parts) < 2:
        return [query.strip()]
    return parts[:max_parts]


def focus_query(query: str, max_words: int = 48) -> str:
    """A retrievable form of a long request: its first question or sentence, shortened.

    Dense encoders truncate long inputs silently; a focused query keeps the topic words.
    """
    text = " ".join(query.split())
    if word_count(text) <= max_words:
        return text
    first = next((s for s in split_sentences(text) if s.endswith(("?", "？"))), None)
    return shorten(first or text, max_words).rstrip(" …")


def anchored_query(query: str, missing: Sequence[str], max_terms: int = 7) -> str:
    """A follow-up query: the request's named entities (capitalised words) plus missing terms."""
    entities = [w for m in _ENTITY.finditer(" ".join(query.split())) for w in content_terms(m.group(0))]
    terms = list(dict.fromkeys(entities[:4] + list(missing)))
    return " ".join(terms[:max_terms])


def distinctive_terms(texts: Sequence[str], background: Sequence[str], k: int = 4,
                      exclude: Sequence[str] = ()) -> list[str]:
    """Terms frequent in ``texts`` but rare in ``background`` (a contrastive tf·idf)."""
    inside = Counter(w for t in texts for w in set(content_terms(t)))
    df = Counter(w for t in background for w in set(content_terms(t)))
    n = max(len(background), 1)
    skip = set(exclude)
    scored = [(c * np.log(1 + n / (1 + df[w])), w) for w, c in inside.items()
              if w not in skip and not w.isdigit()]
    scored.sort(key=lambda p: (-p[0], p[1]))
    return [w for _, w in scored[:k]]


def cluster(vecs: np.ndarray, n: int, order: Sequence[int] | None = None) -> list[list[int]]:
    """Deterministic clustering: farthest-point seeds (the first seed is ``order[0]``, the
    most relevant item), every item joins its most similar seed, two refinement passes.

    Returns clusters as lists of row indices, each sorted by ``order``; empty ones dropped.
    """
    m = len(vecs)
    if m == 0:
        return []
    order = list(order) if order is not None else list(range(m))
    rank = {i: r for r, i in enumerate(order)}
    n = max(1, min(n, m))
    seeds = [order[0]]
    while len(seeds) < n:
        best = np.max(vecs @ vecs[seeds].T, axis=1)
        cand = min(range(m), key=lambda i: (best[i], rank[i]))
        if best[cand] > 0.999:  # only duplicates left
            break
        seeds.append(cand)
    centroids = vecs[seeds]
    for _ in range(2):
        assign = np.argmax(vecs @ centroids.T, axis=1)
        groups = [[i for i in range(m) if assign[i] == c] for c in range(len(seeds))]
        groups = [g for g in groups if g]
        centroids = np.stack([vecs[g].mean(axis=0) for g in groups])
        centroids /= np.maximum(np.linalg.norm(centroids, axis=1, keepdims=True), 1e-9)
    assign = np.argmax(vecs @ centroids.T, axis=1)
    groups = [sorted((i for i in range(m) if assign[i] == c), key=rank.__getitem__)
              for c in range(len(centroids))]
    groups = [g for g in groups if g]
    groups.sort(key=lambda g: rank[g[0]])
    return groups


def mmr(relevance: np.ndarray, vecs: np.ndarray, k: int, lam: float = 0.7,
        chosen: Sequence[int] = (), min_relevance: float = 0.0, max_sim: float = 0.92) -> list[int]:
    """Maximal marginal relevance: pick ``k`` more items trading relevance against redundancy.

    ``chosen`` items count as already selected (they are not returned again). Items below
    ``min_relevance`` or nearly identical (cosine > ``max_sim``) to a picked one are skipped.
    """
    picked = list(chosen)
    out: list[int] = []
    pool = [i for i in range(len(relevance)) if i not in set(picked) and relevance[i] >= min_relevance]
    sims = vecs @ vecs.T if len(vecs) else np.zeros((0, 0))
    while pool and len(out) < k:
        if picked:
            red = np.max(sims[np.ix_(pool, picked)], axis=1)
        else:
            red = np.zeros(len(pool))
        score = lam * relevance[pool] - (1 - lam) * red
        j = int(np.argmax(score))
        i = pool.pop(j)
        if picked and red[j] > max_sim:
            continue
        picked.append(i)
        out.append(i)
    return out
