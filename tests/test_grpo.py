"""deepr grpo: env masks of multi-turn rollouts, the TRL contract we rely on, both stages end to end."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from deepr.records import QRPair
from grpo_helpers import capture_batches as _capture_masks, scripted, scripted_rows

PLAN = {"nodes": [
    {"id": "N1", "type": "search", "query": "causes of earthquakes plate tectonics", "key_points": ["faults"]},
    {"id": "N2", "type": "search", "query": "volcano eruption effects", "key_points": ["ash"]},
    {"id": "N3", "type": "aggregate", "need": "how earthquakes happen", "key_points": ["plates move"],
     "inputs": ["N1", "N2"]},
    {"id": "N4", "type": "aggregate", "need": "risks to people", "key_points": ["damage"], "inputs": ["N3", "N2"]},
    {"id": "N5", "type": "answer", "need": "a short report", "inputs": ["N4"]}]}
REVISED = {"nodes": [dict(PLAN["nodes"][0], query="tectonic plates earthquakes"), *PLAN["nodes"][1:]],
           "fetch": ["N1-R1"]}
RUBRICS = [{"id": "R1", "type": "factual", "description": "Earthquakes come from moving tectonic plates.",
            "weight": 1.0}]


def _pairs(n: int = 2) -> list[QRPair]:
    qs = ["What causes earthquakes and how dangerous are they?", "How do volcanoes affect the climate?"]
    return [QRPair(id=f"q{i}", tree_id="t", question=qs[i % 2], selected_leaf_ids=[], rubrics=RUBRICS)
            for i in range(n)]


# --- the TRL contract -----------------------------------------------------------------------


def test_trl_api_we_rely_on_is_still_there():
    """Fails loudly when TRL renames what deepr passes or calls. What TRL does with a rollout's
    env_mask (tool tokens carry no loss) is checked by behaviour in
    tests/test_grpo_rubric.py::test_rubric_stage_trains_on_cpu_masks_and_saves_an_adapter."""
    from trl import GRPOConfig, GRPOTrainer

    init = inspect.signature(GRPOTrainer.__init__).parameters
    assert {"rollout_func", "reward_funcs", "peft_config", "processing_class"} <= set(init)
    gen = inspect.signature(GRPOTrainer._generate_single_turn).parameters
    assert list(gen)[1:5] == ["prompt_ids", "images", "multimodal_fields", "num_generations"]
    score = inspect.signature(GRPOTrainer._calculate_rewards).parameters
    assert list(score)[1:] == ["inputs", "prompts", "completions", "completion_ids_list"]
    assert callable(getattr(GRPOTrainer, "_generate_and_score_completions", None))
    assert callable(getattr(GRPOTrainer, "_log_metric", None))
    fields = set(GRPOConfig.__dataclass_fields__)
    assert {"loss_type", "importance_sampling_level", "epsilon_high", "beta", "use_vllm", "vllm_mode",
            "steps_per_generation", "max_completion_length", "scale_rewards"} <= fields


def test_config_has_table5_defaults_and_checks_batches(tmp_path: Path):
    from deepr.train.grpo import GrpoConfig

    p = GrpoConfig(stage="planner", model="m", out=tmp_path)
    a = GrpoConfig(stage="answerer", model="m", out=tmp_path)
    assert (p.lora_r, p.lora_alpha, p.learning_rate, p.temperature) == (64, 128, 4e-6, 1.0)
    assert (p.beta, p.prompts_per_step, p.num_generations, p.mini_batch_prompts) == (0.001, 8, 6, 4)
    assert (a.beta, a.prompts_per_step, a.max_completion_length) == (0.005, 4, 16384)
    with pytest.raises(ValueError, match="multiple of mini_batch_prompts"):
        GrpoConfig(stage="planner", model="m", out=tmp_path, prompts_per_step=3, mini_batch_prompts=2)
    with pytest.raises(ValueError, match="--stage answerer"):
        GrpoConfig(stage="planner", model="m", out=tmp_path, planner_adapter=tmp_path)


# --- token-level masks -----------------------------------------------------------------------


def test_env_turn_tokens_match_the_chat_template(tok):
    from deepr.train.rollouts import env_turn_ids, prompt_ids

    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "question?"}]
    reply, env = '{"nodes": []}', "Results:\n[N1-R1] A title: some text"
    turn = tok(reply, add_special_tokens=False)["input_ids"]
    full = prompt_ids(tok, msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": env}])
    assert prompt_ids(tok, msgs) + turn + [tok.eos_token_id] + env_turn_ids(tok, env, closed=True) == full
    # a turn cut before its end token gets the end token from the environment (masked)
    open_turn = env_turn_ids(tok, env, closed=False)
    assert open_turn[0] == tok.eos_token_id and open_turn[1:] == env_turn_ids(tok, env, closed=True)


def test_planner_turns_are_separate_calls_under_their_own_prompts(tok, retriever):
    from deepr.train.grpo import planner_dataset
    from deepr.train.environments import PlannerEnvironment, planner_prompt
    from deepr.train.rollouts import planner_rollouts, prompt_ids

    rows, lookup = planner_dataset(_pairs(2))
    env = PlannerEnvironment(retriever, k=2)
    gen = scripted(tok, [json.dumps(PLAN), json.dumps(REVISED)])
    eps, extra = planner_rollouts([r["prompt"] for r in rows], lookup, env, gen, tok, budget=4000,
                                  eos_ids=[tok.eos_token_id])
    for ep, row in zip(eps, rows):
        t1, t2 = ep.calls
        assert t1.prompt_ids == prompt_ids(tok, planner_prompt(row["query"]))
        assert tok.decode(t1.completion_ids, skip_special_tokens=True) == json.dumps(PLAN)
        assert tok.decode(t2.completion_ids, skip_special_tokens=True) == json.dumps(REVISED)
        # turn 2 is sampled under the revision prompt alone: the search results, not turn 1's prompt or reply
        shown = tok.decode(t2.prompt_ids)
        assert "N1-R1" in shown and "N2-R2" in shown and "Revise the plan" in shown
        assert "Write the initial plan" not in shown and ep.prompts[1][-1]["role"] == "user"
        assert len(ep.prompts[1]) == 2  # system + user: a fresh prompt, not a continuation
        hit_titles = [h.title for h in retriever.search(PLAN["nodes"][0]["query"], k=2)]
        assert any(t in shown for t in hit_titles)
        assert not any(t in tok.decode(t1.completion_ids + t2.completion_ids) for t in hit_titles)
    assert extra["plan"] == [REVISED, REVISED] and extra["initial_valid"] == [1.0, 1.0]


def test_train_turns_keeps_the_first_calls_for_training_while_the_reward_reads_every_turn(tok, retriever, tmp_path):
    """--stage planner with train_turns 1: both turns are sampled (R_plan scores the revised plan),
    only the initial plan's call reaches the loss."""
    from types import SimpleNamespace

    from deepr.train.grpo import planner_dataset
    from deepr.train.environments import PlannerEnvironment
    from deepr.train.rollouts import make_rollout_func

    rows, lookup = planner_dataset(_pairs(2))
    prompts = [r["prompt"] for r in rows]
    for turns, trained in ((None, 2), (1, 1)):
        func = make_rollout_func("planner", lookup, budget=4000, env=PlannerEnvironment(retriever, k=2),
                                 generate_for=lambda _t: scripted(tok, [json.dumps(PLAN), json.dumps(REVISED)]),
                                 train_turns=turns)
        trainer = SimpleNamespace(processing_class=tok, eos_token_ids=[tok.eos_token_id])
        out = func(prompts, trainer)
        assert out["plan"] == [REVISED, REVISED]  # the reward's input is the revised plan either way
        assert [len(calls) for calls in trainer._warp_calls] == [trained, trained]
        first = trainer._warp_calls[0][0]
        assert tok.decode(first.completion_ids, skip_special_tokens=True) == json.dumps(PLAN)
    # every rollout is logged with its turns and what was scored, so a run of zero rewards says why
    log_dir = tmp_path / "run"
    bad = make_rollout_func("planner", lookup, budget=4000, env=PlannerEnvironment(retriever, k=2),
                            generate_for=lambda _t: scripted(tok, ['{"nodes": []}']), train_turns=1)
    bad(prompts, SimpleNamespace(processing_class=tok, eos_token_ids=[tok.eos_token_id],
                                 args=SimpleNamespace(output_dir=str(log_dir)), state=SimpleNamespace(global_step=3)))
    rows = [json.loads(x) for x in (log_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["step"] == 3 and r["plan_source"] == "refused" for r in rows)
    assert rows[0]["query"] == _pairs(2)[0].question and rows[0]["turns"] == ['{"nodes": []}']
    assert "nodes" in rows[0]["refused"]  # the validator's reason, not an empty note


def test_planner_invalid_first_plan_ends_the_episode_unasked_and_budget_bounds_model_tokens(tok, retriever):
    """DecomposeR §3.4.2 has no re-ask: an invalid G0 has nothing to search, so its episode is that
    one call, scored 0; no call of any RL rollout carries the executor's re-ask."""
    from deepr.agent.planner import INITIAL
    from deepr.train.grpo import planner_dataset
    from deepr.train.environments import PlannerEnvironment
    from deepr.train.rollouts import planner_rollouts

    rows, lookup = planner_dataset(_pairs(1))
    reask = INITIAL.output.reask("")[:30]
    for validity in ("paper", "run"):
        env = PlannerEnvironment(retriever, k=2, validity=validity)
        bad_g0 = '{"nodes": [{"id": "N1", "type": "search"}]}'
        (ep,), extra = planner_rollouts([rows[0]["prompt"]], lookup, env, scripted(tok, [bad_g0, json.dumps(PLAN)]),
                                        tok, budget=4000, eos_ids=[tok.eos_token_id])
        assert len(ep.calls) == 1 and ep.prompts == [rows[0]["prompt"]]
        assert extra["initial_valid"] == [0.0] and extra["plan_source"] == ["refused"] and _score(extra) == [0.0]
        assert "query" in extra["plan"][0]  # the validator's reason
    for turns in ([json.dumps(PLAN), json.dumps(REVISED)], ["{not json", json.dumps(PLAN)],
                  [json.dumps(PLAN), "no plan here"]):
        eps, _ = planner_rollouts([rows[0]["prompt"]] * 3, lookup, PlannerEnvironment(retriever, k=2),
                                  scripted(tok, turns), tok, budget=4000, eos_ids=[tok.eos_token_id])
        assert not any(reask in m["content"] for e in eps for p in e.prompts for m in p)
        assert not any(reask in tok.decode(c.prompt_ids) for e in eps for c in e.calls)
    env = PlannerEnvironment(retriever, k=2)
    small = scripted(tok, [json.dumps(PLAN), json.dumps(REVISED)])
    (ep,), extra = planner_rollouts([rows[0]["prompt"]], lookup, env, small, tok, budget=20,
                                    eos_ids=[tok.eos_token_id])
    assert ep.used() <= 20 and ep.truncated and len(ep.calls) == 1 and extra["plan_source"] == ["refused"]
    capped = scripted(tok, [json.dumps(PLAN), json.dumps(REVISED)])
    (ep,), extra = planner_rollouts([rows[0]["prompt"]], lookup, env, capped, tok, budget=4000,
                                    eos_ids=[tok.eos_token_id], turn_cap=10)
    assert [len(c.completion_ids) for c in ep.calls] == [10] and ep.truncated and extra["plan_source"] == ["refused"]


def _bow_embed(texts):
    """Bag of words hashed into 64 dimensions: related texts get similar vectors, no model needed."""
    import zlib

    import numpy as np

    out = np.zeros((len(texts), 64), dtype=np.float32)
    for i, t in enumerate(texts):
        for w in t.lower().split():
            out[i, zlib.crc32(w.encode()) % 64] += 1.0
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def _score(extra: dict) -> list[float]:
    from deepr.rewards.trl_adapters import PlanRewardFn

    n = len(extra["plan"])
    return PlanRewardFn(_bow_embed)([""] * n, [""] * n, plan=extra["plan"], rubrics=[RUBRICS] * n)


def test_planner_reward_scores_the_revised_plan_only(tok, retriever):
    """DecomposeR Eq. 17: R_plan(G1) if G1 is valid, else 0 — a refused or cut revision scores 0
    however good G0 was. Valid(G) is the typed-DAG check; deepr run's acceptance checks join it only
    with validity "run"."""
    from deepr.train.grpo import planner_dataset
    from deepr.train.environments import PlannerEnvironment
    from deepr.train.rollouts import planner_rollouts

    rows, lookup = planner_dataset(_pairs(1))
    env = PlannerEnvironment(retriever, k=2)
    bad_revision = dict(REVISED, nodes=[*REVISED["nodes"][:-1], dict(REVISED["nodes"][-1], inputs=["N9"])])
    cases = {"invalid": [json.dumps(PLAN), json.dumps(bad_revision)],
             "revised": [json.dumps(PLAN), json.dumps(REVISED)], "cut": [json.dumps(PLAN), json.dumps(REVISED)]}
    got = {}
    for name, turns in cases.items():
        budget = len(tok(json.dumps(PLAN))["input_ids"]) + 20 if name == "cut" else 4000
        (ep,), extra = planner_rollouts([rows[0]["prompt"]], lookup, env, scripted(tok, turns), tok,
                                        budget=budget, eos_ids=[tok.eos_token_id])
        got[name] = extra
    assert got["revised"]["plan_source"] == ["revised"] and got["revised"]["plan"][0]["nodes"] == REVISED["nodes"]
    assert _score(got["revised"])[0] > 0
    for name in ("invalid", "cut"):
        assert got[name]["plan_source"] == ["refused"] and got[name]["initial_valid"] == [1.0]
        assert _score(got[name]) == [0.0]
    assert "N9" in got["invalid"]["refused"][0]
    # one-word queries keep the typed-DAG rules (valid in the paper's sense) but not the run's acceptance
    vague = {"nodes": [dict(n, query="earthquakes") if n["type"] == "search" else n for n in PLAN["nodes"]]}
    turns = [json.dumps(vague), json.dumps(vague)]
    (_,), paper = planner_rollouts([rows[0]["prompt"]], lookup, env, scripted(tok, turns), tok, budget=4000,
                                   eos_ids=[tok.eos_token_id])
    assert paper["plan_source"] == ["revised"] and _score(paper)[0] > 0
    (ep,), run = planner_rollouts([rows[0]["prompt"]], lookup, PlannerEnvironment(retriever, k=2, validity="run"),
                                  scripted(tok, turns), tok, budget=4000, eos_ids=[tok.eos_token_id])
    assert run["initial_valid"] == [0.0] and run["plan_source"] == ["refused"] and _score(run) == [0.0]
    assert "content words" in run["plan"][0] and len(ep.calls) == 1


def test_planner_turn2_has_the_same_token_ids_in_run_sft_and_rl(tok, retriever):
    """Issue 15.6: the revision turn renders to the same ids through `deepr run` (recorded turn),
    the SFT example built from that record, and the GRPO rollout."""
    from deepr.agent.dag import execute_searches
    from deepr.evidence.env import Ctx, RunConfig
    from deepr.agent.planner import initial_plan, revise_plan
    from deepr.evidence.trace import Tracer
    from deepr.corpus.tools import ResearchTools
    from deepr.llm.base import run_sync
    from deepr.train.grpo import planner_dataset
    from deepr.train.environments import PlannerEnvironment
    from deepr.train.rollouts import planner_rollouts, prompt_ids
    from deepr.train.sft import to_row
    from deepr.train.trajectories import turn_examples
    from tree_helpers import ScriptedLLM

    pair = _pairs(1)[0]
    llm = ScriptedLLM(lambda m: json.dumps(REVISED) if "Revise the plan" in m[-1]["content"] else json.dumps(PLAN))
    ctx = Ctx(llm, ResearchTools(retriever, k=2), RunConfig(k=2, fetch_limit=4), Tracer(pair.question, "dag"))

    async def plan_phase():  # `deepr run --mode dag`'s planning turns
        results: dict = {}
        g0 = await initial_plan(ctx, pair.question)
        await execute_searches(ctx, g0, results, only=None)
        await revise_plan(ctx, pair.question, g0, results, cycle=1)

    run_sync(plan_phase())
    run_turn = ctx.tracer.turns[1]
    assert run_turn.action == "revise"
    example = turn_examples(ctx.tracer.trajectory("t1", report="r"))[1]
    rows, lookup = planner_dataset([pair])
    (ep,), _ = planner_rollouts([rows[0]["prompt"]], lookup, PlannerEnvironment(retriever, k=2, fetch_limit=4),
                                scripted(tok, [json.dumps(PLAN), json.dumps(REVISED)]), tok, budget=8000,
                                eos_ids=[tok.eos_token_id])
    run_ids = prompt_ids(tok, run_turn.messages)
    sft_ids = prompt_ids(tok, to_row(example, "completion")["prompt"])
    assert run_ids == sft_ids == ep.calls[1].prompt_ids
    assert prompt_ids(tok, ctx.tracer.turns[0].messages) == ep.calls[0].prompt_ids  # turn 1 too


@pytest.fixture(scope="module")
def prepared(retriever) -> list:
    """Prepared records from the extractive planner (the `grpo prepare` path without a model)."""
    from deepr.train.prepare import PrepareConfig, Prepared, prepare_records

    recs = list(prepare_records(_pairs(1), None, retriever, PrepareConfig(k=2, fetch_limit=1)))
    assert all(isinstance(r, Prepared) for r in recs)
    return recs


def test_prepare_fixes_plan_results_pages_and_catalog(prepared):
    from deepr.evidence.plan import validate_plan, waves

    for rec in prepared:
        plan, errors = validate_plan(rec.plan)
        assert plan is not None, errors
        assert rec.waves == waves(plan) and rec.rubrics[0]["id"] == "R1"
        cited = {cid for ids in rec.results.values() for cid in ids}
        assert cited and cited <= set(rec.catalog)
        assert all(rec.catalog[c]["text"] for c in cited)
        assert set(rec.results) == {n.id for n in plan.nodes if n.type == "search"}
    assert any(e["kind"] == "fetch" for rec in prepared for e in rec.catalog.values())


def _wave_reply(wave: list[str], cid: str) -> str:
    return json.dumps({nid: f"Plates move and cause damage [{cid}]." for nid in wave})


def test_answerer_waves_are_separate_calls_under_the_run_prompts(tok, prepared):
    from deepr.agent.answerer import FINAL, WAVE, FinalAsk, WaveAsk, final_inputs, node_evidence
    from deepr.evidence.plan import validate_plan
    from deepr.train.grpo import answerer_dataset
    from deepr.train.environments import AnswererEnvironment
    from deepr.train.rollouts import answerer_rollouts, prompt_ids

    rec = prepared[0].model_dump()
    rows, lookup = answerer_dataset([prepared[0]])
    cid = next(iter(next(iter(rec["results"].values()))))
    replies = [_wave_reply(w, cid) for w in rec["waves"]] + [f"<answer>Plates move [{cid}].</answer>"]
    (ep,), extra = answerer_rollouts([rows[0]["prompt"]], lookup, scripted(tok, replies), tok, budget=20000,
                                     eos_ids=[tok.eos_token_id])
    assert len(ep.calls) == len(rec["waves"]) + 1 and all(len(p) == 2 for p in ep.prompts)
    # each prompt is exactly what the WAVE / FINAL role sends in `deepr run` given the same outputs
    env = AnswererEnvironment(rec)
    plan, outputs = validate_plan(rec["plan"])[0], {}
    by_id = {n.id: n for n in plan.nodes}
    for t, wave in enumerate(rec["waves"]):
        shown = {n: node_evidence(env.ctx, plan, by_id[n], env.results, outputs) for n in wave}
        want = WAVE.messages(WaveAsk(env.ctx, rec["query"], plan, wave, outputs, [],
                                     {n: v[0] for n, v in shown.items()}, {n: v[1] for n, v in shown.items()}))
        assert ep.calls[t].prompt_ids == prompt_ids(tok, want)
        outputs = {**outputs, **json.loads(_wave_reply(wave, cid))}
    ans, ids = final_inputs(env.ctx, plan, outputs, rec.get("dropped") or {})
    assert ep.calls[-1].prompt_ids == prompt_ids(tok, FINAL.messages(FinalAsk(env.ctx, rec["query"], plan, outputs,
                                                                             [], ans, ids)))
    page = next(e for e in rec["catalog"].values() if e["kind"] == "fetch")
    snippet = " ".join(page["text"].split())[:40]
    prompts_text = " ".join(tok.decode(c.prompt_ids) for c in ep.calls)
    replies_text = " ".join(tok.decode(c.completion_ids) for c in ep.calls)
    assert snippet in prompts_text and snippet not in replies_text  # the page is shown, never trained on
    aggs = [n for w in rec["waves"] for n in w]
    assert extra["node_outputs"][0].keys() == set(aggs) and extra["answer"] == [f"Plates move [{cid}]."]


def test_answerer_rollout_stops_at_a_failed_wave(tok, prepared):
    from deepr.train.grpo import answerer_dataset
    from deepr.train.rollouts import answerer_rollouts

    rows, lookup = answerer_dataset([prepared[0]])
    (ep,), extra = answerer_rollouts([rows[0]["prompt"]], lookup, scripted(tok, ["no json here"]), tok,
                                     budget=20000, eos_ids=[tok.eos_token_id])
    assert len(ep.calls) == 1 and not ep.truncated
    assert extra["answer"] == [None] and extra["node_outputs"] == [{}]


# --- both stages end to end on the tiny model --------------------------------------------------


BAD_REVISION = dict(REVISED, nodes=[*REVISED["nodes"][:-1], dict(REVISED["nodes"][-1], inputs=["N9"])])


@pytest.fixture(scope="module")
def planner_run(tiny, tok, retriever, tmp_path_factory):
    """One planner-stage GRPO step on the tiny model, a group of two hand-built episodes: both
    write the same valid G0 (so the environment searches); episode 0 then writes a valid G1,
    episode 1 an invalid one. Captures what TRL feeds the loss."""
    from deepr.train import grpo, stage
    from deepr.train.environments import PlannerEnvironment

    rows, lookup = grpo.planner_dataset(_pairs(1))
    out = tmp_path_factory.mktemp("rl") / "planner"
    cfg = grpo.GrpoConfig(stage="planner", model=str(tiny), out=out, num_generations=2, prompts_per_step=1,
                          mini_batch_prompts=1, max_completion_length=3000, max_steps=1, lora_r=4, lora_alpha=8,
                          k=2, learning_rate=1e-3)
    turns = [[json.dumps(PLAN)], [json.dumps(REVISED), json.dumps(BAD_REVISION)]]
    store: list = []
    built = stage.build_stage_trainer

    def keep(*a, **kw):
        store.append(built(*a, **kw))
        return store[0]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stage, "build_stage_trainer", keep)
        res = grpo.train_grpo(cfg, rows, lookup, env=PlannerEnvironment(retriever, k=2),
                              generate_for=lambda _t: scripted_rows(tok, turns), callbacks=[_capture_masks(store)])
    return res, store[1]


def _live_rows(batch, tok):
    live = [i for i, m in enumerate(batch["completion_mask"]) if int(m.sum()) > 0]
    prompts = [tok.decode(batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]) for i in live]
    replies = [tok.decode(batch["completion_ids"][i][batch["completion_mask"][i].bool()], skip_special_tokens=True)
               for i in live]
    return live, prompts, replies


def test_planner_stage_trains_masks_and_saves_a_loadable_adapter(planner_run, tok):
    from deepr.llm import get_llm

    res, batch = planner_run
    assert res.steps == 1 and res.rewards and res.rewards[0][0] == 1
    # one row per model turn (2 rollouts x 2 turns), each under the prompt it was sampled from
    live, prompts, replies = _live_rows(batch, tok)
    assert len(live) == 4
    first = [i for i, p in enumerate(prompts) if "Write the initial plan" in p]
    assert len(first) == 2 and all(replies[i].startswith(json.dumps(PLAN)) for i in first)
    second = [i for i in range(4) if i not in first]
    assert all("N1-R1" in prompts[i] and "Write the initial plan" not in prompts[i] for i in second)
    # exactly the model's replies are trained on; the search results are prompt
    assert sorted(replies) == sorted(json.dumps(p) for p in (PLAN, PLAN, REVISED, BAD_REVISION))
    log = [json.loads(x) for x in (res.out / "metrics.jsonl").read_text().splitlines()]
    assert {"plan/C_rub", "plan/valid", "rollout/trained_tokens_per_episode", "rollout/initial_plan_valid",
            "rollout/calls_per_episode", "rewards/plan_reward/mean", "rollout/plan_revised"} <= set(log[0])
    assert log[0]["rollout/initial_plan_valid"] == 1.0 and log[0]["rollout/calls_per_episode"] == 2.0
    assert log[0]["rollout/plan_revised"] == 0.5 and log[0]["plan/valid"] == 0.5
    meta = json.loads((res.out / "deepr_meta.json").read_text())
    assert meta["role"] == "planner" and meta["status"] == "done"
    assert meta["rollout_formats"] == "none" and meta["on_policy"] is True
    llm = get_llm(meta["llm_spec"])
    assert llm.config.adapters == {"planner": str(res.out)}
    assert isinstance(llm.chat([{"role": "user", "content": "hi"}], role="planner", max_tokens=4), str)


def test_invalid_revision_scores_zero_and_both_its_calls_take_the_groups_low_advantage(planner_run, tok):
    """Eq. 17: the episode whose G1 is invalid scores 0 though its G0 was valid, and each of its
    turns is trained with that episode's advantage, the lower of the group's two."""
    res, batch = planner_run
    live, prompts, replies = _live_rows(batch, tok)
    adv = [float(batch["advantages"][i]) for i in live]
    bad = [j for j, r in enumerate(replies) if r == json.dumps(BAD_REVISION)]
    good = [j for j, r in enumerate(replies) if r == json.dumps(REVISED)]
    assert len(bad) == 1 and len(good) == 1
    assert adv[bad[0]] < 0 < adv[good[0]] and adv[bad[0]] == min(adv)
    # the G0 call of the bad episode shares its advantage: two rows hold the low value, two the high
    assert sorted(adv) == pytest.approx([adv[bad[0]]] * 2 + [adv[good[0]]] * 2)
    assert res.rewards[0][1] == pytest.approx(json.loads((res.out / "metrics.jsonl").read_text().splitlines()[0])[
        "rewards/plan_reward/mean"])


def test_loss_is_eq16_per_episode_not_per_call(planner_run):
    """Eq. 16 over episodes: each trained token weighs 1/|o_e| (its episode's model tokens over both
    calls), fillers weigh 0, and the mean's denominator is the number of episodes, not of rows."""
    _, batch = planner_run
    mask, weights = batch["completion_mask"].float(), batch["tool_mask"]
    live = [i for i in range(len(mask)) if mask[i].sum() > 0]
    assert float(batch["num_items_in_batch"]) == 2.0
    assert all(float((weights[i] * mask[i]).sum()) == 0.0 for i in range(len(mask)) if i not in live)
    per_row = [float((weights[i] * mask[i]).sum()) for i in live]
    assert sum(per_row) == pytest.approx(2.0, abs=1e-5)  # each episode's weights sum to one
    tokens = [int(mask[i].sum()) for i in live]
    adv = [round(float(batch["advantages"][i]), 5) for i in live]  # the two episodes' advantages differ
    assert len(set(adv)) == 2
    for a in range(len(live)):  # rows of one episode share 1/(its total tokens over both calls)
        episode_tokens = sum(tokens[b] for b in range(len(live)) if adv[b] == adv[a])
        assert float(weights[live[a]][0]) == pytest.approx(1.0 / episode_tokens, rel=1e-5)


def test_answerer_stage_merges_planner_and_saves_answerer_adapter(tiny, prepared, planner_run, tmp_path):
    from deepr.llm import get_llm
    from deepr.train import grpo

    planner = planner_run[0].out
    rows, lookup = grpo.answerer_dataset(prepared[:1])
    cfg = grpo.GrpoConfig(stage="answerer", model=str(tiny), out=tmp_path / "answerer", planner_adapter=planner,
                          num_generations=2, prompts_per_step=1, mini_batch_prompts=1, max_completion_length=24,
                          max_steps=1, lora_r=4, lora_alpha=8)
    res = grpo.train_grpo(cfg, rows, lookup)
    assert res.steps == 1 and res.rewards and 0.0 <= res.rewards[0][1] <= 1.0
    meta = json.loads((tmp_path / "answerer" / "deepr_meta.json").read_text())
    assert meta["role"] == "answerer" and meta["base_model"] == str(tmp_path / "answerer" / "base")
    llm = get_llm(meta["llm_spec"])
    assert set(llm.config.adapters) == {"answerer"}
    assert isinstance(llm.chat([{"role": "user", "content": "hi"}], role="answerer", max_tokens=4), str)
    with pytest.raises(ValueError, match="--resume"):
        grpo.train_grpo(cfg, rows, lookup)


def test_cli_rejects_missing_flags_and_bad_config(tmp_path):
    from typer.testing import CliRunner

    from deepr.cli import app

    r = CliRunner().invoke(app, ["grpo", "--stage", "planner"])
    assert r.exit_code == 2 and "missing --model" in r.output
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    r = CliRunner().invoke(app, ["grpo", "--config", str(bad), "--stage", "planner", "--model", "m",
                                 "--data", "d.jsonl", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "line 1" in r.output


def test_cli_prepare_writes_resumable_records(mini_corpus, tmp_path):
    from typer.testing import CliRunner

    from deepr.cli import app
    from deepr.io import read_jsonl
    from deepr.train.prepare import Prepared

    data = tmp_path / "verified.jsonl"
    data.write_text("".join(p.model_dump_json() + "\n" for p in _pairs(1)))
    out = tmp_path / "prepared.jsonl"
    args = ["grpo", "prepare", "--planner", "extractive", "--data", str(data), "--out", str(out),
            "--corpus", str(mini_corpus), "--retriever", "bm25", "--k", "2"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    (rec,) = read_jsonl(out, Prepared)
    assert rec.id == "q0" and rec.planner == "extractive/extractive" and rec.waves
    assert json.loads(Path(str(out) + ".meta.json").read_text())["counts"]["prepared"] == 1
    r = CliRunner().invoke(app, args)  # a re-run skips finished ids
    assert r.exit_code == 0 and len(out.read_text().splitlines()) == 1
    r = CliRunner().invoke(app, [*args[:3], str(tmp_path / "nope"), *args[4:]])
    assert r.exit_code == 2 and "nope" in r.output


def _sampling_trainer(tiny, tok, *, max_new: int, n: int):
    """What the rollout sampler reads of a GRPOTrainer, around the tiny model: sampling at
    temperature 1, ``n`` generations per prompt."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(tiny))
    config = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
    return SimpleNamespace(model_wrapped=model, accelerator=Accelerator(cpu=True), processing_class=tok,
                           args=SimpleNamespace(gradient_checkpointing_kwargs=None), use_vllm=False,
                           generation_config=config, eos_token_ids=[tok.eos_token_id], num_generations=n)


def test_constrained_rollouts_sample_under_the_runs_decoding_format(tiny, tok):
    """GRPO rollouts decode under the same format `deepr run` applies: even the random tiny model's
    replies are then JSON of the requested shape, one group of `num_generations` per prompt."""
    pytest.importorskip("xgrammar")
    from deepr.llm.base import OutputFormat
    from deepr.profiles.small.rollouts import constrained_generate, planner_format
    from deepr.train.rollouts import prompt_ids

    trainer = _sampling_trainer(tiny, tok, max_new=40, n=2)
    shape = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"],
             "additionalProperties": False}
    gen = constrained_generate(trainer, lambda turn: OutputFormat("x", json_schema=shape) if turn == 0 else None)
    seqs = [prompt_ids(tok, [{"role": "user", "content": q}]) for q in ("plates?", "volcanoes and ash?")]
    replies, logprobs = gen(seqs, True, 40)
    assert len(replies) == 4 and logprobs is None
    for ids in replies:
        assert ids[-1] == tok.eos_token_id
        # strict=False: this test tokenizer decodes some tokens to raw control characters
        assert set(json.loads(tok.decode(ids, skip_special_tokens=True), strict=False)) == {"q"}
    # the planner's formats are deepr run's schema formats: the plan shape, then the revision shape,
    # each string naming a word once (as the hf backend decodes them)
    assert planner_format(0).json_schema["properties"].keys() == {"nodes"}
    assert "fetch" in planner_format(1).json_schema["properties"]
    assert planner_format(0).distinct_words and planner_format(1).distinct_words
    # (what the ban does is checked on SmolLM2 in test_smollm2.py: this tokenizer spells words letter
    # by letter, past any ban on word-initial tokens)
    gen = constrained_generate(trainer, lambda turn: OutputFormat("x", json_schema=shape, distinct_words=True))
    assert all(set(json.loads(tok.decode(ids, skip_special_tokens=True), strict=False)) == {"q"}
               for ids in gen(seqs, True, 40)[0])
    assert trainer._deepr_word_ban.tokenizer is tok


def test_constrained_planner_rollouts_are_valid_plans_even_from_a_random_model(tiny, tok):
    """The planner's rollouts decode under the graph schema and its guard, as `deepr run` does, so
    even the random tiny model's finished plans pass the plan validator (and earn R_plan)."""
    pytest.importorskip("xgrammar")
    from deepr.evidence.plan import validate_plan
    from deepr.profiles.plan_guard import PlanGuard
    from deepr.profiles.small.rollouts import constrained_generate, planner_format
    from deepr.train.rollouts import prompt_ids

    assert isinstance(planner_format(0).guard, PlanGuard) and isinstance(planner_format(1).guard, PlanGuard)
    trainer = _sampling_trainer(tiny, tok, max_new=900, n=3)
    gen = constrained_generate(trainer, planner_format)
    seqs = [prompt_ids(tok, [{"role": "user", "content": q}]) for q in ("plates?", "volcanoes and ash?")]
    finished = [ids for ids in gen(seqs, True, 900)[0] if ids[-1] == tok.eos_token_id]
    assert len(finished) >= 3
    for ids in finished:
        # strict=False: this test tokenizer decodes some tokens to raw control characters
        value = json.loads(tok.decode(ids[:-1]), strict=False)
        assert validate_plan(value)[0] is not None, (validate_plan(value)[1], value)
