"""A regex :class:`~deepr.llm.base.OutputFormat` as a GBNF grammar, for servers that take one.

OpenAI-compatible servers share a field for JSON schemas (``response_format``) but not for
regexes. llama.cpp's servers (llama-server, llama-cpp-python) accept a GBNF ``grammar`` in
the request body, so a tagged format such as ``<answer>…[N1-R2]…</answer>`` is translated
here. The translation covers the regex subset deepr's formats use: literals, character
classes (ranges, negation, ``\\d \\w \\s``), ``.``, groups, alternation and bounded or
unbounded repetition; anchors are dropped (a grammar always matches the whole reply).
Anything else raises ValueError, and the caller sends the call unconstrained.

JSON-schema formats go to llama-cpp-python's server the same way, as a ``grammar``: that server
refuses ``response_format`` type ``json_schema``, and with ``json_object`` + schema it silently
falls back to "any JSON" whenever its converter cannot read a schema. :func:`schema_to_gbnf`
converts on the client with the library's own converter (``llama_cpp.llama_grammar``, the
``llamacpp`` extra), so a schema it cannot read is an error here instead of a silent downgrade.
That converter reads only a plain regex dialect in ``pattern`` (no ``(?:``; an escape such as
``\\.`` is copied into the grammar, where llama.cpp rejects it), so each pattern is first
rewritten in that dialect (:func:`plain_pattern`), and its literals get the backslash escape
0.3.36 forgets (an enum sentence with a quote in it broke the grammar).

    regex_to_gbnf(r"<search>[a-z]+( [a-z]+){1,5}</search>")
    schema_to_gbnf({"type": "object", "properties": {"q": {"type": "string", "pattern": "^[a-z]+$"}}})
"""

from __future__ import annotations

import functools
import json
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


def _class(items: list[tuple[Any, Any]], char: Any = None, dialect: str = "GBNF") -> str:
    """A character class in GBNF (``char`` = _char) or in llama.cpp's pattern dialect (``_lit``,
    where a space inside a class must be written as an escape)."""
    char = char or _char
    negate, parts = False, []
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            parts.append(char(av, True))
        elif op is C.RANGE:
            parts.append(f"{char(av[0], True)}-{char(av[1], True)}")
        elif op is C.CATEGORY and av in _CATEGORY:
            parts.append(_CATEGORY[av] if char is _char else _CATEGORY[av].replace(" ", "\\x20"))
        else:
            raise ValueError(f"regex class item {op} {av} has no {dialect} form here")
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


@functools.lru_cache(maxsize=256)  # a run sends the same few tag formats on every call
def regex_to_gbnf(regex: str) -> str:
    """The GBNF grammar (one ``root`` rule) matching exactly what ``regex`` fully matches."""
    try:
        parsed = P.parse(regex)
    except re.error as e:
        raise ValueError(f"not a valid regex: {e}") from None
    return f"root ::= {_seq(parsed)}\n"


# --- JSON schemas through llama-cpp-python's converter -----------------------------------

LLAMACPP_EXTRA = "pip install -e '.[llamacpp]' (in the deepr checkout)"
# Characters written as themselves in a converter pattern; any other becomes \\xHH (\\uHHHH),
# which the converter copies as is and llama.cpp's grammar parser reads.
_PLAIN = re.compile(r"[A-Za-z0-9 _',;:!%&=<>@#~`/-]")


def _hex(code: int) -> str:
    return f"\\x{code:02X}" if code < 256 else f"\\u{code:04X}" if code < 0x10000 else f"\\U{code:08X}"


def _lit(code: int, in_class: bool = False) -> str:
    ch = chr(code)
    if _PLAIN.fullmatch(ch) and not (in_class and ch in "-^"):
        return ch
    if not in_class and ch in "\"\\":  # the converter would put it in the JSON string unescaped
        raise ValueError(f"a pattern with a literal {ch!r} has no form in llama.cpp's pattern dialect")
    # Outside a class the escape goes into a one-character class: the converter splits a literal
    # run before a group (``\\x2E(`` became ``"\\x2" "E"``), never a class.
    return _hex(code) if in_class else f"[{_hex(code)}]"


def _plain(items: Any) -> str:
    out = []
    for op, av in items:
        if op is C.LITERAL:
            out.append(_lit(av))
        elif op is C.NOT_LITERAL:
            out.append(f"[^{_lit(av, True)}]")
        elif op is C.IN:
            out.append(_class(av, _lit, "llama.cpp pattern"))
        elif op is C.ANY:
            out.append(".")
        elif op is C.AT:
            continue  # anchors: the whole pattern is anchored once, below
        elif op is C.SUBPATTERN:
            out.append(f"({_plain(av[-1])})")
        elif op is C.BRANCH:
            out.append("(" + "|".join(_plain(b) for b in av[1]) + ")")
        elif op is C.CATEGORY and av in _CATEGORY:
            out.append(f"[{_CATEGORY[av]}]".replace(" ", "\\x20"))
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", None)):
            lo, hi, body = av
            # Always a group: the converter applies a quantifier after an escape to the whole
            # preceding literal run.
            inner = f"({_plain(body)})"
            if hi is C.MAXREPEAT:
                out.append(f"{inner}*" if lo == 0 else f"{inner}+" if lo == 1 else f"{inner}{{{lo},}}")
            else:
                out.append(f"{inner}?" if (lo, hi) == (0, 1) else
                           f"{inner}{{{lo}}}" if lo == hi else f"{inner}{{{lo},{hi}}}")
        else:
            raise ValueError(f"regex construct {op} has no form in llama.cpp's pattern dialect")
    return "".join(out)


def plain_pattern(regex: str) -> str:
    """``regex`` as an anchored pattern in the dialect llama.cpp's schema converter reads: only
    capturing groups, quantifiers on groups, and every special character as a hex escape."""
    try:
        parsed = P.parse(regex)
    except re.error as e:
        raise ValueError(f"not a valid regex: {e}") from None
    return f"^{_plain(parsed)}$"


def _plain_patterns(node: Any) -> Any:
    if isinstance(node, list):
        return [_plain_patterns(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _plain_patterns(v) for k, v in node.items()}
    if isinstance(node.get("pattern"), str) and node.get("type") == "string":
        out["pattern"] = plain_pattern(node["pattern"])
    return out


def schema_to_gbnf(schema: dict[str, Any]) -> str:
    """The GBNF grammar for ``schema``, from llama-cpp-python's own converter (imported here:
    it is the ``llamacpp`` extra). ImportError when it is missing; ValueError when the converter
    cannot read the schema."""
    return _converted(json.dumps(schema))


@functools.lru_cache(maxsize=256)  # a dag plan's grammar is ~20 kB; roles resend the same schemas
def _converted(schema_text: str) -> str:
    from llama_cpp.llama_grammar import SchemaConverter

    class Converter(SchemaConverter):
        # llama-cpp-python 0.3.36 escapes quotes but not backslashes in grammar literals, so a
        # constant or enum string holding a quote (JSON text: \") became an unparsable grammar.
        def _format_literal(self, literal: str) -> str:
            return super()._format_literal(literal.replace("\\", "\\\\"))

    # What llama_cpp.llama_grammar.json_schema_to_gbnf does, with the converter above.
    conv = Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        conv.visit(conv.resolve_refs(_plain_patterns(json.loads(schema_text)), "stdin"), "")
        return conv.format_grammar()
    except (AssertionError, ValueError, KeyError, TypeError, NotImplementedError, RecursionError) as e:
        raise ValueError(f"llama.cpp's JSON-schema converter cannot read this schema ({e})") from None
