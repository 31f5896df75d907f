"""The short-answer role without a model (``deepr run --answer short``).

- explanation: the draft's first cited sentences (up to three), each keeping its ids; a draft
  that cites nothing is explained by the best-matching evidence sentence with its id;
- exact answer: the sentence closest to the question, its citations removed, cut to twelve words
  (the engine cannot compose a shorter phrase than the evidence states), its source's title
  first when it opens with a pronoun;
- confidence: the cosine of that sentence and the question, as a percentage (0 when nothing
  was found), so an answer far from the question admits it.
"""

from __future__ import annotations

from typing import Any

from deepr.evidence import writer
from deepr.evidence.citations import cited_ids
from deepr.evidence.extract import shorten
from deepr.text import strip_citations

EXACT_WORDS = 12
PRONOUNS = frozenset("it its he his she her they their this these".split())


def _sentences(a: Any) -> list[str]:
    cited = [s for s in writer.cited_sentences(a.draft or "") if cited_ids(s)]
    if cited:
        return cited
    out = []
    for cid in a.ids:
        first = next(iter(a.ctx.sentences(cid)), "").strip()
        if first:
            out.append(f"{first.rstrip('.')} [{cid}].")
    return out


def short_reply(a: Any) -> dict[str, Any]:
    sents = _sentences(a)
    if not sents:
        return {"explanation": "The searches returned no evidence for this question.",
                "exact_answer": "No answer found", "confidence": 0}
    plain = [strip_citations(s).strip() for s in sents]
    sims = a.ctx.encode(plain) @ a.ctx.encode([a.query])[0]
    best = int(sims.argmax())
    exact = _named(a, sents[best], shorten(plain[best].rstrip("."), EXACT_WORDS))
    return {"explanation": " ".join(sents[:3]), "exact_answer": exact,
            "confidence": max(0, min(100, round(float(sims[best]) * 100)))}


def _named(a: Any, sentence: str, exact: str) -> str:
    """An answer opening with a pronoun ("Its 1815 eruption …") names its source's title."""
    ids = [c for c in cited_ids(sentence) if c in a.ctx.catalog]
    title = a.ctx.catalog[ids[0]].title.strip() if ids else ""
    if title and exact.split(" ", 1)[0].lower() in PRONOUNS:
        exact = f"{title}: {exact}"
    return exact.replace("[", "(").replace("]", ")")
