"""The hf backend's logits processors: an :class:`OutputFormat` becomes a grammar mask
(constrained decoding), the optional repetition penalty (``penalty_processor``), and the optional
ban on repeating a run of the reply's own tokens (``repeat_ban_processor``), on a word
following itself, and on a word named twice inside one JSON string where the format asks for
distinct words (``StutterBan``; the planner's formats do); and a format's ``guard``
(``guard_processor``; the plan's graph rules).

xgrammar (``pip install xgrammar``) compiles a JSON schema or a regex against the model's
tokenizer once (~0.3 s; cached per format here) and masks every token that would leave the
grammar, so the reply is schema-valid JSON / matches the regex unless ``max_new_tokens``
cuts it first (the backend then flags the reply ``truncated``). Chosen over llguidance
because it ships a ready transformers processor and needs no ``torch.compile`` warm-up
(llguidance's first call compiled for ~17 s here); overhead is about 0.5 ms per token.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

from deepr.llm.base import OutputFormat
from deepr.text import STOP_WORDS

INSTALL_HINT = "pip install -e '.[smollm2]' in the deepr checkout  (or: pip install xgrammar)"


class Constrainer:
    """Compiles formats for one tokenizer and hands out a fresh processor per generate call."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Any = ()):
        """``stop_ids``: every token id generation stops at (the generation config's eos list,
        which may name more than the tokenizer's eos). The grammar ends its reply on each of them;
        a stop id it took for text would end the row mid-reply (the tiny models stop at
        ``<|endoftext|>`` too) and leave the matcher behind the padded row."""
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        eos = tokenizer.eos_token_id
        self._stop_ids = sorted({int(t) for t in stop_ids} | ({int(eos)} if eos is not None else set()))
        self._compiler: Any = None
        self._compiled: dict[str, Any] = {}
        self._lock = threading.Lock()

    @staticmethod
    def available() -> bool:
        import importlib.util

        return importlib.util.find_spec("xgrammar") is not None

    def compile(self, fmt: OutputFormat) -> Any:
        """The format's compiled grammar (compiled once per format)."""
        key = json.dumps([fmt.json_schema, fmt.regex], sort_keys=True)
        with self._lock:
            if key not in self._compiled:
                import xgrammar as xgr

                if self._compiler is None:
                    info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                              stop_token_ids=self._stop_ids or None)
                    self._compiler = xgr.GrammarCompiler(info)
                try:
                    if fmt.json_schema is not None:
                        # Compact JSON: free whitespace lets a small model pad with spaces
                        # until max_tokens runs out (seen with SmolLM2 and random models).
                        grammar = self._compiler.compile_json_schema(
                            json.dumps(fmt.json_schema), any_whitespace=False)
                    else:
                        grammar = self._compiler.compile_regex(fmt.regex)
                except (RuntimeError, ValueError) as e:
                    raise ValueError(f"output format {fmt.name!r} cannot be compiled into a grammar: {e}") from None
                self._compiled[key] = grammar
            return self._compiled[key]

    def processor(self, fmt: OutputFormat | list[OutputFormat]) -> Any:
        """A new logits processor (it keeps per-generation state, so one per call); a list of
        formats gives each row of a batch its own grammar, in order."""
        from xgrammar.contrib.hf import LogitsProcessor

        if isinstance(fmt, list):
            return LogitsProcessor([self.compile(f) for f in fmt])
        return LogitsProcessor(self.compile(fmt))


def penalty_processor(penalty: float, window: int | None, n_prompt: int) -> Any:
    """transformers' repetition penalty over the last ``window`` tokens (prompt included, as
    llama.cpp's repeat_last_n), or with no window over the reply's tokens only."""
    from transformers import RepetitionPenaltyLogitsProcessor

    if window:
        return _Window(RepetitionPenaltyLogitsProcessor(penalty), window)
    return RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=n_prompt)


class _Window:
    """A logits processor handed only the last ``window`` tokens (transformers' processor reads
    every token it is given)."""

    def __init__(self, inner: Any, window: int):
        self.inner, self.window = inner, window

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        return self.inner(input_ids[:, -self.window:], scores)


def repeat_ban_processor(n: int, n_prompt: int) -> Any:
    """transformers' no-repeat-n-gram rule over the reply's tokens only (a prompt's phrases may be
    quoted), placed after the grammar's mask: where the ban would leave no token the grammar
    allows (a constant of the format recurring), the row keeps the mask's choices."""
    from transformers import NoRepeatNGramLogitsProcessor

    return _ReplyBan(NoRepeatNGramLogitsProcessor(n), n, n_prompt)


class _ReplyBan:
    def __init__(self, inner: Any, n: int, n_prompt: int):
        self.inner, self.n, self.n_prompt = inner, n, n_prompt

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        reply = input_ids[:, self.n_prompt:]
        if reply.shape[1] < self.n:
            return scores
        return _keep_choices(self.inner(reply, scores), scores)


def _keep_choices(banned: Any, scores: Any) -> Any:
    """``banned``, except that a row it left with no token keeps its ``scores`` (the grammar's
    only ways on, e.g. a format's recurring constant)."""
    left = (banned > float("-inf")).any(dim=-1, keepdim=True)
    return banned.where(left, scores)


_WORD_END = re.compile(r"([A-Za-z][A-Za-z'-]*)( ?)$")
_STRING_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")
_PARTIAL = re.compile(r"[A-Za-z][A-Za-z'-]*$")  # the word a text ends in, perhaps unfinished
# Word starts left open although a used word begins with them: words in their own right ("a",
# "on"), not the one-letter fragments of the stop-word list ("d", "t" of "don't")
_OPEN_STARTS = frozenset({w for w in STOP_WORDS if len(w) > 1} | {"a", "i"})
# A position where the grammar's mask leaves more tokens than this is free text (string bans, guards)
FREE_TEXT_TOKENS = 256


def _open_string(text: str) -> str | None:
    """The text of the JSON string ``text`` ends inside (escapes honoured), or None."""
    start, i = None, 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and start is not None:
            i += 2
            continue
        if ch == '"':
            start = i + 1 if start is None else None
        i += 1
    return None if start is None else text[start:]


class StutterBan:
    """Keeps a word from following itself ("Algiers Algiers Algiers", "seasons seasons"):
    once a reply's text ends in a word (or a word and one space), the next token may not start
    a new word with that word or a two-letter-plus beginning of it, in any case. Built once per
    tokenizer (its word-initial tokens, " alg", and bare letter tokens, "alg", by lower-cased
    text: under a grammar SmolLM2 often writes the space as its own token); :meth:`processor`
    makes the per-call processor, which goes after the grammar's mask and keeps a row's
    choices where it would empty them. The same tables serve the ban on naming a word twice
    inside one JSON string (:meth:`banned_in_string`, :meth:`string_processor`)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        spaced: dict[str, list[int]] = {}
        bare: dict[str, list[int]] = {}
        for tid in range(len(tokenizer)):
            piece = tokenizer.decode([tid])
            if len(piece) > 1 and piece[0] == " " and piece[1:].isalpha():
                spaced.setdefault(piece[1:].lower(), []).append(tid)
            elif piece.isalpha():
                bare.setdefault(piece.lower(), []).append(tid)
        self.spaced, self.bare = spaced, bare

    def banned(self, tail: str) -> list[int]:
        """Token ids that would start the last word of ``tail`` again (none unless it ends a word)."""
        m = _WORD_END.search(tail)
        if not m:
            return []
        word, starts = m.group(1).lower(), self.bare if m.group(2) else self.spaced
        return [t for n in range(2, len(word) + 1) for t in starts.get(word[:n], ())]

    def processor(self, n_prompt: int) -> Any:
        return _BanRows(self.banned, self.tokenizer, n_prompt, None, tail=8)

    def banned_in_string(self, reply: str, free: bool = True) -> list[int]:
        """Token ids that would start, inside the JSON string ``reply`` ends in, a content word
        that string already holds ("Han emperor" → no " emperor", " emp", ..., " e"; "Optics the
        science of" → no " optics"), or carry the word being written on into one ("... one
        main d" → no "omes"); none outside a string. Single letters too: under a grammar SmolLM2
        spelled a repeat out, " d" "omes" "t" "i" "c" after "Domestic turkey"; a new word still
        opens with a longer token of its own (" dry"). In ``free`` text a start that is itself a
        stop word (" a" of "Algiers", " on" of "one") stays allowed, and is then kept from
        growing into the word; under a grammar that allows few tokens it is banned too, as there
        the grammar may allow nothing after " a" but "ppeal", and a ban that empties a row gives
        way ("Appeal appeal Appeal")."""
        opened = _open_string(reply)
        if not opened:
            return []
        # after a letter only a token with its own space starts a word; after a space only a bare
        # one; after "(" or "-" either
        last = opened[-1]
        tables = [self.spaced] if last.isalnum() else [self.bare] if last == " " else [self.spaced, self.bare]
        tail = _PARTIAL.search(opened)
        partial = tail.group(0).lower() if tail else ""
        used = {w.lower() for w in _STRING_WORD.findall(opened[:tail.start()] if tail else opened)}
        used = {w for w in used - STOP_WORDS if len(w) > 2}
        starts = used | ({partial} if len(partial) > 2 and partial not in STOP_WORDS else set())
        open_starts = _OPEN_STARTS if free else frozenset()
        out = [t for w in starts for n in range(1, len(w) + 1) if n == len(w) or w[:n] not in open_starts
               for table in tables for t in table.get(w[:n], ())]
        grow = [w for w in used if partial and len(w) > len(partial) and w.startswith(partial)]
        return out + [t for w in grow for m in range(len(partial) + 1, len(w) + 1)
                      for t in self.bare.get(w[len(partial):m], ())]

    def string_processor(self, n_prompt: int, rows: list[bool]) -> Any:
        """The per-call processor of :meth:`banned_in_string` for the batch rows marked True."""
        return _BanRows(self.banned_in_string, self.tokenizer, n_prompt, rows, tail=None, free_above=FREE_TEXT_TOKENS)


class _BanRows:
    """Bans, per batch row marked in ``rows``, the tokens ``banned`` names for the row's reply text
    (its last ``tail`` tokens, or all of it), keeping a row's choices where the ban empties them."""

    def __init__(self, banned: Any, tokenizer: Any, n_prompt: int, rows: list[bool] | None, tail: int | None,
                 free_above: int | None = None):
        self.banned, self.tokenizer, self.n_prompt, self.rows, self.tail = banned, tokenizer, n_prompt, rows, tail
        self.free_above = free_above  # set: ``banned`` also hears whether the row is free text

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        bans = {}
        for row in range(input_ids.shape[0]):
            if self.rows is not None and not self.rows[row]:
                continue
            reply = input_ids[row, self.n_prompt:]
            text = self.tokenizer.decode((reply if self.tail is None else reply[-self.tail:]).tolist())
            if self.free_above is None:
                bans[row] = self.banned(text)
            else:
                bans[row] = self.banned(text, int(torch.isfinite(scores[row]).sum()) > self.free_above)
        return _ban_rows(scores, bans)


def _ban_rows(scores: Any, bans: dict[int, list[int]]) -> Any:
    """``scores`` with each row's banned token ids at -inf, except that a row the bans would
    leave without a token keeps its choices (see :func:`_keep_choices`)."""
    import torch

    out = None
    for row, ids in bans.items():
        if ids:
            out = scores.clone() if out is None else out
            out[row, torch.tensor(ids, device=scores.device)] = float("-inf")
    return scores if out is None else _keep_choices(out, scores)


def guard_processor(guards: list[Any], tokenizer: Any, n_prompt: int, most: int = FREE_TEXT_TOKENS) -> Any:
    """The per-call processor of the batch rows' :attr:`OutputFormat.guard` objects (None: a row
    without one), placed after the grammar's mask: where a guard is watching, each token the mask
    left is tried on the reply so far and banned when the result is not viable. A position where
    the mask leaves more than ``most`` tokens is free text, which no guard here reads."""
    return _GuardRows(guards, tokenizer, n_prompt, most)


class _GuardRows:
    def __init__(self, guards: list[Any], tokenizer: Any, n_prompt: int, most: int):
        self.guards, self.tokenizer, self.n_prompt, self.most = guards, tokenizer, n_prompt, most
        self._pieces: dict[int, str] = {}

    def _piece(self, tid: int) -> str:
        if tid not in self._pieces:
            self._pieces[tid] = self.tokenizer.decode([tid])
        return self._pieces[tid]

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        bans = {}
        for row, guard in enumerate(self.guards):
            if guard is None:
                continue
            text = self.tokenizer.decode(input_ids[row, self.n_prompt:].tolist())
            if not guard.watching(text):
                continue
            left = torch.isfinite(scores[row]).nonzero().flatten().tolist()
            if len(left) <= self.most:
                bans[row] = [t for t in left if not guard.viable(text + self._piece(t))]
        return _ban_rows(scores, bans)
