"""The Python entry points behind ``deepr run``, ``deepr build-trees`` and ``deepr eval``, for
scripts and notebooks. ``import deepr`` stays light: each function imports what it needs.

    import deepr

    report = deepr.run("How did the printing press change science?", corpus="my_docs/")
    print(report.markdown)                      # cited report; report.trace is the audit trace
    trees = deepr.build_trees(corpus="my_docs/", n_trees=3)
    scores = deepr.evaluate(["runs/q1.json"], metrics=["citation", "structure"])

Models are given as the CLI's ``--llm`` specs ("extractive", "openai:<model>", "hf:<path>",
"smollm2", ...) or as LLM objects; corpora as ``--corpus`` specs or a loaded retriever.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: nothing heavy is imported by `import deepr`
    from deepr.agent.runner import RunResult
    from deepr.llm.base import LLM
    from deepr.profiles import Profile
    from deepr.records import Reject, Score, Tree

__all__ = ["run", "arun", "build_trees", "evaluate"]


def _profile(profile: str | Profile | None, llm: str | LLM | None) -> Profile:
    """``profile`` as a Profile: a name, or None for the one the model spec selects (``small`` for
    smollm2 and gguf:, else ``default``; a model given as an object gets ``default``)."""
    from deepr.profiles import Profile, get_profile

    if isinstance(profile, Profile):
        return profile
    return get_profile(profile, spec=llm if isinstance(llm, str) else None)


def _llm(llm: str | LLM | None, profile: Profile | None = None, **kw: Any) -> LLM | None:
    """The backend ``llm`` names (None for ``extractive``: no model); a backend passes through."""
    if isinstance(llm, str):
        from deepr.llm import get_llm

        return get_llm(llm, decoding=dict(profile.decoding) if profile is not None else None, **kw)
    return llm


def _retriever(corpus: str | Any, search: str, cache_dir: str | Path | None) -> Any:
    """The corpus retriever (built and cached on first use), or a web source for ``search``."""
    from deepr.corpus import open_retriever

    def local() -> Any:
        return corpus if not isinstance(corpus, str) else open_retriever(corpus, cache_dir=cache_dir, progress=False)

    if search == "corpus":
        return local()
    from deepr.search import open_source
    from deepr.search.config import search_config

    return open_source(search_config(search, cache_dir=Path(cache_dir) if cache_dir else None), local)


def run(question: str, *, llm: str | LLM | None = "extractive", corpus: str | Any = "wiki", search: str = "corpus",
        mode: str = "dag", out: str | Path | None = None, html: bool = False, k: int = 5,
        cache_dir: str | Path | None = None, tools: Any = None, config: Any = None,
        query_id: str | None = None, rubrics: Sequence[Any] = (), profile: str | Profile | None = None,
        on_phase: Callable[[str], None] | None = None, **options: Any) -> RunResult:
    """Research ``question`` and return its cited report (``deepr run``).

    ``mode``: dag, warp, decor or tools; ``options``: any other RunConfig field (e.g.
    ``max_reasks=1``). With ``out`` the report, its ``.json`` trace (and ``.html`` with
    ``html=True``) are written as ``deepr run --out`` writes them. ``tools`` and ``config``
    take prepared objects instead of ``corpus``/``search`` and ``mode``/``options``. ``profile``:
    ``"default"``, ``"small"`` or a Profile (None: the one ``llm`` selects, see deepr.profiles).
    """
    from deepr.llm.base import run_sync

    return run_sync(arun(question, llm=llm, corpus=corpus, search=search, mode=mode, out=out, html=html, k=k,
                         cache_dir=cache_dir, tools=tools, config=config, query_id=query_id, rubrics=rubrics,
                         profile=profile, on_phase=on_phase, **options))


async def arun(question: str, *, llm: str | LLM | None = "extractive", corpus: str | Any = "wiki", search: str = "corpus",
               mode: str = "dag", out: str | Path | None = None, html: bool = False, k: int = 5,
               cache_dir: str | Path | None = None, tools: Any = None, config: Any = None,
               query_id: str | None = None, rubrics: Sequence[Any] = (), profile: str | Profile | None = None,
               on_phase: Callable[[str], None] | None = None, **options: Any) -> RunResult:
    """:func:`run` on a running event loop: ``deepr run --queries`` awaits many at once."""
    from deepr.agent import RunConfig, write_report
    from deepr.agent.runner import arun_agent

    if tools is None:
        from deepr.corpus import ResearchTools

        tools = ResearchTools(_retriever(corpus, search, cache_dir), k=k)
    config = config or RunConfig(mode=mode, **options)
    prof = _profile(profile, llm)
    result = await arun_agent(question, tools=tools, llm=_llm(llm, prof), config=config, query_id=query_id,
                              rubrics=rubrics, html=html or out is not None and Path(out).suffix == ".html",
                              on_phase=on_phase, profile=prof)
    if out is not None:
        write_report(result, Path(out))
    return result


def build_trees(*, corpus: str | Any = "wiki", n_trees: int = 20, topics: Iterable[Any] | None = None,
                llm: str | LLM | None = "extractive", judge: str | LLM | None = "writer", seed: int = 0,
                cache_dir: str | Path | None = None, config: Any = None,
                on_result: Callable[[Any], None] | None = None, profile: str | Profile | None = None,
                judge_profile: str | Profile | None = None, **options: Any) -> list[Tree | Reject]:
    """Evidence trees (DeepRubric Alg. 1), one per topic: ``topics`` (titles or SeedTopics),
    else ``n_trees`` topics sampled from the corpus. A topic that yields no usable tree comes back
    as a Reject with its reason. ``options``: TreeConfig fields (``max_depth=2``), or ``config``.
    ``judge``: the gate and ground roles' model, a spec or a backend (``"writer"``: ``llm``; None
    or ``"extractive"``: no model). ``profile`` / ``judge_profile``: each model's profile (None:
    the one its spec selects)."""
    from deepr.data.topics import SeedTopic, sample_topics, tree_id
    from deepr.data.trees import TreeConfig, abuild_trees
    from deepr.llm.base import run_sync

    retriever = _retriever(corpus, "corpus", cache_dir)
    if topics is None:
        seeds = sample_topics(retriever.documents, n_trees, seed=seed)
    else:
        seeds = [SeedTopic(id=tree_id(t, seed), title=t) if isinstance(t, str) else t for t in topics]
    prof = _profile(profile, llm)
    writer = judge == "writer"
    judge_prof = prof if writer else _profile(judge_profile, judge)
    return run_sync(abuild_trees(seeds, retriever, _llm(llm, prof), config or TreeConfig(seed=seed, **options),
                                 judge="writer" if writer else _llm(judge, judge_prof), on_result=on_result,
                                 profile=prof, judge_profile=judge_prof))


def evaluate(items: str | Path | Sequence[Any], *, metrics: Sequence[str], rubrics: str | Path | None = None,
             gold: str | Path | None = None, judge: str | LLM = "extractive",
             concurrency: int = 8, on_score: Callable[[Score], None] | None = None) -> list[Score]:
    """Score reports, plans or answers (``deepr eval``): ``items`` is what ``deepr eval`` reads
    (a JSONL file, a report.json, a folder of them) or a list of EvalItems. A metric whose input
    is missing everywhere (rubric without ``rubrics``) raises ValueError; one missing for some
    items is recorded in that Score's ``failures``."""
    from deepr.eval.evaluate import EvalConfig, EvalContext, missing_inputs
    from deepr.eval.evaluate import evaluate as score_all
    from deepr.llm.base import run_sync

    cfg = EvalConfig(metrics=list(metrics), judge=judge if isinstance(judge, str) else "custom",
                     concurrency=concurrency)
    if isinstance(items, (str, Path)):
        from deepr.eval.inputs import load_items

        items = load_items(Path(items))
    ctx = EvalContext()
    if rubrics is not None or gold is not None:
        from deepr.eval.inputs import load_references

        ctx.rubrics = load_references(Path(rubrics), "rubrics") if rubrics else ({}, {})
        ctx.gold = load_references(Path(gold), "gold") if gold else ({}, {})
    problems = missing_inputs(cfg.metrics, items, ctx)
    if problems:
        raise ValueError("; ".join(problems))
    attach_models(ctx, cfg.metrics, judge)
    scores: list[Score] = []

    def keep(score: Score) -> None:
        scores.append(score)
        if on_score is not None:
            on_score(score)

    run_sync(score_all(list(items), cfg.metrics, ctx, sink=keep, concurrency=cfg.concurrency))
    return scores


def attach_models(ctx: Any, metrics: Sequence[str], judge: str | LLM, *, cache_path: Path | None = None,
                  make_llm: Callable[[str], LLM] | None = None) -> None:
    """Give ``ctx`` the embedder and the judge the chosen metrics need, and nothing else."""
    from deepr.eval.evaluate import JUDGED, needs
    from deepr.rewards.judges import Judge, JudgeCache

    extractive = judge == "extractive"
    if needs(metrics, extractive):
        from deepr.corpus.embed import get_embedder

        ctx.embed = get_embedder().encode
    if JUDGED & set(metrics):
        llm = None if extractive else (make_llm or _llm)(judge) if isinstance(judge, str) else judge
        ctx.judge = Judge(llm, ctx.embed, cache=JudgeCache(cache_path))
