"""DeepResearch Bench interop: read ``{id, prompt, article}`` reports that cite URLs with ``[n]``
markers and a numbered reference list, and export ``deepr run`` output in that format.

:func:`parse_references` finds numbered reference lines that carry a URL (``[3] Title
https://...``, ``3. https://...``, ``- [3]: <https://...>``) under a heading in any language,
or anywhere; such lines are never statements. :func:`cited_statements` splits the rest into
sentences and gives each its marker numbers: a marker right after a sentence's full stop, at
the start of the next sentence, or alone at the end of a paragraph belongs to the sentence
before it. :func:`group_statements` maps statements to URLs and merges statements that say
the same thing about the same URL. :func:`to_submission` turns run records into DRB rows.

Example::

    python -c "from deepr.search.drb import cited_statements as c; \
print(c('Lava is hot. [1] Ice is cold.[2]'))"
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from deepr.text import words

_URL = re.compile(r"https?://[^\s<>\"'\]）)，。]+")
_REF_LINE = re.compile(r"^\s*(?:[-*•]\s*)?(?:\[\^?(\d{1,4})\]|\^?(\d{1,4})[.):：])\s*:?\s*(.*)$")
_MARKER = re.compile(r"\[\^?(\d{1,4}(?:\s*[,;，、–-]\s*\^?\d{1,4})*)\]")
_LEAD = re.compile(r"^\s*((?:\[\^?\d[^\]\n]{0,40}\]\s*)+)")
_SENT_END = re.compile(r"(?<=[.!?。！？；])\s+|(?<=[。！？；])")
_AFTER_STOP = re.compile(r"([.!?。！？；])((?:\[\^?\d[^\]\n]{0,40}\])+)")
_HEADING = re.compile(r"^\s*(#{1,6}\s|\*\*[^*]{1,60}\*\*\s*:?\s*$)")


def _numbers(inner: str) -> list[int]:
    out: list[int] = []
    for part in re.split(r"\s*[,;，、]\s*", inner):
        part = part.replace("^", "")
        if re.fullmatch(r"\d+\s*[–-]\s*\d+", part):
            a, b = (int(x) for x in re.split(r"\s*[–-]\s*", part))
            out.extend(range(a, b + 1) if 0 <= b - a <= 20 else [a, b])
        elif part.strip().isdigit():
            out.append(int(part))
    return out


def parse_references(text: str) -> tuple[dict[int, dict[str, str]], str]:
    """({number: {"url", "title"}}, the article without reference lines and their heading)."""
    refs: dict[int, dict[str, str]] = {}
    body: list[str] = []
    for line in (text or "").splitlines():
        m, url = _REF_LINE.match(line), _URL.search(line)
        if m and url:
            n = int(m.group(1) or m.group(2))
            title = _URL.sub("", m.group(3)).strip(" -–:<>()[]*_\"'")
            refs.setdefault(n, {"url": url.group(0).rstrip(".,;:"), "title": title})
            while body and not body[-1].strip():
                body.pop()
            if body and _looks_heading(body[-1]) and not _MARKER.search(body[-1]):
                body.pop()  # the reference list's heading, whatever its language
            continue
        body.append(line)
    return refs, "\n".join(body)


def _looks_heading(line: str) -> bool:
    s = line.strip()
    return bool(_HEADING.match(line)) or (0 < len(s) <= 40 and not re.search(r"[.!?。！？]$", s))


def cited_statements(body: str) -> list[tuple[str, list[int]]]:
    """(statement without markers, marker numbers) for every sentence that cites something."""
    out: list[list[Any]] = []  # [text, numbers]
    for para in re.split(r"\n\s*\n", body or ""):
        lines = [ln for ln in para.splitlines() if ln.strip() and not _HEADING.match(ln)]
        text = _AFTER_STOP.sub(r"\1 \2", " ".join(ln.strip() for ln in lines))
        if not text:
            continue
        for piece in _SENT_END.split(text):
            lead = _LEAD.match(piece)
            if lead and out:  # markers opening a sentence close the one before
                out[-1][1].extend(n for m in _MARKER.finditer(lead.group(1)) for n in _numbers(m.group(1)))
                piece = piece[lead.end():]
            if piece.strip():
                nums = [n for m in _MARKER.finditer(piece) for n in _numbers(m.group(1))]
                out.append([piece, nums])
    result = []
    for sent, nums in out:
        clean = re.sub(r"\s+([.,;:!?。])", r"\1", re.sub(r"\s{2,}", " ", _MARKER.sub("", sent))).strip()
        if nums and len(words(clean)) >= 3:  # words: a Chinese sentence's, not its \w runs
            result.append((clean, list(dict.fromkeys(nums))))
    return result


def _jaccard(a: str, b: str) -> float:
    x, y = set(words(a)), set(words(b))
    return len(x & y) / len(x | y) if x | y else 1.0


def group_statements(pairs: Iterable[tuple[str, list[int]]], refs: dict[int, dict[str, str]],
                     embed: Callable[[list[str]], np.ndarray] | None = None,
                     same: float = 0.9) -> tuple[dict[str, list[str]], list[int]]:
    """({url: distinct statements}, marker numbers with no reference entry). Two statements
    citing one URL are the same when their embeddings' cosine ≥ ``same`` (or, without an
    embedder, their word sets overlap ≥ 0.8)."""
    groups: dict[str, list[str]] = {}
    missing: list[int] = []
    for statement, nums in pairs:
        for n in nums:
            if n not in refs:
                missing.append(n)
                continue
            groups.setdefault(refs[n]["url"], []).append(statement)
    return {u: _dedupe(s, embed, same) for u, s in groups.items()}, sorted(set(missing))


def _dedupe(statements: Sequence[str], embed: Callable[[list[str]], np.ndarray] | None, same: float) -> list[str]:
    uniq = list(dict.fromkeys(statements))
    if len(uniq) < 2:
        return uniq
    if embed is not None:
        mat = np.asarray(embed(uniq), dtype=np.float32)
        mat /= np.maximum(np.linalg.norm(mat, axis=1, keepdims=True), 1e-9)
        sim = mat @ mat.T
    else:
        sim = np.array([[_jaccard(a, b) for b in uniq] for a in uniq])
        same = 0.8
    kept: list[int] = []
    for i in range(len(uniq)):
        if all(sim[i, j] < same for j in kept):
            kept.append(i)
    return [uniq[i] for i in kept]


# --- export ---------------------------------------------------------------------------------


def _drb_id(value: Any) -> Any:
    """DRB ids are integers: keep ints (and digit strings) as ints, anything else as given."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return value


def article_from_report(markdown: str, citations: dict[str, Any]) -> str:
    """A deepr report rewritten with ``[n]`` markers and a numbered ``## References`` list of URLs
    (sources without a URL keep their title and doc id)."""
    from deepr.evidence.citations import cited_ids
    from deepr.evidence.phrases import TABLES, phrases

    heads = "|".join(re.escape(t["references"]) for t in TABLES.values())  # a report in any language
    body = re.split(rf"^## (?:{heads})\s*$", markdown, maxsplit=1, flags=re.M)[0].rstrip()
    order = [c for c in cited_ids(body) if c in citations]
    number: dict[str, int] = {}
    lines = []
    for cid in order:
        c = citations[cid]
        key = c.get("url") or c.get("doc_id") or cid
        if key not in {citations[k].get("url") or citations[k].get("doc_id") or k for k in number}:
            lines.append((len(lines) + 1, c))
        number[cid] = next(n for n, cc in lines if (cc.get("url") or cc.get("doc_id")) ==
                           (c.get("url") or c.get("doc_id")))

    def renumber(m: re.Match) -> str:
        ids = [t for t in re.split(r"[\s,;]+", m.group(1)) if t]
        if not ids or not all(t in number for t in ids):
            return m.group(0)
        return "".join(f"[{n}]" for n in dict.fromkeys(number[t] for t in ids))

    text = re.sub(r"\[([^\[\]\n]{1,400})\](?!\()", renumber, body)
    refs = [f"[{n}] {c.get('title') or c.get('doc_id')}. {c.get('url') or 'doc ' + str(c.get('doc_id'))}"
            for n, c in lines]
    heading = phrases(text)["references"]  # the article's language: 参考文献 under a Chinese report
    return text + (f"\n\n## {heading}\n\n" + "\n".join(refs) if refs else "") + "\n"


def to_submission(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``{id, prompt, article}`` per run record (``id``, ``query``/``prompt``, ``report``, ``citations``)."""
    out = []
    for r in rows:
        prompt = r.get("prompt") or r.get("query") or ""
        article = article_from_report(r.get("report") or "", r.get("citations") or {})
        out.append({"id": _drb_id(r.get("id")), "prompt": prompt, "article": article})
    return out
