"""Issue 15: training signals that match the papers — loss aggregation, optimiser, judges made
explicit, DECOR's format penalty, dynamic sampling and server-mode pairing, WARP per-call samples.
Fast: no trainer is built here (the slow end-to-end runs live in test_grpo*.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_each_stage_defaults_to_its_papers_loss_aggregation_and_optimiser(tmp_path: Path):
    # 15.8: DecomposeR Eq. 16 and DECOR Eq. 4-5 average per sequence (TRL "grpo"), not token-mean "dapo";
    # 15.10: DECOR trains with a cosine schedule and AdamW beta2 0.95 (001 App. C).
    from deepr.train.decor_stage import DecorStageConfig
    from deepr.train.grpo import GrpoConfig, trl_args
    from deepr.train.rubric_stage import RubricStageConfig
    from deepr.train.warp_stage import WarpReportConfig

    p = GrpoConfig(stage="planner", model="m", out=tmp_path)
    a = GrpoConfig(stage="answerer", model="m", out=tmp_path)
    d = DecorStageConfig(model="m", out=tmp_path)
    assert (p.loss_type, a.loss_type, RubricStageConfig(model="m", out=tmp_path).loss_type) == ("grpo",) * 3
    assert (d.loss_type, d.lr_scheduler, d.adam_beta2, d.importance_sampling_level) == ("grpo", "cosine", 0.95,
                                                                                       "sequence")
    assert (p.lr_scheduler, p.adam_beta2) == ("constant", 0.999)
    assert WarpReportConfig(model="m", out=tmp_path).loss_type == "dapo"  # 003 names none
    assert GrpoConfig(stage="planner", model="m", out=tmp_path, loss_type="dapo").loss_type == "dapo"
    args = trl_args(d)
    assert (args.loss_type, args.lr_scheduler_type.value, args.adam_beta2) == ("grpo", "cosine", 0.95)
    assert trl_args(p).loss_type == "grpo"


def test_grpo_recomputes_activations_by_default_even_on_cpu(tmp_path: Path):
    """A planner revision call trains on ~3k tokens: storing every activation of a few of them took
    a 135M model's first GRPO step past 12 GB on CPU (bench/sft_memory.py --grpo-scripted), and the
    learning run's first step was killed at 22.9 GB. A --config file may still turn it off."""
    from deepr.train.grpo import GrpoConfig, trl_args

    on = trl_args(GrpoConfig(stage="planner", model="m", out=tmp_path))
    assert on.gradient_checkpointing and on.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert not trl_args(GrpoConfig(stage="planner", model="m", out=tmp_path, gradient_checkpointing=False)
                        ).gradient_checkpointing


@pytest.mark.parametrize("stage", ["answerer", "rubric", "decor", "warp-report", "warp-atomic"])
def test_require_judge_llm_refuses_every_judged_stage_without_a_judge(stage, tmp_path):
    from typer.testing import CliRunner

    from deepr.cli import app

    r = CliRunner().invoke(app, ["grpo", "--stage", stage, "--model", "m", "--data", str(tmp_path / "d.jsonl"),
                                 "--out", str(tmp_path / "o"), "--require-judge-llm"])
    assert r.exit_code == 2, r.output
    assert "--require-judge-llm" in r.output and "--judge-llm" in r.output and "Traceback" not in r.output


def test_judge_fallback_is_warned_and_recorded(tmp_path, capsys):
    from deepr.train.grpo import GrpoConfig, judge_record, warn_judge, write_run_meta
    from deepr.train.stage import StageConfig  # noqa: F401  (stage configs share the same fields)

    a = GrpoConfig(stage="answerer", model="m", out=tmp_path)
    warn_judge(a)
    err = capsys.readouterr().err
    assert "WARNING" in err and "J_rub" in err and "extractive" in err and "not the paper's reward" in err
    write_run_meta(a, "running", "fp", "m", {})
    meta = json.loads((tmp_path / "deepr_meta.json").read_text())
    assert (meta["judge"], meta["extractive_fallback"], meta["judged_terms"]) == ("extractive", True, "J_rub")
    p = GrpoConfig(stage="planner", model="m", out=tmp_path)
    warn_judge(p)
    assert capsys.readouterr().err == ""  # R_plan has no judged term
    assert judge_record(p)["extractive_fallback"] is False
    j = GrpoConfig(stage="answerer", model="m", out=tmp_path, judge_llm="openai:qwen", require_judge_llm=True)
    assert judge_record(j) == {"judge": "openai:qwen", "judged_terms": "J_rub", "extractive_fallback": False}


# --- 15.5: AgentCPM atomic terms with an LLM judge --------------------------------------------------


class FakeJudgeLLM:
    """An LLM judge: quality 5/5/5(/5) for replies mentioning magma, else 1s; claims per sentence,
    supported when the sentence says 'magma'. Records every prompt."""

    def __new__(cls):
        from deepr.llm.base import LLM

        class _Fake(LLM):
            name = "fake-judge"

            def __init__(self):
                super().__init__(max_concurrency=4)
                self.prompts: list[str] = []

            async def _achat(self, messages, *, role, temperature, max_tokens, stop, **extra):
                text = messages[-1]["content"]
                self.prompts.append(text)
                reply = text.split("Reply to grade:", 1)[-1].split("Reference reply", 1)[0] if "Aspects:" in text \
                    else text.split("Reply:", 1)[-1]
                if "Aspects:" in text:
                    keys = [k for k in ("guidance", "hierarchy", "coherence", "relevance", "coverage", "depth",
                                        "novelty") if f"- {k}:" in text]
                    s = 5 if "magma" in reply.lower() else 1
                    return json.dumps({"scores": {k: s for k in keys}})
                sents = [x for x in reply.split(".") if x.strip() and "<<<" not in x and ">>>" not in x
                         and "Return" not in x]
                return json.dumps({"claims": [{"claim": x.strip(), "supported": "magma" in x.lower()}
                                              for x in sents[:4]]})

        return _Fake()


def _write_row(evidence_ids=("S1-R1", "S1-R2")):
    ev = "\n".join(f"[{i}] Magma rises through the crust." for i in evidence_ids)
    prompt = [{"role": "system", "content": "warp"},
              {"role": "user", "content": f"User question:\nHow do volcanoes form?\n\nRetrieved information:\n{ev}"}]
    return prompt, "<content>Magma rises through the crust [S1-R1].</content>"


def test_judge_adds_quality_and_faithfulness_and_hallucination_zeroes_only_citations():
    import asyncio

    from deepr.rewards.judges import Judge
    from deepr.train.warp_stage import WarpAtomicRewardFn

    llm = FakeJudgeLLM()
    judge = Judge(llm)
    fn = WarpAtomicRewardFn(None, judge=judge)
    prompt, reference = _write_row()
    body = " ".join(["Magma rises through the crust and erupts."] * 20)
    good = f"<content>{body} [S1-R1].</content>"
    fake = f"<content>{body} [S1-R1] [Z9-R9].</content>"
    cols = {"action": ["write", "write", "initialize"], "reference": [reference, reference, "{}"],
            "query": ["How do volcanoes form?"] * 3}
    outline = json.dumps({"name": "initialize", "title": "Volcanoes", "sections": [
        {"title": "Magma", "plan": "how magma rises"}, {"title": "Eruptions", "plan": "what follows"}]})
    got = asyncio.run(fn([prompt, prompt, prompt], [good, fake, outline], **cols))
    # paragraph: mean(basic 1, citation precision 1, quality 1, faithfulness 1) = 1
    assert got[0] == pytest.approx(1.0)
    # the hallucinated id zeroes citation precision only: mean(1, 0, 1, 1)
    assert got[1] == pytest.approx(0.75)
    # outline: mean(basic 1, quality 1 (magma), faithfulness: 1 claim of 1 supported... ) within [0, 1]
    assert 0.0 < got[2] <= 1.0
    asks = " ".join(llm.prompts)
    assert "guidance" in asks and "novelty" in asks and "Source material" in asks
    # without a judge the same rows keep only the unjudged terms: paragraph 0.5 basic + 0.5 precision
    plain = asyncio.run(WarpAtomicRewardFn(None)([prompt, prompt], [good, fake], **{k: v[:2] for k, v in
                                                                                   cols.items()}))
    assert plain == [pytest.approx(1.0), pytest.approx(0.5)]


def test_a_failed_judgement_leaves_the_row_unscored_not_zero():
    import asyncio

    from deepr.llm.base import LLM
    from deepr.rewards.judges import Judge
    from deepr.train.warp_stage import WarpAtomicRewardFn

    class Mute(LLM):
        name = "mute"

        async def _achat(self, messages, **kw):
            return "I cannot grade this."

    prompt, reference = _write_row()
    body = " ".join(["Magma rises through the crust and erupts."] * 20)
    got = asyncio.run(WarpAtomicRewardFn(None, judge=Judge(Mute(), max_reasks=0))(
        [prompt], [f"<content>{body} [S1-R1].</content>"], action=["write"], reference=[reference],
        query=["How do volcanoes form?"]))
    assert got == [None]


# --- 15.7: DECOR first turns are generated one per prompt ---------------------------------------------


def test_decor_completions_pair_with_their_own_observations_under_server_mode_generation(tok, retriever):
    """A generator that behaves like TRL's vLLM server mode: asked for a first turn, it keeps every
    G-th prompt and returns G completions of it. Each filter row sees its own episode's search, so a
    completion generated for another row's observation would name the wrong query."""
    import itertools
    import re

    from deepr.train.decor_stage import QARecord, context_factory, decor_dataset, decor_rollouts

    G, counter, firsts = 2, itertools.count(1), []

    def server_like(seqs, first, max_new):
        firsts.append(first)
        todo = seqs[::G] if first else seqs
        out = []
        for ids in todo:
            text = tok.decode(ids, skip_special_tokens=True)
            if "You plan the searches" in text:
                reply = ("<think>go</think><search>STOP</search>" if "Searches made: (none)" not in text
                         else f"<think>go</think><search>earthquake fault number {next(counter)}</search>")
            elif "You filter search results" in text:
                q = re.findall(r"Search query: (.*)", text)[-1].strip()
                reply = f"<think>keep</think><filter>Facts for {q} [S1-R1].</filter>"
            else:
                reply = "<think>so</think><answer>plates</answer>"
            out.append((tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:max_new])
        return ([o for o in out for _ in range(G)] if first else out), None

    rows, lookup = decor_dataset([QARecord(id="q", question="What causes earthquakes?", answers=["plates"])])
    filter_rows = [r["prompt"] for r in rows if r["role"] == "filter" for _ in range(G)]
    rollouts, extra = decor_rollouts(filter_rows, lookup, context_factory(retriever, 2), server_like, tok,
                                     budget=6000, eos_ids=[tok.eos_token_id])
    seen = []
    for r in rollouts:
        call = r.calls[0]
        asked = re.findall(r"Search query: (.*)", tok.decode(call.prompt_ids, skip_special_tokens=True))[-1].strip()
        wrote = tok.decode(call.completion_ids, skip_special_tokens=True)
        assert f"Facts for {asked}" in wrote, (asked, wrote)
        seen.append(asked)
    assert len(set(seen)) == G  # the two rows really saw different observations
    assert not any(firsts)  # no turn was requested as G samples of one prompt


# --- 15.10: DECOR's trajectory-wide format penalty and dynamic sampling --------------------------------


def test_a_protocol_break_anywhere_gives_every_role_of_the_episode_minus_one(embedder):
    from deepr.llm.base import run_sync
    from deepr.train.decor_stage import DecorRewardFn

    fn = DecorRewardFn(embed=embedder.encode)
    good = [{"context": "facts", "output": "<think>so</think><answer>plates</answer>"}]
    out = run_sync(fn(prompts=[""] * 3, completions=[""] * 3, role=["answerer", "filter", "answerer"],
                      question=["q"] * 3, answers=[["plates"]] * 3, team_answer=["plates", "", "plates"],
                      role_steps=[good, [], good], format_valid=[True, True, True],
                      broken=["planner: no <search> block", "planner: no <search> block", ""]))
    # the answerer spoke well but its planner broke the protocol: the trajectory gets -1 (001 §4.3);
    # the filter never spoke because of that break: -1 as well, not "no reward"
    assert out[0] == -1.0 and out[1] == -1.0 and out[2] > 0


def test_decor_dynamic_sampling_replaces_a_flat_group(tiny, tok, retriever, tmp_path):
    """First batch: both rollouts of the group succeed alike (zero spread, no gradient); the trainer
    samples again, and the second batch (one rollout breaks the protocol) is what it trains on."""
    from test_grpo_decor import Q, role_aware

    from deepr.train import decor_stage as ds
    from deepr.train import stage as rs

    cfg = ds.DecorStageConfig(model=str(tiny), out=tmp_path / "rl", num_generations=2, prompts_per_step=1,
                              mini_batch_prompts=1, max_completion_length=3000, max_turn_tokens=64, max_steps=1,
                              lora_r=4, lora_alpha=8, k=2, learning_rate=1e-3, decor_steps=2)
    batches: list = []

    def gen_for(trainer):
        batches.append(len(batches))
        return role_aware(tok, broken_at=set() if len(batches) == 1 else {1})

    store: list = []
    built = rs.build_stage_trainer

    def keep(*a, **kw):
        store.append(built(*a, **kw))
        return store[0]

    from transformers import TrainerCallback

    class Capture(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            inner = store[0]._generate_and_score_completions
            store[0]._generate_and_score_completions = lambda inputs: store.append(inner(inputs)) or store[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rs, "build_stage_trainer", keep)
        res = ds.train_decor(cfg, [ds.QARecord(id="q", question=Q, answers=["tectonic plates"])], retriever,
                             generate_for=gen_for, callbacks=[Capture()])
    assert res.steps == 1 and len(batches) == 2  # sampled again once
    assert store[0]._decor_advantages == pytest.approx([1.0, -1.0], abs=1e-5)
    assert int(store[1]["completion_mask"].sum()) > 0
    log = [json.loads(x) for x in (res.out / "metrics.jsonl").read_text().splitlines()]
    assert log[0]["dynamic/flat_first"] == 1.0 and log[0]["dynamic/flat_left_out"] == 0.0
    assert log[0]["dynamic/samplings"] == 2.0 and log[0]["zero_advantage_frac"] == 0.0
