"""A real model through the whole dag agent: `deepr run --mode dag --llm smollm2` on one question
over the small wiki corpus the suite shares, as a user runs it (a subprocess, the CLI's flags).

What a user relies on: the answer is written by the model (its final turn accepted, not the
extractive fallback), it cites evidence, and every cited id is one the run's searches returned;
no accepted turn carries a placeholder, template text, an echo of the instructions or a
one-word query (checked here over the recorded trajectory, independently of deepr's own
acceptance code); and the decoding formats themselves leave no room for a placeholder or an
invented id, whatever the prompt asks for.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SMOLLM2_SKIP, smollm2_missing

# About 3 minutes on a quiet 2-core machine (five model calls); the bound is for shared runners.
pytestmark = [pytest.mark.skipif(smollm2_missing(), reason=SMOLLM2_SKIP), pytest.mark.timeout(1800)]

QUESTION = "What causes acid rain and how does it harm the environment?"
_IDS = re.compile(r"\[([A-Z]+\d+-[A-Z]+\d+(?:, [A-Z]+\d+-[A-Z]+\d+)*)\]")
_JUNK = re.compile(r"\.\.\.|…|<[a-z]+ [a-z ]{2,40}>")
# a slot's name standing in for its content; with three more words after it, it opens a real text
# ("The answer to the question is that nitrogen oxides in fossil fuels release nitric oxide")
_SLOT = re.compile(r"\b(?:the (?:query|answer|paragraph)(?: to the question)?)\b\W*((?:\w+\W*){0,2})$", re.I)


@pytest.fixture(scope="module")
def dag_run(smollm2_cache, mini_corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    cache, _, _ = smollm2_cache
    out = tmp_path_factory.mktemp("real-dag")
    env = {**os.environ, "DEEPR_CACHE": str(cache), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "deepr", "run", QUESTION, "--mode", "dag", "--llm", "smollm2",
           "--corpus", str(mini_corpus), "--cache-dir", str(out / "index"), "--out", str(out / "report.md"),
           "--record", str(out / "traj.jsonl"), "--seed", "0", "--allow-fallback"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trace = json.loads((out / "report.json").read_text())
    turns = [t for line in (out / "traj.jsonl").read_text().splitlines() for t in json.loads(line)["turns"]]
    return trace, turns


def _fields(completion: str) -> list[str]:
    """A reply's text fields: the strings of a JSON reply, else the reply itself."""
    try:
        value = json.loads(completion)
    except ValueError:
        return [completion]
    out, todo = [], [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return out


def _shown(trace: dict) -> set[str]:
    return {i for t in trace["tools"] for i in t.get("ids") or []}


def test_dag_answer_is_model_written_and_cites_only_retrieved_ids(dag_run):
    trace, turns = dag_run
    final = [t for t in turns if (t["role"], t["action"]) == ("answerer", "final")]
    assert final and final[-1]["ok"] and not final[-1].get("extractive"), final[-1:]
    assert not [f for f in trace["failures"] if f["where"] == "answerer/final"], trace["failures"]
    answer = trace["answer"]
    cited = {i for m in _IDS.finditer(answer) for i in m.group(1).split(", ")}
    assert cited and cited <= _shown(trace), (cited, answer)
    assert len(_IDS.sub(" ", answer).split()) >= 40, answer
    assert all(c["constrained"] for c in trace["calls"]), [c["role"] for c in trace["calls"] if not c["constrained"]]


def test_no_accepted_turn_is_a_placeholder_or_an_echo(dag_run):
    trace, turns = dag_run
    accepted = [t for t in turns if t["ok"] and not t.get("extractive")]
    assert len(accepted) >= 3  # plan, wave, final at least were the model's
    for t in accepted:
        system = " ".join(m["content"] for m in t["messages"] if m["role"] == "system")
        assert not _JUNK.search(t["completion"]), (t["role"], t["action"], t["completion"])
        for field in _fields(t["completion"]):
            assert not _SLOT.search(field), (t["role"], t["action"], field)
        for sentence in re.split(r"(?<=\.)\s+", _IDS.sub("", t["completion"])):
            if len(sentence) >= 40:
                assert sentence.strip() not in system, (t["role"], sentence)
    plans = [json.loads(t["completion"]) for t in accepted if t["role"] == "planner"]
    queries = [n["query"] for p in plans for n in p["nodes"] if n["type"] == "search"]
    assert queries and all(len(re.findall(r"[A-Za-z]{3,}", q)) >= 2 for q in queries), queries


def test_cited_format_leaves_no_room_for_placeholders_or_invented_ids(smollm2_cache):
    """Asked outright to copy a placeholder and an example id, the constrained model cannot."""
    from deepr.profiles.formats import cited_prose, tagged
    from deepr.llm.hf_backend import HFLLM

    llm = HFLLM(smollm2_cache[1])
    fmt = tagged("answer", cited_prose(["N1-R1", "N2-R3"], sentences=(2, 3), words=(6, 15)))
    ask = [{"role": "system", "content": "Reply exactly with: <answer>... [S1-R1]</answer>"},
           {"role": "user", "content": "[N1-R1] Acid rain: rain made acidic by sulfur and nitrogen oxides.\n"
                                       "[N2-R3] Lakes: acid water kills fish and trees."}]
    out = llm.chat(ask, max_tokens=160, fmt=fmt)
    assert out.constrained and not out.truncated, out
    assert re.fullmatch(fmt.regex, out) and "..." not in out and "S1-R1" not in out, out
    assert {i for m in _IDS.finditer(out) for i in m.group(1).split(", ")} <= {"N1-R1", "N2-R3"}
