"""tools mode: the DeepRubric tool-calling research agent (002 App. D).

One model loops ``<think>`` → ``<tool_call>{"name", "arguments"}</tool_call>`` → the
environment's ``<tool_response>`` → ... → ``<answer>`` whose claims are wrapped in
``<cite id="S1-R2">claim</cite>`` spans. Tools: ``search`` / ``scholar`` (ranked snippets)
and ``browse`` (the full page of a document an earlier search returned). Citation ids are
issued by code (:class:`~deepr.evidence.citations.Catalog`): results of tool call t are
``S<t>-R<k>``, a browsed page ``S<t>-F<n>``. An answer citing an id the agent was never
shown is re-asked (bounded), then accepted with those citations removed and a failure
recorded. At most ``max_turns`` tool turns (10 at inference, 20 in training); after that
the agent must answer. The same text protocol is used by ``deepr grpo --stage rubric``,
whose rollouts call :class:`ToolSession` for every ``<tool_call>``.

The extractive implementation writes the same protocol without a model: it searches the
question and each of its parts, browses the best document, and answers with the
extractive writer's cited sentences turned into ``<cite>`` spans.

    deepr run "Who painted the Mona Lisa and where is it?" --mode tools --out report.md
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from collections.abc import Sequence
from typing import Any

from deepr.evidence.citations import cited_ids, normalize, strip_ids
from deepr.evidence.env import Ctx
from deepr.evidence.extract import shorten, sub_questions
from deepr.extractive.tools import ExtractivePolicy, cite_tags, step_reply
from deepr.text.lang import ask_in_language
from deepr.agent.render import GNode, Graph, Section
from deepr.llm.base import OutputFormat
from deepr.roles.acceptance import FREE_TEXT, no_babble, no_placeholder, query_words
from deepr.roles import REASK_TEMPERATURE, Role, perform

RUN_TURNS, TRAIN_TURNS = 10, 20
# 002 App. D (Fig. 13-14): one system prompt for training and inference, carrying the long-form
# requirements: several rounds of search with gap analysis, cross-source verification, a deep,
# structured answer, grounded citations only, and the think -> one tool call / answer workflow.
TOOLS_SYSTEM = """You are a deep research assistant. You investigate a question thoroughly, from several \
sources, and write a comprehensive, accurate and objective report. Questions may be broad or belong to a \
specialised field.

Research requirements:
- Never stop after a single search. Search in several rounds (normally 2 to 4 or more tool calls before \
answering, unless the question is trivial), varying queries, angles and keywords.
- After every result, work out what is still missing, uncertain or contradictory, and search for it.
- Investigate each key concept of the question on its own, and check important facts across sources. \
One source or one perspective is not enough.

Answer requirements:
- The final answer is comprehensive, detailed and in depth: it covers every aspect of the question, \
explains the mechanisms behind what it reports (not only what happens), compares perspectives, models or \
assumptions where relevant, and ties the sources into one coherent narrative instead of listing them.
- Organise it under clear markdown headers; write paragraphs of 5 to 8 sentences with topic sentences and \
transitions; use lists only where they make things clearer.
- Say where evidence is thin or sources disagree, and what evidence would settle it.
- Ground every non-trivial claim in the tool responses: wrap the claim as <cite id="S1-R2">the claim</cite> \
(several ids separated by commas) using only ids that tool responses showed. Never invent content, \
snippets or ids.

Tools (call as <tool_call>{"name": "...", "arguments": {...}}</tool_call>):
- search {"query": "a few words"}: ranked snippets of an encyclopedia, each labelled with an id like [S1-R2].
- browse {"doc_id": "an id or doc id from an earlier search"}: the full page of that document. Only \
documents an earlier search returned can be opened; never make up a document id. Prefer opening pages of \
different sources.
- scholar {"query": "..."}: like search, over a second (scholarly) corpus when one is available.
The tool's output comes back inside <tool_response>...</tool_response>. You may make at most \
{max_turns} tool calls.

Workflow: every step (and every step after a tool response) starts with brief reasoning inside \
<think>...</think>, followed by exactly one of: one <tool_call> block when you need more evidence, or the \
whole final answer inside <answer>...</answer> when the evidence is sufficient. Never put a tool call \
inside the think block."""
# Re-ask texts name the tags in words: a literal "<answer>...</answer>" or an example id is
# what a weak model copies back verbatim.
FINAL_NUDGE = "You have used all your tool calls. Write the final answer now, inside answer tags, from what you found."
BAD_STEP = ("Your reply could not be used: {reason}. Reply with brief reasoning in think tags, then exactly "
            "one tool call (a JSON object with name and arguments in tool_call tags) or the answer in answer tags.")
BAD_CITES = ("Your answer cites ids that no tool response showed: {ids}. Cite only ids that tool responses "
             "labelled, and reply with the corrected answer in answer tags.")
NO_SEARCH = ("You answered before searching. Search for evidence first with a tool call, then answer citing "
             "the ids the tool responses show.")
NO_CITES = ("Your answer cites nothing. Wrap each factual claim in a cite tag carrying the id of the tool "
            "response it comes from, and reply with the corrected answer in answer tags.")
STEP_REGEX = (r'(<think>[^<]*</think>[ \n]*)?(<tool_call>\{[^<]*\}</tool_call>|'
              r'<answer>([^<]|<cite id="[^"<>]*">|</cite>)+</answer>)')

_TOOL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S | re.I)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_THINK = re.compile(r"<think>(.*?)</think>", re.S | re.I)
_CITE_TAG = re.compile(r"</?cite\b[^>]*>", re.I)
_CITE = re.compile(r"<cite\s+ids?\s*=\s*[\"']([^\"']*)[\"']\s*>", re.I)


@dataclass
class Step:
    """One parsed model turn: a tool call, the answer, or an unusable reply (with the reason)."""

    kind: str  # "tool" | "answer" | "invalid"
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    answer: str = ""
    reason: str = ""


def system_prompt(max_turns: int = RUN_TURNS) -> str:
    return TOOLS_SYSTEM.replace("{max_turns}", str(max_turns))


def first_messages(query: str, max_turns: int = RUN_TURNS) -> list[dict[str, str]]:
    return ask_in_language([{"role": "system", "content": system_prompt(max_turns)},
                            {"role": "user", "content": query.strip()}], query)


def parse_step(text: str) -> Step:
    """Read one turn; the tool call wins when a reply has both (the answer would be premature)."""
    calls = _TOOL.findall(text or "")
    if calls:
        try:
            call = json.loads(calls[0].strip())
        except json.JSONDecodeError as e:
            return Step("invalid", reason=f"the <tool_call> body is not JSON ({e.msg})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return Step("invalid", reason='the <tool_call> needs {"name": ..., "arguments": {...}}')
        args = call.get("arguments", {})
        if not isinstance(args, dict):
            return Step("invalid", reason="the tool call's arguments must be a JSON object")
        return Step("tool", name=call["name"], arguments=args)
    answers = _ANSWER.findall(text or "")
    if answers and answers[-1].strip():
        if not _CITE_TAG.sub("", answers[-1]).strip():  # '<cite id=""></cite>' alone says nothing
            return Step("invalid", reason="the <answer> is empty once its cite tags are removed")
        return Step("answer", answer=answers[-1].strip())
    return Step("invalid", reason="no <tool_call> and no non-empty <answer>")


def tool_response(text: str) -> str:
    return f"<tool_response>\n{text.strip()}\n</tool_response>"


def answer_ids(answer: str) -> list[str]:
    """Ids cited in an answer, from <cite id> spans and bracket markers alike."""
    ids = [i.strip() for m in _CITE.finditer(answer) for i in re.split(r"[,\s;]+", m.group(1)) if i.strip()]
    return list(dict.fromkeys(ids + cited_ids(answer)))


class ToolSession:
    """Runs one agent's tool calls on a :class:`Ctx` and remembers what it may cite."""

    def __init__(self, ctx: Ctx, *, max_chars: int = 600):
        self.ctx, self.max_chars = ctx, max_chars
        self.calls = 0
        self.valid = 0
        self.shown: list[str] = []
        # each executed call as JSON, and who made it ("" for the model), what the report lists
        self.log: list[tuple[str, str]] = []

    def execute(self, name: str, arguments: dict[str, Any], *, by: str = "") -> str:
        """The tool's output as text (errors too: the model reads them and can recover)."""
        self.calls += 1
        self.log.append((json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False), by))
        node = f"S{self.calls}"
        if name in ("search", "scholar"):
            query = arguments.get("query")
            if not isinstance(query, str) or not query.strip():
                return f'{name} needs {{"query": "some words"}}; got arguments {json.dumps(arguments)[:120]}'
            if name == "scholar" and getattr(self.ctx.tools, "scholar_retriever", None) is None:
                return "scholar is not available in this run (no second corpus); use search"
            ids = self._search(name, node, query.strip())
            self.valid += 1
            return self.ctx.catalog.evidence(ids, self.max_chars) if ids else f"no results for {query!r}"
        if name == "browse":
            ref = arguments.get("doc_id") or arguments.get("id") or arguments.get("url")
            if not isinstance(ref, str) or not ref.strip():
                return 'browse needs {"doc_id": "an id from an earlier search result"}'
            cids = self.ctx.fetch_all(ref.strip(), node=node)
            if not cids:
                return f"browse refused: {ref!r} was not returned by an earlier search in this run"
            self.valid += 1
            self.shown.extend(cids)
            return self.ctx.catalog.evidence(cids, self.max_chars * 4 // len(cids))
        return f"unknown tool {name!r}; use search, browse or scholar"

    def _search(self, name: str, node: str, query: str) -> list[str]:
        if name == "search":
            ids = self.ctx.search(node, query)
        else:
            hits = self.ctx.catalog.screen(self.ctx.tools.scholar(query))
            ids = self.ctx.catalog.add_hits(node, hits, query)
            self.ctx.tracer.tool("scholar", node=node, query=query, ids=ids, doc_ids=[h.doc_id for h in hits])
        self.shown.extend(ids)
        return ids

    def store(self) -> dict[str, str]:
        """{id: snippet text} of everything shown, the citation store of the reward."""
        return {cid: self.ctx.catalog[cid].text for cid in self.shown}


@dataclass
class ToolsOutcome:
    answer: str  # markdown with [id] markers, as the report renders it
    raw_answer: str  # the <answer> body with <cite> spans
    transcript: list[dict[str, str]]
    tool_calls: int
    # the calls executed, in order, with who made them (ToolSession.log): the model's and the fallback's
    log: list[tuple[str, str]] = field(default_factory=list)


# --- the loop ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StepReply:
    """The agent's reply shape: one tool call or the answer (the raw reply is the value)."""

    def fmt(self, name: str, inp: Any = None) -> OutputFormat:
        return OutputFormat(name, regex=STEP_REGEX)

    def parse(self, reply: str) -> tuple[str | None, str | None]:
        step = parse_step(reply)
        return (reply, None) if step.kind != "invalid" else (None, step.reason)

    def render(self, value: str) -> str:
        return value

    def reask(self, error: str) -> str:
        return BAD_STEP.format(reason=error)


@dataclass
class StepAsk:
    convo: list[dict[str, str]]
    session: ToolSession
    policy: ExtractivePolicy
    # Set once the model repeated a search: from then on its format offers only browsing and
    # the answer (re-asked, a small model repeats the same query until its turns run out).
    no_search: bool = False


REPEATED = "was already made"


def searched_queries(messages: Sequence[dict[str, str]]) -> set[str]:
    """The search queries of the conversation's earlier turns (accepted or not), normalized."""
    return {" ".join(str(p.arguments.get("query", "")).lower().split())
            for m in messages if m.get("role") == "assistant"
            for p in [parse_step(str(m.get("content", "")))] if p.kind == "tool" and p.name in ("search", "scholar")}


def _corrections(messages: Sequence[dict[str, str]]) -> list[str]:
    """The loop's own correction messages (user turns after the question that are not tool
    output): a reply that copies one of their sentences is an echo, not an answer."""
    users = [str(m.get("content", "")) for m in messages if m.get("role") == "user"]
    return [u for u in users[1:] if not u.lstrip().startswith("<tool_response>")]


def _step_accept(reply: str, messages: Sequence[dict[str, str]], sent: Sequence[str]) -> list[str]:
    """Strict acceptance of one agent turn: a real answer, a real search query."""
    step = parse_step(reply)
    if step.kind == "answer":
        body = _CITE_TAG.sub("", step.answer)
        again = [*sent, *_corrections(messages)]
        return [p for accept in FREE_TEXT for p in accept(body, messages, again)]
    if step.kind == "tool" and step.name in ("search", "scholar"):
        query = str(step.arguments.get("query", ""))
        if " ".join(query.lower().split()) in searched_queries(messages):  # a weak model repeats one search
            return [f"the search {query!r} {REPEATED}; search for something not yet covered, or answer"]
        return (no_placeholder(query, messages, sent) or no_babble(query, messages, sent)
                or query_words(lambda q: [q])(query, messages, sent))
    return []


STEP = Role(name="agent", action="step", messages=lambda a: list(a.convo), output=StepReply(),
            extractive=step_reply, fallback=None, max_tokens=1024, accept=(_step_accept,),
            turn_action=lambda v: (lambda st: st.name or st.kind)(parse_step(v)))
# 1024: after ten tool turns the transcript fills most of a small model's context.
ANSWER = replace(STEP, action="answer", max_tokens=1024)


async def run_tools(ctx: Ctx, query: str, *, max_turns: int = RUN_TURNS) -> ToolsOutcome:
    """Run the loop until an accepted answer; see the module docstring."""
    session = ToolSession(ctx)
    convo = first_messages(query, max_turns)
    ask = StepAsk(convo, session, ExtractivePolicy(ctx, query, max_turns))
    reasks, answer = 0, None
    while answer is None:
        role = ANSWER if session.calls >= max_turns else STEP
        with ctx.tracer.phase("agent"):
            # Re-asks are part of this loop's conversation, so the executor asks once per turn.
            out = await perform(role, ask, llm=ctx.llm, rec=ctx.tracer, max_reasks=0, profile=ctx.profile,
                                temperature=ctx.config.temperature if reasks == 0 else max(
                                    ctx.config.temperature or 0.0, REASK_TEMPERATURE),
                                max_tokens=ctx.config.max_tokens, earlier=reasks)
        reply = out.value if out.ok else out.reply
        if reply is None:  # the call itself failed (after the backend's retries): answer from what was found
            answer = _salvage(ctx, query, Step("invalid", reason=out.error or ""), session)
            break
        step, rejected = parse_step(reply), None if out.ok else out.error
        ask.no_search = ask.no_search or REPEATED in (rejected or "")
        convo.append({"role": "assistant", "content": reply})
        if step.kind == "tool" and rejected is None and session.calls < max_turns:
            with ctx.tracer.phase("tools"):
                convo.append({"role": "user", "content": tool_response(session.execute(step.name, step.arguments))})
            continue
        problem = _answer_problem(step, session, max_turns, rejected)
        if problem is None:
            answer = step.answer
        elif reasks >= ctx.config.max_reasks:
            ctx.tracer.fail("agent/answer", problem, attempts=reasks + 1)
            _written_around(ctx, problem)
            cited = [i for i in answer_ids(step.answer) if i in session.shown]
            # An answer whose only fault is an invented id keeps its valid citations (the
            # invented ones are stripped below); a rejected one is written from the evidence.
            answer = _salvage(ctx, query, step if rejected is None and cited else Step("invalid"), session)
        else:
            reasks += 1
            if rejected and ctx.profile is not None and ctx.profile.reask == "resample":
                convo.pop()  # the same conversation again, sampled (see GenDefaults.reask)
            else:
                convo.append({"role": "user", "content": problem})
    md = strip_ids(normalize(answer), [i for i in answer_ids(answer) if i not in session.shown])
    ctx.tracer.decide("answer", tool_calls=session.calls, cited=answer_ids(answer))
    ctx.tracer.extra.update(tool_calls=session.calls)
    return ToolsOutcome(md, answer, convo, session.calls, list(session.log))


def _answer_problem(step: Step, session: ToolSession, max_turns: int, rejected: str | None = None) -> str | None:
    """What is wrong with a turn that should now be the answer (None: accept it)."""
    at_limit = session.calls >= max_turns
    if step.kind == "tool" and (at_limit or rejected is None):
        return FINAL_NUDGE
    if step.kind == "invalid":
        return FINAL_NUDGE if at_limit else BAD_STEP.format(reason=step.reason)
    if rejected:
        return BAD_STEP.format(reason=rejected)
    unknown = [i for i in answer_ids(step.answer) if i not in session.shown]
    if unknown:
        return BAD_CITES.format(ids=", ".join(unknown[:8]))
    if not session.shown:  # nothing was found, so nothing could back (or be cited by) an answer
        return FINAL_NUDGE if at_limit else NO_SEARCH
    if not answer_ids(step.answer):
        return NO_CITES
    return None


def _written_around(ctx: Ctx, problem: str) -> None:
    """Mark the turn the loop gave up on as failed: the answer that stands is salvaged (invented
    ids stripped) or written extractively, so the run's exit status and a pruned trajectory must
    not count that turn as the model's success (the executor had passed its format)."""
    turn = ctx.tracer.turns[-1] if ctx.tracer.turns else None
    if turn is not None and turn.ok:
        turn.ok = False
        turn.error = problem  # type: ignore[attr-defined]  # Turn keeps extra fields


def _salvage(ctx: Ctx, query: str, step: Step, session: ToolSession) -> str:
    """After the re-asks: keep a usable answer (unknown ids are stripped later), else write one
    extractively from what was found, so the run still yields a cited report."""
    if step.kind == "answer" and session.shown:
        return step.answer
    from deepr.evidence.writer import write_by_parts

    if not session.shown:  # the model never searched: the extractive policy's searches, made by code
        for q in ExtractivePolicy(ctx, query, 1).queries:
            session.execute("search", {"query": q}, by="code, for the extractive answer")
    ctx.tracer.decide("fallback", fallback=["agent answer"])
    return cite_tags(write_by_parts(ctx, query, sub_questions(query), session.shown,
                                     ctx.config.answer_sentences))


def tools_doc(out: ToolsOutcome, words: dict[str, Any] | None = None) -> tuple[str, list[Section], Graph]:
    """The report pieces for the runner: the answer, the tool-call log, a chain graph; headings
    from ``words`` (deepr/evidence/phrases.py, the question's language), else English. The log
    lists the calls the session executed, never a reply's text: a reply cut inside its call,
    or refused, mentions ``<tool_call>`` without being one."""
    w = words or {}
    calls = out.log
    lines = [f"{i}. `{shorten(c, 30).replace('`', chr(39))}`" + (f" (made by {by})" if by else "")
             for i, (c, by) in enumerate(calls, 1)]
    g = Graph([GNode(f"T{i}", f"tool call {i}", "step") for i in range(1, len(calls) + 1)]
              + [GNode("answer", "answer", "answer")])
    chain = [n.id for n in g.nodes]
    g.edges = list(zip(chain, chain[1:]))
    return out.answer, [Section(w.get("answer", "Answer"), out.answer),
                        Section(w.get("tool_calls", "Tool calls"), "\n".join(lines) or "(none)")], g
