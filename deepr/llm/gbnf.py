"""A regex :class:`~deepr.llm.base.OutputFormat` as a GBNF grammar, for servers that take one.

OpenAI-compatible servers share a field for JSON schemas (``response_format``) but not for
regexes. llama.cpp's servers (llama-server, llama-cpp-python) accept a GBNF ``grammar`` in
the request body, so a tagged format such as ``<answer>…[N1-R2]…</answer>`` is translated
here. The translation covers the regex subset deepr's formats use: literals, character
classes (ranges, negation, ``\\d \\w \\s``), ``.``, groups, alternation and bounded or
unbounded repetition; anchors are dropped (a grammar always matches the whole reply).
Anything else raises ValueError, and the caller sends the call unconstrained.

    regex_to_gbnf(r"<search>[a-z]+( [a-z]+){1,5}</search>")
"""

from __future__ import annotations

import re
from typing import Any

try:  # Python 3.11+: the parser lives in re._parser; older versions name it sre_parse
    from re import _constants as C, _parser as P  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants as C  # type: ignore[no-redef]
    import sre_parse as P  # type: ignore[no-redef]

_CATEGORY = {C.CATEGORY_DIGIT: "0-9", C.CATEGORY_WORD: "a-zA-Z0-9_", C.CATEGORY_SPACE: " \\t\\n\\r"}
_NOT_CATEGORY = {C.CATEGORY_NOT_DIGIT: "0-9", C.CATEGORY_NOT_WORD: "a-zA-Z0-9_", C.CATEGORY_NOT_SPACE: " \\t\\n\\r"}


def _char(code: int, in_class: bool) -> str:
    ch = chr(code)
    if ch in "\\\"" or (in_class and ch in "]^-["):
        return "\\" + ch
    if ch == "\n":
        return "\\n"
    if ch == "\t":
        return "\\t"
    if ch == "\r":
        return "\\r"
    return ch


def _class(items: list[tuple[Any, Any]]) -> str:
    negate, parts = False, []
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            parts.append(_char(av, True))
        elif op is C.RANGE:
            parts.append(f"{_char(av[0], True)}-{_char(av[1], True)}")
        elif op is C.CATEGORY and av in _CATEGORY:
            parts.append(_CATEGORY[av])
        else:
            raise ValueError(f"regex class item {op} {av} has no GBNF form here")
    return f"[{'^' if negate else ''}{''.join(parts)}]"


def _seq(items: Any) -> str:
    out = []
    for op, av in items:
        out.append(_node(op, av))
    return " ".join(x for x in out if x) or '""'


def _node(op: Any, av: Any) -> str:
    if op is C.LITERAL:
        return f'"{_char(av, False)}"'
    if op is C.NOT_LITERAL:
        return f"[^{_char(av, True)}]"
    if op is C.IN:
        return _class(av)
    if op is C.ANY:
        return "[^\\n]"
    if op is C.AT:
        return ""  # ^ and $: the grammar spans the whole reply anyway
    if op is C.SUBPATTERN:
        return f"({_seq(av[-1])})"
    if op is C.BRANCH:
        return "(" + " | ".join(_seq(b) for b in av[1]) + ")"
    if op is C.CATEGORY and av in _CATEGORY:
        return f"[{_CATEGORY[av]}]"
    if op is C.CATEGORY and av in _NOT_CATEGORY:
        return f"[^{_NOT_CATEGORY[av]}]"
    if op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", None)):
        lo, hi, body = av
        inner = f"({_seq(body)})"
        if hi is C.MAXREPEAT:
            return f"{inner}*" if lo == 0 else (f"{inner}+" if lo == 1 else f"{inner}{{{lo},}}")
        if (lo, hi) == (0, 1):
            return f"{inner}?"
        return f"{inner}{{{lo}}}" if lo == hi else f"{inner}{{{lo},{hi}}}"
    raise ValueError(f"regex construct {op} has no GBNF form here")


def regex_to_gbnf(regex: str) -> str:
    """The GBNF grammar (one ``root`` rule) matching exactly what ``regex`` fully matches."""
    try:
        parsed = P.parse(regex)
    except re.error as e:
        raise ValueError(f"not a valid regex: {e}") from None
    return f"root ::= {_seq(parsed)}\n"
