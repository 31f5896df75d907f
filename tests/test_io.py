"""The one reader/writer pair: clear errors, atomic writes, resume, shards, sidecars."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from deepr.io import (
    JsonlAppender,
    RecordError,
    done_ids,
    in_shard,
    meta_path,
    parse_shard,
    read_jsonl,
    redact,
    redact_argv,
    rejects_path,
    write_jsonl,
    write_meta,
)
from deepr.records import Document, QRPair, Reject


def test_malformed_json_line_names_file_and_line(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text('{"id": "a", "text": "x"}\n\n{"id": "b", "text": \n{"id": "c", "text": "z"}\n')
    with pytest.raises(RecordError) as e:
        list(read_jsonl(p, Document))
    assert e.value.line == 3 and e.value.path == str(p)
    assert f"{p}:3" in str(e.value) and "not valid JSON" in str(e.value)


def test_schema_error_names_the_field(tmp_path):
    p = tmp_path / "pairs.jsonl"
    good = {"id": "q1", "tree_id": "t1", "question": "Why?", "selected_leaf_ids": ["L1"],
            "rubrics": [{"id": "R1", "type": "factual", "description": "d", "weight": 0.5}]}
    bad = dict(good, id="q2", rubrics=[{"id": "R1", "type": "opinion", "description": "d", "weight": 0.5}])
    p.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(RecordError) as e:
        list(read_jsonl(p, QRPair))
    assert e.value.line == 2
    assert e.value.field == "rubrics.0.type"


def test_non_object_line_and_missing_file(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text("[1, 2]\n")
    with pytest.raises(RecordError, match="expected a JSON object"):
        list(read_jsonl(p))
    with pytest.raises(FileNotFoundError, match="no such file"):
        list(read_jsonl(tmp_path / "missing.jsonl"))


def test_atomic_write_survives_exception_mid_write(tmp_path):
    p = tmp_path / "out.jsonl"
    write_jsonl(p, [{"id": "old"}])

    def records():
        yield {"id": "new1"}
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_jsonl(p, records())
    assert [r["id"] for r in read_jsonl(p)] == ["old"]
    assert [f.name for f in tmp_path.iterdir()] == ["out.jsonl"]  # no temp file left behind


def test_appender_resume_skips_finished_ids_and_cuts_torn_tail(tmp_path):
    p = tmp_path / "out.jsonl"
    with JsonlAppender(p) as w:
        w.write({"id": "a"})
        w.write({"id": "b"})
    with p.open("a") as f:  # a process killed mid-line leaves half a record
        f.write('{"id": "c", "te')
    assert done_ids(p) == {"a", "b"}
    with JsonlAppender(p) as w:
        w.write({"id": "c"})
    assert [r["id"] for r in read_jsonl(p)] == ["a", "b", "c"]


def test_appender_loses_nothing_when_process_is_killed(tmp_path):
    """Records written before a SIGKILL are on disk and readable."""
    out = tmp_path / "out.jsonl"
    code = textwrap.dedent(f"""
        import os, signal
        from deepr.io import JsonlAppender
        w = JsonlAppender({str(out)!r})
        for i in range(5):
            w.write({{"id": str(i)}})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -9
    assert done_ids(out) == {str(i) for i in range(5)}


def test_shards_partition_ids_deterministically():
    ids = [f"tree-{i}" for i in range(300)]
    shards = [parse_shard(f"{k}/3") for k in (1, 2, 3)]
    parts = [[i for i in ids if in_shard(i, s)] for s in shards]
    assert sorted(sum(parts, [])) == sorted(ids)  # every id in exactly one shard
    assert all(len(p) > 50 for p in parts)
    assert parts[0] == [i for i in ids if in_shard(i, (1, 3))]
    assert in_shard("x", None)
    for bad in ("3", "0/2", "3/2", "a/b"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)


def test_meta_sidecar_records_inputs_and_redacts_secrets(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a"}\n')
    out = tmp_path / "out.jsonl"
    write_meta(out, stage="test", config={"llm": "openai:m", "api_key": "sk-SECRET123", "n": 3},
               inputs=[inp], counts={"written": 1}, timings={"total_s": 0.1})
    text = meta_path(out).read_text()
    assert "sk-SECRET123" not in text
    meta = json.loads(text)
    assert meta["config"] == {"llm": "openai:m", "api_key": "***", "n": 3}
    assert meta["inputs"][0]["sha256"] and meta["counts"] == {"written": 1}
    assert "python" in meta["versions"] and "pydantic" in meta["versions"]


def test_meta_sidecars_read_package_versions_once_per_process(tmp_path, monkeypatch):
    """`deepr run --queries` writes a sidecar per question: each must not rescan sys.path for
    every library's version (a third of the run's CPU), yet every sidecar still names them."""
    import deepr.io as dio

    looked_up = []
    real = dio.metadata.version
    monkeypatch.setattr(dio.metadata, "version", lambda name: looked_up.append(name) or real(name))
    dio._versions.cache_clear()
    metas = [json.loads(write_meta(tmp_path / f"r{i}.jsonl", stage="run").read_text()) for i in range(5)]
    assert len(looked_up) == len(dio._VERSIONED)  # once each, not once per sidecar
    assert metas[0]["versions"]["pydantic"] == real("pydantic")
    assert all(m["versions"] == metas[0]["versions"] for m in metas)
    dio.versions()["pydantic"] = "changed"  # a caller's copy: the next sidecar is unaffected
    assert dio.versions()["pydantic"] == real("pydantic")
    dio._versions.cache_clear()


def test_redact_nested_and_rejects_path(tmp_path):
    assert redact({"a": [{"Authorization": "Bearer x"}], "hf_token": "hf_abc", "max_tokens": 512,
                   "prompt_tokens": 9, "tokenizer": "path"}) == {
        "a": [{"Authorization": "***"}], "hf_token": "***", "max_tokens": 512, "prompt_tokens": 9,
        "tokenizer": "path"}
    assert redact_argv(["deepr", "--api-key", "sk-1", "--max-tokens", "5", "--hf-token=x"]) == [
        "deepr", "--api-key", "***", "--max-tokens", "5", "--hf-token=***"]
    assert rejects_path(tmp_path / "trees.jsonl").name == "trees.rejects.jsonl"
    r = Reject(id="t1", stage="build-trees", reason="no supporting document")
    assert json.loads(r.model_dump_json())["reason"] == "no supporting document"


def test_torn_tail_is_an_error_for_plain_reads(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"id": "a"}\n{"id": ')
    with pytest.raises(RecordError):
        list(read_jsonl(p))
    assert [r["id"] for r in read_jsonl(p, tolerate_torn_tail=True)] == ["a"]
    assert os.path.getsize(p) > 0
