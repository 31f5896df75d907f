"""The support check without a model: a claim is backed when most of its content words occur in the
cited source and it names no number or name the source never mentions."""

from __future__ import annotations

import re
from typing import Any

from deepr.text import STOP_WORDS, tok, words

SUPPORTED, PARTIAL = 0.6, 0.34  # share of the claim's content words found in the cited text
_NAME = re.compile(r"(?<![.!?:]\s)(?<!^)\b([A-Z][\w'-]*)")
Verdict = dict[str, Any]  # {"verdict": "supported" | "partial" | "unsupported", "reason": str}


def _key(word: str) -> str:
    # A crude stem: "eruption" / "erupted" / "erupts" meet on "erupt"; numbers stay whole.
    return word if any(c.isdigit() for c in word) or len(word) <= 5 else word[:5]


def invented(claim: str, source: str) -> list[str]:
    """Numbers and names of ``claim`` (lower-cased) that ``source`` never mentions."""
    plain = set(words(source))
    have = {_key(w) for w in plain}
    numbers = [w for w in tok(claim) if any(c.isdigit() for c in w) and w not in plain]
    names = [n for n in dict.fromkeys(m.group(1).lower() for m in _NAME.finditer(claim))
             if n not in STOP_WORDS and _key(n) not in have]
    return numbers + [n for n in names if n not in numbers]


def overlap_verdict(claim: str, source: str) -> Verdict:
    """The no-model check: content-word overlap, and no number or name missing from the source."""
    have = {_key(w) for w in words(source)}
    content = tok(claim)
    if not content:
        return {"verdict": "supported", "reason": "", "overlap": 1.0}
    share = sum(_key(w) in have for w in content) / len(content)
    found = invented(claim, source)
    if found:
        return {"verdict": "unsupported", "overlap": round(share, 3),
                "reason": f"not in the cited source: {', '.join(found[:6])}"}
    if share >= SUPPORTED:
        return {"verdict": "supported", "reason": "", "overlap": round(share, 3)}
    verdict = "partial" if share >= PARTIAL else "unsupported"
    return {"verdict": verdict, "overlap": round(share, 3),
            "reason": f"only {share:.0%} of its content words occur in the cited source"}


def support_reply(a: Any) -> dict[str, Any]:
    """The support judge's reply (deepr.agent.support) from the overlap check."""
    v = overlap_verdict(a.claim, a.sources)
    return {"verdict": v["verdict"], "unsupported_part": v["reason"]}
