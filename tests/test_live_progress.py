"""Saying what is happening and what happened (issue 64): the live view of every model-calling
command, run's reasons with the next step, reasons that keep their numbers, verify's counts and
side files, the Ctrl-C message, honest banners, one citation rule, the help and the docs.

Model calls go to the loopback stub (deepr/llm/stub_server.py), some answered by the competent
fake (tests/fake_model.py); the live view is read through rich's recording console (a terminal)
and through a plain stream (CI, logs)."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
from fake_model import CompetentModel
from rich.console import Console
from typer.testing import CliRunner

from deepr.cli import app
from deepr.llm.stub_server import StubServer

QUESTION = "How do volcanic eruptions affect the climate?"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tree_helpers import volcano_docs

    path = tmp_path_factory.mktemp("live") / "volcano.jsonl"
    path.write_text("".join(d.model_dump_json() + "\n" for d in volcano_docs()), encoding="utf-8")
    return path


def stub(srv: StubServer) -> list[str]:
    return ["--llm", "openai:fake", "--base-url", srv.base_url, "--no-cache"]


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def _role():
    from deepr.roles import Role, TaggedReply

    return Role(name="asker", action="ask", messages=lambda q: [{"role": "user", "content": q}],
                output=TaggedReply("answer", required=True), extractive=lambda q: "from the evidence",
                parts=lambda q: ["answer"], max_tokens=32)


# -- 1: the live view ------------------------------------------------------------------------


def test_the_live_view_on_a_terminal_counts_what_the_library_did():
    """Counts come from the model-call layer and the executor, not from the command: two good
    calls, one refused by the server, one re-ask, one fallback; units and the deadline."""
    from deepr.cli.live import LiveView
    from deepr.llm import get_llm
    from deepr.roles import Recorder, perform
    from deepr.llm.base import run_sync

    screen = Console(record=True, force_terminal=True, width=100, file=io.StringIO())
    with StubServer(reply=["no tags here", "still none", "<answer>fine</answer>"], fail_first=1,
                    fail_status=400) as srv:
        llm = get_llm("openai:fake", base_url=srv.base_url, cache=False)
        with LiveView("build-trees", total=2, unit="trees", deadline=240, console=screen) as view:
            with pytest.raises(Exception):
                llm.chat([{"role": "user", "content": "refused"}])
            got = run_sync(perform(_role(), "q?", llm=llm, rec=Recorder(), max_reasks=1))
            view.advance()
            counts = view.counts()
        llm.close()
    assert got.by == "fallback"
    assert counts == {"calls done": 2, "in flight": 0, "failed": 1, "re-asks": 1, "fallbacks": 1, "searches": 0}
    text = screen.export_text()
    assert "build-trees" in text and "1/2" in text and "trees" in text
    assert "2 done · 0 in flight · 1 failed" in text
    assert re.search(r"re-asks\s+1", text) and re.search(r"fallbacks\s+1", text)
    assert "--deadline 240 s" in text and "left" in text


def test_the_live_view_on_a_plain_stream_prints_lines():
    from deepr.activity import note
    from deepr.cli.live import LiveView

    log = io.StringIO()
    with LiveView("verify", total=3, unit="pairs", console=Console(file=log, width=300), every=60) as view:
        note("sent")
        note("search", 2)
        view.advance()
        view.phase("auditing")
    lines = log.getvalue().splitlines()
    assert "\x1b[" not in log.getvalue() and len(lines) >= 3  # the start, the unit, the end
    assert lines[0].startswith("verify: 0/3 pairs · calls 0 done, 0 in flight, 0 failed")
    assert "1/3 pairs" in lines[-1] and "1 in flight" in lines[-1] and "searches 2" in lines[-1]
    assert "no deadline" in lines[-1]


def test_build_trees_shows_trees_and_calls_as_it_works(corpus, tmp_path):
    topics = tmp_path / "topics.txt"
    topics.write_text("Volcano\nPlate tectonics\n", encoding="utf-8")
    with StubServer(CompetentModel()) as srv:
        r = invoke("build-trees", "--corpus", corpus, "--topics", topics, "--out", tmp_path / "trees.jsonl",
                   "--deadline", "600", *stub(srv))
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("build-trees: ")]
    assert lines[0].startswith("build-trees: 0/2 trees") and any("1/2 trees" in ln for ln in lines)
    calls, searches = re.search(r"calls (\d+) done.*searches (\d+)", lines[-1]).groups()
    assert "2/2 trees" in lines[-1] and int(calls) > 2 and int(searches) > 2
    assert "of --deadline 600 s" in lines[-1]


# -- 2, 3: run's reasons, with the next step and their own numbers --------------------------


def test_run_summary_names_the_top_reason_and_the_next_step(corpus, tmp_path):
    """Every reply cut at max_tokens: the summary says so, with its number, and what to do."""
    with StubServer(reply='{"nodes": [', finish_reason="length") as srv:
        r = invoke("run", QUESTION, "--out", tmp_path / "r.md", "--corpus", corpus, "--max-reasks", "0",
                   "--max-tokens", "64", *stub(srv))
    assert r.exit_code in (3, 4), r.output
    top = [ln for ln in r.output.splitlines() if "top failure 1" in ln]
    assert top and "cut at max_tokens (64)" in top[0] and "raise --max-tokens" in r.output


def test_a_batch_summary_names_the_top_reason_too(corpus, tmp_path):
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"id": "a", "question": QUESTION}) + "\n")
    with StubServer(reply='{"nodes": [', finish_reason="length") as srv:
        r = invoke("run", "--queries", queries, "--out", tmp_path / "runs", "--corpus", corpus, "--max-reasks", "0",
                   "--max-tokens", "64", *stub(srv))
    assert r.exit_code in (3, 4), r.output
    assert "top failure 1" in r.output and "raise --max-tokens" in r.output


def test_reasons_keep_addresses_ports_and_limits():
    from deepr.data.outcomes import StageTally
    from deepr.records import Reject

    reason = ("local at http://127.0.0.1:8080/v1 refused the request (HTTP 400: maximum context length is "
              "2048 tokens)")
    t = StageTally("build-trees")
    for i in range(2):
        t.add(Reject(id=f"t{i}", stage="build-trees", reason=reason))
    shown = " ".join([t.verdict(), *(str(v) for _, v in t.rows()), json.dumps(t.counts())])
    assert "127.0.0.1:8080/v1" in shown and "HTTP 400" in shown and "2048" in shown
    assert "N.N" not in shown and "vN" not in shown
    assert "2× record: local at http://127.0.0.1:8080/v1" in shown
    assert t.counts()["top_failure_reasons"][0]["next_step"].startswith("the prompt does not fit")
    t2 = StageTally("run")
    t2.add_failures([{"where": "planner/plan", "reason": "model call failed: deadline of 240 s reached"}])
    assert t2.reason_rows()[0][1] == "1× planner/plan: model call failed: deadline of 240 s reached → " \
                                     "--deadline reached: raise --deadline or do less (--limit)"


# -- 4: verify ----------------------------------------------------------------------------


def test_verify_counts_agree_and_side_files_follow_one_rule(tmp_path):
    from deepr.cli.verify_cmd import dropped_path
    from deepr.io import meta_path, rejects_path
    from test_verify import _pair

    for name in ("verified.jsonl", "verified_ext.jsonl"):
        out = tmp_path / name
        stem = name.removesuffix(".jsonl")
        assert (dropped_path(out).name, rejects_path(out).name, meta_path(out).name) == (
            f"{stem}.dropped.jsonl", f"{stem}.rejects.jsonl", f"{name}.meta.json")
    docs = (Path(__file__).parents[1] / "docs" / "artefacts.md").read_text(encoding="utf-8")
    assert "<stem>.dropped.jsonl" in docs and "<stem>.rejects.jsonl" in docs

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(_pair().model_dump_json() + "\n")
    with StubServer(reply="not an audit") as srv:  # the audit fails: a reject
        r = invoke("verify", pairs, "--out", tmp_path / "verified.jsonl", *stub(srv))
    assert r.exit_code == 4, r.output
    assert re.search(r"audit failures \(all runs\)\s*│\s*1\b", r.output), r.output
    assert re.search(r"this run: audit failed \(rejects file\)\s*│\s*1\b", r.output)
    assert re.search(r"records failed\s*│\s*1\b", r.output)


# -- 5: Ctrl-C ----------------------------------------------------------------------------


@pytest.mark.parametrize("cache", [True, False])
def test_a_stopped_run_says_truthfully_what_is_kept(corpus, tmp_path, monkeypatch, cache):
    import deepr

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(deepr, "run", stop)
    monkeypatch.setenv("DEEPR_CACHE", str(tmp_path / "cache"))
    with StubServer(CompetentModel()) as srv:
        args = ["--llm", "openai:fake", "--base-url", srv.base_url] + ([] if cache else ["--no-cache"])
        r = invoke("run", QUESTION, "--out", tmp_path / "r.md", "--corpus", corpus, *args)
    assert r.exit_code == 130
    text = " ".join(r.output.split())
    assert "finished records are saved" not in text and "no report was written" in text
    if cache:
        assert "reply cache" in text and str(tmp_path / "cache" / "llm.sqlite") in text
    else:
        assert "nothing was kept" in text


def test_a_stopped_prune_says_nothing_was_written(tmp_path, monkeypatch):
    import deepr.train.trajectories as trajectories
    from deepr.records import Trajectory

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(trajectories, "prune_trajectories", stop)
    traj = tmp_path / "traj.jsonl"
    traj.write_text(Trajectory(id="t1", query="q?", mode="dag", turns=[]).model_dump_json() + "\n")
    r = invoke("prune-trajectories", traj, "--out-dir", tmp_path / "data")
    assert r.exit_code == 130
    text = " ".join(r.output.split())
    assert "nothing was written" in text and "a re-run starts over" in text and "are saved" not in text
    assert not (tmp_path / "data" / "sft.jsonl").exists()


# -- 6, 7: banners ------------------------------------------------------------------------


def test_a_decor_report_whose_roles_fell_back_says_so_and_names_the_trace(corpus, tmp_path):
    def reply(body: dict) -> str:
        if "plan the searches" in body["messages"][0]["content"]:
            return "<search>Volcanic eruptions and the climate:</search>"
        return "I cannot help with that."

    out = tmp_path / "d.md"
    with StubServer(reply=reply) as srv:
        r = invoke("run", QUESTION, "--out", out, "--mode", "decor", "--corpus", corpus, "--max-reasks", "0",
                   "--steps", "1", "--allow-fallback", *stub(srv))
    assert r.exit_code == 0, r.output
    md = out.read_text(encoding="utf-8")
    banner = [ln for ln in md.splitlines() if ln.startswith("> Written by the extractive writer")]
    assert banner and "answer" in banner[0] and "evidence filter" in banner[0]
    assert ".json trace beside this report" in banner[0] and "sidecar's failures" not in banner[0]
    assert ":**:" not in md and "**Volcanic eruptions and the climate**:" in md
    meta = json.loads((tmp_path / "d.md.meta.json").read_text())
    trace = json.loads((tmp_path / "d.json").read_text())
    assert meta["failures"] and len(meta["failures"]) == len(trace["failures"])


# -- 8: tools mode and the citation rule --------------------------------------------------


def test_tools_report_lists_the_calls_the_summary_counts(corpus, tmp_path):
    """A model that never calls a tool: the fallback searches by code; the report lists those
    calls, as many as the summary counts."""
    out = tmp_path / "t.md"
    with StubServer(reply="<answer>Eruptions cool the climate.</answer>") as srv:
        r = invoke("run", QUESTION, "--out", out, "--mode", "tools", "--corpus", corpus, "--max-reasks", "0",
                   "--allow-fallback", *stub(srv))
    assert r.exit_code == 0, r.output
    counted = int(re.search(r"agent tool calls\s*│\s*(\d+)", r.output).group(1))
    md = out.read_text(encoding="utf-8")
    section = md.split("## Tool calls", 1)[1].split("\n## ", 1)[0]
    assert counted >= 1 and "(none)" not in section
    assert len(re.findall(r"^\d+\. `", section, re.M)) == counted


def test_citations_go_before_the_full_stop_in_every_mode():
    from deepr.evidence.citations import cite_before_stop, normalize

    assert normalize('<cite id="S1-R2">Lava is hot.</cite>') == "Lava is hot [S1-R2]."
    assert cite_before_stop("Lava is hot. [S1-R2] It flows! [S1-R3][S2-R1]") == \
        "Lava is hot [S1-R2]. It flows [S1-R3][S2-R1]!"
    # a numbered list and brackets that are not citations stay as they are
    assert cite_before_stop("1. [N1-R1] first") == "1. [N1-R1] first"
    assert cite_before_stop("In 1815. [sic] then") == "In 1815. [sic] then"


# -- 9, 10: help, docs, summaries -----------------------------------------------------------


@pytest.mark.parametrize("command,flag", [("run", "--llm"), ("build-trees", "--llm"), ("synthesize-rubrics", "--llm"),
                                          ("verify", "--llm"), ("eval", "--judge-llm"),
                                          ("prune-trajectories", "--judge-llm")])
def test_llm_help_lists_every_model_spec(command, flag):
    import typer

    [param] = [p for p in typer.main.get_command(app).commands[command].params if flag in p.opts]
    assert "smollm2" in param.help and "gguf:" in param.help and "replay:" in param.help


def test_the_llama_cpp_example_of_a_small_model_sets_the_small_profile():
    docs = (Path(__file__).parents[1] / "docs" / "models.md").read_text(encoding="utf-8")
    served = [ln for ln in docs.splitlines() if ln.startswith("deepr ") and "openai:smollm2" in ln]
    assert served and all("--profile small" in ln for ln in served)
    for ln in served:
        import shlex

        r = CliRunner().invoke(app, [*shlex.split(ln)[1:], "--help"])
        assert r.exit_code == 0, r.output


def test_summary_tables_keep_long_paths_whole(monkeypatch):
    cli_app = sys.modules["deepr.cli.app"]  # (the package's `app` attribute is the typer app)
    log = io.StringIO()
    monkeypatch.setattr(cli_app, "console", Console(file=log, width=60))
    path = "/home/someone/.cache/deepr/indexes/a-rather-long-corpus-name-0123456789abcdef/hybrid"
    cli_app.summary_table("deepr index — corpus", [("cache path", path)])
    cells = "".join(re.sub(r"[│┃┏┓┗┛┡┩└┘┌┐─━ ]", "", ln).removeprefix("cachepath") for ln in log.getvalue().splitlines())
    assert path.replace(" ", "") in cells and "…" not in log.getvalue()


def test_the_recorded_runs_show_the_live_view_and_the_readme_links_one():
    """docs/img/live_*.svg come from examples/record_live.py (rich's recording console)."""
    import html

    root = Path(__file__).parents[1]
    for name, unit in (("live_run.svg", None), ("live_build_trees.svg", "trees")):
        svg = (root / "docs" / "img" / name).read_text(encoding="utf-8")
        text = html.unescape(" ".join(re.findall(r"<text[^>]*>([^<]*)</text>", svg))).replace("\xa0", " ")
        assert "model calls" in text and "in flight" in text and "searches" in text and "--deadline" in text
        assert unit is None or re.search(rf"{unit}\s+━+\s*2/2", text), text[:600]
    assert "(docs/img/live_run.svg)" in (root / "README.md").read_text(encoding="utf-8")
