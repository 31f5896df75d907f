"""deepr.learn.answers (`python bench/learning.py answers`): the final-answer turn alone, replayed from a recorded teacher run and
judged by `deepr run`'s own checks."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.cli import app
from deepr.learn import answers as ap


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One extractive dag run on a volcano corpus, recorded as a training trajectory."""
    from tree_helpers import volcano_docs

    d = tmp_path_factory.mktemp("answer_probe")
    corpus = d / "volcano.jsonl"
    corpus.write_text("".join(doc.model_dump_json() + "\n" for doc in volcano_docs()), encoding="utf-8")
    result = CliRunner().invoke(app, ["run", "How do volcanoes erupt and what do eruptions leave behind?",
                                      "--corpus", str(corpus), "--top-k", "2", "--out", str(d / "report.md"),
                                      "--record", str(d / "traj.jsonl")])
    assert result.exit_code == 0, result.output
    return d / "traj.jsonl"


RUBRIC = [{"id": "r1", "type": "factual", "description": "Explains how magma reaches the surface", "weight": 1.0},
          {"id": "r2", "type": "factual", "description": "Names lava flows and ash as what eruptions leave",
           "weight": 0.5}]


def _turn(recorded: Path) -> dict:
    traj = json.loads(recorded.read_text().splitlines()[0])
    (turn,) = ap.final_turns(recorded, {traj["id"]: RUBRIC})
    return turn


def test_the_final_turn_is_read_with_the_ids_its_prompt_showed(recorded: Path):
    turn = _turn(recorded)
    assert turn["ids"] and all("-R" in i or "-F" in i for i in turn["ids"])
    assert all(f"[{i}]" in turn["messages"][-1]["content"] for i in turn["ids"])
    # the teacher's own answer to that prompt passes the checks the model's answer must pass
    value, why = ap.judge(turn, turn["teacher"])
    assert why is None and value


def test_answers_are_judged_as_deepr_run_judges_them(recorded: Path):
    turn = _turn(recorded)
    good_id, other = turn["ids"][0], "N9-R9"
    assert ap.judge(turn, f"<answer>Eruptions follow magma ascent [{good_id}].</answer>")[1] is None
    refusals = {
        "invented id": f"<answer>Eruptions follow magma ascent [{other}].</answer>",
        "no citation": "<answer>Eruptions follow magma ascent through the crust.</answer>",
        "stray bracket": f"<answer>Eruptions [with a] follow magma ascent [{good_id}].</answer>",
        "no tags": f"Eruptions follow magma ascent [{good_id}].",
        "empty": "<answer> </answer>",
    }
    for name, reply in refusals.items():
        value, why = ap.judge(turn, reply)
        assert value is None and why, name


def test_a_trajectory_without_a_final_answer_is_named(tmp_path: Path, recorded: Path):
    rows = [json.loads(x) for x in recorded.read_text().splitlines() if x.strip()]
    rows[0]["turns"] = [t for t in rows[0]["turns"] if t["action"] != "final"]
    bad = tmp_path / "traj.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="record 1 .*no accepted final-answer turn"):
        ap.final_turns(bad, {rows[0]["id"]: RUBRIC})
    # a recorded run without a rubric, and none given, cannot be scored: named, not scored 0
    with pytest.raises(ValueError, match="record 1 .*no rubric; give --rubrics"):
        ap.final_turns(recorded)


def test_a_model_behind_an_endpoint_is_probed_and_summarised(recorded: Path):
    from deepr.llm.stub_server import StubServer

    turn = _turn(recorded)
    cite = turn["ids"][0]
    replies = {"cites": f"<answer>Magma rises and erupts as lava and ash [{cite}].</answer>",
               "invents": "<answer>Magma rises and erupts as lava and ash [Z1-R7].</answer>"}
    rows = {}
    for name, reply in replies.items():
        with StubServer(reply) as srv:
            rows[name] = asyncio.run(ap.write_answers("openai:stub", [turn], 200, srv.base_url))[0]
        assert len(srv.requests) == 1
    assert rows["cites"]["accepted"] and rows["cites"]["answer"].startswith("Magma rises")
    assert not rows["invents"]["accepted"] and "Z1-R7" in rows["invents"]["refused"]
    scores = asyncio.run(ap.rubric_scores([turn, turn], [rows["cites"]["answer"], None]))
    assert 0.0 <= scores[0] <= 1.0 and scores[1] is None
    for r, t in ((rows["cites"], 0.5), (rows["invents"], 0.7)):
        r["rubric"], r["teacher_rubric"], r["taught_rubric"] = scores[0] if r["accepted"] else None, t, t / 2
    s = ap.summary([rows["cites"], rows["invents"]])
    assert s["accepted"] == 1 and s["questions"] == 2 and s["accepted_share"] == pytest.approx(0.5)
    assert s["rubric_model_accepted"] == scores[0] and s["rubric_teacher_same_questions"] == 0.5
    assert s["rubric_taught_same_questions"] == 0.25 and s["rubric_teacher_all"] == pytest.approx(0.6)
    assert s["refusals"] == [rows["invents"]["refused"]]


def test_the_answer_is_decoded_over_the_shown_ids_unless_formats_says_schema(recorded: Path):
    """make learn's evaluation (and the probe's default) decodes the answer as the small profile's
    cited prose, whose grammar spells out the evidence ids the prompt shows; ``--formats schema``
    sends the answer's own tag format, which names none."""
    from deepr.llm.stub_server import StubServer

    turn = _turn(recorded)
    # a GBNF literal, one character at a time (the ids' shared first letter is factored out)
    spelled = " ".join(f'"{c}"' for c in turn["ids"][0][1:])
    sent = {}
    for formats in ("schema,answerer=strict", "schema"):
        with StubServer(f"<answer>Magma rises and erupts as lava and ash [{turn['ids'][0]}].</answer>") as srv:
            (row,) = asyncio.run(ap.write_answers("openai:stub", [turn], 200, srv.base_url, formats=formats))
        assert row["accepted"], formats
        sent[formats] = srv.requests[0]["grammar"]
    assert spelled in sent["schema,answerer=strict"] and spelled not in sent["schema"]


def test_a_refused_answer_is_re_asked_with_its_reason_when_asked_to(recorded: Path):
    """--reasks N: deepr run's executor re-asks with the refusal's reason; 0 (make learn's
    evaluation) leaves the first refusal standing, with no fallback answer in its place."""
    from deepr.llm.stub_server import StubServer

    turn = _turn(recorded)
    replies = ["<answer>Magma rises [Z1-R7].</answer>", f"<answer>Magma rises and erupts [{turn['ids'][0]}].</answer>"]
    with StubServer(replies) as srv:
        (first,) = asyncio.run(ap.write_answers("openai:stub", [turn], 200, srv.base_url))
    assert not first["accepted"] and first["answer"] is None and first["attempts"] == 1
    with StubServer(replies) as srv:
        (again,) = asyncio.run(ap.write_answers("openai:stub", [turn], 200, srv.base_url, reasks=1))
    assert again["accepted"] and again["attempts"] == 2 and again["answer"].startswith("Magma rises and erupts")
    assert "Z1-R7" in srv.requests[1]["messages"][-1]["content"]  # the re-ask names what was wrong


def test_runs_pool_as_seeds_over_the_questions_all_of_them_answered():
    def rows(flags: str) -> list[dict]:
        return [{"id": f"q{i}", "accepted": f == "1", "rubric": 0.4 if f == "1" else None, "teacher_rubric": 0.6,
                 "taught_rubric": 0.5} for i, f in enumerate(flags)]

    p = ap.pooled({"s0": rows("110"), "s1": rows("111"), "s2": rows("10")})
    assert (p["questions"], p["seeds"], p["answers"], p["accepted"]) == (2, 3, 6, 5)
    assert p["accepted_share"] == pytest.approx(5 / 6, abs=1e-4) and p["ci95"][0] < 0.8333 <= p["ci95"][1] <= 1.0
    assert p["rubric_model_accepted"] == 0.4 and p["rubric_taught_same_questions"] == 0.5
    assert p["exact95"][0] < 5 / 6 < p["exact95"][1] < 1.0
    # every answer accepted: the bootstrap collapses to a point, the exact interval does not
    every = ap.pooled({"s0": rows("111"), "s1": rows("111"), "s2": rows("111")})
    assert every["ci95"] == [1.0, 1.0] and 0.6 < every["exact95"][0] < 0.75 and every["exact95"][1] == 1.0
    with pytest.raises(ValueError, match="two labelled runs"):
        ap.pooled({"s0": rows("1")})


def test_missing_inputs_are_named_not_tracebacks(tmp_path: Path, monkeypatch):
    out = tmp_path / "probe.json"
    out.write_text(json.dumps({"results": {"s0": {"per_question": []}}}))
    for argv, says in ((["hf:x", "--trajectories", str(tmp_path / "none.jsonl")], "none.jsonl: no such file"),
                       (["--pool", "s0", "--pool", "s9", "--out", str(out)], "no run labelled 's9'")):
        monkeypatch.setattr(sys, "argv", ["answer_probe.py", *argv])
        with pytest.raises(SystemExit, match=says):
            ap.main()


def test_a_new_probe_adds_its_run_and_keeps_the_pooled_runs_already_written(recorded: Path, tmp_path: Path,
                                                                             monkeypatch):
    from deepr.llm.stub_server import StubServer

    turn = _turn(recorded)
    out, rubrics = tmp_path / "probe.json", tmp_path / "rubrics.jsonl"
    out.write_text(json.dumps({"results": {"old": {"accepted": 1}}, "pooled": {"three seeds": {"accepted": 3}}}))
    rubrics.write_text(json.dumps({"id": json.loads(recorded.read_text().splitlines()[0])["id"], "rubrics": RUBRIC}) + "\n")
    with StubServer(f"<answer>Magma rises and erupts as lava and ash [{turn['ids'][0]}].</answer>") as srv:
        monkeypatch.setattr(sys, "argv", ["answer_probe.py", "openai:stub", "--label", "new", "--base-url", srv.base_url,
                                          "--trajectories", str(recorded), "--rubrics", str(rubrics), "--out", str(out)])
        ap.main()
    data = json.loads(out.read_text())
    assert data["pooled"] == {"three seeds": {"accepted": 3}} and set(data["results"]) == {"old", "new"}
    assert data["results"]["new"]["accepted"] == 1 and data["results"]["new"]["formats"] == "schema,answerer=strict"
