"""Reports: markdown with a code-rendered reference list, and a self-contained HTML page.

The reference list is built from the ids that the report text actually cites, so no
uncited source is listed and no cited id is missing; :func:`render_markdown` checks that
every id in the final markdown resolves before returning. The HTML page (``--html``) has
no scripts, fonts or network references: inline CSS, the plan graph drawn as inline SVG
(search / aggregate / answer nodes in layers, edges as arrows), citations linked to the
reference list.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from typing import Any

from deepr.records import Citation, Plan

from deepr.evidence.citations import Catalog, cite_before_stop, clean_brackets, cited_ids, strip_ids

@dataclass
class GNode:
    id: str
    label: str
    kind: str  # search | aggregate | answer | section | step


@dataclass
class Graph:
    nodes: list[GNode] = field(default_factory=list)
    edges: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Section:
    heading: str | None
    body: str
    level: int = 2


@dataclass
class ReportDoc:
    title: str
    sections: list[Section]
    notes: list[str] = field(default_factory=list)
    graph: Graph | None = None
    # the code's own words in the report's language (deepr/evidence/phrases.py); None: English
    words: dict[str, Any] | None = None


def plan_graph(plan: Plan) -> Graph:
    return Graph([GNode(n.id, n.query or n.need or "", n.type) for n in plan.nodes],
                 [(src, n.id) for n in plan.nodes for src in n.inputs])


def render_markdown(doc: ReportDoc, catalog: Catalog) -> tuple[str, dict[str, Citation], list[str]]:
    """(markdown, citations of every id in it, ids dropped because the catalog lacks them)."""
    bodies = [cite_before_stop(s.body) for s in doc.sections]
    unknown = [c for b in bodies for c in cited_ids(b) if c not in catalog]
    if unknown:  # texts are checked before they get here; this guards the invariant anyway
        bodies = [strip_ids(b, unknown) for b in bodies]
    ids = list(dict.fromkeys(c for b in bodies for c in cited_ids(b)))
    # Brackets in a report are citations of evidence and nothing else ([N4], [S1] cite nothing).
    parts = [f"# {clean_brackets(doc.title, ())}"] + [f"> {clean_brackets(n, ())}" for n in doc.notes]
    for s, body in zip(doc.sections, bodies):
        if s.heading:
            parts.append(f"{'#' * s.level} {clean_brackets(s.heading, ())}")
        parts.append(clean_brackets(body, ids).strip())
    w = doc.words or {}
    refs = clean_brackets(catalog.references(ids, w.get("reference_words")), ids) if ids else None
    parts += [f"## {w.get('references', 'References')}", refs or w.get("no_sources", "(no sources were cited)")]
    md = "\n\n".join(p for p in parts if p) + "\n"
    citations = catalog.citations(ids)
    missing = [c for c in cited_ids(md) if c not in citations]
    if missing:
        raise RuntimeError(f"report cites ids without a reference entry: {missing}")
    return md, citations, sorted(set(unknown))


# --- HTML -------------------------------------------------------------------------------

_COLORS = {"search": "#f7c6c2", "aggregate": "#c4dcf7", "answer": "#f9d49e", "section": "#d3ecd1",
           "step": "#e3d9f4", "report": "#f9d49e"}
_CSS = """body{font:16px/1.55 system-ui,-apple-system,Segoe UI,sans-serif;max-width:60rem;margin:2rem auto;
padding:0 1rem;color:#1d1d1f}h1{font-size:1.8rem}blockquote{border-left:4px solid #c9c9c9;margin:1rem 0;
padding:.3rem 1rem;color:#555;background:#f7f7f7}a.cite{text-decoration:none;font-size:.85em}
figure{margin:1.5rem 0;overflow-x:auto;border:1px solid #e2e2e2;border-radius:6px;padding:.5rem}
figcaption{color:#666;font-size:.9rem}table{border-collapse:collapse}td,th{border:1px solid #ccc;
padding:.25rem .5rem}code{background:#f2f2f2;padding:0 .2rem}li[id]:target{background:#fff3c4}"""


def _layers(graph: Graph) -> dict[str, int]:
    parents: dict[str, list[str]] = {n.id: [] for n in graph.nodes}
    for src, dst in graph.edges:
        if src in parents and dst in parents:
            parents[dst].append(src)
    layer: dict[str, int] = {}

    def depth(nid: str, trail: frozenset = frozenset()) -> int:
        if nid not in layer:
            ps = [p for p in parents[nid] if p not in trail]
            layer[nid] = 1 + max((depth(p, trail | {nid}) for p in ps), default=-1)
        return layer[nid]

    for n in graph.nodes:
        depth(n.id)
    return layer


def _wrap(text: str, width: int = 30, lines: int = 2) -> list[str]:
    words, out, cur = text.split(), [], ""
    for w in words:
        if len(cur) + len(w) + 1 > width and cur:
            out.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}".strip()
    out.append(cur)
    if len(out) > lines:
        out = out[:lines]
        out[-1] = out[-1][: width - 1] + "…"
    return out


def graph_svg(graph: Graph) -> str:
    """The graph as inline SVG: one column per layer, arrows from input to consumer."""
    W, H, GX, GY, PAD = 210, 58, 70, 18, 16
    layer = _layers(graph)
    cols: dict[int, list[GNode]] = {}
    for n in graph.nodes:
        cols.setdefault(layer[n.id], []).append(n)
    pos = {n.id: (PAD + c * (W + GX), PAD + r * (H + GY)) for c, ns in cols.items() for r, n in enumerate(ns)}
    width = PAD * 2 + (max(cols, default=0) + 1) * (W + GX) - GX
    height = PAD * 2 + max((len(ns) for ns in cols.values()), default=1) * (H + GY) - GY
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="plan graph">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M0 0L10 5L0 10z" fill="#777"/></marker></defs>']
    for src, dst in graph.edges:
        if src in pos and dst in pos:
            (x1, y1), (x2, y2) = pos[src], pos[dst]
            x1, y1, y2 = x1 + W, y1 + H / 2, y2 + H / 2
            mid = (x1 + x2) / 2
            out.append(f'<path d="M{x1} {y1} C{mid} {y1} {mid} {y2} {x2 - 2} {y2}" fill="none" stroke="#999" '
                       'stroke-width="1.4" marker-end="url(#arrow)"/>')
    for n in graph.nodes:
        x, y = pos[n.id]
        fill = _COLORS.get(n.kind, "#eee")
        out.append(f'<g><title>{html.escape(f"{n.id} ({n.kind}): {n.label}")}</title>'
                   f'<rect x="{x}" y="{y}" width="{W}" height="{H}" rx="8" fill="{fill}" stroke="#888"/>'
                   f'<text x="{x + 8}" y="{y + 17}" font-size="12" font-weight="bold" font-family="sans-serif">'
                   f'{html.escape(n.id)} · {html.escape(n.kind)}</text>')
        for i, line in enumerate(_wrap(n.label)):
            out.append(f'<text x="{x + 8}" y="{y + 33 + 14 * i}" font-size="11" font-family="sans-serif">'
                       f'{html.escape(line)}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


_CITE = re.compile(r"\[((?:[A-Za-z][A-Za-z0-9_.\-]*?-[RF][0-9]+)(?:\s*[,;]\s*[A-Za-z][A-Za-z0-9_.\-]*?-[RF][0-9]+)*)\]")


def _inline(text: str, anchors: set[str]) -> str:
    t = html.escape(text, quote=False)
    t = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", t)
    t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
    t = re.sub(r"&lt;(https?://[^\s&]+)&gt;", r'<a href="\1">\1</a>', t)

    def link(m: re.Match) -> str:
        ids = [i.strip() for i in re.split(r"[,;]", m.group(1))]
        inner = ", ".join(f'<a class="cite" href="#ref-{i}">{i}</a>' if i in anchors else i for i in ids)
        return f"[{inner}]"

    return _CITE.sub(link, t)


def markdown_html(md: str, anchors: set[str]) -> str:
    """The small markdown subset reports use: headings, paragraphs, lists, quotes, tables."""
    out: list[str] = []
    para: list[str] = []
    lst: str | None = None

    def flush() -> None:
        nonlocal lst
        if para:
            out.append(f"<p>{_inline(' '.join(para), anchors)}</p>")
            para.clear()
        if lst:
            out.append(f"</{lst}>")
            lst = None

    for line in md.splitlines():
        s = line.strip()
        if m := re.match(r"^(#{1,6})\s+(.*)$", s):
            flush()
            out.append(f"<h{len(m.group(1))}>{_inline(m.group(2), anchors)}</h{len(m.group(1))}>")
        elif m := re.match(r"^(?:[-*+]|(\d+)[.)])\s+(.*)$", s):
            kind = "ol" if m.group(1) else "ul"
            if para:
                out.append(f"<p>{_inline(' '.join(para), anchors)}</p>")
                para.clear()
            if lst != kind:
                flush()
                out.append(f"<{kind}>")
                lst = kind
            ref = re.match(r"^\[([^\]]+)\]", m.group(2))
            rids = [i.strip() for i in ref.group(1).split(",") if i.strip() in anchors] if ref else []
            rid = f' id="ref-{html.escape(rids[0])}"' if rids else ""
            more = "".join(f'<span id="ref-{html.escape(i)}"></span>' for i in rids[1:])  # grouped by URL
            out.append(f"<li{rid}>{more}{_inline(m.group(2), anchors)}</li>")
        elif s.startswith(">"):
            flush()
            out.append(f"<blockquote>{_inline(s.lstrip('> '), anchors)}</blockquote>")
        elif s.startswith("|") and s.endswith("|"):
            flush()
            if not re.fullmatch(r"\|[\s:\-|]+\|", s):
                cells = "".join(f"<td>{_inline(c.strip(), anchors)}</td>" for c in s.strip("|").split("|"))
                out.append(f"<table><tr>{cells}</tr></table>")
        elif not s:
            flush()
        else:
            para.append(s)
    flush()
    return "\n".join(out).replace("</table>\n<table>", "\n")


def render_html(md: str, doc: ReportDoc, citations: dict[str, Citation]) -> str:
    body = markdown_html(md, set(citations))
    if doc.graph and doc.graph.nodes:
        fig = (f'<figure>{graph_svg(doc.graph)}<figcaption>Research graph: red search, blue aggregate, '
               'orange answer (plan modes); green sections (warp); purple steps (decor).</figcaption></figure>')
        body = body.replace("</h1>", "</h1>\n" + fig, 1)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(doc.title)}</title>'
            f"<style>{_CSS}</style></head><body>\n{body}\n</body></html>\n")
