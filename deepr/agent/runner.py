"""``deepr run`` as a plain function: query in, cited report + audit trace + trajectory out.

    from deepr.agent import RunConfig, run_agent
    result = run_agent("How do vaccines work?", tools=ResearchTools(retriever), llm=get_llm("extractive"),
                       config=RunConfig(mode="dag"))
    result.markdown, result.trace (report.json), result.trajectory (for --record)

:func:`write_report` writes ``report.md``, the ``report.json`` sidecar, ``report.html`` with
``html=True`` and the ``report.md.meta.json`` provenance file.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepr.io import write_json, write_meta, write_text
from deepr.llm.base import LLM, run_sync
from deepr.records import RubricItem, RunTrace, Trajectory
from deepr.roles import engine_info
from deepr.text import join_sentences, strip_citations

from deepr.agent.decor import DecorOutcome, run_decor
from deepr.agent.dag import DagOutcome, run_dag
from deepr.evidence.env import Ctx, RunConfig
from deepr.evidence.extract import shorten
from deepr.evidence.phrases import need_topics, phrases
from deepr.agent.render import GNode, Graph, ReportDoc, Section, plan_graph, render_html, render_markdown
from deepr.agent.support import check_support
from deepr.evidence.trace import Tracer
from deepr.evidence.writer import cited_sentences
from deepr.agent.warp import WarpOutcome, run_warp


@dataclass
class RunResult:
    query: str
    mode: str
    markdown: str
    html: str | None
    answer: str
    trace: RunTrace
    trajectory: Trajectory
    seconds: float


def trajectory_id(query: str, mode: str, query_id: str | None = None) -> str:
    if query_id:
        return f"{query_id}:{mode}"
    return f"run-{mode}-" + hashlib.sha1(" ".join(query.split()).encode("utf-8")).hexdigest()[:12]


def _question(query: str) -> str:
    text = query.strip()
    # the question cites nothing: brackets in a report are citations of evidence only
    text = text.replace("[", "(").replace("]", ")")
    return "\n".join(f"> {ln}" if ln.strip() else ">" for ln in text.splitlines())


def _fallback_note(tracer: Tracer) -> list[str]:
    parts = list(dict.fromkeys(p for d in tracer.decisions for p in d.get("fallback", [])))
    if not parts:
        return []
    return [phrases(tracer.query)["fallback_note"].format(parts=", ".join(parts))]


def _same(a: str, b: str) -> bool:
    return " ".join(a.split()).casefold() == " ".join(b.split()).casefold()


def _topic(need: str) -> str:
    # the extractive planner's aggregate need (deepr/extractive/planner.py): its topic list is
    # the heading a reader wants, not the instruction the writer was given
    return need_topics(need) or need


def _heading(nid: str, need: str) -> str:
    return f"{_topic(need)} ({nid})"


def _sentence_key(sentence: str) -> str:
    return " ".join(strip_citations(sentence).split()).casefold()


def _unseen(text: str, seen: set[str]) -> str:
    """``text`` without the sentences already in ``seen`` (compared without their citations, so
    the same sentence cited from another search node counts as seen); adds what it keeps."""
    paragraphs = []
    for para in text.split("\n\n"):
        if re.match(r"^\s*([-*+|#>]|\d+[.)])", para):  # lists, tables, headings: whole lines only
            lines = [ln for ln in para.splitlines() if _sentence_key(ln) not in seen]
            seen.update(_sentence_key(ln) for ln in lines)
            kept = "\n".join(lines)
        else:
            sentences = [x for x in cited_sentences(para) if _sentence_key(x) not in seen]
            seen.update(_sentence_key(x) for x in sentences)
            kept = join_sentences(sentences)
        if kept.strip():
            paragraphs.append(kept)
    return "\n\n".join(paragraphs)


def _dag_doc(out: DagOutcome, query: str) -> tuple[str, list[Section], Graph]:
    by_id = {n.id: n for n in out.plan.nodes}
    seen = {_sentence_key(x) for x in cited_sentences(out.answer)}
    findings = [Section(_heading(nid, by_id[nid].need or nid), body, 3) for w in out.waves for nid in w
                if (body := _unseen(out.outputs.get(nid, ""), seen))]
    words = phrases(query)
    sections = [Section(words["answer"], out.answer)]
    if findings:  # what the answer left out; the answer's own sentences are not repeated
        sections += [Section(words["more_findings"], ""), *findings]
    rows = [words["plan_header"], "|---|---|---|---|"]
    for n in out.plan.nodes:
        text = n.query or n.need or ""
        text = words["question_cell"] if _same(text, query) else text.replace("|", "/")
        rows.append(f"| {n.id} | {words['types'].get(n.type, n.type)} | {text} | {', '.join(n.inputs)} |")
    waves = " → ".join(", ".join(w) for w in out.waves)
    sections.append(Section(words["research_plan"], "\n".join(rows) + (
        "\n\n" + words["waves"].format(waves=waves) if waves else "")))
    graph = plan_graph(out.plan)
    for g in graph.nodes:  # the drawing names each aggregate's topic, as its heading does
        g.label = _topic(g.label) if g.kind == "aggregate" else g.label
    return out.answer, sections, graph


def _warp_doc(out: WarpOutcome) -> tuple[str, list[Section], Graph]:
    body = out.outline.markdown().split("\n", 1)[1]
    g = Graph([GNode("report", out.outline.title, "report")])
    for s in out.outline.walk():
        g.nodes.append(GNode(f"section-{s.pos}", s.title, "section"))
        parent = s.pos.rsplit(".", 1)[0] if "." in s.pos else None
        g.edges.append((f"section-{parent}" if parent else "report", f"section-{s.pos}"))
    return body, [Section(None, body)], g


def _decor_doc(out: DecorOutcome, query: str) -> tuple[str, list[Section], Graph]:
    words = phrases(query)
    # a query a model ended with a colon keeps one colon before its evidence
    mem = "\n".join(f"- **{m.query.rstrip(': ')}**: {m.evidence}" for m in out.memory) or words["no_memory"]
    g = Graph([GNode(f"S{i}", q, "step") for i, q in enumerate(out.queries, 1)] + [GNode("answer", "answer", "answer")])
    chain = [n.id for n in g.nodes]
    g.edges = list(zip(chain, chain[1:]))
    return out.answer, [Section(words["answer"], out.answer), Section(words["evidence_gathered"], mem)], g


async def arun_agent(query: str, *, tools: Any, llm: LLM | None, config: RunConfig, query_id: str | None = None,
                     rubrics: Sequence[RubricItem] = (), on_phase: Callable[[str], None] | None = None,
                     html: bool = False, profile: Any = None) -> RunResult:
    """Run one query in ``config.mode``; see the module docstring. ``profile``: the model's
    profile (:mod:`deepr.profiles`; None: the default one). ``llm=None``: no model, every role
    run by the extractive engine."""
    if not query or not query.strip():
        raise ValueError("the query is empty: pass the research question as text")
    tracer = Tracer(query, config.mode, on_phase=on_phase)
    ctx = Ctx(llm=llm, tools=tools, config=config, tracer=tracer, profile=profile)
    if config.mode == "dag":
        answer, sections, graph = _dag_doc(await run_dag(ctx, query), query)
    elif config.mode == "warp":
        answer, sections, graph = _warp_doc(await run_warp(ctx, query))
    elif config.mode == "tools":
        from deepr.agent.tools_agent import run_tools, tools_doc

        answer, sections, graph = tools_doc(await run_tools(ctx, query), phrases(query))
    else:
        answer, sections, graph = _decor_doc(await run_decor(ctx, query), query)
    if config.answer == "short":  # the mode's answer is the draft the short response is made from
        from deepr.agent.short_answer import short_answer, short_text

        with tracer.phase("short answer"):
            short = await short_answer(ctx, query, answer)
        response = Section(phrases(query)["response"], short_text(short))
        answer, sections = short["exact_answer"], [response, *sections[1:]]
    # The note follows what happened: every role was performed by the non-LLM engine.
    words = phrases(query)  # the report's own words, in the question's language
    notes = ([words["extractive_note"]] if set(tracer.engines) == {"extractive"} else []) + _fallback_note(tracer)
    title = shorten(next(ln for ln in query.splitlines() if ln.strip()).strip(), 16)
    asked = [] if _same(title, query) else [Section(words["question"], _question(query))]  # the title says it all
    doc = ReportDoc(title, asked + sections, notes, graph, words=words)
    with tracer.phase("render"):
        md, citations, dropped = render_markdown(doc, ctx.catalog)
        if dropped:
            tracer.fail("render", f"removed citations of unknown ids {dropped}")
        page = render_html(md, doc, citations) if html else None
    support = await check_support(md, {k: c.text for k, c in citations.items()}, question=query)
    if support.count("unsupported"):
        tracer.decide(f"citation support: {support.count('unsupported')} of {len(support.rows)} cited claims "
                      "are not backed by the text they cite (listed under support in report.json)")
    backend = engine_info(llm)
    trace = tracer.run_trace(md, citations, query_id=query_id, answer=answer, backend=backend,
                             config={**config.model_dump(), "profile": _profile_info(profile)},
                             catalog_size=len(ctx.catalog), support=support.as_dict(), rejected_replies=tracer.rejected,
                             **({"set_aside": ctx.catalog.set_aside} if ctx.catalog.set_aside else {}))
    traj = tracer.trajectory(trajectory_id(query, config.mode, query_id), md, rubrics, query_id=query_id,
                             backend=backend.get("backend"))
    return RunResult(query, config.mode, md, page, answer, trace, traj, tracer.seconds())


def _profile_info(profile: Any) -> dict[str, Any]:
    """The profile a run's model calls went out under (what deepr_meta.json and sidecars record)."""
    return profile.describe() if profile is not None else {"name": "default"}


def run_agent(query: str, **kw: Any) -> RunResult:
    """Synchronous :func:`arun_agent`."""
    return run_sync(arun_agent(query, **kw))


def sidecar_path(report: Path) -> Path:
    return report.with_suffix(".json")


def write_report(result: RunResult, out: Path, *, inputs: Sequence[Path] = ()) -> dict[str, Path]:
    """Write report.md (atomically), its report.json trace, report.html and the meta sidecar."""
    paths = {"report": out, "trace": sidecar_path(out)}
    write_json(paths["trace"], result.trace.model_dump(mode="json"))
    if result.html is not None:
        paths["html"] = out.with_suffix(".html")
        write_text(paths["html"], result.html)
    write_text(out, result.markdown)
    counts = {"citations": len(result.trace.citations), "model_calls": len(result.trace.calls),
              "tool_calls": len(result.trace.tools), "failures": len(result.trace.model_extra.get("failures", []))}
    failures = [{k: f.get(k) for k in ("where", "reason")} for f in result.trace.model_extra.get("failures", [])]
    paths["meta"] = write_meta(out, stage="run", config=result.trace.model_extra.get("config"), inputs=inputs,
                               counts=counts, timings=result.trace.model_extra.get("timings"),
                               extra={"failures": failures} if failures else None)
    return paths
