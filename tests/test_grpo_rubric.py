"""grpo --stage rubric: tool-response masks, the composite reward and its logged parts, a CPU run."""

from __future__ import annotations

import json

import pytest

from deepr.records import QRPair
from grpo_helpers import capture_batches, scripted, segments as _segments

RUBRICS = [{"id": "R1", "type": "factual", "description": "Earthquakes come from moving tectonic plates.",
            "weight": 1.0}]
QUESTION = "What causes earthquakes?"


def _pairs() -> list[QRPair]:
    return [QRPair(id="q0", tree_id="t", question=QUESTION, selected_leaf_ids=[], rubrics=RUBRICS),
            QRPair(id="q1", tree_id="t", question="dropped", selected_leaf_ids=[], rubrics=RUBRICS,
                   decision="DROP")]


def _call(query: str) -> str:
    return f'<think>look it up</think><tool_call>{json.dumps({"name": "search", "arguments": {"query": query}})}' \
           "</tool_call>"


def test_config_takes_the_papers_rl_settings(tmp_path):
    from deepr.train.rubric_stage import RubricStageConfig

    c = RubricStageConfig(model="m", out=tmp_path)
    assert (c.learning_rate, c.beta, c.num_generations, c.tool_turns, c.max_turn_tokens) == (1e-6, 0.0, 8, 20, 2048)
    assert c.role == "agent" and RubricStageConfig(model="m", out=tmp_path, learning_rate=1e-3).learning_rate == 1e-3
    with pytest.raises(ValueError, match="multiple of mini_batch_prompts"):
        RubricStageConfig(model="m", out=tmp_path, prompts_per_step=3, mini_batch_prompts=2)


def test_tool_responses_get_zero_loss_weight(tok, retriever):
    from deepr.train.rubric_stage import rubric_dataset, session_factory, tool_rollouts

    rows, lookup = rubric_dataset(_pairs())
    assert [r["id"] for r in rows] == ["q0"]  # a dropped pair is not trained on
    hits = retriever.search("tectonic plates earthquake", k=2)
    answer = f'<think>enough</think><answer><cite id="S1-R1">{hits[0].text[:60]}</cite></answer>'
    gen = scripted(tok, [_call("tectonic plates earthquake"), answer])
    (r,), extra = tool_rollouts([rows[0]["prompt"]], lookup, session_factory(retriever, k=2), gen, tok,
                                budget=6000, eos_ids=[tok.eos_token_id])
    segs = _segments(r)
    assert [m for m, _ in segs] == [1, 0, 1] and len(r.env_mask) == len(r.completion_ids)
    masked = tok.decode(segs[1][1])
    assert "<tool_response>" in masked and "[S1-R1]" in masked and hits[0].title in masked
    model = tok.decode(segs[0][1] + segs[2][1], skip_special_tokens=True)
    assert "<tool_response>" not in model and hits[0].title not in tok.decode(segs[0][1])
    assert extra["n_tool_calls"] == [1] and set(extra["store"][0]) == {"S1-R1", "S1-R2"}
    assert extra["transcript"][0] == _call("tectonic plates earthquake") + "\n" + answer


def test_turn_limit_nudges_then_stops(tok, retriever):
    from deepr.train.rubric_stage import rubric_dataset, session_factory, tool_rollouts

    rows, lookup = rubric_dataset(_pairs())
    (r,), extra = tool_rollouts([rows[0]["prompt"]], lookup, session_factory(retriever, k=1),
                                scripted(tok, [_call("plates")]), tok, budget=20000, eos_ids=[tok.eos_token_id],
                                tool_turns=2)
    assert len(r.texts) == 4 and extra["n_tool_calls"] == [2]  # 2 calls, a refused 3rd (nudged), a last turn
    assert "used all your tool calls" in r.env_texts[-1]


def test_composite_reward_is_the_weighted_sum_and_logs_parts(embedder, retriever):
    from deepr.llm.base import run_sync
    from deepr.train.rubric_stage import RubricRewardFn

    hit = retriever.search("tectonic plates earthquake", k=1)[0]
    text = _call("plates") + f'\n<think>ok</think><answer><cite id="S1-R1">{hit.text[:80]}</cite></answer>'
    logged: dict[str, float] = {}
    fn = RubricRewardFn(embed=embedder.encode)
    out = run_sync(fn(prompts=["p", "p"], completions=["", ""], transcript=[text, "no answer"],
                      store=[{"S1-R1": hit.text}, {}], n_tool_calls=[1, 0], query=[QUESTION] * 2,
                      rubrics=[RUBRICS, RUBRICS], log_metric=lambda k, v: logged.__setitem__(k, v)))
    assert out[0] is not None and out[1] is not None and out[0] > out[1]
    # the second rollout: no think / tool / answer → format 0, search 0, nothing to cite or grade
    assert out[1] == pytest.approx(0.0)
    keys = {f"rubric/{c}" for c in ("R", "R_rubric", "R_format", "R_cite", "R_search", "I_think")}
    assert keys <= set(logged)
    assert logged["rubric/R_search"] == pytest.approx((1 / 6 + 0) / 2)
    assert logged["rubric/R_format"] == pytest.approx((1.0 + 0.0) / 2)  # all four format indicators hold
    assert logged["rubric/R"] == pytest.approx(sum(out) / 2)
    assert run_sync(fn(prompts=["p"], completions=[text], rubrics=[None], query=[QUESTION])) == [None]


def test_rubric_stage_trains_on_cpu_masks_and_saves_an_adapter(tiny, tok, retriever, tmp_path):
    from deepr.llm import get_llm
    from deepr.train import rubric_stage as rs
    from deepr.train import stage as st
    from deepr.train.rollouts import trainer_generate

    cfg = rs.RubricStageConfig(model=str(tiny), out=tmp_path / "rl", num_generations=2, prompts_per_step=1,
                               mini_batch_prompts=1, max_completion_length=2500, max_turn_tokens=48, max_steps=1,
                               lora_r=4, lora_alpha=8, k=2, learning_rate=1e-3, tool_turns=3)

    def mixed(trainer):  # turn 1 scripted (a real tool call), later turns sampled from the model
        real, first = trainer_generate(trainer), scripted(tok, [_call("earthquake plates")])
        return lambda seqs, is_first, max_new: first(seqs, is_first, max_new) if is_first else real(
            seqs, False, min(max_new, 12))

    seen: list = []

    class Spy(rs.RubricRewardFn):
        async def __call__(self, prompts, completions, **cols):
            seen.append(cols)
            return await super().__call__(prompts, completions, **cols)

    store: list = []
    built = st.build_stage_trainer

    def keep(*a, **kw):
        store.append(built(*a, **kw))
        return store[0]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(st, "build_stage_trainer", keep)
        res = rs.train_rubric(cfg, _pairs(), retriever, generate_for=mixed, callbacks=[capture_batches(store)],
                              reward_fn=Spy())
    assert res.steps == 1 and res.rewards
    batch = store[1]
    loss = batch["completion_mask"] * batch["tool_mask"]
    for row, full, ids in zip(loss, batch["completion_mask"], batch["completion_ids"]):
        assert 0 < int(row.sum()) < int(full.sum())
        assert "<tool_response>" not in tok.decode(ids[row.bool()])
        assert "<tool_response>" in tok.decode(ids[full.bool() & ~row.bool()])
    assert seen and seen[0]["n_tool_calls"] == [1, 1] and all(s for s in seen[0]["store"])
    log = [json.loads(x) for x in (res.out / "metrics.jsonl").read_text().splitlines()]
    assert {"rubric/R", "rubric/R_rubric", "rubric/R_format", "rubric/R_cite", "rubric/R_search",
            "rollout/masked_token_share", "rollout/tool_calls", "rewards/rubric_reward/mean"} <= set(log[0])
    assert log[0]["rubric/R_search"] == pytest.approx(1 / 6)
    meta = json.loads((res.out / "deepr_meta.json").read_text())
    assert meta["status"] == "done" and meta["role"] == "agent" and (res.out / "adapter_config.json").is_file()
    llm = get_llm(meta["llm_spec"])
    assert isinstance(llm.chat([{"role": "user", "content": "hi"}], role="agent", max_tokens=4), str)


def test_cli_runs_the_rubric_stage_and_reports_bad_data(tiny, mini_corpus, retriever, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import deepr.corpus
    from deepr.cli import app

    opened: list = []  # the session's index stands in for a fresh build of the same corpus
    monkeypatch.setattr(deepr.corpus, "open_retriever", lambda *a, **kw: opened.append((a, kw)) or retriever)

    data = tmp_path / "verified.jsonl"
    data.write_text("".join(p.model_dump_json() + "\n" for p in _pairs()))
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"num_generations": 2, "prompts_per_step": 1, "mini_batch_prompts": 1, "lora_r": 4,
                               "lora_alpha": 8, "max_completion_length": 48, "max_turn_tokens": 24, "tool_turns": 2}))
    args = ["grpo", "--stage", "rubric", "--model", str(tiny), "--data", str(data), "--out", str(tmp_path / "rl"),
            "--config", str(cfg), "--max-steps", "1", "--corpus", str(mini_corpus), "--retriever", "bm25"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "grpo --stage rubric" in r.output and "adapter=agent:" in r.output
    assert opened[0][0] == (str(mini_corpus),) and opened[0][1]["retriever"] == "bm25"
    assert (tmp_path / "rl" / "adapter_config.json").is_file()
    data.write_text('{"id": "x", "question": 3}\n')
    r = CliRunner().invoke(app, [*args[:8], str(tmp_path / "rl2"), *args[9:]])
    assert r.exit_code == 2 and "verified.jsonl:1" in r.output and "tree_id" in r.output
