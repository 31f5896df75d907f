"""Main text of an HTML page: trafilatura's extraction turned into sentence-safe plain text.

:func:`html_text` asks trafilatura for its XML rendering (blocks tagged ``head``, ``p``,
``list/item``, ``code``, ``quote``, ``table/row/cell``) rather than plain text, so the joining
can tell blocks apart. The corpus chunker later joins lines with spaces, so every line that
ends a block must end its sentence too, or a heading opens the next paragraph's first sentence
("Queen bee The queen lays ..."). The rules:

- headings, list items and table rows get a full stop when they lack an end mark, unless
  they end open (a comma, "and", "or": a list that spells out one sentence);
- a paragraph (or a ``<br>`` segment of one) that lacks an end mark and is followed by one
  that starts in lower case is the same sentence cut by the page's markup
  ("Version 1.0 came out" / "in March 2008."): the two are joined with a space;
- whitespace inside a paragraph is collapsed (source line wraps are not line breaks);
- code blocks are kept verbatim, line for line, and never given full stops.

Settings: ``favor_recall=True``, tables on, comments off. On the saved real pages of
``tests/pages`` (docs/benchmarks.md: page reading) precision mode dropped footnotes, definition lists and
list items that carry the page's facts (96.9 % of the known main-text snippets kept), the
default 99.0 %, recall mode all of them, and all three leaked the same 1 of 64 known
boilerplate snippets (a licence line inside a blog's article column). A lost fact cannot be
cited at all; a leaked line is one passage among many and still has to be chosen by the
relevance ranking before anyone sees it.

libxml2 and trafilatura are not safe to run in several threads at once (native crashes,
SIGSEGV or SIGABRT, under concurrent page reads): every extraction holds :data:`LOCK`. The
page-reading benchmark compares this with a process pool; the lock costs less on pages of ordinary size.

Example::

    python -c "from deepr.search.extract import html_text; \
print(html_text('<html><body><article><h1>Bees</h1><p>Version 1.0 came out<br>in March 2008.</p>' \
'<p>Bees make honey from nectar they collect from flowers all summer long.</p></article></body></html>'))"
"""

from __future__ import annotations

import html as htmllib
import re
import threading
from collections.abc import Iterator

LOCK = threading.Lock()  # one extraction at a time in this process (libxml2/trafilatura thread safety)
SETTINGS = {"include_comments": False, "include_tables": True, "favor_recall": True}
END_MARK = re.compile(r"[.!?:;…][\"'’”)\]]*$")
OPEN_END = re.compile(r"(?:,|\b(?:and|or|but|nor|then))$", re.I)
_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.I | re.S)
_LB = "\x00"


def page_title(html: str) -> str:
    """The ``<title>`` as plain text: tags dropped, entities decoded once (``Doesn&#x27;t`` is
    ``Doesn't``), whitespace collapsed. Renderers escape it once for their own format."""
    m = _TITLE.search(html)
    if not m:
        return ""
    return " ".join(htmllib.unescape(re.sub(r"<[^>]+>", "", m.group(1))).split())


def html_text(html: str) -> str:
    """Main text of a page, one block per line (see the module notes); '' when none."""
    import trafilatura
    from lxml import etree

    with LOCK:
        xml = trafilatura.extract(html, output_format="xml", **SETTINGS)
        if not xml:
            return ""
        try:
            root = etree.fromstring(xml.encode("utf-8"), etree.XMLParser(recover=True, huge_tree=False))
        except etree.XMLSyntaxError:
            return ""
        if root is None:
            return ""
        main = root.find("main")
        blocks = list(_blocks(main if main is not None else root))
    return "\n".join(_join(blocks))


def _inline(el: object, with_tail: bool = True) -> str:
    """The text of an inline element (``<lb/>`` kept as a marker), with its tail."""
    parts: list[str] = []
    if el.tag == "lb":  # type: ignore[attr-defined]
        return _LB + ((el.tail or "") if with_tail else "")  # type: ignore[attr-defined]
    for node in el.iter():  # type: ignore[attr-defined]
        if node is not el and node.tag == "lb":
            parts.append(_LB)
        elif node.text:
            parts.append(node.text)
        if node is not el and node.tail:
            parts.append(node.tail)
    if with_tail and el.tail:  # type: ignore[attr-defined]
        parts.append(el.tail)  # type: ignore[attr-defined]
    return "".join(parts)


def _segments(raw: str) -> list[str]:
    """Text cut at each ``<lb/>`` (a ``<br>``), whitespace collapsed in each piece."""
    return [seg for seg in (" ".join(p.split()) for p in raw.split(_LB)) if seg]


def _is_block(el: object) -> bool:
    """A block inside a paragraph or list item: a list, table, paragraph, or multi-line code."""
    tag = el.tag if isinstance(el.tag, str) else ""  # type: ignore[attr-defined]
    return tag in ("list", "table", "p", "quote", "head") or (tag == "code" and "\n" in "".join(el.itertext()).strip())  # type: ignore[attr-defined]


def _blocks(node: object) -> Iterator[tuple[str, str]]:
    """(kind, text) of each block under ``node`` in page order; kind is head, p, item, row or code."""
    for el in node:  # type: ignore[attr-defined]
        yield from _block(el)


def _block(el: object) -> Iterator[tuple[str, str]]:
    tag = el.tag if isinstance(el.tag, str) else ""  # type: ignore[attr-defined]
    if tag == "code":
        text = "".join(el.itertext()).strip("\n")  # type: ignore[attr-defined]
        if text.strip():
            yield "code", text
    elif tag == "table":
        for row in el.iter("row"):  # type: ignore[attr-defined]
            cells = [" ".join("".join(c.itertext()).split()) for c in row if isinstance(c.tag, str)]
            if any(cells):
                yield "row", " | ".join(c for c in cells if c)
    elif tag == "list":
        for item in el:  # type: ignore[attr-defined]
            if isinstance(item.tag, str) and item.tag == "item":
                yield from _mixed(item, "item")
    elif tag and tag not in ("graphic", "lb"):  # p, head, quote, item, div and anything new
        yield from _mixed(el, "head" if tag == "head" else "item" if tag == "item" else "p")


def _mixed(el: object, kind: str) -> Iterator[tuple[str, str]]:
    """A block whose children may be inline (code, links, emphasis) or blocks of their own (a
    nested list, a code sample): inline runs become ``kind`` blocks, cut at ``<br>`` except in
    list items, which stay one line each."""
    buf = [el.text or ""]  # type: ignore[attr-defined]

    def flush() -> Iterator[tuple[str, str]]:
        raw = "".join(buf)
        segs = _segments(raw) if kind != "item" else [" ".join(raw.replace(_LB, " ").split())]
        yield from ((kind, seg) for seg in segs if seg)

    for child in el:  # type: ignore[attr-defined]
        if _is_block(child):
            yield from flush()
            buf = [child.tail or ""]
            yield from _block(child)
        else:
            buf.append(_inline(child))
    yield from flush()


def _join(blocks: list[tuple[str, str]]) -> list[str]:
    """Lines of text from blocks: end marks added where a block ends a sentence, paragraphs cut
    mid-sentence joined again, code left alone."""
    lines: list[str] = []
    for i, (kind, text) in enumerate(blocks):
        if kind == "code":
            lines.extend(text.splitlines() or [""])
            continue
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        if lines and kind == "p" and i and blocks[i - 1][0] == "p" and _continues(blocks[i - 1][1], text):
            lines[-1] = f"{lines[-1]} {text}"
        else:
            lines.append(text)
        ends_sentence = not (kind == "p" and nxt is not None and nxt[0] == "p" and _continues(text, nxt[1]))
        if ends_sentence and not END_MARK.search(lines[-1]) and not OPEN_END.search(lines[-1]) \
                and not (kind == "p" and nxt and nxt[0] == "code"):
            lines[-1] += "."
    return lines


def _continues(before: str, after: str) -> bool:
    """Whether ``after`` carries on the sentence ``before`` left open (no end mark, lower case next)."""
    return not END_MARK.search(before) and after[:1].islower()
