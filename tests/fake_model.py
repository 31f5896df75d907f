"""A "competent model" behind an OpenAI-compatible loopback server, for tests.

:class:`CompetentModel` is a reply script for :class:`deepr.llm.stub_server.StubServer`. It
infers the role of each request (the response_format's schema name for JSON roles, the system
prompt for tagged ones), writes a plausible reply from what the prompt shows (a plan that
decomposes the question, text that cites ids the evidence lines carry, rubric JSON, verdicts)
and fits it to the schema or regex the request carried, so it is valid under exactly the format
deepr sent. A reply that is still not valid is recorded in ``invalid`` (a test asserts none).

The model reads formats, never deepr's own role modules: the JSON value is walked against the
schema sent (required fields filled, fields a closed object does not declare dropped, nullable
optional fields null), so a change of a role's schema changes the replies with it.

    with StubServer(CompetentModel()) as srv:
        deepr run "..." --llm openai:fake --base-url srv.base_url
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from typing import Any

from deepr.llm.stub_server import Raw

ID = r"[A-Za-z][A-Za-z0-9_.\-]*?-[RF][0-9]+"
_EVIDENCE = re.compile(rf"^\s*\[({ID})\]\s*(.*)$", re.M)
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]{2,}")
_STOP = set("the and for with that this from what which when where who whom whose why how are was were "
            "has have had does did into onto about over under than then them they their there these those "
            "its his her our your not but can could would should will shall may might must been being also "
            "only such more most much many some any each other between during while after before".split())


def words_of(text: str, n: int = 8) -> list[str]:
    out: list[str] = []
    for w in _WORD.findall(text):
        if w.lower() not in _STOP and w.lower() not in {x.lower() for x in out}:
            out.append(w)
    return out[:n]


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if len(s.split()) >= 5]


class Prompt:
    """What one request shows: system text, user texts, evidence lines, the question."""

    def __init__(self, body: dict[str, Any]):
        msgs = body.get("messages") or []
        self.system = next((str(m.get("content") or "") for m in msgs if m.get("role") == "system"), "")
        self.users = [str(m.get("content") or "") for m in msgs if m.get("role") == "user"]
        self.user = self.users[0] if self.users else ""
        self.last = self.users[-1] if self.users else ""
        self.messages = msgs
        every = "\n".join(self.users)
        self.evidence: dict[str, str] = {}
        for m in _EVIDENCE.finditer(every):
            text = m.group(2)
            text = text.split(": ", 1)[1] if ": " in text else text
            self.evidence.setdefault(m.group(1), text.replace("<<<", "").replace(">>>", "").strip())
        # sentences that already carry a marker (decor's memory facts, a condensed memory)
        for m in re.finditer(rf"([A-Z][^.\[\]\n]{{20,300}}?)\s*\[({ID})\]", every):
            self.evidence.setdefault(m.group(2), m.group(1).strip() + ".")
        self.question = self._question()

    def _question(self) -> str:
        for label in ("Research question:", "User question:", "Question:", "Seed topic:", "Sub-query:",
                      "Research sub-query:", "question:"):
            if label in self.user:
                rest = self.user.split(label, 1)[1].strip()
                return rest.splitlines()[0].strip() if rest else ""
        return self.user.strip().splitlines()[0] if self.user.strip() else "the topic"

    def cited(self, ids: list[str] | None = None, n: int = 3) -> str:
        """Sentences taken from the evidence, each with the id it came from."""
        out = []
        for cid in (ids if ids is not None else list(self.evidence)):
            text = self.evidence.get(cid, "")
            sent = next(iter(sentences(text)), "")
            sent = re.sub(r"[\[\]<>]", "", sent).rstrip(" …")
            if sent and not any(o.startswith(sent.rstrip(".")) for o in out):  # one passage under several ids
                out.append(f"{sent.rstrip('.')} [{cid}].")
            if len(out) == n:
                break
        return " ".join(out)

    def terms(self, n: int = 6) -> list[str]:
        return words_of(self.question, n) or ["history", "topic"]


# --- fitting a value to the schema sent ---------------------------------------------------


def _resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    while isinstance(schema, dict) and "$ref" in schema:
        path = schema["$ref"].lstrip("#/").split("/")
        node: Any = root
        for p in path:
            node = node[p]
        schema = node
    return schema


def _nullable(schema: dict[str, Any]) -> bool:
    t = schema.get("type")
    return t == "null" or (isinstance(t, list) and "null" in t) or any(
        isinstance(s, dict) and s.get("type") == "null" for s in schema.get("anyOf", []))


def fit(value: Any, schema: dict[str, Any], root: dict[str, Any], filler: str = "the topic") -> Any:
    """``value`` made valid under ``schema`` where it is not (schema-driven, see module doc)."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or not schema:
        return value
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return value if value in schema["enum"] else schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = [_resolve(s, root) for s in schema[key]]
            if value is None and any(o.get("type") == "null" for o in options):
                return None
            best = next((o for o in options if _valid(value, o, root)), None)
            if best is not None:
                return value
            typed = [o for o in options if o.get("type") != "null"]
            return fit(value, typed[0] if typed else options[0], root, filler)
    t = schema.get("type")
    if isinstance(t, list):
        if value is None and "null" in t:
            return None
        t = next((x for x in t if x != "null"), None)
    if t == "object" or "properties" in schema:
        return _fit_object(value if isinstance(value, dict) else {}, schema, root, filler)
    if t == "array":
        items = value if isinstance(value, list) else []
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        prefix = schema.get("prefixItems") or []
        out = [fit(v, prefix[i] if i < len(prefix) else schema.get("items", {}), root, filler)
               for i, v in enumerate(items)]
        while len(out) < max(lo, len(prefix)):
            i = len(out)
            out.append(fit(None, prefix[i] if i < len(prefix) else schema.get("items", {}), root, filler))
        return out[:hi] if hi is not None else out
    if t == "string":
        s = value if isinstance(value, str) else filler
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if len(s) < lo:
            s = (s + " " + filler * (lo // max(1, len(filler)) + 1))[: max(lo, len(s))]
        if hi is not None:
            s = s[:hi]
        return s
    if t == "boolean":
        return value if isinstance(value, bool) else False
    if t in ("integer", "number"):
        v = value if isinstance(value, (int, float)) and not isinstance(value, bool) else schema.get("minimum", 1)
        v = max(v, schema.get("minimum", v))
        v = min(v, schema.get("maximum", v))
        return int(v) if t == "integer" else v
    return value


def _fit_object(value: dict[str, Any], schema: dict[str, Any], root: dict[str, Any], filler: str) -> dict[str, Any]:
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    out: dict[str, Any] = {}
    for k, v in value.items():
        if k in props:
            out[k] = fit(v, props[k], root, filler)
        elif isinstance(extra, dict):
            out[k] = fit(v, extra, root, filler)
        elif extra is not False:
            out[k] = v
    for k in schema.get("required", []):
        if k not in out:
            sub = _resolve(props.get(k, {}), root)
            out[k] = None if _nullable(sub) else sub.get("default", fit(None, sub, root, filler))
    return out


def _valid(value: Any, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    return not errors_of(value, {**schema, "$defs": root.get("$defs", {})})


def errors_of(value: Any, schema: dict[str, Any]) -> list[str]:
    from jsonschema import Draft202012Validator

    return [e.message for e in Draft202012Validator(schema).iter_errors(value)][:3]


# --- the model ----------------------------------------------------------------------------


class CompetentModel:
    """Reply script for StubServer; see the module docstring. Counts replies by role."""

    def __init__(self) -> None:
        self.roles: Counter = Counter()
        self.invalid: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> str | Raw:
        if "grammar" in body:  # regex formats as vLLM sends them, which the fake can check
            return Raw(json.dumps({"error": {"message": "grammar is not supported"}}), status=400)
        p = Prompt(body)
        rf = body.get("response_format") or {}
        js = rf.get("json_schema") or {}
        schema = js.get("schema") or rf.get("schema")
        regex = (body.get("structured_outputs") or {}).get("regex")
        role = infer_role(js.get("name", ""), p)
        with self._lock:
            self.roles[role] += 1
        make = ROLES.get(role, _generic)
        value = make(p)
        if schema is not None:
            value = fit(value, schema, schema, " ".join(p.terms(3)))
            problems = errors_of(value, schema)
            text = json.dumps(value, ensure_ascii=False)
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            problems = [] if regex is None or re.fullmatch(regex, text) else [f"does not match {regex[:80]}"]
        if problems:
            with self._lock:
                self.invalid.append((role, "; ".join(problems)))
        return text


def infer_role(name: str, p: Prompt) -> str:
    if name:
        return name
    s = p.system
    for key, role in (("You plan the searches of a question-answering", "decor_planner_plan"),
                      ("You filter search results", "decor_filter_filter"),
                      ("You answer a question strictly from the facts", "decor_answerer_answer"),
                      ("You are a deep research assistant", "agent_step"),
                      ("You write parts of a research report", "answerer_final"),
                      ("report writer who works in small actions", "warp_write")):
        if key in s:
            return role
    return "unknown"


# --- role replies: plausible content from the prompt -----------------------------------------


def _generic(p: Prompt) -> Any:
    return {}


def _plan(p: Prompt) -> dict[str, Any]:
    terms = p.terms(6)
    facets = ["background", "causes", "effects", "comparison"]
    nodes = [{"id": f"N{i}", "type": "search", "query": " ".join([*terms[:3], f]),
              "key_points": [f"{f} of {' '.join(terms[:3])}"]} for i, f in enumerate(facets[:3], 1)]
    nodes.append({"id": "N4", "type": "aggregate", "need": f"How the sources explain {' '.join(terms[:4])}",
                  "key_points": ["agreement and conflict between sources"], "inputs": ["N1", "N2", "N3"]})
    nodes.append({"id": "N5", "type": "answer", "need": f"A cited answer about {' '.join(terms[:4])}",
                  "inputs": ["N4"]})
    reply: dict[str, Any] = {"nodes": nodes}
    if "Current plan:" in p.user:
        reply["fetch"] = list(p.evidence)[:1]
    return reply


def _searcher(p: Prompt) -> dict[str, Any]:
    return {"done": True, "queries": []}


def _wave(p: Prompt) -> dict[str, Any]:
    out = {}
    for m in re.finditer(r"^(?:#+\s*)?(?:Node\s+)?(N\d+)\b[^\n]*$", p.user, re.M):
        nid = m.group(1)
        block = p.user[m.end():].split("\nN", 1)[0]
        ids = [c for c in re.findall(rf"\[({ID})\]", block) if c in p.evidence] or list(p.evidence)
        out[nid] = p.cited(ids, 2) or p.cited(None, 2)
    return out


def _answer_text(p: Prompt) -> str:
    return p.cited(None, 4)


def _final(p: Prompt) -> str:
    return f"<think>Combine the branch findings.</think><answer>{_answer_text(p)}</answer>"


def _rubric_persistent(p: Prompt) -> dict[str, Any]:
    t = " ".join(p.terms(3))
    return {"criteria": [{"name": "Coverage", "description": f"Explains the main facts about {t}",
                          "guidance": f"Check each facet of {t} against the sources"},
                         {"name": "Evidence", "description": "Backs every claim with a cited source",
                          "guidance": "Compare the sources where they disagree"}]}


def _rubric_ephemeral(p: Prompt) -> dict[str, Any]:
    return {"sufficient": True, "gaps": []}


def _judge_support(p: Prompt) -> dict[str, Any]:
    return {"verdict": "supported", "unsupported_part": ""}


def _decor_plan(p: Prompt) -> str:
    facts = p.user.split("Facts so far:", 1)[-1].split("Searches made:", 1)[0]
    if "[" in facts:
        return "<think>The facts answer the question.</think><search>STOP</search>"
    return f"<think>Nothing is known yet.</think><search>{' '.join(p.terms(5))}</search>"


def _decor_filter(p: Prompt) -> str:
    return f"<think>Keep what answers the question.</think><filter>{p.cited(None, 2)}</filter>"


def _decor_answer(p: Prompt) -> str:
    return f"<think>From the facts.</think><answer>{p.cited(None, 3)}</answer>"


def _condense(p: Prompt) -> dict[str, Any]:
    return {"facts": [p.cited([c], 1) for c in list(p.evidence)[:4]] or [p.cited(None, 1)]}


def _tools(p: Prompt) -> str:
    shown = [c for c in p.evidence]
    searched = sum("<tool_call>" in str(m.get("content")) for m in p.messages if m.get("role") == "assistant")
    if not shown and searched < 2:
        q = " ".join(p.terms(5))
        return f'<think>Search first.</think><tool_call>{{"name": "search", "arguments": {{"query": "{q}"}}}}</tool_call>'
    spans = " ".join(f'<cite id="{c}">{p.cited([c], 1).rsplit(" [", 1)[0]}.</cite>' for c in shown[:3])
    return f"<think>Enough evidence.</think><answer>{spans}</answer>"


def _warp_search(p: Prompt) -> dict[str, Any]:
    instr = p.user.split("Instruction:", 1)[-1].splitlines()[0]
    return {"name": "search", "keywords": [" ".join(words_of(instr, 4)) or " ".join(p.terms(3))]}


def _warp_init(p: Prompt) -> dict[str, Any]:
    t = p.terms(4)
    return {"name": "initialize", "title": f"Report on {' '.join(t[:3])}",
            "sections": [{"title": f"Background of {t[0]}", "plan": f"Introduce {' '.join(t[:3])}."},
                         {"title": f"Main findings on {t[-1]}", "plan": f"What the sources say about {' '.join(t)}."},
                         {"title": "Open questions", "plan": "Where the evidence is thin."}]}


def _warp_write(p: Prompt) -> str:
    return f"<think>Write from the evidence.</think><content>{p.cited(None, 3)}</content>"


def _warp_expand(p: Prompt) -> dict[str, Any]:
    return {"name": "terminate", "position": "", "subsections": []}


def _short_answer(p: Prompt) -> dict[str, Any]:
    """BrowseComp's three fields: an explanation citing the evidence, the answer as a short
    phrase the first cited source states, and an integer confidence."""
    first = next(iter(p.evidence.values()), "")
    exact = " ".join(words_of(first, 4)) or " ".join(p.terms(2))
    return {"explanation": p.cited(None, 2), "exact_answer": exact, "confidence": 80}


ROLES = {
    "planner_plan": _plan, "planner_revise": _plan, "searcher_search": _searcher,
    "answerer_wave": _wave, "answerer_final": _final,
    "rubric_persistent": _rubric_persistent, "rubric_ephemeral": _rubric_ephemeral,
    "judge_support": _judge_support,
    "decor_planner_plan": _decor_plan, "decor_filter_filter": _decor_filter,
    "decor_answerer_answer": _decor_answer, "condenser_condense": _condense,
    "agent_step": _tools,
    "warp_search": _warp_search, "warp_initialize": _warp_init, "warp_write": _warp_write,
    "warp_expand": _warp_expand, "short_answer_answer": _short_answer,
}


# --- evidence trees ------------------------------------------------------------------------


def _after(text: str, label: str) -> str:
    return text.split(label, 1)[1].strip().splitlines()[0].strip() if label in text else ""


def _root_query(p: Prompt) -> dict[str, Any]:
    topic = _after(p.user, "Seed topic:") or p.question
    return {"query": f"{topic} formation activity and effects"}


def _gate(p: Prompt) -> dict[str, Any]:
    depth = re.search(r"\(depth (\d+)\)", p.user)
    atomic = bool(depth and int(depth.group(1)) >= 2)
    return {"atomic": atomic, "reason": "One fact remains." if atomic else "Distinct aspects remain."}


def _decompose(p: Prompt) -> dict[str, Any]:
    parent = _after(p.user, "Parent query")
    parent = parent.split(":", 1)[1].strip() if ":" in parent else parent
    topic = " ".join(words_of(parent, 2)) or "the topic"
    return {"queries": [{"query": f"Comparison of {topic} with alternatives", "facet": "comparison"},
                        {"query": f"Risks and failures of {topic}", "facet": "risks"},
                        {"query": f"Statistics and numbers on {topic}", "facet": "quantitative"}]}


def _ground(p: Prompt) -> dict[str, Any]:
    n = len(re.findall(r"^\[(\d+)\]", p.user, re.M))
    return {"supporting": list(range(1, min(n, 3) + 1))}


def _extract(p: Prompt) -> dict[str, Any]:
    doc = p.user.split("Document:", 1)[-1].split("\n", 1)[-1]
    return {"statements": [s for s in sentences(doc) if 5 <= len(s.split()) <= 40][:2]}


ROLES.update({"root_query_write": _root_query, "gate_judge": _gate, "decompose_split": _decompose,
              "ground_judge": _ground, "extract_quote": _extract})


# --- rubrics, audits, judges ---------------------------------------------------------------


def _synthesize(p: Prompt) -> dict[str, Any]:
    tree, _ = json.JSONDecoder().raw_decode(p.user)  # a prompt may close with a line after the tree (its language)
    chosen, bags = [], []
    for lf in tree.get("leaves", []):  # leaves whose statements say different things
        for st in lf.get("statements") or []:
            bag = {w.lower() for w in words_of(st, 40)}
            if bag and all(len(bag & b) / len(bag | b) < 0.4 for b in bags):
                chosen.append({**lf, "statements": [st]})
                bags.append(bag)
                break
        if len(chosen) == 5:
            break
    ids = [lf["id"] for lf in chosen]
    root = next((n.get("query", "") for n in tree.get("nodes", []) if n.get("depth", 0) == 0), p.question)
    question = f"How do the sources explain {root.rstrip('?.')}, and where do they disagree or fall short?"
    rubrics, k = [], 0
    for lf in chosen:
        k += 1
        st = " ".join(lf["statements"][0].split()[:30])
        rubrics.append({"id": f"R{k}", "type": "factual", "description": f"States that {st}", "weight": 1.0,
                        "source_leaf_ids": [lf["id"]], "evidence": [lf["statements"][0]]})
    logical = ["Compares the facets against each other instead of listing them",
               "Explains the causes behind the reported effects",
               "Qualifies claims where the evidence is thin or disputed",
               "Ends with a reasoned conclusion drawn from the sources"]
    for text in logical:
        if len(rubrics) >= 5:
            break
        k += 1
        rubrics.append({"id": f"R{k}", "type": "logical", "description": text, "weight": 0.5,
                        "source_leaf_ids": ids[:2], "evidence": []})
    return {"question": question, "selected_leaf_ids": ids,
            "selection_trace": [{"leaf_id": i, "reason": "A distinct facet of the topic."} for i in ids],
            "merge_trace": [{"id": "M1", "inputs": ids, "output": question,
                             "rationale": "Together they cover the topic."}],
            "rubrics": rubrics}


def _audit(p: Prompt) -> dict[str, Any]:
    return {"decision": "KEEP", "error_tags": [], "major_issues": [], "justification": "Sound as it is.",
            "fix_plan": "", "revised_question": None, "revised_rubrics": None}


ROLES.update({"synthesize_pair": _synthesize, "verify_audit": _audit})


def _between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[-1].split(end, 1)[0] if start in text else ""


def _overlap(claim: str, source: str) -> float:
    want = {w.lower() for w in words_of(claim, 40)}
    have = {w.lower() for w in words_of(source, 400)}
    return len(want & have) / len(want) if want else 0.0


def _judge_rubric(p: Prompt) -> dict[str, Any]:
    response = _between(p.user, "<<<", ">>>")
    criterion = p.user.split("Criterion", 1)[-1]
    share = _overlap(criterion, response)
    return {"score": 4 if share >= 0.6 else 3 if share >= 0.3 else 2}


def _judge_claim(p: Prompt) -> dict[str, Any]:
    statement = _after(p.user, "Statement:")
    share = _overlap(statement, _between(p.user, "<<<", ">>>"))
    return {"support": "full" if share >= 0.7 else "partial" if share >= 0.4 else "none", "relevant": share >= 0.2}


def _needs_citation(p: Prompt) -> dict[str, Any]:
    n = re.search(r"exactly (\d+) booleans", p.user)
    return {"needs_citation": [False] * int(n.group(1) if n else 0)}


ROLES.update({"judge_rubric": _judge_rubric, "judge_claim": _judge_claim, "judge_needs_cite": _needs_citation})


# --- in process -----------------------------------------------------------------------------


def request_body(messages: list[dict[str, Any]], fmt: Any) -> dict[str, Any]:
    """The body deepr's openai backend would send for ``fmt`` (vLLM's regex field for regexes)."""
    body: dict[str, Any] = {"messages": messages}
    if fmt is not None and fmt.json_schema is not None:
        name = re.sub(r"[^A-Za-z0-9_-]", "_", fmt.name)[:64]
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": fmt.json_schema}}
    elif fmt is not None and fmt.regex is not None:
        body["structured_outputs"] = {"regex": fmt.regex}
    return body


def in_process(model: Any, **overrides: Any) -> Any:
    """An LLM object answering through ``model`` without HTTP; ``overrides`` replace roles
    ({role key: function(Prompt) -> value})."""
    from deepr.llm.base import LLM

    class InProcess(LLM):
        name = "fake"

        def __init__(self) -> None:
            super().__init__(max_concurrency=64)
            self.requests: list[dict[str, Any]] = []

        async def _achat(self, messages, *, role=None, temperature=None, max_tokens=None, stop=None, **extra):
            body = request_body(list(messages), extra.get("fmt"))
            self.requests.append(body)
            p = Prompt(body)
            key = infer_role(((body.get("response_format") or {}).get("json_schema") or {}).get("name", ""), p)
            if key in overrides:
                out = overrides[key](p)
                return out if isinstance(out, str) else json.dumps(out)
            return model(body)

    return InProcess()
