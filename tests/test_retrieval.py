"""Embedder, index cache, search modes, fusion, agent tools and the index/search CLI.

Uses the session fixtures of conftest.py (``mini_corpus``: ~180 wiki articles;
``retriever``: a hybrid index over it) and a tiny hand-written corpus for cache tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deepr.corpus import BrowseRefused, ResearchTools, UnknownIdError, open_retriever, rrf_fuse
from deepr.corpus import index as index_mod
from deepr.corpus.embed import get_embedder
from deepr.records import Document

TINY = [
    ("volcano", "Volcano", "A volcano is a rupture in the crust of a planet where lava and ash escape."),
    ("violin", "Violin", "The violin is a wooden string instrument played with a bow."),
    ("photosynthesis", "Photosynthesis",
     "Photosynthesis lets plants turn light, water and carbon dioxide into sugar."),
    ("chess", "Chess", "Chess is a board game for two players on a checkered board of 64 squares."),
    ("saturn", "Saturn", "Saturn is the sixth planet from the Sun, known for its bright rings of ice."),
    ("bread", "Bread", "Bread is a staple food baked from a dough of flour and water."),
]


@pytest.fixture()
def tiny_corpus(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps({"id": i, "title": t, "text": x}) + "\n" for i, t, x in TINY),
                    encoding="utf-8")
    return path


# --- embedder ----------------------------------------------------------------------------


def test_embedder_vectors_are_unit_float32_and_cached(embedder) -> None:
    before = embedder.encoded
    vecs = embedder.encode(["a small cat", "a small cat", "tax forms for 2024"])
    assert vecs.shape == (3, embedder.dim) and vecs.dtype.name == "float32"
    assert abs(float((vecs * vecs).sum(1).max()) - 1.0) < 1e-4
    assert (vecs[0] == vecs[1]).all()
    assert embedder.encoded - before <= 2  # the repeated text went to the model at most once
    again = embedder.encoded
    embedder.encode(["a small cat"])
    assert embedder.encoded == again  # second time: served from the cache
    assert get_embedder() is get_embedder()
    assert "MiniLM" in embedder.name


def test_cos_ranks_related_text_higher(embedder) -> None:
    sims = embedder.cos(["a cat sleeping"], ["a kitten napping", "quarterly tax return"])
    assert sims.shape == (1, 2) and sims[0, 0] > sims[0, 1] + 0.2
    assert embedder.cos([], ["x"]).shape == (0, 1)


# --- fusion ------------------------------------------------------------------------------


def test_rrf_fusion_order_on_a_hand_example() -> None:
    dense, bm25 = [10, 20, 30], [30, 40, 10]
    fused = rrf_fuse([dense, bm25], [1.0, 1.0], k=60)
    # 10: 1/61+1/63, 30: 1/63+1/61 (tie, broken by best single rank: both 1 -> smaller id),
    # 20: 1/62, 40: 1/62 (tie: both rank 2 -> smaller id)
    assert [i for i, _ in fused] == [10, 30, 20, 40]
    assert fused[0][1] == pytest.approx(1 / 61 + 1 / 63)
    weighted = rrf_fuse([dense, bm25], [1.0, 3.0], k=60)
    # 30: 1/63 + 3/61 > 10: 1/61 + 3/63 > 40: 3/62 > 20: 1/62
    assert [i for i, _ in weighted] == [30, 10, 40, 20]  # a heavier BM25 vote reorders


# --- search -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["dense", "bm25", "hybrid"])
def test_title_query_finds_its_article(retriever, mode: str) -> None:
    docs = [d for d in retriever.documents if d.text.strip()]
    ranked = retriever.search_many([d.title for d in docs], k=5, mode=mode)
    top1 = sum(bool(hits) and hits[0].doc_id == d.id for d, hits in zip(docs, ranked))
    top5 = sum(d.id in {h.doc_id for h in hits} for d, hits in zip(docs, ranked))
    assert top1 >= 0.9 * len(docs), f"{mode}: title found first for only {top1}/{len(docs)}"
    assert top5 >= 0.97 * len(docs), f"{mode}: title in top 5 for only {top5}/{len(docs)}"


def test_hits_carry_stable_ids_ranks_and_sources(retriever) -> None:
    doc = retriever.documents[0]
    hits = retriever.search(doc.title, k=4)
    assert [h.rank for h in hits] == [1, 2, 3, 4]
    assert all(h.score >= nxt.score for h, nxt in zip(hits, hits[1:]))
    for h in hits:
        p = retriever.get_passage(h.id)
        assert h.id.startswith(h.doc_id + "#") and (p.text, p.doc_id) == (h.text, h.doc_id)
        assert retriever.get_document(h.doc_id).title == h.title


def test_blank_and_stopword_queries_return_nothing(retriever) -> None:
    assert retriever.search("") == [] and retriever.search("   \n") == []
    assert retriever.search("the of and", mode="bm25") == []
    assert retriever.search_many(["", "chess"], k=2)[0] == []


def test_a_bm25_search_scores_in_the_calling_thread(retriever, monkeypatch) -> None:
    """An agent runs a search between two model calls on its one event loop; bm25s given
    n_threads=1 started a thread pool for every search (~2 ms, ten times the scoring)."""
    import threading

    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), real_start(self))[1])
    hits = [retriever.search(q, k=2, mode="bm25") for q in ("Paris France capital", "photosynthesis plants")]
    assert all(hits) and started == []


def test_search_many_matches_single_searches(retriever) -> None:
    queries = [d.title for d in retriever.documents[:5]]
    batched = retriever.search_many(queries, k=3)
    single = [retriever.search(q, k=3) for q in queries]
    assert [[h.id for h in hs] for hs in batched] == [[h.id for h in hs] for hs in single]
    scores = [h.score for hs in single for h in hs]
    assert [h.score for hs in batched for h in hs] == pytest.approx(scores, abs=1e-3)


def test_bad_arguments_and_unknown_ids_are_clear(retriever) -> None:
    with pytest.raises(ValueError, match="at least one"):
        retriever.search("x", k=0)
    with pytest.raises(ValueError, match="expected one of dense, bm25, hybrid"):
        retriever.search("x", mode="sparse")
    with pytest.raises(UnknownIdError, match="no passage 'nope#0'"):
        retriever.get_passage("nope#0")
    with pytest.raises(UnknownIdError, match="no document 'nope'"):
        retriever.get_document("nope")


# --- cache -------------------------------------------------------------------------------


def test_second_open_reuses_the_cached_index(tiny_corpus: Path, tmp_path: Path) -> None:
    emb = get_embedder(use="index")  # the one open_retriever uses by default
    first = open_retriever(str(tiny_corpus), cache_dir=tmp_path / "c", progress=False)
    assert first.built and (first.path / "index.meta.json").is_file()
    stamp, encoded = (first.path / "dense.faiss").stat().st_mtime_ns, emb.encoded
    second = open_retriever(str(tiny_corpus), cache_dir=tmp_path / "c", progress=False, retriever="dense")
    assert not second.built and second.path == first.path
    assert emb.encoded == encoded  # no passage was embedded again
    assert (second.path / "dense.faiss").stat().st_mtime_ns == stamp
    assert second.search("planet with rings", k=1)[0].doc_id == "saturn"
    meta = json.loads((first.path / "index.meta.json").read_text())
    assert meta["counts"] == {"passages": 6, "documents": 6, "documents_without_text": 0}
    assert meta["stage"] == "index"
    assert meta["inputs"][0]["path"] == str(tiny_corpus) and len(meta["inputs"][0]["sha256"]) == 64
    assert meta["config"]["chunking"] == {"max_words": 120, "overlap": 20}


def test_changed_corpus_or_chunking_gets_a_new_index(tiny_corpus: Path, tmp_path: Path) -> None:
    from deepr.corpus import ChunkConfig

    a = open_retriever(str(tiny_corpus), cache_dir=tmp_path, progress=False)
    b = open_retriever(str(tiny_corpus), cache_dir=tmp_path, progress=False, chunking=ChunkConfig(max_words=60))
    docs = [Document(id=i, title=t, text=x + " Edited.") for i, t, x in TINY] + [Document(id="blank", text=" ")]
    c = open_retriever(docs, cache_dir=tmp_path, progress=False)
    assert len({a.path, b.path, c.path}) == 3 and b.built and c.built
    assert c.describe()["documents_without_text"] == 1  # counted, not silently lost


def test_interrupted_build_leaves_no_index_and_resumes(tiny_corpus: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_mod, "SHARD", 2)  # 6 passages -> 3 saved shards

    def stop_after_first_shard(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        open_retriever(str(tiny_corpus), cache_dir=tmp_path, progress=stop_after_first_shard)
    index_dir = tmp_path / "index"
    assert [p.name.endswith(".partial") for p in index_dir.iterdir()] == [True]  # no half index
    emb = get_embedder(use="index")  # the one open_retriever uses by default
    before = emb.encoded
    r = open_retriever(str(tiny_corpus), cache_dir=tmp_path, progress=False)
    assert emb.encoded - before == 4  # only the two unfinished shards were embedded
    assert r.built and [p.name for p in index_dir.iterdir()] == [r.path.name]
    assert r.search("bow and strings", k=1, mode="dense")[0].doc_id == "violin"


# --- tools -------------------------------------------------------------------------------


def test_browse_only_opens_what_search_returned(retriever) -> None:
    tools = ResearchTools(retriever, k=3)
    target = retriever.documents[3]
    with pytest.raises(BrowseRefused, match="not returned by an earlier search"):
        tools.browse(target.id)
    assert "browse refused" in tools.call("browse", doc_id="/etc/passwd")
    hits = tools.search(target.title)
    assert len(hits) == 3
    assert tools.browse(hits[0].doc_id) == retriever.get_document(hits[0].doc_id).text
    assert tools.browse(hits[1].id) == retriever.get_document(hits[1].doc_id).text  # passage id -> doc
    names = [(e["name"], e["ok"]) for e in tools.log]
    assert names == [("browse", False), ("browse", False), ("search", True), ("browse", True), ("browse", True)]
    assert tools.log[2]["ids"] == [h.id for h in hits] and tools.log[2]["arguments"] == {"query": target.title}
    assert all(e["seconds"] >= 0 for e in tools.log)


def test_tool_text_interface_and_scholar(retriever) -> None:
    tools = ResearchTools(retriever, k=2, scholar=retriever, max_chars=40)
    assert [f.__name__ for f in tools.functions()] == ["search", "browse", "scholar"]
    text = tools.call("scholar", query=retriever.documents[0].title)
    first_id = text.split("]")[0].lstrip("[")
    assert first_id in {p.id for p in retriever.passages}
    assert tools.call("browse", doc_id=first_id).endswith("[truncated]")
    assert "unknown tool" in tools.call("delete", path="x")
    assert "scholar" not in ResearchTools(retriever).names


# --- CLI ---------------------------------------------------------------------------------


def test_cli_index_then_search(tiny_corpus: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from deepr.cli import app

    runner = CliRunner()
    cache = tmp_path / "cache"
    res = runner.invoke(app, ["index", "--corpus", str(tiny_corpus), "--cache-dir", str(cache)])
    assert res.exit_code == 0, res.output
    assert "passages" in res.output and "built now" in res.output
    assert len(list((cache / "index").glob("*/index.meta.json"))) == 1
    res = runner.invoke(app, ["search", "game on a checkered board", "--corpus", str(tiny_corpus),
                              "--cache-dir", str(cache), "-k", "2", "--json"])
    assert res.exit_code == 0, res.output
    hits = json.loads(res.stdout)
    assert hits[0]["id"] == "chess#0" and hits[0]["rank"] == 1 and len(hits) == 2
    res = runner.invoke(app, ["search", "lava", "--corpus", str(tiny_corpus), "--cache-dir", str(cache),
                              "--retriever", "bm25"])
    assert res.exit_code == 0 and "1. [volcano#0] Volcano" in res.stdout


def test_cli_index_and_search_for_bm25_alone(tiny_corpus: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from deepr.cli import app

    runner = CliRunner()
    cache = tmp_path / "cache"
    res = runner.invoke(app, ["index", "--corpus", str(tiny_corpus), "--cache-dir", str(cache), "--retriever", "bm25"],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "none (--retriever bm25)" in res.output and "built now" in res.output
    assert not list((cache / "index").glob("*/dense.faiss"))
    res = runner.invoke(app, ["search", "lava", "--corpus", str(tiny_corpus), "--cache-dir", str(cache),
                              "--retriever", "bm25"])
    assert res.exit_code == 0 and "1. [volcano#0] Volcano" in res.stdout


def test_cli_bad_corpus_is_a_clean_error(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from deepr.cli import app

    res = CliRunner().invoke(app, ["index", "--corpus", str(tmp_path / "nope.jsonl"),
                                   "--cache-dir", str(tmp_path)])
    assert res.exit_code == 2 and "no such file or folder" in res.output
    assert "Traceback" not in res.output
    res = CliRunner().invoke(app, ["search", "x", "--corpus", "wiki", "--retriever", "magic",
                                   "--cache-dir", str(tmp_path), "--limit", "1"])
    assert res.exit_code == 2 and "expected one of dense, bm25, hybrid" in res.output


def test_cli_help_explains_every_flag() -> None:
    from typer.testing import CliRunner

    from deepr.cli import app

    for cmd, flags in [("index", ["--corpus", "--retriever", "--cache-dir", "--limit", "--precision"]),
                       ("search", ["--corpus", "--top-k", "--retriever", "--json", "--cache-dir"])]:
        res = CliRunner().invoke(app, [cmd, "--help"], terminal_width=200)
        assert res.exit_code == 0
        for flag in flags:
            line = next(ln for ln in res.output.splitlines() if flag in ln)
            assert len(line.split(flag, 1)[1].strip(" │")) > 20, f"{cmd} {flag} has no help text"


# --- the embedder: a library-exported ONNX model on onnxruntime ------------------------------


def test_embedder_gives_sentence_transformers_vectors(mini_corpus: Path) -> None:
    """Queries and rewards get fp32 vectors within cosine 0.999 of sentence-transformers' own
    (a text past the 256-token limit included); the index's int8 passage vectors stay close."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from deepr.corpus.embed import Embedder, default_model_path

    # 48 passages keep this quick on a shared 2-core machine; bench/cold_start.py checks 1,000
    texts = _sample_texts(mini_corpus, 48) + ["  leading spaces", "ÜNÏCÖDÉ and UPPER case"]
    ref = SentenceTransformer(default_model_path(), device="cpu").encode(texts, normalize_embeddings=True)
    fp32 = Embedder(precision="fp32").encode(texts, cache=False)
    int8 = Embedder(precision="int8").encode_passages(texts)
    assert fp32.dtype == np.float32 and fp32.shape == ref.shape == int8.shape
    cos = (fp32 * ref).sum(1)
    assert float(cos.min()) >= 0.999, f"lowest cosine {cos.min():.5f} at text {int(cos.argmin())}"
    assert float((int8 * ref).sum(1).min()) >= 0.98
    assert np.allclose((int8 * int8).sum(1), 1.0, atol=1e-4)


def test_a_texts_vector_does_not_depend_on_its_call(embedder) -> None:
    """Texts of very different lengths share a padded batch; each keeps its place and its vector,
    whether encoded alone, together, or from several threads at once (eval scores concurrently)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    texts = ["volcano", "A volcano is a rupture in the crust of a planetary-mass object, such as Earth, "
             "that allows hot lava, volcanic ash, and gases to escape from a magma chamber below the surface.",
             "Mount Etna eruption", "lava", ""]
    together = embedder.encode(texts, cache=False)
    alone = np.vstack([embedder.encode([t], cache=False) for t in texts])
    assert np.abs(together - alone).max() < 1e-5
    assert np.allclose((together * together).sum(1), 1.0, atol=1e-5)
    calls = [[f"question {i} about volcanoes and {w}" for w in ("ash", "lava flows in Iceland", "Etna")]
             for i in range(8)]
    one_by_one = [embedder.encode(c, cache=False) for c in calls]
    with ThreadPoolExecutor(4) as pool:
        at_once = list(pool.map(lambda c: embedder.encode(c, cache=False), calls))
    assert max(float(np.abs(a - b).max()) for a, b in zip(one_by_one, at_once)) < 1e-5
    assert embedder.encode_passages([]).shape == (0, embedder.dim)


def test_the_export_is_made_once_and_found_by_the_models_files(tmp_path: Path, monkeypatch) -> None:
    """A second process finds the exported files instead of exporting again; a changed model
    file is another model and gets its own export folder."""
    import shutil

    from deepr.corpus import embed_export
    from deepr.corpus.embed import default_model_path

    monkeypatch.setenv("DEEPR_EMBEDDER_CACHE", str(tmp_path / "exports"))
    model = tmp_path / "model"
    shutil.copytree(default_model_path(), model)
    first = embed_export.ensure_exported(str(model), None)
    assert sorted(p.name for p in first.iterdir()) == ["meta.json", "model.onnx", "model_int8.onnx", "tokenizer.json"]
    monkeypatch.setattr(embed_export, "_export", lambda *a: pytest.fail("exported twice"))
    assert embed_export.ensure_exported(str(model), None) == first
    (model / "config.json").write_text((model / "config.json").read_text() + " ", encoding="utf-8")
    assert embed_export.export_dir(str(model), None) != first
    assert list((tmp_path / "exports").iterdir()) == [first]  # no temporary folder left behind


def test_bm25_retriever_embeds_nothing_and_needs_no_faiss(tiny_corpus: Path, tmp_path: Path) -> None:
    """A BM25-only user (or a machine without faiss) gets an index without the corpus embedding pass;
    a later hybrid open of the same corpus builds the dense half instead of failing."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['faiss'] = None; from deepr.corpus import open_retriever; "
            f"r = open_retriever({str(tiny_corpus)!r}, cache_dir={str(tmp_path)!r}, progress=False, "
            "retriever='bm25'); h = r.search('planet with rings', k=1); print(h[0].doc_id, r.built, "
            "r.embedder.encoded)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["saturn", "True", "0"]
    index = next((tmp_path / "index").iterdir())
    assert (index / "bm25").is_dir() and not (index / "dense.faiss").exists()
    bm25_only = open_retriever(str(tiny_corpus), cache_dir=tmp_path, progress=False, retriever="bm25")
    assert not bm25_only.built  # the BM25-only index is reused by a BM25 search
    assert bm25_only.describe()["dense_index"] is None and bm25_only.describe()["mode"] == "bm25"
    with pytest.raises(ValueError, match="indexed for BM25 alone"):
        bm25_only.search("planet with rings", mode="dense")
    hybrid = open_retriever(str(tiny_corpus), cache_dir=tmp_path, progress=False)
    assert hybrid.built and (hybrid.path / "dense.faiss").is_file()
    assert hybrid.search("planet with rings", k=1, mode="dense")[0].doc_id == "saturn"
    assert hybrid.describe()["dense_index"]["vectors"] == 6
    # the full index serves a later BM25 search too, its dense half left closed until asked for
    again = open_retriever(str(tiny_corpus), cache_dir=tmp_path, progress=False, retriever="bm25")
    assert not again.built and again.search("planet with rings", k=1, mode="dense")[0].doc_id == "saturn"


def test_bm25_keeps_an_installed_jax_off_the_gpu(tiny_corpus: Path, tmp_path: Path) -> None:
    """bm25s calls JAX once on import when jax is installed; with a GPU that call would reserve 75 %
    of the card. A stand-in jax records the platform it was started on and every top-k asked of it."""
    import subprocess
    import sys

    fake = tmp_path / "site" / "jax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("from . import lax\n")
    (fake / "lax.py").write_text(
        "import os, numpy as np\nCALLS = []\n"
        "def top_k(x, k):\n"
        "    CALLS.append(os.environ.get('JAX_PLATFORMS'))\n"
        "    i = np.argsort(-np.asarray(x))[:k]\n    return np.asarray(x)[i], i\n")
    code = ("import sys; sys.modules['faiss'] = None; from deepr.corpus import open_retriever; "
            f"r = open_retriever({str(tiny_corpus)!r}, cache_dir={str(tmp_path / 'c')!r}, progress=False, "
            "retriever='bm25'); h = r.search('planet with rings', k=1); import jax.lax; "
            "print(h[0].doc_id, jax.lax.CALLS)")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("JAX_PLATFORMS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    # bm25s's import-time probe ran on the CPU platform; the search itself used numpy's top-k
    assert out.stdout.split() == ["saturn", "['cpu']"]


def test_search_process_never_imports_torch(tiny_corpus: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Even when the index's passages are bf16 (encoded on torch), a process that opens the built
    index and searches it embeds its queries on onnxruntime and never imports torch."""
    import subprocess
    import sys

    monkeypatch.setenv("DEEPR_NATIVE_BF16", "1")  # auto -> bf16 here and in the child, on any CPU
    built = open_retriever(str(tiny_corpus), cache_dir=tmp_path, progress=False)  # build here (uses torch)
    assert built.embedder.name == "all-MiniLM-L6-v2+bf16"
    code = ("import sys; from deepr.corpus import open_retriever; "
            f"r = open_retriever({str(tiny_corpus)!r}, cache_dir={str(tmp_path)!r}, progress=False); "
            "assert not r.built; h = r.search('planet with rings', k=1, mode='dense'); "
            "heavy = [m for m in ('torch', 'sentence_transformers', 'transformers') if m in sys.modules]; "
            "print(r.embedder.name, h[0].doc_id, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["all-MiniLM-L6-v2+bf16", "saturn", "[]"]


# --- incremental rebuilds, shards, approximate index ---------------------------------------


def test_rebuild_after_edit_embeds_only_new_or_changed_passages(tiny_corpus: Path, tmp_path: Path) -> None:
    emb = get_embedder(use="index")  # the one open_retriever uses by default
    open_retriever(str(tiny_corpus), cache_dir=tmp_path, progress=False)
    docs = [Document(id=i, title=t, text=x) for i, t, x in TINY]
    docs[1] = Document(id="violin", title="Violin", text="The violin has four strings tuned in fifths.")
    docs.append(Document(id="comet", title="Comet", text="A comet is an icy body that grows a tail near the Sun."))
    before = emb.encoded
    r = open_retriever(docs, cache_dir=tmp_path, progress=False)
    assert r.built and emb.encoded - before == 2  # the edited violin and the new comet only
    assert r.search("icy body with a tail", k=1, mode="dense")[0].doc_id == "comet"
    assert r.search("strings tuned in fifths", k=1, mode="dense")[0].doc_id == "violin"


def _vectors(r) -> "np.ndarray":  # noqa: F821
    return r._dense.reconstruct_n(0, r._dense.ntotal)


@pytest.mark.parametrize("precision", ["fp32", "int8", "bf16"])
def test_shards_then_merge_equal_a_single_build(tiny_corpus: Path, tmp_path: Path, precision: str) -> None:
    import numpy as np

    from deepr.corpus.shards import build_shard, merge_shards, shard_of

    emb = get_embedder(precision=precision, use="index")
    single = open_retriever(str(tiny_corpus), cache_dir=tmp_path / "one", progress=False, embedder=emb)
    sizes = [build_shard(str(tiny_corpus), k, 3, embedder=emb, cache_dir=tmp_path / f"w{k}",
                         shard_dir=tmp_path / "shards")[1] for k in (1, 2, 3)]
    assert sizes == [sum(shard_of(p.id, 3) == k for p in single.passages) for k in (1, 2, 3)]
    assert sum(sizes) == 6 and max(sizes) < 6  # a real partition, not one machine doing it all
    before = emb.encoded
    merged = merge_shards(str(tiny_corpus), embedder=emb, cache_dir=tmp_path / "merge", shard_dir=tmp_path / "shards")
    assert emb.encoded == before  # the merge embedded nothing
    assert [p.id for p in merged.passages] == [p.id for p in single.passages]
    a, b = _vectors(merged), _vectors(single)
    if precision == "fp32":
        assert np.abs(a - b).max() < 1e-3
    else:  # int8 activations are scaled per batch, and bf16 rounds differently in another padded
        # batch, so other batch-mates move a vector slightly
        assert float((a * b).sum(1).min()) > (0.999 if precision == "bf16" else 0.99)
    k = 3 if precision == "fp32" else 1  # int8/bf16: the unrelated tail of 6 passages may swap
    for q in ("bow and strings", "baked dough", "lava"):
        assert [h.id for h in merged.search(q, k=k)] == [h.id for h in single.search(q, k=k)]


def test_merge_with_a_missing_shard_is_a_clear_error(tiny_corpus: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from deepr.cli import app

    runner = CliRunner()
    base = ["index", "--corpus", str(tiny_corpus), "--cache-dir", str(tmp_path), "--shard-dir", str(tmp_path / "s")]
    assert runner.invoke(app, base + ["--shard", "1/2"]).exit_code == 0
    res = runner.invoke(app, base + ["--merge"])
    assert res.exit_code == 2 and "shard(s) 2/2 missing" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, base + ["--shard", "3/2"])
    assert res.exit_code == 2 and "1 <= K <= N" in res.output
    assert runner.invoke(app, base + ["--shard", "2/2"]).exit_code == 0
    res = runner.invoke(app, base + ["--merge"])
    assert res.exit_code == 0 and "built now" in res.output, res.output


def test_dense_index_turns_approximate_above_the_threshold(mini_corpus: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from deepr.corpus import dense

    exact = open_retriever(str(mini_corpus), cache_dir=tmp_path, progress=False, retriever="dense")
    assert exact.describe()["dense_index"]["kind"] == "flat"
    monkeypatch.setattr(dense, "ANN_THRESHOLD", len(exact.passages))  # this corpus is now "large"
    approx = open_retriever(str(mini_corpus), cache_dir=tmp_path, progress=False, retriever="dense")
    info = approx.describe()["dense_index"]
    assert approx.path != exact.path and info["kind"] == "ivf" and info["nlist"] > 1
    assert info["vectors"] == len(exact.passages)
    queries = [d.title for d in exact.documents[::6]]
    agree = [len({h.id for h in a} & {h.id for h in b}) / 5
             for a, b in zip(exact.search_many(queries, k=5), approx.search_many(queries, k=5))]
    assert sum(agree) / len(agree) >= 0.8  # recall of the approximate top-5 against exact search
    monkeypatch.setattr(dense, "ANN_THRESHOLD", len(exact.passages) + 1)
    assert open_retriever(str(mini_corpus), cache_dir=tmp_path, progress=False).path == exact.path


# --- index precision ------------------------------------------------------------------------


def _sample_texts(mini_corpus: Path, n: int) -> list[str]:
    from deepr.corpus import ChunkConfig
    from deepr.corpus.index import embed_text, load_corpus

    _, _, passages = load_corpus(str(mini_corpus), ChunkConfig())
    return [embed_text(p) for p in passages[:n]] + ["a cat", "Who designed the Eiffel Tower?", "x " * 400]


def test_int8_index_build_runs_without_torch(tiny_corpus: Path, tmp_path: Path, embedder) -> None:
    """Once the model is exported, `deepr index --precision int8` embeds on onnxruntime with no
    torch import, under an index key of its own, and fp32 queries still find the right passage."""
    import subprocess
    import sys

    assert embedder.dim == 384  # the export exists (this session's DEEPR_CACHE, which the child shares)
    code = ("import sys; from deepr.corpus import open_retriever, get_embedder; "
            "e = get_embedder(precision='int8'); "
            f"r = open_retriever({str(tiny_corpus)!r}, cache_dir={str(tmp_path)!r}, embedder=e, progress=False); "
            "v = e.encode_passages([f'passage number {i}' for i in range(40)]); "
            "h = r.search('planet with rings', k=1, mode='dense'); "
            "print(e.name, h[0].doc_id, v.shape[0], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    name, doc, rows, torch_loaded = out.stdout.split()
    assert name == "all-MiniLM-L6-v2+int8-ort2" and doc == "saturn" and rows == "40" and torch_loaded == "False"


def test_precision_auto_per_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto``: rewards are fp32 (their numbers must not follow the index default); an index's
    passages are bf16 on a CPU with native bf16, else int8. An explicit choice wins; anything
    else is a clear error."""
    from deepr.corpus import embed

    monkeypatch.delenv("DEEPR_NATIVE_BF16", raising=False)
    assert embed.native_bf16("fpu vme sse2 avx512f avx512_bf16 avx512_fp16")
    assert embed.native_bf16("fpu sse2 amx_bf16 amx_tile amx_int8")
    assert not embed.native_bf16("fpu sse2 avx2 avx512f avx512_vnni amx_tile")
    for flags, index_default in (("fpu avx2 amx_bf16 amx_tile", "bf16"), ("fpu sse2 avx2 fma", "int8")):
        monkeypatch.setattr(embed, "_cpu_flags", lambda flags=flags: flags)
        assert embed.resolve_precision("auto", "index") == index_default
        assert embed.Embedder(use="index").precision == index_default
        assert embed.resolve_precision("auto") == "fp32" and embed.get_embedder().name == "all-MiniLM-L6-v2"
        assert embed.Embedder(use="rewards").name == "all-MiniLM-L6-v2"
    monkeypatch.setenv("DEEPR_NATIVE_BF16", "1")  # the override wins over the flags (int8 CPU above)
    assert embed.resolve_precision("auto", "index") == "bf16"
    monkeypatch.setenv("DEEPR_NATIVE_BF16", "0")
    assert embed.resolve_precision("auto", "index") == "int8"
    assert embed.resolve_precision("fp32", "index") == "fp32"
    assert embed.resolve_precision("bf16") == "bf16"  # explicit bf16 runs on any CPU
    with pytest.raises(ValueError, match="use 'train'"):
        embed.resolve_precision("auto", "train")
    with pytest.raises(ValueError, match="precision 'fp16'"):
        embed.Embedder(precision="fp16")  # type: ignore[arg-type]
    assert embed.Embedder(precision="int8").name == "all-MiniLM-L6-v2+int8-ort2"
    assert embed.Embedder(precision="bf16").name == "all-MiniLM-L6-v2+bf16"
    assert embed.Embedder(max_seq_length=128).name == "all-MiniLM-L6-v2+seq128"


def test_bf16_passages_are_sentence_transformers_vectors_in_float32() -> None:
    """bf16 passage vectors are within cosine 0.999 of sentence-transformers' own fp32 vectors
    and unit-length in float32; the same embedder's queries are the fp32 onnxruntime vectors."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from deepr.corpus.embed import Embedder, default_model_path

    texts = ["a cat", "Who designed the Eiffel Tower?", "  leading spaces", "ÜNÏCÖDÉ and UPPER case",
             "Saturn is the sixth planet from the Sun and the second largest in the Solar System, after "
             "Jupiter. It is a gas giant with an average radius about nine times that of Earth. " * 3,
             "volcano " * 300]  # the last is past the 256-token limit
    ref = SentenceTransformer(default_model_path(), device="cpu").encode(texts, normalize_embeddings=True)
    bf16 = Embedder(precision="bf16")
    vecs = bf16.encode_passages(texts)
    assert vecs.dtype == np.float32 and vecs.shape == ref.shape
    cos = (vecs * ref.astype(np.float32)).sum(1)
    assert float(cos.min()) >= 0.999, f"lowest cosine {cos.min():.5f} at text {int(cos.argmin())}"
    norms = np.linalg.norm(vecs.astype(np.float64), axis=1)
    assert float(np.abs(norms - 1).max()) < 1e-5, norms
    queries = bf16.encode(texts, cache=False)
    assert np.array_equal(queries, Embedder(precision="fp32").encode(texts, cache=False))
    # a model's passage prompt goes on bf16 passages as on fp32 ones (e5's "passage: ")
    e5_bf16, e5_fp32 = Embedder(precision="bf16"), Embedder(precision="fp32")
    e5_bf16.prompts = e5_fp32.prompts = {"query": "query: ", "passage": "passage: "}
    cos = (e5_bf16.encode_passages(texts[:4]) * e5_fp32.encode_passages(texts[:4])).sum(1)
    assert float(cos.min()) >= 0.999 and float((e5_bf16.encode_passages(["a cat"]) * vecs[0]).sum()) < 0.99


def test_index_default_follows_the_cpu_and_fp32_indexes_stay_valid(tiny_corpus: Path, tmp_path: Path) -> None:
    """An index is built from bf16 (CPU with native bf16) or int8 passage vectors by default,
    under a key of its own: an fp32 index is still found when asked for. Queries stay fp32 at
    any batch size, so a search does not depend on which searches shared its batch."""
    import numpy as np

    from deepr.corpus.embed import native_bf16

    old = open_retriever(str(tiny_corpus), cache_dir=tmp_path, progress=False,
                         embedder=get_embedder(precision="fp32", use="index"))
    r = open_retriever(str(tiny_corpus), cache_dir=tmp_path, progress=False)
    default = "all-MiniLM-L6-v2+bf16" if native_bf16() else "all-MiniLM-L6-v2+int8-ort2"
    assert r.embedder.name == default and r.embedder is get_embedder(use="index")
    assert r.built and r.path != old.path
    again = open_retriever(str(tiny_corpus), cache_dir=tmp_path, progress=False,
                           embedder=get_embedder(precision="fp32"))
    assert not again.built and again.path == old.path
    assert r.search("planet with rings", k=1, mode="dense")[0].doc_id == "saturn"
    queries = [f"question {i} about a planet with rings" for i in range(70)]
    rewards = get_embedder()  # fp32, the rewards' embedder
    assert rewards.name == "all-MiniLM-L6-v2"
    ref = rewards.encode(queries[:3], cache=False)
    assert np.abs(r.embedder.encode(queries, cache=False)[:3] - ref).max() < 1e-4
    passages = r.embedder.encode_passages(queries[:3])  # int8 or bf16: close to fp32, not equal
    assert float((passages * ref).sum(1).min()) > 0.98 and np.abs(passages - ref).max() > 1e-4
