"""Chunking: documents -> passages with stable ids ``<doc_id>#<k>`` (k counts from 0).

Passages are word windows of at most ``max_words`` that end on sentence boundaries where
possible; consecutive passages of one document share up to ``overlap`` words (whole trailing
sentences when they fit) so a fact cut at a boundary is still found whole in one passage.
A sentence longer than a window is split into word windows with the same overlap.
Sentences are deepr.text.split_sentences' (one splitter for every stage). In a document
written in a script without spaces (Chinese, Japanese, Thai: deepr.text.lang), a "word" is one
character, whitespace aside — about one model token, as an English word is about 1.3 — and
sentences join with no space between them.

Inputs: ``list[Document]``; output: ``list[Passage]`` (blank documents yield none).

Example::

    python -c "from deepr.corpus import load_documents, chunk_documents; \
print(len(chunk_documents(load_documents('wiki', limit=100))))"
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deepr.text.lang import HAS_UNSPACED, UNSPACED, detect_language
from deepr.records import Document, Passage
from deepr.text import split_sentences as _split


class ChunkConfig(BaseModel):
    """How documents are cut into passages; part of the index cache key."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_words: int = Field(120, ge=8, le=2000, description="Most words in one passage.")
    overlap: int = Field(20, ge=0, description="Words repeated from the end of the previous passage "
                                                 "(whole sentences when they fit); must be < max_words/2.")

    @model_validator(mode="after")
    def _overlap_leaves_room(self) -> ChunkConfig:
        if self.overlap * 2 > self.max_words:
            raise ValueError(f"chunking overlap {self.overlap} is more than half of max_words "
                             f"{self.max_words}; lower --overlap or raise --max-words")
        return self


def split_sentences(text: str) -> list[str]:
    """Sentences of a passage's text: a blank line or end punctuation ends one; every
    character is kept (deepr.text.split_sentences in paragraph mode)."""
    return _split(text, paragraphs=True)


def unspaced(text: str) -> bool:
    """Whether ``text`` is written in a script without spaces between words."""
    return bool(HAS_UNSPACED.search(text[:4000])) and detect_language(text) in UNSPACED


def _pieces(sentence: str, by_char: bool) -> list[str]:
    if not by_char:
        return sentence.split()
    # characters, each keeping the whitespace before it, so joining them restores the sentence
    out: list[str] = []
    pending = ""
    for ch in sentence:
        if ch.isspace():
            pending = " "
        else:
            out.append(pending + ch if out else ch)
            pending = ""
    return out


def _units(text: str, cfg: ChunkConfig, by_char: bool = False) -> list[list[str]]:
    """Sentences as word lists; an over-long sentence becomes several overlapping windows."""
    out: list[list[str]] = []
    step = cfg.max_words - cfg.overlap
    for sentence in split_sentences(text):
        words = _pieces(sentence, by_char)
        if len(words) <= cfg.max_words:
            out.append(words)
            continue
        for start in range(0, len(words), step):
            out.append(words[start:start + cfg.max_words])
            if start + cfg.max_words >= len(words):
                break
    return out


def _tail(chunk: list[list[str]], budget: int) -> list[list[str]]:
    """Trailing whole units of a chunk that fit in ``budget`` words (the overlap carried over)."""
    kept: list[list[str]] = []
    used = 0
    for unit in reversed(chunk):
        if used + len(unit) > budget:
            break
        kept.insert(0, unit)
        used += len(unit)
    return kept


def chunk_text(text: str, cfg: ChunkConfig | None = None) -> list[str]:
    """Pack sentences into windows of at most ``max_words`` words (characters where words are not
    space-separated), of balanced length.

    Balancing avoids a 120-word passage followed by a stub of overlap plus a few new
    words: a 130-word text becomes two passages of about 75 words, not 120 + 30.
    """
    cfg = cfg or ChunkConfig()
    by_char = unspaced(text)
    units = _units(text, cfg, by_char)
    total = sum(map(len, units))
    step = cfg.max_words - cfg.overlap
    n = max(1, -(-max(0, total - cfg.overlap) // step))
    target = -(-(total + (n - 1) * cfg.overlap) // n)
    chunks: list[list[list[str]]] = []
    current: list[list[str]] = []
    fresh = 0  # units in `current` that no earlier chunk contains
    for unit in units:
        size = sum(map(len, current))
        if fresh and (size + len(unit) > cfg.max_words or size >= target):
            chunks.append(current)
            current = _tail(current, cfg.overlap)
            # a carried tail that would not leave room for the next unit is dropped
            if sum(map(len, current)) + len(unit) > cfg.max_words:
                current = []
            fresh = 0
        current.append(unit)
        fresh += 1
    if fresh:
        chunks.append(current)
    if by_char:  # a window may start inside a sentence: the space it kept goes
        return ["".join(p for unit in chunk for p in unit).strip() for chunk in chunks]
    return [" ".join(w for unit in chunk for w in unit) for chunk in chunks]


def chunk_document(doc: Document, cfg: ChunkConfig | None = None) -> list[Passage]:
    return [
        Passage(id=f"{doc.id}#{k}", doc_id=doc.id, title=doc.title, text=text, url=doc.url)
        for k, text in enumerate(chunk_text(doc.text, cfg))
    ]


def chunk_documents(docs: Iterable[Document], cfg: ChunkConfig | None = None) -> list[Passage]:
    cfg = cfg or ChunkConfig()
    return [p for d in docs for p in chunk_document(d, cfg)]
