"""The evolving outline of warp mode: numbered sections, their plans, content and evidence.

Positions are dotted numbers ("2", "2.1"); the models see them as ``section-2.1``. A
section at level L can be expanded into subsections at level L+1 once, and only while
L+1 stays within the level limit (AgentCPM-Report: at most 3 levels).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from deepr.evidence.extract import shorten

_POS = re.compile(r"^(?:section[-\s_]*)?(\d+(?:\.\d+)*)$", re.I)


@dataclass
class Section:
    pos: str
    title: str
    plan: str
    content: str = ""
    ids: list[str] = field(default_factory=list)  # evidence shown when it was written
    children: list[Section] = field(default_factory=list)

    @property
    def level(self) -> int:
        return self.pos.count(".") + 1

    def as_dict(self) -> dict[str, Any]:
        return {"position": f"section-{self.pos}", "title": self.title, "plan": self.plan,
                "evidence": self.ids, "children": [c.as_dict() for c in self.children]}


@dataclass
class Outline:
    title: str
    sections: list[Section] = field(default_factory=list)

    def walk(self) -> Iterator[Section]:
        stack = list(reversed(self.sections))
        while stack:
            s = stack.pop()
            yield s
            stack.extend(reversed(s.children))

    def find(self, position: str) -> Section | None:
        m = _POS.match(position.strip())
        return next((s for s in self.walk() if s.pos == m.group(1)), None) if m else None

    def expandable(self, max_levels: int) -> list[Section]:
        return [s for s in self.walk() if not s.children and s.level < max_levels]

    def add_sections(self, items: list[dict[str, str]], parent: Section | None = None) -> list[Section]:
        siblings = parent.children if parent else self.sections
        prefix = f"{parent.pos}." if parent else ""
        new = [Section(f"{prefix}{len(siblings) + i}", it["title"].strip(), it.get("plan", "").strip())
               for i, it in enumerate(items, start=1)]
        siblings.extend(new)
        return new

    def listing(self, with_content: int = 0) -> str:
        """Outline as text for prompts; ``with_content`` words of each written section."""
        lines = []
        for s in self.walk():
            pad = "  " * (s.level - 1)
            lines.append(f"{pad}section-{s.pos} {s.title}: {s.plan}")
            if with_content and s.content:
                lines.append(f"{pad}  > {shorten(s.content, with_content)}")
        return "\n".join(lines) or "(empty)"

    def markdown(self) -> str:
        """The draft: title and every section under a heading of its level."""
        parts = [f"# {self.title}"]
        for s in self.walk():
            parts.append(f"{'#' * (s.level + 1)} {s.pos} {s.title}")
            if s.content:
                parts.append(s.content)
        return "\n\n".join(parts) + "\n"

    def used_text(self) -> list[str]:
        return [s.content for s in self.walk() if s.content]
