"""The extractive policy of tools mode (:mod:`deepr.agent.tools_agent`): replies in the agent's
text protocol without a model. It searches the question and each of its parts, browses the best
document once, and answers with the extractive writer's cited sentences as ``<cite>`` tags.

    deepr run "Who painted the Mona Lisa and where is it?" --mode tools --llm extractive
"""

from __future__ import annotations

import json
import re
from typing import Any

from deepr.evidence.env import Ctx
from deepr.evidence.extract import sub_questions

_MARKED = re.compile(r"(\s*)(.+?)\s*\[([^\[\]]+)\]([.!?]?)(?=\s|$)", re.S)


def cite_tags(text: str) -> str:
    """Turn writer sentences ending in ``[id]`` markers into ``<cite id="id">sentence</cite>``."""
    def wrap(m: re.Match) -> str:
        ids = [i.strip() for i in m.group(3).split(",") if i.strip()]
        return f'{m.group(1)}<cite id="{ids[0]}">{m.group(2).strip()}{m.group(4)}</cite>' if ids else m.group(0)

    return "\n\n".join(_MARKED.sub(wrap, para) for para in text.split("\n\n"))


MAX_QUERY_CHARS = 300  # web search APIs refuse longer queries (Brave: 400); the corpus takes any


def search_text(text: str) -> str:
    """A question as a search query: one line, whole (no ellipsis: a literal "…" would be searched
    for), cut at a word boundary only past what search APIs accept."""
    flat = " ".join(text.split())
    return flat if len(flat) <= MAX_QUERY_CHARS else flat[:MAX_QUERY_CHARS].rsplit(" ", 1)[0]


class ExtractivePolicy:
    """Deterministic replies in the agent's protocol: search each part, browse once, answer."""

    def __init__(self, ctx: Ctx, query: str, max_turns: int):
        parts = sub_questions(query)
        self.queries = list(dict.fromkeys([search_text(query)] + [search_text(p) for p in parts if p != query]))
        self.ctx, self.query, self.parts, self.max_turns = ctx, query, parts, max_turns
        self.browsed = False

    def reply(self, session: Any) -> str:  # a tools_agent.ToolSession
        if session.calls < min(len(self.queries), self.max_turns):
            q = self.queries[session.calls]
            return (f"<think>Search for: {q}</think>\n<tool_call>"
                    f"{json.dumps({'name': 'search', 'arguments': {'query': q}}, ensure_ascii=False)}</tool_call>")
        if not self.browsed and session.shown and session.calls < self.max_turns:
            self.browsed = True
            top = self.ctx.catalog[session.shown[0]].doc_id
            return (f"<think>Read the most relevant page in full.</think>\n<tool_call>"
                    f"{json.dumps({'name': 'browse', 'arguments': {'doc_id': top}}, ensure_ascii=False)}</tool_call>")
        from deepr.evidence.writer import write_by_parts

        text = write_by_parts(self.ctx, self.query, self.parts, session.shown, self.ctx.config.answer_sentences)
        return f"<think>Answer from the cited evidence.</think>\n<answer>{cite_tags(text)}</answer>"


def step_reply(a: Any) -> str:
    """One step of the tools agent's conversation (deepr.agent.tools_agent), by its policy."""
    return a.policy.reply(a.session)
