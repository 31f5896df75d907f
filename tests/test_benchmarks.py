"""BrowseComp-Plus and ResearchRubrics beside DeepResearch Bench: their published files in, their
graders' layouts out, and recall against TREC qrels.

The formats, as published (looked up in the benchmarks' own repositories and dataset cards):

- BrowseComp-Plus, github.com/texttron/BrowseComp-Plus: ``search_agent/openai_client.py``
  (``_persist_response`` writes ``run_<ts>.json`` with ``json.dump(..., indent=2)``: metadata,
  query_id, tool_call_counts, usage, status, retrieved_docids, result; result items are
  ``{"type", "tool_name", "arguments", "output"}``, the final one ``"output_text"``) and
  ``scripts_evaluation/evaluate_run.py`` (globs ``run_*.json``; grades ``status ==
  "completed"`` and ``result[-1]["output"]`` when its type is ``output_text``; recall =
  |retrieved_docids ∩ qrel positives| / |positives|; qrels lines have 4 whitespace columns
  ``query_id iter docid rel``; citations in the response are ``[docid]``; ground truth is the
  decrypted JSONL ``{query_id, query, answer, ...}``; topics are ``queries.tsv``, id TAB query).
  The corpus (Hugging Face ``Tevatron/browsecomp-plus-corpus``) has columns ``docid, text, url``;
  the queries' dataset card (``Tevatron/browsecomp-plus``) lists ``query_id, query, answer,
  evidence_docs, gold_docs, negative_docs`` (documents as ``{docid, text, url}``).
  The response form is BrowseComp's: ``Explanation: … Exact Answer: … Confidence: N%``.
- ResearchRubrics, github.com/scaleapi/researchrubrics: ``README.md`` (``processed_data.jsonl``
  rows ``{prompt, sample_id, domain, …, rubrics: [{criterion, weight, axis}]}``; reports are
  ``agent_responses/<sample_id>.md``) and ``src/calculate_metrics/calculate_compliance_score.py``
  (compliance = Σ score·weight / Σ of the positive weights; negative weights are penalties).

Every expected value below is computed here from those definitions, not with deepr's helpers.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.cli import app
from deepr.llm.stub_server import StubServer

sys.path.insert(0, str(Path(__file__).parent))
from fake_model import CompetentModel  # noqa: E402

DOCS = [
    ("1001", "https://example.org/tambora", "Mount Tambora is a stratovolcano on the island of Sumbawa in "
     "Indonesia. Its eruption in April 1815 was the most powerful volcanic eruption in recorded history."),
    ("1002", "https://example.org/summer", "The year 1816 is known as the Year Without a Summer. Global "
     "temperatures fell after the eruption of Mount Tambora and crops failed across Europe."),
    ("1003", "https://example.org/krakatoa", "Krakatoa erupted in August 1883 in the Sunda Strait. The "
     "explosion was heard thousands of kilometres away on the island of Rodrigues."),
    ("1004", "https://example.org/frankenstein", "Mary Shelley wrote the novel Frankenstein during the cold "
     "wet summer of 1816 at Lake Geneva, where storms kept the writers indoors."),
    ("1005", "https://example.org/byron", "Lord Byron rented the Villa Diodati on Lake Geneva in 1816 and "
     "proposed that each guest write a ghost story."),
    ("1006", "https://example.org/pinatubo", "Mount Pinatubo in the Philippines erupted in June 1991. Its "
     "sulfur dioxide cooled the global climate for about two years."),
]


def doc(i: int) -> dict:
    return {"docid": DOCS[i][0], "text": DOCS[i][2], "url": DOCS[i][1]}


QUERIES = [  # the decrypted BrowseComp-Plus layout (gold/evidence/negative docs as the dataset has them)
    {"query_id": "7", "query": "Which volcano erupted in 1815 and caused the Year Without a Summer?",
     "answer": "Mount Tambora", "gold_docs": [doc(0)], "evidence_docs": [doc(0), doc(1)], "negative_docs": [doc(5)]},
    {"query_id": "12", "query": "Which novel did Mary Shelley write during the cold summer at Lake Geneva?",
     "answer": "Frankenstein", "gold_docs": [doc(3)], "evidence_docs": [doc(3), doc(4)], "negative_docs": []},
]
# qrels: a judgement of 0 is not relevant (1006); query 12's 1003 (relevance 2) is one no search finds
QRELS = "7 0 1001 1\n7 0 1002 1\n7 0 1006 0\n12 0 1004 1\n12 0 1005 1\n12 0 1003 2\n"
RUBRIC_ROWS = [
    {"prompt": "Explain how the 1815 eruption of Mount Tambora changed the climate of 1816.",
     "sample_id": "683a58c9a7e7fe4e7695846f", "domain": "Earth science", "conceptual_breadth": "Moderate",
     "logical_nesting": "Intermediate", "exploration": "Medium",
     "rubrics": [{"criterion": "Names Mount Tambora as the volcano", "weight": 4.0, "axis": "Explicit Criteria"},
                 {"criterion": "Links the eruption to the failed crops of 1816", "weight": 2.0,
                  "axis": "Synthesis of Information"},
                 {"criterion": "Claims the eruption happened in 1991", "weight": -3.0, "axis": "Explicit Criteria"}]},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def deepr(*args: object, code: int = 0) -> str:
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == code, f"deepr {' '.join(map(str, args))} exited {r.exit_code}:\n{r.output}"
    return r.output


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bench")
    (d / "queries.tsv").write_text("".join(f"{q['query_id']}\t{q['query']}\n" for q in QUERIES), encoding="utf-8")
    (d / "qrel_evidence.txt").write_text(QRELS, encoding="utf-8")
    return {"corpus": write_jsonl(d / "corpus.jsonl", [{"docid": i, "text": t, "url": u} for i, u, t in DOCS]),
            "queries": write_jsonl(d / "browsecomp_plus_decrypted.jsonl", QUERIES), "tsv": d / "queries.tsv",
            "qrels": d / "qrel_evidence.txt", "rubrics": write_jsonl(d / "processed_data.jsonl", RUBRIC_ROWS),
            "dir": d}


@pytest.fixture(scope="module")
def served():
    fake = CompetentModel()
    with StubServer(fake) as srv:
        yield fake, srv


def run_short(files: dict[str, Path], srv: StubServer, mode: str) -> Path:
    out = files["dir"] / f"runs-{mode}"
    deepr("run", "--queries", files["queries"], "--corpus", files["corpus"], "--retriever", "bm25",
          "--out", out, "--mode", mode, "--answer", "short", "--llm", "openai:fake", "--base-url", srv.base_url,
          "--no-cache")
    return out


def traces(folder: Path) -> dict[str, dict]:
    rows = [json.loads(ln) for ln in (folder / "reports.jsonl").read_text(encoding="utf-8").splitlines()]
    return {r["id"]: json.loads(Path(r["trace_path"]).read_text(encoding="utf-8")) for r in rows}


def searched(trace: dict) -> list[str]:
    """The documents behind every passage the run's searches returned, first seen first."""
    out: list[str] = []
    for t in trace["tools"]:
        if t["tool"] == "search":
            out += [d for d in t["doc_ids"] if d not in out]
    return out


# --- inputs in their published formats -------------------------------------------------------


def test_the_corpus_keeps_browsecomp_plus_docids_from_jsonl_and_parquet(files):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from deepr.corpus import load_documents

    pq.write_table(pa.table({"docid": [d[0] for d in DOCS], "text": [d[2] for d in DOCS],
                             "url": [d[1] for d in DOCS]}), files["dir"] / "corpus.parquet")
    for spec in (files["corpus"], files["dir"] / "corpus.parquet"):
        docs = load_documents(str(spec))
        assert [(d.id, d.url, d.text) for d in docs] == [(i, u, t) for i, u, t in DOCS]


def test_queries_are_read_from_each_benchmarks_own_files(files):
    from deepr.cli.run_cmd import load_queries

    bcp = load_queries(files["queries"])
    assert [(q["id"], q["query"]) for q in bcp] == [(q["query_id"], q["query"]) for q in QUERIES]
    assert [(q["id"], q["query"]) for q in load_queries(files["tsv"])] == [(q["id"], q["query"]) for q in bcp]
    [rr] = load_queries(files["rubrics"])
    assert rr["id"] == RUBRIC_ROWS[0]["sample_id"] and rr["query"] == RUBRIC_ROWS[0]["prompt"]
    published = [r["weight"] for r in RUBRIC_ROWS[0]["rubrics"]]
    weights = [r["weight"] for r in rr["rubrics"]]
    # weights fit deepr's [-1, 1] and keep every ratio: the penalty stays a penalty
    assert all(-1 <= w <= 1 for w in weights) and weights[2] < 0
    assert [w / weights[0] for w in weights] == pytest.approx([w / published[0] for w in published])
    assert [r["description"] for r in rr["rubrics"]] == [r["criterion"] for r in RUBRIC_ROWS[0]["rubrics"]]


# --- the short answer, end to end, and the BrowseComp-Plus run files --------------------------

SHORT = re.compile(r"^Explanation: (?P<e>.+)\nExact Answer: (?P<a>.+)\nConfidence: (?P<c>\d+)%$", re.S)
PUBLISHED_KEYS = ["metadata", "query_id", "tool_call_counts", "usage", "status", "retrieved_docids", "result"]


@pytest.mark.parametrize("mode", ["decor", "dag", "tools"])
def test_a_short_answer_run_exports_the_files_browsecomp_plus_grades(files, served, mode):
    from deepr.eval.benchmarks import read_browsecomp_run

    fake, srv = served
    runs = run_short(files, srv, mode)
    by_id = traces(runs)
    assert sorted(by_id) == sorted(q["query_id"] for q in QUERIES)
    for qid, trace in by_id.items():
        short = trace["short_answer"]
        assert short["by"] == "llm" and short["exact_answer"].strip() and short["explanation"].strip()
        assert isinstance(short["confidence"], int) and 0 <= short["confidence"] <= 100
        cited = re.findall(r"\[([^\]]+)\]", short["explanation"])
        assert cited and all(c in trace["citations"] for group in cited for c in re.split(r",\s*", group))
        assert "Exact Answer: " + short["exact_answer"] in Path(runs / f"{qid}.md").read_text(encoding="utf-8")
    assert fake.invalid == []

    out = files["dir"] / f"bcp-{mode}"
    deepr("bench-export", runs, "--format", "browsecomp-plus", "--out", out)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"run_{q['query_id']}.json" for q in QUERIES)
    for path in out.glob("run_*.json"):  # what evaluate_run.py reads, read the way it reads it
        text = path.read_text(encoding="utf-8")
        run = json.loads(text)
        assert text == json.dumps(run, indent=2)  # json.dump(..., indent=2), as its agents write
        assert list(run) == PUBLISHED_KEYS
        trace = by_id[run["query_id"]]
        assert run["status"] == "completed"
        assert run["retrieved_docids"] == searched(trace)
        assert run["tool_call_counts"] == {name: sum(1 for t in trace["tools"] if t["tool"] == tool)
                                           for tool, name in (("search", "search"), ("browse", "get_document"))
                                           if any(t["tool"] == tool for t in trace["tools"])}
        assert all(isinstance(v, int) for v in run["tool_call_counts"].values())
        assert all(set(item) == {"type", "tool_name", "arguments", "output"} for item in run["result"])
        last = run["result"][-1]
        assert last["type"] == "output_text" and last["tool_name"] is None and last["arguments"] is None
        m = SHORT.match(last["output"])
        assert m, last["output"]
        short = trace["short_answer"]
        assert (m["a"], int(m["c"])) == (short["exact_answer"], short["confidence"])
        # the explanation cites corpus docids: the documents of the ids the run cited
        want = {trace["citations"][c]["doc_id"] for c in re.findall(r"[A-Z]\d+-[RF]\d+", short["explanation"])}
        assert set(re.findall(r"\[(\d+)\]", m["e"])) == want and want <= {d[0] for d in DOCS}
        back = read_browsecomp_run(path)  # the reader gives back what was written
        assert (back["exact_answer"], back["confidence"], back["retrieved_docids"]) == \
            (short["exact_answer"], short["confidence"], searched(trace))


def test_recall_against_trec_qrels_equals_the_definition(files, served, tmp_path):
    _, srv = served
    runs = files["dir"] / "runs-decor"
    if not runs.exists():
        run_short(files, srv, "decor")
    deepr("eval", runs, "--metric", "recall", "--qrels", files["qrels"], "--out", tmp_path / "scores.jsonl")
    scores = {r["id"]: r for r in map(json.loads, (tmp_path / "scores.jsonl").read_text().splitlines())}
    relevant: dict[str, set[str]] = {}
    for line in QRELS.splitlines():  # TREC: query-id iteration doc-id relevance; relevant when > 0
        qid, _, doc, rel = line.split()
        if int(rel) > 0:
            relevant.setdefault(qid, set()).add(doc)
    for qid, trace in traces(runs).items():
        row = scores[qid]
        cited_docs = {c["doc_id"] for c in trace["citations"].values()}  # the sidecar holds the cited ids only
        assert row["recall_searched"] == pytest.approx(len(relevant[qid] & set(searched(trace))) / len(relevant[qid]))
        assert row["recall_cited"] == pytest.approx(len(relevant[qid] & cited_docs) / len(relevant[qid]))
    assert scores["12"]["recall_searched"] < 1  # 1003 (relevance 2) is about Krakatoa: not found for it

    # the exported run files score the same way: retrieved_docids, and the response's [docid]s
    deepr("bench-export", runs, "--format", "browsecomp-plus", "--out", tmp_path / "bcp")
    deepr("eval", tmp_path / "bcp", "--metric", "recall", "--qrels", files["qrels"], "--out", tmp_path / "b.jsonl")
    exported = {r["id"]: r for r in map(json.loads, (tmp_path / "b.jsonl").read_text().splitlines())}
    for path in (tmp_path / "bcp").glob("run_*.json"):
        run = json.loads(path.read_text(encoding="utf-8"))
        qid, positives = run["query_id"], relevant[run["query_id"]]
        cited = set(re.findall(r"\d+", " ".join(re.findall(r"\[([^\[\]]*)\]", run["result"][-1]["output"]))))
        assert exported[qid]["recall_searched"] == pytest.approx(len(positives & set(run["retrieved_docids"]))
                                                                 / len(positives)) == scores[qid]["recall_searched"]
        assert exported[qid]["recall_cited"] == pytest.approx(len(positives & cited) / len(positives))
    assert sorted(exported) == sorted(scores)

    bad = tmp_path / "bad.txt"
    bad.write_text("7 0 1001 1\n7 1001 1\n", encoding="utf-8")
    out = deepr("eval", runs, "--metric", "recall", "--qrels", bad, "--out", tmp_path / "s2.jsonl", code=2)
    assert f"{bad}:2" in " ".join(out.split())


# --- ResearchRubrics and DeepResearch Bench ----------------------------------------------------


def test_researchrubrics_reports_and_rubric_records(files, served, tmp_path):
    runs = tmp_path / "rr"
    deepr("run", "--queries", files["rubrics"], "--corpus", files["corpus"], "--retriever", "bm25", "--out", runs,
          "--mode", "dag")
    out = tmp_path / "agent_responses"
    deepr("bench-export", runs, "--format", "researchrubrics", "--out", out)
    sid = RUBRIC_ROWS[0]["sample_id"]
    assert [p.name for p in out.iterdir()] == [f"{sid}.md"]
    [row] = [json.loads(ln) for ln in (runs / "reports.jsonl").read_text().splitlines()]
    assert (out / f"{sid}.md").read_bytes() == Path(row["report_path"]).read_bytes()

    deepr("eval", runs, "--metric", "rubric", "--rubrics", files["rubrics"], "--out", tmp_path / "s.jsonl")
    [score] = [json.loads(ln) for ln in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert not score["failures"] and 0 <= score["rubric"] <= 1
    deepr("eval", runs, "--metric", "rubric", "--rubrics", files["rubrics"], "--out", tmp_path / "j.jsonl",
          "--judge-llm", "openai:fake", "--base-url", served[1].base_url, "--no-cache")
    [judged] = [json.loads(ln) for ln in (tmp_path / "j.jsonl").read_text().splitlines()]
    assert not judged["failures"] and len(judged["rubric_items"]) == len(RUBRIC_ROWS[0]["rubrics"])
    assert served[0].roles["judge_rubric"] >= len(RUBRIC_ROWS[0]["rubrics"])

    from deepr.rewards.judges import coerce_rubrics, rubric_weighted

    items = coerce_rubrics(RUBRIC_ROWS[0]["rubrics"])
    for s in ([1, 1, 0], [1, 0, 1], [1, 1, 1]):  # compliance = Σ s·w / Σ positive w, penalty included
        w = [r["weight"] for r in RUBRIC_ROWS[0]["rubrics"]]
        assert rubric_weighted(items, s) == pytest.approx(sum(a * b for a, b in zip(s, w)) / (4.0 + 2.0))


def test_drb_export_is_bench_export_drb(files, tmp_path):
    runs = tmp_path / "drb"
    deepr("run", "--queries", files["tsv"], "--corpus", files["corpus"], "--retriever", "bm25", "--out", runs,
          "--mode", "decor")
    deepr("drb-export", runs, "--out", tmp_path / "a.jsonl")
    deepr("bench-export", runs, "--format", "drb", "--out", tmp_path / "b.jsonl")
    rows = [json.loads(ln) for ln in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert [(r["id"], r["prompt"]) for r in rows] == [(int(q["query_id"]), q["query"]) for q in QUERIES]
    assert all(set(r) == {"id", "prompt", "article"} for r in rows)


def test_bad_requests_get_one_line_and_exit_2(files, tmp_path):
    out = deepr("run", "What erupted in 1815?", "--mode", "warp", "--answer", "short", "--out", tmp_path / "r.md",
                "--corpus", files["corpus"], code=2)
    assert "--answer short" in out
    out = deepr("bench-export", files["dir"], "--format", "browsecomp", "--out", tmp_path / "x", code=2)
    assert "browsecomp-plus" in out
    out = deepr("bench-export", files["dir"], "--format", "browsecomp-plus", "--out", files["dir"] / "bcp", code=2)
    assert "inside the input" in out and not (files["dir"] / "bcp").exists()


def test_a_rejected_question_is_a_failed_run_file_not_a_missing_one(files, served, tmp_path):
    """The grader counts every run file; a question deepr could not answer must count as wrong."""
    runs = tmp_path / "runs"
    runs.mkdir()
    reject = {"id": "31", "stage": "run", "reason": "the model could not be reached", "record": {"query": "Q?"}}
    answered_later = {**reject, "id": QUERIES[0]["query_id"]}  # rejected, then answered by a re-run
    (runs / "reports.rejects.jsonl").write_text(json.dumps(reject) + "\n" + json.dumps(reject) + "\n"
                                                + json.dumps(answered_later) + "\n", encoding="utf-8")
    answered = files["dir"] / "runs-decor" / f"{QUERIES[0]['query_id']}.json"
    if not answered.exists():
        run_short(files, served[1], "decor")
    row = {"id": QUERIES[0]["query_id"], "trace_path": str(answered)}
    (runs / "reports.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    deepr("bench-export", runs, "--format", "browsecomp-plus", "--out", tmp_path / "bcp")
    run = json.loads((tmp_path / "bcp" / "run_31.json").read_text(encoding="utf-8"))
    assert (run["query_id"], run["status"], run["result"], run["retrieved_docids"]) == ("31", "failed", [], [])
    later = json.loads((tmp_path / "bcp" / f"run_{QUERIES[0]['query_id']}.json").read_text(encoding="utf-8"))
    assert later["status"] == "completed" and len(list((tmp_path / "bcp").iterdir())) == 2
    deepr("bench-export", runs, "--format", "researchrubrics", "--out", tmp_path / "rr")
    assert [p.name for p in (tmp_path / "rr").iterdir()] == [f"{QUERIES[0]['query_id']}.md"]  # none for 31


class NoAnswerModel(CompetentModel):
    """Competent everywhere except the short answer, where it copies the template back."""

    def __call__(self, body):
        name = ((body.get("response_format") or {}).get("json_schema") or {}).get("name", "")
        if name.startswith("short_answer"):
            return json.dumps({"explanation": "...", "exact_answer": "...", "confidence": 50})
        return super().__call__(body)


def test_a_short_answer_from_the_fallback_is_marked_incomplete(files, tmp_path):
    with StubServer(NoAnswerModel()) as srv:
        deepr("run", "--queries", files["tsv"], "--corpus", files["corpus"], "--retriever", "bm25", "--out",
              tmp_path / "runs", "--mode", "decor", "--answer", "short", "--llm", "openai:fake", "--base-url",
              srv.base_url, "--no-cache", code=3)
    deepr("bench-export", tmp_path / "runs", "--format", "browsecomp-plus", "--out", tmp_path / "bcp")
    paths = sorted((tmp_path / "bcp").glob("run_*.json"))
    assert len(paths) == len(QUERIES)
    for path in paths:
        run = json.loads(path.read_text(encoding="utf-8"))
        trace = traces(tmp_path / "runs")[run["query_id"]]
        assert trace["short_answer"]["by"] == "fallback" and trace["short_answer"]["error"]
        assert run["status"] == "incomplete"
