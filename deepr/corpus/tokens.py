"""BM25 tokens per language: a corpus is indexed and queried with the same tokenizer.

``en`` (every language that separates words with spaces) keeps the tokens deepr always used:
lower-cased ``\\w+`` runs without English stop words, so English indexes and their rankings
are unchanged. Chinese is segmented by jieba and loses its function words (deepr.text.lang.ZH_STOP);
Japanese, Thai and the other scripts without spaces become character bigrams
(deepr/text/lang.py). The language is part of the index key (deepr/corpus/index.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from deepr.text.lang import UNSPACED, ZH_STOP, segment

_WORD = re.compile(r"\w+")


def _english_stop() -> frozenset[str]:
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


def tokenize(texts: Sequence[str], language: str = "en") -> list[list[str]]:
    """BM25 tokens of each text: lower-cased words without stop words (digits count: '0', '1')."""
    stop = _english_stop()
    if language not in UNSPACED:
        return [[w for w in _WORD.findall(t.lower()) if w not in stop] for t in texts]
    stop = stop | ZH_STOP if language == "zh" else stop
    return [[w for w in segment(t, language) if w not in stop] for t in texts]
