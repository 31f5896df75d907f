"""WARP's actions without a model: the outline from clusters, deepening by new material.

- initialize: one section per sub-question of a multi-part request, then one per cluster
  of the background results (title = the cluster's central document, plan = its
  distinctive terms), at most six;
- deepen: for each expandable section, search its title and plan and count documents the
  draft does not cite yet and that are on topic (cosine ≥ 0.45 to the section and ≥ 0.5 to
  the question); the section with the most new material (at least two documents
  in two distinct clusters) is expanded into subsections named after those clusters.
  Nothing new anywhere means terminate ("no new documents found", the atomic gate of the tree builder);
  a forced step takes the best candidate with looser relevance (0.2), and with no new
  document at all re-cuts the section's results into subsections (titles qualified by
  their distinctive terms), so the teacher over-expansion always expands while it can.
"""

from __future__ import annotations

from typing import Any

from deepr.evidence import writer
from deepr.evidence.citations import cited_ids
from deepr.evidence.env import Ctx, shares_words
from deepr.evidence.extract import cluster, content_terms, distinctive_terms, focus_query, shorten, sub_questions
from deepr.evidence.outline import Outline
from deepr.evidence.phrases import phrases


def search_reply(a: Any) -> dict[str, Any]:
    return {"name": "search", "keywords": a.default}


def initialize_reply(a: Any) -> dict[str, Any]:
    title, items = initial_outline(a.run.ctx, a.run.query, a.ids)
    return {"name": "initialize", "title": title, "sections": items}


def write_reply(a: Any) -> str:
    run, sec = a.run, a.sec
    return writer.write(run.ctx, [f"{sec.title}. {sec.plan}", run.query], sec.ids,
                        run.ctx.config.section_sentences, avoid=run.outline.used_text())


def deepen_reply(a: Any) -> dict[str, Any]:
    return deepen_choice(a.run.ctx, a.run.query, a.run.outline, a.forced)


MAX_SECTIONS = 6
# Cosine a new document needs to the section and to the question to justify subsections: MiniLM
# puts passages on the asked subject at ~0.55-0.8 and neighbouring subjects at ~0.35-0.47.
SECTION_RELEVANT, QUESTION_RELEVANT = 0.45, 0.5
FORCED_RELEVANT = 0.2  # a forced (teacher over-expansion) step settles for looser material


def _norm(t: str) -> str:
    return " ".join(t.lower().split())


def _cluster_items(ctx: Ctx, titles: list[str], texts: list[str], n: int, taken: set[str],
                   rename: bool = False) -> list[dict[str, str]]:
    """One section per cluster, named after its central document. A title already in the
    outline is skipped, or with ``rename`` qualified by the cluster's distinctive terms."""
    if not texts:
        return []
    groups = cluster(ctx.encode(list(texts)), n, order=range(len(texts)))
    words = phrases(ctx.tracer.query)
    items = []
    for g in groups:
        title = titles[g[0]]
        terms = distinctive_terms([texts[i] for i in g], texts, 4, exclude=content_terms(title))
        if _norm(title) in taken and rename and terms:
            title = title + words["colon"] + words["term_join"].join(terms[:2])
        if _norm(title) in taken:
            continue
        plan = words["sources_on"].format(title=title)
        plan += words["colon"] + words["term_join"].join(terms) if terms else ""
        items.append({"title": title, "plan": plan})
        taken.add(_norm(title))
    return items


def initial_outline(ctx: Ctx, query: str, ids: list[str]) -> tuple[str, list[dict[str, str]]]:
    """(report title, level-1 sections) from the background results ``ids``."""
    parts = sub_questions(query)
    items = [{"title": shorten(p, 10).rstrip(" …?？"), "plan": p} for p in parts] if len(parts) > 1 else []
    taken = {_norm(i["title"]) for i in items}
    entries = [ctx.catalog[c] for c in ids]
    # off-topic results make off-topic sections: keep the relevant ones
    entries = [e for e, ok in zip(entries, ctx.on_topic([e.text for e in entries], focus_query(query))) if ok]
    n = min(4, max(2, len(entries) // 3))
    items += _cluster_items(ctx, [e.title or e.doc_id for e in entries], [e.text for e in entries], n, taken)
    if len(items) < 2:  # too little material to cluster: an overview plus the question itself
        words = phrases(query)
        items = [{"title": words["overview"], "plan": words["background"].format(q=focus_query(query, 20))},
                 {"title": words["answer"], "plan": focus_query(query, 40)}]
    return shorten(focus_query(query, 16), 16).rstrip(" …"), items[:MAX_SECTIONS]


def _candidate(ctx: Ctx, query: str, sec: Any, cited_docs: set[str], titles: set[str],
               forced: bool) -> tuple[int, list[dict[str, str]]]:
    """(new on-topic documents, proposed subsections) for expanding ``sec``."""
    q = focus_query(f"{sec.title} {sec.plan}", 16)
    hits, _ = ctx.raw_search(q, ctx.config.explore_k, node=f"section-{sec.pos}", purpose="deepen")
    fresh = [h for h in hits if h.doc_id not in cited_docs]
    if fresh:  # new material counts only if it is on the section's and the question's topic
        vec = ctx.encode([h.text for h in fresh])
        floors = (FORCED_RELEVANT, FORCED_RELEVANT) if forced else (SECTION_RELEVANT, QUESTION_RELEVANT)
        ok = (vec @ ctx.encode([q])[0] >= floors[0]) & (vec @ ctx.encode([focus_query(query)])[0] >= floors[1])
        shared = shares_words([h.text for h in fresh], [query], fallback=False)  # without spaces: its words too
        fresh = [h for i, (h, good) in enumerate(zip(fresh, ok)) if good and (shared is None or shared[i])]
    pool = fresh if (fresh or not forced) else hits  # a forced step may re-cut material already cited
    items = _cluster_items(ctx, [h.title or h.doc_id for h in pool], [h.text for h in pool],
                           min(3, max(2, len(pool) // 2)), set(titles), rename=forced)
    return len(fresh), items


def deepen_choice(ctx: Ctx, query: str, outline: Outline, forced: bool) -> dict[str, Any]:
    """The expand/terminate decision, in the action shape a model would reply with."""
    cited_docs = {ctx.catalog[c].doc_id for text in outline.used_text() for c in cited_ids(text) if c in ctx.catalog}
    titles = {_norm(s.title) for s in outline.walk()}
    best: tuple[int, Any, list[dict[str, str]]] | None = None
    for sec in outline.expandable(ctx.config.max_levels):
        new, items = _candidate(ctx, query, sec, cited_docs, titles, forced)
        if len(items) >= 2 and (best is None or new > best[0]):
            best = (new, sec, items)
    if best is None or (not forced and best[0] < 2):
        return {"name": "terminate"}
    _, sec, items = best
    return {"name": "expand", "position": f"section-{sec.pos}", "subsections": items[:5]}
