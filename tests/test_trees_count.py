"""`deepr build-trees --n-trees N` yields N trees: rejected topics are replaced by spare ones, at
most N of them, and when trees are still missing the command says so and exits 3."""

from __future__ import annotations

import json
from types import SimpleNamespace

from typer.testing import CliRunner

from deepr.cli import app
from deepr.data.outcomes import StageTally
from deepr.records import Reject


def test_rejected_topics_are_replaced_until_n_trees_stand(tmp_path, mini_corpus, retriever):
    out = tmp_path / "trees.jsonl"
    args = ["build-trees", "--corpus", str(mini_corpus), "--cache-dir", str(retriever.path.parents[1]),
            "--n-trees", "3", "--out", str(out)]
    r = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    rejected = (tmp_path / "trees.rejects.jsonl").read_text().splitlines()
    assert rejected, "the mini corpus rejects some of its first topics; this test needs one"
    trees = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(trees) == 3 and r.exit_code == 0, r.output
    assert "replaced by spare topics" in r.output
    assert not {t["id"] for t in trees} & {json.loads(x)["id"] for x in rejected}
    counts = json.loads((tmp_path / "trees.jsonl.meta.json").read_text())["counts"]
    assert counts["trees asked for"] == 3 and counts["spare topics tried for rejected ones"] >= len(rejected)
    again = CliRunner().invoke(app, args, env={"COLUMNS": "200"})  # resumes: nothing left to build
    assert again.exit_code == 0 and len(out.read_text().splitlines()) == 3


def test_when_spares_run_out_the_command_names_the_shortfall_and_exits_3(capsys):
    from deepr.cli.trees_cmd import _Spares

    spare = _Spares(3, [SimpleNamespace(id="s1")], ids={"a", "b", "c", "s1"})
    assert [s.id for s in spare.next({"a"})] == ["s1"]  # two missing, one spare left
    assert spare.next({"a", "s1"}) == []
    tally = StageTally("build-trees", ok=2, failed=3)
    model = SimpleNamespace(auth_failed=False)
    assert spare.outcome(tally, [model], False) == 3
    assert dict(spare.rows())["trees missing"] == "1, after 1 of 1 spare topics"


def test_summary_reasons_read_as_written():
    tally = StageTally("build-trees")
    tally.add(Reject(id="t", stage="build-trees", reason="tree too small: 1 leaf(s), at least 2 needed "
                     "(leaves stopped by: no children 1; children dropped: none; model failures: 0)"))
    tally.add(Reject(id="u", stage="build-trees", reason="tree too small: 1 leaf(s), at least 3 needed "
                     "(leaves stopped by: no children 2; children dropped: none; model failures: 1)"))
    [(_, top)] = [row for row in tally.rows() if row[0].startswith("top failure")]
    assert top == "2× record: tree too small: 1 leaf(s), at least 2 needed (and alike)"


def test_bm25_trees_build_without_a_dense_index(tmp_path, mini_corpus):
    """`--retriever bm25` builds trees over a BM25-only index (no corpus embedding pass), and the
    sidecar says which index served them."""
    out = tmp_path / "trees.jsonl"
    args = ["build-trees", "--corpus", str(mini_corpus), "--cache-dir", str(tmp_path / "cache"),
            "--retriever", "bm25", "--n-trees", "1", "--out", str(out)]
    r = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert len(out.read_text().splitlines()) == 1
    index = next((tmp_path / "cache" / "index").iterdir())
    assert not (index / "dense.faiss").exists()
    meta = (tmp_path / "trees.jsonl.meta.json").read_text()
    assert '"mode": "bm25"' in meta and '"dense_index": null' in meta
