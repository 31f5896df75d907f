"""Seed topics for ``deepr build-trees``: sampled from the corpus or read from a file.

Inputs: the corpus documents (title, text, optional ``topic`` category) or a topics
file (``.txt``: one topic per line, ``#`` starts a comment; ``.jsonl``: objects with
``topic`` or ``title`` and optional ``category``, ``description``, ``id``).
Output: a list of :class:`SeedTopic`, each carrying the deterministic id of the tree it
seeds, so shards, resumed runs and re-runs with a larger ``--n-trees`` agree on ids.

    deepr build-trees --corpus wiki --n-trees 20 --out trees.jsonl          # sampled
    deepr build-trees --corpus wiki --topics topics.txt --out trees.jsonl   # given

Sampling is stratified: categories take turns (round robin over sorted category
names) and each category's documents are visited in a seeded shuffled order, so 20
trees over the wiki corpus span its 12 categories and the first N of a larger run are
exactly the N of a smaller one.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from deepr.io import RecordError

_SLUG = re.compile(r"[^a-z0-9]+")


class SeedTopic(BaseModel):
    """One seed of one evidence tree."""

    id: str = Field(description="Id of the tree this topic seeds (stable across runs and shards).")
    title: str = Field(min_length=1, description="The seed topic text, e.g. a document title.")
    category: str | None = Field(None, description="Corpus category the topic was drawn from, if any.")
    description: str | None = Field(None, description="Short description shown to the root-query role.")
    doc_id: str | None = Field(None, description="Corpus document the topic was taken from, if sampled.")


def tree_id(title: str, seed: int = 0) -> str:
    """``tree-<slug>-<hash>``: readable, and unique per (title, seed)."""
    slug = _SLUG.sub("-", title.lower()).strip("-")[:40] or "topic"
    digest = hashlib.sha1(f"{seed}|{title}".encode()).hexdigest()[:8]
    return f"tree-{slug}-{digest}"


def _field(doc: Any, name: str) -> Any:
    if isinstance(doc, Mapping):
        return doc.get(name)
    return getattr(doc, name, None)


def sample_topics(documents: Iterable[Any], n: int, *, seed: int = 0,
                  min_words: int = 30) -> list[SeedTopic]:
    """``n`` seed topics from document titles, stratified by the documents' ``topic`` field.

    Documents shorter than ``min_words`` make thin roots and are skipped. Fewer than ``n``
    topics come back only when the corpus has fewer usable documents.
    """
    if n < 1:
        raise ValueError(f"--n-trees {n}: need at least 1 tree")
    remote = getattr(documents, "sample_topics", None)
    if callable(remote):  # a served corpus (deepr/corpus/remote.py): the server samples, by this function
        return [SeedTopic(**t) for t in remote(n, seed=seed, min_words=min_words)]
    groups: dict[str, list[Any]] = {}
    for doc in documents:
        title = (_field(doc, "title") or "").strip()
        if title and len(str(_field(doc, "text") or "").split()) >= min_words:
            groups.setdefault(_field(doc, "topic") or "", []).append(doc)
    order: dict[str, list[Any]] = {}
    for name in sorted(groups):
        docs = sorted(groups[name], key=lambda d: str(_field(d, "id")))
        random.Random(f"{seed}|{name}").shuffle(docs)
        order[name] = docs
    picked: list[SeedTopic] = []
    seen: set[str] = set()
    cursors = {name: 0 for name in order}
    while len(picked) < n and any(cursors[g] < len(order[g]) for g in order):
        for name in order:
            if len(picked) >= n:
                break
            docs, i = order[name], cursors[name]
            while i < len(docs) and _field(docs[i], "title").strip() in seen:
                i += 1
            cursors[name] = i + 1
            if i >= len(docs):
                continue
            doc = docs[i]
            title = _field(doc, "title").strip()
            seen.add(title)
            picked.append(SeedTopic(id=tree_id(title, seed), title=title, category=name or None,
                                    description=_field(doc, "description"),
                                    doc_id=str(_field(doc, "id"))))
    return picked


def load_topics(path: str | Path, *, seed: int = 0) -> list[SeedTopic]:
    """Read a ``--topics`` file; a bad line raises :class:`RecordError` naming file and line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such topics file (one topic per line, or JSONL with 'topic')")
    out: list[SeedTopic] = []
    seen: set[str] = set()
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        topic = _parse_topic_line(line, path, lineno, seed, jsonl=path.suffix == ".jsonl")
        if topic.id in seen:
            raise RecordError(path, lineno, f"duplicate topic id {topic.id!r}; each tree needs its own id",
                              field="id")
        seen.add(topic.id)
        out.append(topic)
    if not out:
        raise ValueError(f"{path}: the topics file has no topics")
    return out


def _parse_topic_line(line: str, path: Path, lineno: int, seed: int, *, jsonl: bool) -> SeedTopic:
    if not jsonl:
        return SeedTopic(id=tree_id(line, seed), title=line)
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise RecordError(path, lineno, f"not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise RecordError(path, lineno, "expected a JSON object like {\"topic\": \"...\"}")
    title = obj.get("topic") or obj.get("title")
    if not isinstance(title, str) or not title.strip():
        raise RecordError(path, lineno, "needs a non-empty 'topic' (or 'title') string", field="topic")
    title = title.strip()
    return SeedTopic(id=str(obj.get("id") or tree_id(title, seed)), title=title,
                     category=obj.get("category"), description=obj.get("description"),
                     doc_id=obj.get("doc_id"))
