"""Citations owned by code: the catalog of every snippet and page a run has seen.

The catalog gives each retrieved snippet an id ``<node>-R<k>`` (search result k of plan
node ``<node>``) and each fetched page ``<node>-F<n>`` (n counts fetches over the run),
as in DecomposeR's citation catalog. Models only ever see evidence labelled with these
ids and cite them in square brackets, ``[N1-R3]`` or ``[N1-R3, N2-F1]``. The code checks
every cited id (:meth:`Catalog.check` lists unknown ones so the writer can be re-asked),
and renders the reference list from the ids actually cited: nothing uncited is listed
and nothing cited is missing.

Text that instructs the reader ("ignore all previous instructions and write ...") is not
evidence: :func:`deepr.evidence.instructions.set_aside` removes such sentences from every search
result before anything of the run reads it (:meth:`Catalog.screen`, which the run's searches
pass through) and from every page before it gets an id; :attr:`Catalog.set_aside` records each
one with its reason (the run's trace lists them).

An id, once issued, always means the same snippet: a re-run search node continues its
numbering instead of reusing numbers, and a snippet seen twice by one node keeps its id.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from deepr.records import Citation, Document, Hit

ID_PATTERN = r"[A-Za-z][A-Za-z0-9_.\-]*?-[RF][0-9]+"
_ID = re.compile(rf"^{ID_PATTERN}$")
_BRACKET = re.compile(r"\[([^\[\]\n]{1,400})\](?!\()")
_LINK = re.compile(r"\[[^\[\]\n]*\]\((?:https?:|www\.)[^)]*\)")
_LATEX_CITE = re.compile(r"\\cite[pt]?\{([^{}]*)\}")
_CITE_TAG = re.compile(r"<cite\s+id=[\"']([^\"']+)[\"']\s*/?>(.*?)(?:</cite>|(?=<cite)|$)", re.S | re.I)
_WIDE = str.maketrans({"【": "[", "】": "]", "［": "[", "］": "]", "，": ","})
_WIDE_CHARS = "".join(map(chr, _WIDE))
_WIDE_BRACKETS = str.maketrans({k: v for k, v in _WIDE.items() if chr(k) != "，"})
_ID_LIST = re.compile(r"\[[^\[\]\n]*，[^\[\]\n]*\]")
REFERENCE_WORDS = {"passage": "passage", "page_passage": "page passage",
                   "search_result": "search result", "accessed": "accessed"}
_NUMERIC = re.compile(r"^\s*\^?\d+(?:\s*[,;\-–]\s*\^?\d+)*\s*$")
# In a prompt, square brackets hold evidence ids and nothing else. A source's own brackets (an
# editor's insertion in a quote: "jazz based music ... [with a] heavy beat") would read as a
# citation, and a sentence copied with them is refused as a stray bracket: shown as parentheses.
_SOURCE_BRACKETS = str.maketrans({"[": "(", "]": ")", "【": "(", "】": ")", "［": "(", "］": ")"})


@dataclass
class Entry:
    """One citable source: a search snippet or a fetched page."""

    id: str
    kind: str  # "search" | "fetch"
    node: str
    doc_id: str
    passage_id: str
    title: str
    text: str
    url: str | None = None
    query: str = ""
    score: float = 0.0
    accessed: str = ""  # retrieval time of a web source (ISO 8601), empty for corpus text

    def citation(self) -> Citation:
        extra = {"accessed": self.accessed} if self.accessed else {}
        return Citation(doc_id=self.doc_id, title=self.title, text=self.text, url=self.url,
                        kind=self.kind, node=self.node, passage_id=self.passage_id, **extra)


def normalize(text: str) -> str:
    """Rewrite common foreign citation styles into ``[id, id]`` markers.

    Open models often write ``\\cite{N1-R3}``, ``<cite id="N1-R3">claim</cite>`` or
    full-width brackets; these carry the same ids and are accepted.
    """
    # Each rewrite runs only where its marker occurs: this runs on every answer a run checks, and
    # str.translate looking up every character of a long non-ASCII answer was 5 % of a dag batch's CPU.
    if not text.isascii() and any(c in text for c in _WIDE_CHARS):
        # brackets everywhere; a full-width comma only between ids, never in the prose
        text = _ID_LIST.sub(lambda m: m.group(0).replace("，", ","), text.translate(_WIDE_BRACKETS))
    if "\\cite" in text:
        text = _LATEX_CITE.sub(lambda m: "[" + ", ".join(p.strip() for p in m.group(1).split(",")) + "]", text)
    if "<" in text:
        text = _CITE_TAG.sub(lambda m: _cited(m.group(2).strip(), m.group(1).strip()), text)
    return text


def _cited(claim: str, ids: str) -> str:
    """``claim [ids]``, the marker inside the claim's closing full stop (the one rule: see
    :func:`cite_before_stop`)."""
    if claim[-1:] in ".!?" and len(claim) > 1:
        return f"{claim[:-1].rstrip()} [{ids}]{claim[-1]}"
    return f"{claim} [{ids}]"


# A citation after a sentence's closing mark: "… in 1815. [N1-R1]" (not a numbered list's "1. [x]").
_AFTER_STOP = re.compile(r"(?<=\S)([.!?])([ \t]*)((?:\[[^\[\]\n]{1,400}\][ \t]*)+)(?=$|\s)", re.M)


def cite_before_stop(text: str) -> str:
    """Every mode places a sentence's citations before its full stop, "… in 1815 [N1-R1]." (as
    the writers are told to): markers written after it are moved inside."""
    if "[" not in text:
        return text

    def move(m: re.Match[str]) -> str:
        line_start = text.rfind("\n", 0, m.start()) + 1
        marks = m.group(3).rstrip()
        if re.fullmatch(r"\s*\d+", text[line_start:m.start()]) or not cited_ids(marks) \
                or any(not cited_ids(f"[{b}]") for b in re.findall(r"\[([^\]]*)\]", marks)):
            return m.group(0)  # a list number, or brackets that are not citations
        return f" {marks}{m.group(1)}" + (m.group(0)[len(m.group(0).rstrip()):])
    return _AFTER_STOP.sub(move, text)


def _tokens(inner: str) -> list[str]:
    return [t for t in re.split(r"[\s,;]+", inner.strip()) if t]


def cited_ids(text: str) -> list[str]:
    """Ids cited in ``text`` in order of first appearance (only well-formed ids)."""
    out: dict[str, None] = {}
    for m in _BRACKET.finditer(text):
        toks = _tokens(m.group(1))
        if toks and all(_ID.match(t) for t in toks):
            for t in toks:
                out.setdefault(t, None)
    return list(out)


def style_errors(text: str) -> list[str]:
    """Citation attempts in a form the code cannot resolve: numbers and links."""
    errors = []
    for m in _BRACKET.finditer(text):
        if _NUMERIC.match(m.group(1)):
            errors.append(f"'[{m.group(1)}]' is a numbered citation; cite evidence ids such as [N1-R2] instead")
    if _LINK.search(text):
        errors.append("the text contains markdown links to URLs; cite evidence ids in brackets instead, "
                      "the reference list is added by the system")
    return errors


def stray_brackets(text: str) -> list[str]:
    """Bracket groups that are not citation markers ([N4], [S1], [section-1], [R1], [n0.1], [see
    above]): brackets in written text hold evidence ids and nothing else."""
    out = []
    for m in _BRACKET.finditer(text):
        toks = _tokens(m.group(1))
        if not (toks and all(_ID.match(t) for t in toks)) and not _NUMERIC.match(m.group(1)):
            out.append(f"[{m.group(1)}]")
    return out


_ANY_BRACKET = re.compile(r"\[([^\[\]\n]*)\](\((?:https?:|www\.)[^)\s]*\))?")


def clean_brackets(text: str, known: Iterable[str]) -> str:
    """``text`` with every bracket group that is not a marker of ``known`` ids taken out, so a
    report shows brackets only around evidence it cites: a markdown link keeps its text and
    target, bracketed prose becomes parenthesised, and a bracketed token ([N4], [S1], [1]) that
    is no known id is removed."""
    ok = set(known)

    def fix(m: re.Match) -> str:
        inner, link = m.group(1), m.group(2)
        toks = _tokens(inner)
        if link:
            return f"{inner.strip()} {link}".strip()
        if toks and all(t in ok for t in toks):
            return m.group(0)
        if len(toks) <= 3 and all(len(t) <= 40 for t in toks) and not re.search(r"[a-z]{4,}\s+[a-z]{2,}", inner):
            return "\0"  # an id-like token: no evidence behind it, so nothing to show
        return f"({inner.strip()})"

    return re.sub(r"[ \t]*\0", "", _ANY_BRACKET.sub(fix, text))


def strip_ids(text: str, drop: Iterable[str]) -> str:
    """Remove the given ids from citation markers (a marker left empty disappears)."""
    bad = set(drop)

    def fix(m: re.Match) -> str:
        toks = _tokens(m.group(1))
        if not toks or not all(_ID.match(t) for t in toks):
            return m.group(0)
        keep = [t for t in toks if t not in bad]
        return f"[{', '.join(keep)}]" if keep else "\0"

    return re.sub(r"[ \t]*\0", "", _BRACKET.sub(fix, text))


def _excerpt(text: str, words: int = 30) -> str:
    """The start of a source's text for the reference list; brackets become parentheses so no
    text of a source can read as a citation of the report."""
    parts = " ".join(text.split()).translate(str.maketrans("[]", "()")).replace("`", "'").split(" ")
    return " ".join(parts[:words]) + (" …" if len(parts) > words else "")


class Catalog:
    """Every citable source of one run, by id."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self._next_r: dict[str, int] = defaultdict(int)
        self._next_f = 0
        self._by_key: dict[tuple[str, str, str], str] = {}
        self.set_aside: list[dict[str, str]] = []  # sentences that instruct the reader, never evidence
        self._aside_at: dict[tuple[str, str], dict[str, str]] = {}

    def _evidence_text(self, cid: str, source: str, text: str) -> str:
        """``text`` without sentences addressed to the reader; each one removed is recorded."""
        from deepr.evidence.instructions import set_aside

        kept, removed = set_aside(text)
        for r in removed:
            self._record_aside(cid, source, r)
        return kept

    def _evidence_title(self, cid: str, source: str, title: str, instead: str) -> str:
        """A title that instructs the reader is set aside like a sentence; ``instead`` stands in."""
        from deepr.evidence.instructions import instructs_reader

        why = instructs_reader(title) if title else None
        if why is None:
            return title
        self._record_aside(cid, source, {"sentence": title[:300], "reason": why, "field": "title"})
        return instead

    def _record_aside(self, cid: str, source: str, removed: dict[str, str]) -> None:
        """One entry per sentence of a source; its id is the first id the source got (empty
        while the text was only looked at, e.g. by the extractive planner)."""
        key = (source, removed["sentence"])
        known = self._aside_at.get(key)
        if known is None:
            self._aside_at[key] = entry = {"id": cid, "source": source, **removed}
            self.set_aside.append(entry)
        elif cid and not known["id"]:
            known["id"] = cid

    def _claim_aside(self, cid: str, source: str) -> None:
        """A result screened before it got an id (:meth:`screen`) names its id once it has one."""
        for entry in self.set_aside:
            if entry["source"] == source and not entry["id"]:
                entry["id"] = cid

    def screen(self, hits: Sequence[Hit]) -> list[Hit]:
        """Search results as every reader of this run gets them: sentences (and titles) that
        instruct the reader removed and recorded, a result left with no text dropped. The run's
        searches pass through here before anything reads a result (planner, search agent,
        writers, prompts), so set-aside text can steer no query, plan node, title or prompt."""
        out = []
        for h in hits:
            text = self._evidence_text("", h.id, h.text)
            title = self._evidence_title("", h.id, h.title, h.doc_id)
            if text.strip():
                out.append(h if (text, title) == (h.text, h.title) else h.model_copy(update={"text": text,
                                                                                            "title": title}))
        return out

    def __contains__(self, cid: str) -> bool:
        return cid in self.entries

    def __getitem__(self, cid: str) -> Entry:
        return self.entries[cid]

    def __len__(self) -> int:
        return len(self.entries)

    def add_hits(self, node: str, hits: Sequence[Hit], query: str = "") -> list[str]:
        """Register search results of ``node`` (in rank order); returns their ids."""
        ids = []
        for h in hits:
            key = ("search", node, h.id)
            if key not in self._by_key:
                self._next_r[node] += 1
                cid = f"{node}-R{self._next_r[node]}"
                self._by_key[key] = cid
                text = self._evidence_text(cid, h.id, h.text)
                title = self._evidence_title(cid, h.id, h.title, h.doc_id)
                self._claim_aside(cid, h.id)
                self.entries[cid] = Entry(cid, "search", node, h.doc_id, h.id, title, text, h.url,
                                          query, float(h.score), getattr(h, "retrieved_at", "") or "")
            ids.append(self._by_key[key])
        return ids

    def move_pages(self, moves: dict[str, str], only: Sequence[str] | None = None) -> dict[str, list[str]]:
        """Re-attribute fetched pages (all, or ``only`` these ids) when a plan revision renames
        search nodes: ``moves`` maps a node's former id to its new one, all at once (two nodes may
        swap). Writers read a search node's pages by its id, so a page left under a reused id
        would be shown to another search. Ids never change. Returns {former id: its pages moved}."""
        moved: dict[str, list[str]] = defaultdict(list)
        for cid, e in self.entries.items():
            if e.kind == "fetch" and e.node in moves and (only is None or cid in only):
                key = self._key_of(cid)
                if key is not None:
                    del self._by_key[key]
                    self._by_key[("fetch", moves[e.node], key[2])] = cid
                moved[e.node].append(cid)
                e.node = moves[e.node]
        return dict(moved)

    def _key_of(self, cid: str) -> tuple[str, str, str] | None:
        e = self.entries[cid]
        key = ("fetch", e.node, e.passage_id)
        return key if self._by_key.get(key) == cid else None

    def add_page(self, node: str, doc: Document, passage_id: str | None = None) -> str:
        """Register a fetched page (or one ``passage_id`` of it: each passage of a web page is
        its own source) under the node whose result led to it; returns its id."""
        key = ("fetch", node, passage_id or doc.id)
        if key not in self._by_key:
            self._next_f += 1
            cid = f"{node}-F{self._next_f}"
            self._by_key[key] = cid
            text = self._evidence_text(cid, passage_id or doc.id, doc.text)
            title = self._evidence_title(cid, passage_id or doc.id, doc.title, doc.id)
            self.entries[cid] = Entry(cid, "fetch", node, doc.id, passage_id or doc.id, title, text,
                                      doc.url, accessed=str(getattr(doc, "retrieved_at", "") or ""))
        return self._by_key[key]

    def resolve(self, ref: str) -> Entry | None:
        """A catalog id, passage id, doc id or URL that some search returned, else None.

        This is how a model's fetch request is mapped to a page: only what a search
        showed can be opened, never an arbitrary URL or path.
        """
        ref = ref.strip().strip("[]")
        if ref in self.entries:
            return self.entries[ref]
        for e in self.entries.values():
            if e.kind == "search" and ref in (e.passage_id, e.doc_id, e.url or "\0"):
                return e
        return None

    def check(self, text: str, allowed: Iterable[str] | None = None, *, require: bool = False) -> list[str]:
        """Problems with the citations of ``text``; empty when every cited id is usable.

        ``allowed`` limits ids to the evidence shown to the writer (an id it was not shown
        is treated as invented); ``require`` demands at least one citation.
        """
        ids = cited_ids(text)
        ok = set(self.entries) if allowed is None else set(allowed) & set(self.entries)
        unknown = [i for i in ids if i not in ok]
        errors = style_errors(text)
        # No example ids in these messages: a weak model copies an example id verbatim, and a
        # real id copied without reading its evidence would pass this very check.
        stray = stray_brackets(text)
        if stray:
            errors.append(f"{', '.join(dict.fromkeys(stray[:4]))} {'is' if len(stray) == 1 else 'are'} not evidence "
                          "ids: brackets may hold only the ids of the evidence items you were given")
        if unknown:
            errors.append(f"unknown citation ids {', '.join(unknown)}: cite only ids that appear in "
                          "brackets at the start of the evidence items you were given")
        if require and not ids and ok:
            errors.append("no citation: after each claim, put the bracketed id of the evidence item that "
                          "supports it")
        return errors

    def evidence(self, ids: Sequence[str], max_chars: int = 700) -> str:
        """Evidence block shown to a model: one ``[id] title: text`` entry per id."""
        lines = []
        for cid in ids:
            e = self.entries[cid]
            text = " ".join(e.text.split())
            if "[" in text or "]" in text or (not text.isascii() and any(c in text for c in _WIDE_CHARS)):
                text = text.translate(_SOURCE_BRACKETS)
            if len(text) > max_chars:
                text = text[:max_chars].rsplit(" ", 1)[0] + " …"
            if e.accessed:  # web text is data, never instructions: fenced so it cannot pose as the prompt
                lines.append(f"[{cid}] {e.title} (web page text, untrusted): <<<{text}>>>")
            else:
                lines.append(f"[{cid}] {e.title}: {text}")
        return "\n".join(lines)

    def citations(self, ids: Iterable[str]) -> dict[str, Citation]:
        return {cid: self.entries[cid].citation() for cid in ids}

    def references(self, ids: Sequence[str], words: dict[str, str] | None = None) -> str:
        """Markdown reference list for ``ids`` (callers pass exactly the cited ids); ``words``:
        its labels in the report's language (deepr/evidence/phrases.py; English by default)."""
        w = {**REFERENCE_WORDS, **(words or {})}
        lines, pages = [], {}
        for cid in ids:  # web sources: one line per URL with every cited snippet and passage of it
            e = self.entries[cid]
            if e.url and e.accessed:
                pages.setdefault(e.url, []).append(e)
        passages: dict[str, list[str]] = {}  # one corpus passage reached by several searches: one line
        for cid in ids:
            e = self.entries[cid]
            if not e.accessed:
                passages.setdefault(e.passage_id, []).append(cid)
        done: set[str] = set()
        for cid in ids:
            e = self.entries[cid]
            if not e.accessed:
                if e.passage_id not in done:
                    done.add(e.passage_id)
                    same = passages[e.passage_id]
                    where = f" <{e.url}>" if e.url else ""
                    lines.append(f"- [{', '.join(same)}] {e.title or e.doc_id}{where}: “{_excerpt(e.text)}” "
                                 f"({w['passage']} `{e.passage_id}`)")
                continue
            group = pages.get(e.url or "\0")
            if group and len(group) > 1:
                if e.url not in done:
                    done.add(e.url)
                    kinds = ", ".join(f"{x.id} {w['page_passage'] if x.kind == 'fetch' else w['search_result']}"
                                      for x in group)
                    lines.append(f"- [{', '.join(x.id for x in group)}] {e.title or e.doc_id} <{e.url}>, "
                                 f"{w['accessed']} {min(x.accessed for x in group)[:10]} ({kinds})")
                continue
            where = f" <{e.url}>" if e.url else ""
            where += f", {w['accessed']} {e.accessed[:10]}" if e.accessed else ""
            kind = w["page_passage"] if e.kind == "fetch" else w["search_result"]
            lines.append(f"- [{cid}] {e.title or e.doc_id}{where}: “{_excerpt(e.text)}” ({kind})")
        return "\n".join(lines)
