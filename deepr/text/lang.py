"""Languages and the word units of their texts: which script a text is written in, and how it
splits into the words that BM25, the rewards' ``tok`` and the extractive engine count.

Most languages separate words with spaces; Chinese, Japanese, Thai, Lao, Khmer and Burmese do
not, so a whitespace or ``\\w+`` tokenizer reads a whole Chinese clause as one "word".
``detect_language`` names the script a text is mostly written in (by counting characters, no
model): ``zh``, ``ja`` (kana present), ``th``/``lo``/``km``/``my``, else ``en`` — every
language whose words are separated by spaces, tokenized as before. ``segment`` cuts a text
into words the way its language needs: Chinese with the jieba segmenter (search mode, which
also yields the shorter words inside a long one), other scripts without spaces into character
bigrams (within runs of one script: kanji, hiragana, katakana, Thai), and any run of Latin
letters or digits inside them as one word.

Example::

    python -c "from deepr.text.lang import detect_language, segment; \
print(detect_language('火山为什么会喷发'), segment('火山为什么会喷发'))"
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

LANGUAGES = ("auto", "en", "zh", "ja", "th", "lo", "km", "my")
UNSPACED = frozenset({"zh", "ja", "th", "lo", "km", "my"})
NAMES = {"en": "English", "zh": "Chinese", "ja": "Japanese", "th": "Thai", "lo": "Lao",
         "km": "Khmer", "my": "Burmese"}

_HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_KANA = "\u3040-\u309f\u30a0-\u30ff\u31f0-\u31ff"
_SCRIPTS = {"th": "\u0e00-\u0e7f", "lo": "\u0e80-\u0eff", "km": "\u1780-\u17ff", "my": "\u1000-\u109f"}
_UNSPACED_CHARS = _HAN + _KANA + "".join(_SCRIPTS.values())
HAS_UNSPACED = re.compile(f"[{_UNSPACED_CHARS}]")
# A run of one script: Han, hiragana, katakana (with its long-vowel mark), one of the others;
# or a run of other letters/digits (a Latin word, a number) inside an unspaced text.
_RUN = re.compile(f"[{_HAN}]+|[\u3040-\u309f]+|[\u30a0-\u30ff\u31f0-\u31ff]+|"
                  + "|".join(f"[{r}]+" for r in _SCRIPTS.values()) + f"|(?:(?![{_UNSPACED_CHARS}])[^\\W_])+")
_HIRAGANA = re.compile("[\u3040-\u309f]+")
_WORDLIKE = re.compile(r"[^\W_]")
_SAMPLE = 4000  # characters read to detect a text's language

# Function words and question words of Chinese: frequent enough to match any passage.
ZH_STOP = frozenset("""的 了 是 在 和 与 及 或 也 就 都 而 及其 以及 之 其 这 那 这个 那个 这些 那些 一个 一种 有 没有 会 能 可以
可 要 把 被 让 对 从 向 为 为了 因为 所以 因此 如果 但 但是 并 并且 还 又 很 更 最 吗 呢 吧 啊 么 什么 为什么 怎么 怎样 如何
哪 哪些 哪个 谁 多少 几 是否 我 你 他 她 它 我们 你们 他们 她们 它们 自己 等 等等 中 上 下 里 着 过 得 地 所 该 此""".split())


def function_word(word: str) -> bool:
    """A word that carries grammar, not content: a Chinese function or question word, or a
    hiragana-only bigram of Japanese (particles and endings: は, なぜ, する)."""
    return word in ZH_STOP or bool(_HIRAGANA.fullmatch(word))


def detect_language(text: str) -> str:
    """The language code of ``text``'s script: a code in UNSPACED, or ``en`` (words separated
    by spaces). Japanese is told from Chinese by its kana."""
    sample = (text or "")[:_SAMPLE]
    if sample.isascii() or not HAS_UNSPACED.search(sample):
        return "en"
    letters = len(_WORDLIKE.findall(sample)) or 1
    han = len(re.findall(f"[{_HAN}]", sample))
    kana = len(re.findall(f"[{_KANA}]", sample))
    counts = {"ja": han + kana if kana * 20 >= han + kana else 0, "zh": han if kana * 20 < han + kana else 0}
    for code, chars in _SCRIPTS.items():
        counts[code] = len(re.findall(f"[{chars}]", sample))
    best = max(counts, key=lambda c: counts[c])
    # a few CJK names in an English text do not make it Chinese
    return best if counts[best] * 4 >= letters else "en"


def corpus_language(texts: Iterable[str], limit: int = 200) -> str:
    """The language most of the first ``limit`` texts are written in (``en`` on a tie)."""
    votes: dict[str, int] = {}
    for i, t in enumerate(texts):
        if i >= limit:
            break
        code = detect_language(t)
        votes[code] = votes.get(code, 0) + 1
    return max(sorted(votes), key=lambda c: (votes[c], c == "en")) if votes else "en"


def resolve(language: str | None, texts: Iterable[str] = ()) -> str:
    """A ``--language`` value as a code: ``auto``/None detects it from ``texts``."""
    lang = (language or "auto").strip().lower()
    if lang not in LANGUAGES:
        raise ValueError(f"--language {language!r}: expected one of {', '.join(LANGUAGES)}")
    return corpus_language(texts) if lang == "auto" else lang


def name(code: str) -> str:
    return NAMES.get(code, code)


@functools.lru_cache(maxsize=1)
def _jieba():
    import jieba

    jieba.setLogLevel(logging.WARNING)  # it prints "Building prefix dict" on its first cut
    return jieba


def _bigrams(run: str) -> list[str]:
    if len(run) == 1:
        # a lone hiragana is a particle or an inflection (は, を, の), never a word of content
        return [] if _HIRAGANA.fullmatch(run) else [run]
    return [run[i:i + 2] for i in range(len(run) - 1)]


def segment(text: str, language: str | None = None) -> list[str]:
    """Lower-cased word tokens of ``text`` in ``language`` (detected when None), punctuation
    dropped; for ``en`` the letters/digits runs. Chinese stop words are kept (callers filter)."""
    text = (text or "").lower()
    lang = language or detect_language(text)
    if lang == "zh" and HAS_UNSPACED.search(text):
        return [w for w in _jieba().cut_for_search(text) if _WORDLIKE.search(w) and not w.isspace()]
    if lang in UNSPACED or HAS_UNSPACED.search(text):
        out: list[str] = []
        for m in _RUN.finditer(text):
            run = m.group(0)
            out.extend(_bigrams(run) if HAS_UNSPACED.match(run) else [run])
        return out
    return re.findall(r"[^\W_]+", text)


def write_in(question: str, language: str | None = None) -> str:
    """The sentence a prompt adds so the model writes in the question's language; empty for
    English, whose prompts stay as they were. ``language``: the code where the caller knows it
    (a data stage knows its corpus's), else detected from ``question``."""
    code = language or detect_language(question)
    if code == "en":
        return ""
    return (f"Write everything you produce in {name(code)}, the language of the question "
            f"(keep ids, citation markers and JSON keys as they are).")


def ask_in_language(messages: list[dict[str, str]], question: str = "",
                    language: str | None = None) -> list[dict[str, str]]:
    """``messages`` with :func:`write_in`'s sentence closing the last user message, so every
    role's prompt asks for the question's language the same way (English prompts unchanged)."""
    note = write_in(question, language)
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not note or not users:
        return messages
    out = [dict(m) for m in messages]
    out[users[-1]]["content"] = f"{out[users[-1]]['content'].rstrip()}\n\n{note}"
    return out


def in_question_language(question_of: Callable[[Any], str],
                         language_of: Callable[[Any], str | None] = lambda a: None
                         ) -> Callable[[Callable[..., list]], Callable[..., list]]:
    """Decorate a role's message builder ``f(a)`` so its prompt asks for the language of
    ``question_of(a)``, or ``language_of(a)`` where that names one (:func:`ask_in_language`)."""
    def wrap(build: Callable[..., list]) -> Callable[..., list]:
        @functools.wraps(build)
        def messages(a: Any) -> list:
            return ask_in_language(build(a), question_of(a), language_of(a))
        return messages
    return wrap
