"""Text helpers every reward shares: content tokens, citation stripping, SQuAD
normalisation, sentence splitting, and one batched embedding lookup per call.

``tok(x)`` is the set the rewards use (DecomposeR Eq. 28): lower-cased content tokens of ``x`` after inline
citations are removed, without punctuation or stop-words. :class:`Vectors` embeds every
distinct text of one reward call in a single ``embed`` call and answers cosine queries
from that table, so a reward never encodes the same string twice.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from deepr.text.lang import HAS_UNSPACED, function_word, segment

Embed = Callable[[list[str]], np.ndarray]

# A compact English function-word list: enough that tok() keeps the words that carry content.
STOP_WORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being
below between both but by can could did do does doing down during each either few for from further
had has have having he her here hers herself him himself his how however i if in into is it its
itself just me more most my myself neither no nor not of off on once only or other our ours
ourselves out over own same she should so some such than that the their theirs them themselves then
there these they this those through thus to too under until up upon us very via was we were what
when where whether which while who whom whose why will with within without would yet you your yours
yourself yourselves s t d ll m re ve etc e g ie eg
""".split())

_CITE_TAG = re.compile(r"</?cite\b[^>]*>", re.I)
# Bracketed citation markers: [N1-R3], [N1-R3, N2-F1], [1], [^2], [Albert_Einstein#0].
# A marker must hold a digit, and a markdown link "[text](url)" is never one.
_ID = r"\^?[A-Za-z0-9_#.:/-]*\d[A-Za-z0-9_#.:/-]*"
CITE_MARKER = re.compile(rf"\[\s*({_ID}(?:\s*[,;]\s*{_ID})*)\s*\](?!\()")
_MD_LINK = re.compile(r"\[([^\]]+)\]\([^)\s]*\)")
_XML_TAG = re.compile(r"</?[A-Za-z][\w-]*(?:\s[^<>]*)?/?>")
_WORD = re.compile(r"[^\W_]+", re.UNICODE)
_HSPACE = re.compile(r"[ \t]+")
_SPACE_PUNCT = re.compile(r"[ \t]+([.,;:!?])")


_ANY_MARKER = re.compile(r"\[\s*([A-Za-z0-9_#.:/^-]+(?:\s*[,;]\s*[A-Za-z0-9_#.:/^-]+)*)\s*\](?!\()")


def find_markers(text: str, known: Iterable[str] | None = None) -> list[tuple[int, int, list[str]]]:
    """Bracketed citation markers as (start, end, ids). Without ``known`` a marker must hold a
    digit ([N1-R3], [1]); with it, a marker naming at least one known id counts too ([a, zz])."""
    known_set = set(known or ())
    out = []
    for m in _ANY_MARKER.finditer(text or ""):
        ids = marker_ids(m.group(1))
        if ids and (CITE_MARKER.fullmatch(m.group(0)) or any(i in known_set for i in ids)):
            out.append((m.start(), m.end(), ids))
    return out


def marker_ids(inner: str) -> list[str]:
    """Ids inside one bracketed marker's text ("N1-R3, N2-F1" → ["N1-R3", "N2-F1"])."""
    return [p.strip().lstrip("^") for p in re.split(r"[,;]", inner) if p.strip()]


def strip_citations(text: str) -> str:
    """Remove citation markers, markup tags and link targets, keeping the text and line breaks."""
    # Each pattern runs only on a text holding the characters it needs: this runs on every sentence
    # the agent compares and every text a reward tokenises, and most have no tag, link or marker.
    text = text or ""
    if "<" in text:
        text = _CITE_TAG.sub("", text)
    if "[" in text:
        text = CITE_MARKER.sub("", _MD_LINK.sub(r"\1", text))
    if "<" in text:
        text = _XML_TAG.sub(" ", text)
    if "\t" in text or "  " in text:
        text = _HSPACE.sub(" ", text)
    if any(f" {p}" in text for p in ".,;:!?"):
        text = _SPACE_PUNCT.sub(r"\1", text)
    return "\n".join(line.strip() for line in text.splitlines()).strip()


def words(text: str) -> list[str]:
    """Lower-cased word tokens (letters/digits runs), punctuation dropped; in a script without
    spaces, its words as deepr.text.lang.segment cuts them (jieba for Chinese, else bigrams)."""
    if text and not text.isascii() and HAS_UNSPACED.search(text):
        return segment(text)
    return _WORD.findall((text or "").lower())


def word_count(text: str) -> int:
    """Words in ``text``: its whitespace-separated parts, or, in a script without spaces, the
    words deepr.text.lang.segment cuts it into (a Chinese sentence is one "part")."""
    if text and not text.isascii() and HAS_UNSPACED.search(text):
        return len(segment(text))
    return len((text or "").split())


def tok(text: str) -> set[str]:
    """Normalised content tokens of ``text`` after citation stripping (the rewards' tok)."""
    found = words(strip_citations(text))
    if not text or text.isascii():  # tok runs on every text a reward scores: English takes the short way
        return {w for w in found if w not in STOP_WORDS}
    return {w for w in found if w not in STOP_WORDS and not function_word(w)}


def coverage(part: str, whole: str | set[str]) -> float | None:
    """|tok(part) ∩ tok(whole)| / |tok(part)|; None when ``part`` has no content token."""
    p = tok(part)
    if not p:
        return None
    w = whole if isinstance(whole, set) else tok(whole)
    return len(p & w) / len(p)


# --- SQuAD v1.1 answer normalisation ---------------------------------------------------

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def squad_normalize(s: str) -> str:
    """Lower-case, drop ASCII punctuation, articles → space, collapse whitespace."""
    s = (s or "").lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


# --- sentences -------------------------------------------------------------------------

_ABBREV = frozenset("e.g i.e etc vs dr mr mrs ms st no fig al approx cf jr sr inc ltd co u.s u.k".split())
_END = re.compile(r"[.!?]+[\"'”’)\]]*\s+")
_HEADING = re.compile(r"^\s{0,3}(#{1,6}\s|[-*_]{3,}\s*$|\|)")
_BULLET = re.compile(r"^\s*(?:[-*+•]|\d+[.)])\s+")
_CJK_CHARS = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_CJK_STOP = re.compile(f"[。！？；]|[{_CJK_CHARS}](?:…|\\.\\.\\.)")


def _is_abbrev(before: str) -> bool:
    last = before.rstrip(".!?\"'”’)]").split()[-1:] or [""]
    if last[0].startswith("["):  # "... [c]." ends a sentence with a citation, not an initial
        return False
    w = last[0].lower().strip("(\"'")
    return w in _ABBREV or (len(w) == 1 and w.isalpha())


# Where a sentence ends in a script without spaces: 。！？； (and an ellipsis after such a
# character), then closing quotes or brackets, then citation markers, which in these languages
# may follow the full stop and still belong to its sentence. No space or capital follows.
_CJK_END = re.compile(rf"(?:[。！？；]+|(?<=[{_CJK_CHARS}])(?:…+|\.{{3,}}))[」』”’）)\]】》]*"
                      rf"(?:\s*\[[^\[\]\n]*\d[^\[\]\n]*\](?!\())*")


def _ends(line: str) -> list[int]:
    """Offsets where the line's sentences end, in order."""
    ends, start = [], 0
    cjk = [m.end() for m in _CJK_END.finditer(line)] if _CJK_STOP.search(line) else []
    for m in _END.finditer(line):
        nxt = line[m.end():m.end() + 1]
        if not nxt or not (nxt.isupper() or nxt.isdigit() or nxt in "\"'“‘<[(*"):
            continue
        if cjk:  # the sentence before this full stop starts after any earlier CJK end
            start = max([start, *(c for c in cjk if c <= m.start())])
        if m.group(0).startswith(".") and _is_abbrev(line[start:m.start() + 1]):
            continue
        ends.append(m.end())
        start = m.end()
    return sorted(set(ends + cjk)) if cjk else ends


def _split_line(line: str) -> list[str]:
    out, start = [], 0
    for end in _ends(line):
        out.append(line[start:end].strip())
        start = end
    out.append(line[start:].strip())
    return [s for s in out if s]


_WIDE_END = re.compile(rf"[{_CJK_CHARS}\u3000-\u303f\uff01-\uff0f\uff1a-\uff20](?:\s*\[[^\[\]\n]*\])*\s*$")


def join_sentences(sentences: Iterable[str]) -> str:
    """Sentences as one paragraph: a space after each, except after a sentence in a script
    written without spaces (…边界[N1-R1]。印刷术…), which the next one follows directly."""
    out = ""
    for s in sentences:
        s = s.strip()
        if s:
            out += s if not out or _WIDE_END.search(out) else f" {s}"
    return out


def split_sentences(text: str, *, drop_headings: bool = True, paragraphs: bool = False) -> list[str]:
    """Sentences of prose or markdown; headings, rules and table rows are not sentences.

    ``paragraphs``: every character is kept and only a blank line breaks a sentence besides its
    end punctuation (the chunker: a line break inside a paragraph is wrapping, and a heading
    or list marker is part of the passage's text)."""
    if paragraphs:
        blocks = re.split(r"\n\s*\n", text or "")
        return [s for b in blocks if b.strip() for s in _split_line(" ".join(b.split("\n")))]
    out: list[str] = []
    for line in (text or "").splitlines():
        if not line.strip() or (drop_headings and _HEADING.match(line)):
            continue
        out.extend(_split_line(_BULLET.sub("", line)))
    return out


# --- embeddings ------------------------------------------------------------------------


class Vectors:
    """Embeddings of a fixed set of texts, computed with ONE ``embed`` call.

    ``embed`` must return one row per text; rows are re-normalised here so a cosine is a
    dot product even if an embedder forgets to normalise.
    """

    def __init__(self, embed: Embed, texts: Iterable[str]):
        uniq = list(dict.fromkeys(t for t in texts if t and t.strip()))
        self.index = {t: i for i, t in enumerate(uniq)}
        if not uniq:
            self.matrix = np.zeros((0, 1), dtype=np.float32)
            return
        mat = np.asarray(embed(uniq), dtype=np.float32)
        if mat.ndim != 2 or mat.shape[0] != len(uniq):
            raise ValueError(f"embedder returned shape {mat.shape} for {len(uniq)} texts; "
                             "it must return one row per text")
        norms = np.linalg.norm(mat, axis=1, keepdims=True)
        self.matrix = mat / np.where(norms > 0, norms, 1.0)

    def rows(self, texts: Sequence[str]) -> np.ndarray:
        try:
            return self.matrix[[self.index[t] for t in texts]]
        except KeyError as e:
            raise KeyError(f"text {e.args[0]!r} was not embedded in this call") from None

    def sim(self, a: Sequence[str], b: Sequence[str]) -> np.ndarray:
        """cos⁺ matrix (len(a) × len(b)); negative cosines clamp to 0."""
        if not a or not b:
            return np.zeros((len(a), len(b)), dtype=np.float32)
        return np.clip(self.rows(a) @ self.rows(b).T, 0.0, 1.0)

    def cos(self, a: str, b: str) -> float:
        return float(self.sim([a], [b])[0, 0])


def mean_pairwise(vectors: Vectors, texts: Sequence[str]) -> float | None:
    """Mean cos⁺ over unordered pairs i<j; None with fewer than two texts."""
    if len(texts) < 2:
        return None
    m = vectors.sim(texts, texts)
    iu = np.triu_indices(len(texts), k=1)
    return float(m[iu].mean())


def diminishing(k: int) -> float:
    """f(k) = max(0, 1 − 1/max(k, 1)): most of the gain from 1 → 2, then saturating."""
    return max(0.0, 1.0 - 1.0 / max(k, 1))


# Sections a deepr report writes by code, not claims: the question, the plan table and its
# waves, the tool-call log and the reference list (deepr.agent.runner / render).
# Their Chinese and Japanese headings are deepr/evidence/phrases.py's.
_SCAFFOLD = frozenset({"question", "research plan", "tool calls", "references", "问题", "研究计划", "工具调用",
                       "参考文献", "質問", "調査計画", "ツール呼び出し"})
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")


def report_prose(report: str) -> str:
    """``report`` with what is not a claim blanked out (same length, so offsets hold): headings,
    the code-written sections (Question, Research plan, Tool calls, References) and the
    provenance notes quoted under the title. Metrics score claims, not the report's frame."""
    out, skip, seen_section = [], False, False
    for line in (report or "").split("\n"):
        s = line.strip()
        m = _HEADING.match(s)
        if m:
            if len(s) - len(s.lstrip("#")) > 1:  # a section: the title (level 1) opens none
                seen_section, skip = True, m.group(1).lower() in _SCAFFOLD
        if m or skip or (s.startswith(">") and not seen_section):
            out.append(" " * len(line))
        else:
            out.append(line)
    return "\n".join(out)
