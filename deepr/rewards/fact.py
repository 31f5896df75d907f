"""FACT-style citation check: are the cited statements supported by their sources?

Input: a report (``<cite id>`` spans, ``[id]`` markers or markdown links) and its citation
store {id or url: source text} — the ``citations`` of a ``deepr run`` sidecar. Output per
report: (statement, source) pairs judged supported / unsupported / unknown (unknown = the
source text is not available, so nothing can be checked); across reports: citation
accuracy = Σ supported / Σ (supported + unsupported) and effective citations = Σ supported
/ number of reports with at least one citation.

    deepr eval runs/ --metric fact --out fact.jsonl

A pair is judged once even if the same statement cites the same source twice. If the judge
fails on any pair, the report's fact score is a failure with the reason (excluded from
the summary), never a 0.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, field_validator

from deepr.rewards.judges import Judge
from deepr.rewards.rubric_reward import extract_claims
from deepr.text import split_sentences, strip_citations

_MD_LINK = re.compile(r"\[([^\]]+)\]\((https?://[^)\s]+)\)")
SUPPORT_THRESHOLD = 0.5  # extractive judge: support score at which a statement counts as supported


@dataclass
class FactPair:
    statement: str
    source: str
    verdict: str = "unknown"  # supported | unsupported | unknown


@dataclass
class FactResult:
    pairs: list[FactPair] = field(default_factory=list)
    supported: int = 0
    unsupported: int = 0
    unknown: int = 0
    accuracy: float | None = None
    judge: str = ""
    failure: str | None = None
    unfetched: dict[str, str] = field(default_factory=dict)  # url -> why its page could not be read

    @property
    def has_citations(self) -> bool:
        return bool(self.pairs)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def source_text(store: Mapping[str, Any], key: str) -> str | None:
    """Text of a store entry: a string, or a dict / Citation with ``text``."""
    entry = store.get(key)
    if entry is None:
        return None
    text = entry if isinstance(entry, str) else getattr(entry, "text", None) or (
        entry.get("text") if isinstance(entry, dict) else None)
    return text if text and text.strip() else None


def _url_index(store: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for key, entry in store.items():
        url = getattr(entry, "url", None) or (entry.get("url") if isinstance(entry, dict) else None)
        if url:
            out[url] = key
    return out


def extract_pairs(report: str, known: Collection[str] = ()) -> list[FactPair]:
    """(statement, source id or url) pairs, deduplicated, in order of appearance."""
    pairs: list[tuple[str, str]] = []
    for c in extract_claims(report, known):
        pairs.extend((c.text, i) for i in c.ids)
    for sent in split_sentences(report):
        for m in _MD_LINK.finditer(sent):
            pairs.append((strip_citations(_MD_LINK.sub(r"\1", sent)), m.group(2)))
    return [FactPair(s, src) for s, src in dict.fromkeys(p for p in pairs if p[0].strip())]


class _Support(BaseModel):
    verdict: Literal["supported", "unsupported"]

    @field_validator("verdict", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v


FACT_PROMPT = """Does the source text back up the statement? Answer "supported" when the
source states the statement's facts or they follow directly from it, and "unsupported"
when the source lacks them or contradicts them. Use only the source, not outside knowledge.

Statement: {statement}

Source:
<<<
{source}
>>>

Return {{"verdict": "supported"}} or {{"verdict": "unsupported"}}."""


async def _judge_pair(judge: Judge, statement: str, source: str):
    return await judge.run(
        "fact", [statement, source],
        local=lambda: "supported" if judge.support(statement, source) >= SUPPORT_THRESHOLD else "unsupported",
        prompt=FACT_PROMPT.format(statement=statement, source=source),
        schema=_Support, convert=lambda v: v.verdict)


async def fact_check(report: str, store: Mapping[str, Any], judge: Judge) -> FactResult:
    """Judge every (statement, source) pair of one report."""
    pairs = extract_pairs(report, store.keys())
    urls = _url_index(store)
    todo = []
    for p in pairs:
        text = source_text(store, p.source) or source_text(store, urls.get(p.source, ""))
        if text is not None:
            todo.append((p, text))
    verdicts = await asyncio.gather(*(_judge_pair(judge, p.statement, t) for p, t in todo))
    bad = [v.reason for v in verdicts if not v.ok]
    res = FactResult(pairs=pairs, judge=judge.name)
    if bad:
        res.failure = "; ".join(bad)
        return res
    for (p, _), v in zip(todo, verdicts):
        p.verdict = v.value
    res.supported = sum(p.verdict == "supported" for p in pairs)
    res.unsupported = sum(p.verdict == "unsupported" for p in pairs)
    res.unknown = len(pairs) - res.supported - res.unsupported
    judged = res.supported + res.unsupported
    res.accuracy = res.supported / judged if judged else None
    return res


def _passages_for(page: Mapping[str, Any], statement: str) -> str:
    from deepr.search.source import best_passages

    return "\n\n".join(best_passages(page["url"], page.get("title", ""), page["text"], statement, 3))


async def fact_check_web(article: str, judge: Judge, pages: Any) -> FactResult | None:
    """FACT as DeepResearch Bench runs it, on a report whose ``[n]`` markers point into a numbered
    reference list of URLs; None when the article has no such list. Each cited page is read
    through ``pages`` (the search layer's reader: cache, limits, address guard); a page that
    cannot be read makes only the statements citing it unknown."""
    from deepr.search.drb import cited_statements, group_statements, parse_references

    refs, body = parse_references(article)
    if not refs:
        return None
    groups, _missing = group_statements(cited_statements(body), refs, embed=judge.embed)
    urls = list(groups)
    fetched = await asyncio.to_thread(pages.fetch_many, urls, miss_is_failure=True) if urls else []
    res = FactResult(judge=judge.name)
    todo = []
    for url, page in zip(urls, fetched):
        if not page["ok"]:
            res.unfetched[url] = page["reason"]
        for statement in groups[url]:
            pair = FactPair(statement, url)
            res.pairs.append(pair)
            if page["ok"]:
                todo.append((pair, _passages_for(page, statement)))
    verdicts = await asyncio.gather(*(_judge_pair(judge, p.statement, t) for p, t in todo))
    bad = [v.reason for v in verdicts if not v.ok]
    if bad:
        res.failure = "; ".join(bad)
        return res
    for (p, _), v in zip(todo, verdicts):
        p.verdict = v.value
    res.supported = sum(p.verdict == "supported" for p in res.pairs)
    res.unsupported = sum(p.verdict == "unsupported" for p in res.pairs)
    res.unknown = len(res.pairs) - res.supported - res.unsupported
    judged = res.supported + res.unsupported
    res.accuracy = res.supported / judged if judged else None
    return res


def fact_summary(results: Sequence[FactResult]) -> dict[str, Any]:
    """Citation accuracy and effective citations over the reports that were scored."""
    ok = [r for r in results if r.failure is None]
    sup = sum(r.supported for r in ok)
    judged = sup + sum(r.unsupported for r in ok)
    with_cites = sum(r.has_citations for r in ok)
    return {"reports": len(ok), "failed": len(results) - len(ok), "reports_with_citations": with_cites,
            "supported": sup, "unsupported": judged - sup, "unknown": sum(r.unknown for r in ok),
            "citation_accuracy": sup / judged if judged else None,
            "effective_citations": sup / with_cites if with_cites else None}
