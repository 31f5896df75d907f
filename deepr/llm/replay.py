"""``replay:<file.jsonl>``: recorded replies played back in order, for tests and demos.

``ReplayLLM(["reply 1", "reply 2"])`` answers every call with the next reply;
``ReplayLLM({"planner": [...], "judge": [...]})`` keeps one queue per role. Running out
raises :class:`LLMError` ("replay exhausted for role X after N replies"), which
``ask_json`` records as a failure instead of hanging. ``calls`` keeps every
``(role, messages)`` received, so tests can check what a role asked.

A replay file has one JSON object per line: ``{"role": "planner", "reply": "..."}``.
If no line names a role, the replies form a single queue.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deepr.llm.base import LLM, LLMError, Message


class ReplayLine(BaseModel):
    """One recorded reply."""

    model_config = ConfigDict(extra="ignore")

    role: str | None = Field(None, description="Role the reply is for; omit for a single shared queue.")
    reply: str = Field(description="The reply text, returned verbatim.")


class ReplayLLM(LLM):
    name = "replay"

    def __init__(self, replies: Sequence[str] | Mapping[str, Sequence[str]], *,
                 source: str | None = None):
        super().__init__(max_concurrency=1)  # order of replies must follow order of calls
        if isinstance(replies, str):
            raise TypeError("ReplayLLM takes a list of replies (or a dict role -> list), not one string")
        self.per_role = isinstance(replies, Mapping)
        if self.per_role:
            self._queues = {role: list(rs) for role, rs in replies.items()}  # type: ignore[union-attr]
        else:
            self._queues = {None: list(replies)}  # type: ignore[dict-item]
        self._used: dict[str | None, int] = {k: 0 for k in self._queues}
        self.source = source
        self.calls: list[tuple[str | None, list[Message]]] = []

    @classmethod
    def from_file(cls, path: str | Path) -> ReplayLLM:
        from deepr.io import RecordError, parse_line

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such replay file (record one, or check the path in --llm replay:...)")
        lines = [(n, parse_line(raw, ReplayLine, path, n))
                 for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1) if raw.strip()]
        if not lines:
            raise ValueError(f"{path}: replay file has no replies; add lines like "
                             '{"role": "planner", "reply": "..."}')
        if all(r.role is None for _, r in lines):
            return cls([r.reply for _, r in lines], source=str(path))
        queues: dict[str, list[str]] = {}
        for lineno, r in lines:
            if r.role is None:
                raise RecordError(path, lineno, "missing while other lines name a role; give every line "
                                  "a role or none", field="role")
            queues.setdefault(r.role, []).append(r.reply)
        return cls(queues, source=str(path))

    def remaining(self, role: str | None = None) -> int:
        key = role if self.per_role else None
        return len(self._queues.get(key, [])) - self._used.get(key, 0)

    async def _achat(self, messages: list[Message], *, role: str | None, temperature: float | None,
                     max_tokens: int | None, stop: Sequence[str] | None, **extra: Any) -> str:
        self.calls.append((role, messages))
        key = role if self.per_role else None
        queue, used = self._queues.get(key, []), self._used.get(key, 0)
        if used >= len(queue):
            self.usage.failures += 1
            raise LLMError(f"replay exhausted for role {role or 'default'} after {used} replies"
                           + (f" (from {self.source})" if self.source else ""))
        self._used[key] = used + 1
        reply = queue[used]
        self.usage.add(role=role, prompt_tokens=_words(messages), completion_tokens=len(reply.split()))
        return reply

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "source": self.source,
                "replies": {str(k): len(v) for k, v in self._queues.items()}}


def _words(messages: list[Message]) -> int:
    return sum(len(str(m.get("content", "")).split()) for m in messages)
