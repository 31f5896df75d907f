"""``deepr serve-index``: serve a corpus over HTTP to every process of a training cluster.

Examples::

    deepr serve-index --corpus wiki --port 8000
    deepr serve-index --corpus milvus://milvus-host:19530/wiki --host 0.0.0.0 --port 8000
    deepr run "..." --corpus http://127.0.0.1:8000       # any command, same ids and citations
"""

from __future__ import annotations

from pathlib import Path

import typer

from deepr.cli.app import app, console, user_errors
from deepr.cli.index_cmd import CACHE_HELP, DENSE_HELP, EMBEDDER_HELP, PRECISION_HELP, RETRIEVER_HELP

SERVE_CORPUS_HELP = ("Corpus to serve: anything --corpus takes in `deepr index` (wiki, a .jsonl/.parquet file, a "
                     "folder, hf:...) or a Milvus collection (milvus://HOST:PORT/NAME, milvus:PATH.db).")


@app.command("serve-index")
def serve_index_command(
    corpus: str = typer.Option("wiki", "--corpus", "-c", help=SERVE_CORPUS_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", "-p", help="Port to listen on."),
    retriever: str = typer.Option("hybrid", "--retriever", "-r", help=RETRIEVER_HELP + " Requests may ask for "
                                  "another mode the index has."),
    topk: int = typer.Option(3, "--topk", help="Results per query when a /retrieve request names no topk."),
    max_batch: int = typer.Option(256, "--max-batch", help="Most queries searched in one batched call."),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", help=CACHE_HELP),
    embedder: str | None = typer.Option(None, "--embedder", help=EMBEDDER_HELP),
    precision: str = typer.Option("auto", "--precision", help=PRECISION_HELP),
    max_words: int = typer.Option(120, "--max-words", help="Most words per passage (must match the index)."),
    overlap: int = typer.Option(20, "--overlap", help="Passage overlap in words (must match the index)."),
    dense: str = typer.Option("auto", "--dense", help=DENSE_HELP),
) -> None:
    """Serve a corpus's searches over HTTP: deepr's API (/v1/...), Search-R1/verl/SkyRL's POST /retrieve,
    FlashRAG's POST /search and /batch_search, and GET /health. Concurrent searches are batched into
    one embedding call; the request count and latencies are logged on exit (Ctrl-C)."""
    from deepr.cli.index_cmd import _open

    with user_errors():
        if not 1 <= port <= 65535:
            raise ValueError(f"--port {port}: must be between 1 and 65535")
        if topk < 1 or max_batch < 1:
            raise ValueError("--topk and --max-batch must be at least 1")
        if corpus.strip().lower().startswith(("http://", "https://")):
            raise ValueError(f"--corpus {corpus}: serve a local index or a Milvus collection, not another server")
        r = _open(corpus, retriever, cache_dir, None, embedder, precision, max_words, overlap, dense)
        from deepr.corpus.server import serve
        from deepr.data.topics import sample_topics

        def seeder(documents, n, seed, min_words):  # build-trees' sampling, over every served document
            return [t.model_dump() for t in sample_topics(documents, n, seed=seed, min_words=min_words)]

    info = r.describe()
    console.print(f"serving {info['corpus']} ({info['passages']} passages, {r.mode}) on http://{host}:{port}",
                  highlight=False)
    serve(r, host=host, port=port, default_k=topk, seeder=seeder, max_batch=max_batch)
