"""What a data stage did with each record, for its summary, its sidecar and its exit status.

``build-trees``, ``synthesize-rubrics`` and ``verify`` feed every result (a Tree, a QRPair, a
verify Verdict or a Reject) to a :class:`StageTally`. It counts records by who produced
them (``ok``: the model path, or the extractive engine when that is the chosen backend;
``fallback``: rebuilt by the extractive engine after the model path failed, with
``--fallback extractive``; ``failed``: rejected) and groups the failure reasons, those
that rejected a record and those recorded per turn inside a record (its Recorder
failures), so a user sees at once why a model is not producing data.

    tally = StageTally("build-trees")
    for r in results: tally.add(r)
    tally.rows()          # summary-table rows: counts and the top reasons
    tally.every_failed    # True: the CLI exits non-zero

A record rebuilt by the fallback carries ``fallback = {"engine": "extractive", "reason": …,
"model_failures": [...]}`` (see :func:`mark_fallback`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from deepr.activity import note
from deepr.records import Reject

Fallback = Literal["none", "extractive"]
FALLBACKS = ("none", "extractive")

_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_SPACE = re.compile(r"\s+")
_REASON_CHARS = 120


def reason_key(reason: str) -> str:
    """A failure reason with its particulars (quoted text, numbers) blanked, so that the same
    failure on different records counts as one reason. Only a grouping key: what a user reads
    is one record's reason in its own words and numbers (:func:`brief_reason`)."""
    text = _NUMBER.sub("N", _QUOTED.sub("'…'", _SPACE.sub(" ", str(reason)).strip()))
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 1].rstrip() + "…"


def brief_reason(reason: str) -> str:
    """A reason as a person reads it in a table: its own words and numbers (addresses, ports,
    limits and HTTP statuses as they were), without a trailing parenthesised list of details
    (it stays in the rejects file), cut to one line."""
    text = _SPACE.sub(" ", str(reason)).strip()
    head, sep, tail = text.partition(" (")
    if sep and head and "; " in tail and len(text) > _REASON_CHARS // 2:
        text = head
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 1].rstrip() + "…"


# What a user can do about a reason, first match wins (a reply cut short is the cause even when
# the reason starts "gave up after 3 attempts").
_NEXT_STEPS = [
    (re.compile(r"cut at max_tokens|finish_reason\W+length", re.I), "raise --max-tokens"),
    (re.compile(r"maximum context|context length|model's context", re.I),
     "the prompt does not fit the model's context: lower --max-tokens or use a longer-context model"),
    (re.compile(r"deadline of .* reached", re.I), "--deadline reached: raise --deadline or do less (--limit)"),
    (re.compile(r"credentials|HTTP 40[13]\b", re.I), "check --api-key / OPENAI_API_KEY"),
    (re.compile(r"timed out|timeout", re.I), "raise --timeout or lower --concurrency"),
    (re.compile(r"refused the connection|connection refused|could not connect|unreachable", re.I),
     "check --base-url: is the server running?"),
    (re.compile(r"JSON|not accepted|constraint violation|gave up after|no usable reply", re.I),
     "the replies failed their checks: try --profile small or a stronger --llm"),
]


def next_step(reason: str) -> str | None:
    """The next step for a failure reason ("raise --max-tokens"), or None when none is known."""
    return next((step for pattern, step in _NEXT_STEPS if pattern.search(str(reason))), None)


def _failures(record: Any) -> list[dict[str, Any]]:
    extra = getattr(record, "model_extra", None) or {}
    got = getattr(record, "failures", None)
    if got is None:
        got = extra.get("failures")
    return [f for f in (got or []) if isinstance(f, dict)]


def mark_fallback(record: Any, reason: str, model_failures: Sequence[dict[str, Any]] = ()) -> Any:
    """Record on ``record`` that the extractive engine rebuilt it after the model path failed."""
    note("fallback")
    setattr(record, "fallback", {"engine": "extractive", "reason": reason,
                                 "model_failures": [dict(f) for f in model_failures]})
    return record


@dataclass
class StageTally:
    stage: str
    ok: int = 0
    fallback: int = 0
    failed: int = 0
    reasons: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # a reason as one record gave it, per key

    def add(self, result: Any) -> None:
        """Count one stage result: a record, a Reject, or a verify Verdict (``kind``, ``record``)."""
        if hasattr(result, "kind") and hasattr(result, "record") and not isinstance(result, Reject):
            result = result.record
        if isinstance(result, Reject):
            self.failed += 1
            self._reasons([{"where": "record", "reason": result.reason}])
            self._reasons((result.record or {}).get("failures") or [])
            return
        fb = (getattr(result, "model_extra", None) or {}).get("fallback")
        if isinstance(fb, dict):
            self.fallback += 1
            self._reasons([{"where": "record", "reason": fb.get("reason", "")}, *fb.get("model_failures", [])])
        else:
            self.ok += 1
        self._reasons(_failures(result))

    def add_failures(self, failures: Iterable[dict[str, Any]]) -> None:
        """Group recorded failures (``{"where", "reason"}``) without counting a record."""
        self._reasons(failures)

    def _reasons(self, failures: Iterable[dict[str, Any]]) -> None:
        for f in failures:
            where = f.get("where") or "record"
            key = f"{where}: {reason_key(f.get('reason', ''))}"
            self.reasons[key] += 1
            self.examples.setdefault(key, f"{where}: {brief_reason(f.get('reason', ''))}")

    @property
    def total(self) -> int:
        return self.ok + self.fallback + self.failed

    @property
    def every_failed(self) -> bool:
        """Records were worked on and none came out (the stage should exit non-zero)."""
        return self.total > 0 and self.ok + self.fallback == 0

    def top(self, n: int = 3) -> list[tuple[str, int]]:
        return self.reasons.most_common(n)

    def counts(self) -> dict[str, Any]:
        """For the provenance sidecar: record counts and the top reasons."""
        return {"ok": self.ok, "fallback": self.fallback, "failed": self.failed,
                "top_failure_reasons": [{"reason": self.examples.get(r, r), "count": c,
                                         **({"next_step": n} if (n := next_step(self.examples.get(r, r))) else {})}
                                        for r, c in self.top(5)]}

    def rows(self, n: int = 3) -> list[tuple[str, Any]]:
        """Summary-table rows: counts, then the ``n`` commonest failure reasons."""
        rows: list[tuple[str, Any]] = [("records ok", self.ok), ("rebuilt by the extractive fallback", self.fallback),
                                       ("records failed", self.failed)]
        return rows + self.reason_rows(n)

    def reason_rows(self, n: int = 3) -> list[tuple[str, str]]:
        """The ``n`` commonest reasons, each as one record gave it, with its count and next step."""
        rows = []
        for i, (r, c) in enumerate(self.top(n), start=1):
            step = next_step(self.examples.get(r, r))
            rows.append((f"top failure {i}", f"{c}× {self.examples.get(r, r)}" + (" (and alike)" if c > 1 else "")
                         + (f" → {step}" if step else "")))
        return rows

    def verdict(self) -> str | None:
        """One line for a stage where every record failed (None otherwise)."""
        if not self.every_failed:
            return None
        top = self.top(1)
        why = f"; the commonest reason ({top[0][1]}×): {self.examples.get(top[0][0], top[0][0])}" if top else ""
        return (f"{self.stage}: all {self.failed} record(s) failed{why}. "
                "Try --fallback extractive, a stronger --llm, or see the rejects file.")


def failure_rows(failures: Iterable[dict[str, Any]], n: int = 3) -> list[tuple[str, str]]:
    """Summary rows of the ``n`` commonest of some recorded failures (``{"where", "reason"}``)."""
    tally = StageTally("failures")
    tally.add_failures(failures)
    return tally.reason_rows(n)
