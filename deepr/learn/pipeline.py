"""Does deepr make a real model better? SFT then GRPO on SmolLM2-135M-Instruct, measured on
held-out questions whose topics training never saw, through the real CLI at every step.

Pipeline (every step a ``deepr`` command; every output under ``--work``; re-running resumes):
  data     build-trees (wiki) → synthesize-rubrics → verify (extractive teacher, offline) → split
           train / held-out by topic (corpus category), recorded in ``split.json``
  teacher  deepr run --mode dag on the train questions (extractive) --record → prune-trajectories;
           the same on the held-out questions, recorded for the answer probe only
  base     deepr run --llm smollm2 on the held-out questions (greedy) + deepr eval
  per seed deepr sft --role all (LoRA; plans and final answers) → deepr export (merge) → evaluate;
           deepr grpo --stage planner from the merged SFT model → evaluate (--llm hf:<adapter>)
  report   mean and 95 % bootstrap interval per stage and metric, paired differences, figures

Outputs, in ``--results``: ``learning.json`` (summary), ``learning_runs.json`` (every held-out
run's metrics per stage and seed), ``learning.md`` (the table); in ``--img``: ``learning_grpo.png``
and ``learning_stages.png``. Example (the default does not yet fit 60 minutes on 2 CPU cores: see docs/learning.md):

    make learn
    make learn LEARN_ARGS="--trees 120 --heldout 40 --grpo-steps 60 --seeds 0,1,2,3,4 --use-vllm"
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from deepr.learn.config import (Budget, LearnConfig, deepr, done, mark, parse_args, read_jsonl, repeat_counts,
                                write_atomic, write_jsonl)
from deepr.learn.stats import STAGES, split_by_topic


# --- stages -------------------------------------------------------------------------------------


def build_data(cfg: LearnConfig, log: Path) -> tuple[Path, Path]:
    """Trees → pairs → verified pairs, split by topic. Re-run on a finished --work with another
    --heldout, only the split is redone: the held-out set grows or shrinks (its first questions
    stay the same) while training must not change, so trained models are reused and each
    evaluation runs only the questions it has not run yet."""
    w = cfg.work
    train, held = w / "train.jsonl", w / "heldout.jsonl"
    if not done(w / "data"):
        deepr(["build-trees", "--corpus", cfg.corpus, "--n-trees", str(cfg.trees), "--seed", "0", "--max-depth", "2",
               "--out", str(w / "trees.jsonl")], log, threads=cfg.threads)
        deepr(["synthesize-rubrics", str(w / "trees.jsonl"), "--out", str(w / "pairs.jsonl")], log, threads=cfg.threads)
        deepr(["verify", str(w / "pairs.jsonl"), "--out", str(w / "verified.jsonl")], log, threads=cfg.threads)
    pairs, trees = read_jsonl(w / "verified.jsonl"), read_jsonl(w / "trees.jsonl")
    tr, ho, record = split_by_topic(pairs, trees, heldout_topics=cfg.heldout_topics, seed=0,
                                    max_heldout=cfg.heldout, max_train=cfg.max_train)
    if not tr or not ho:
        raise RuntimeError(f"the split left {len(tr)} train and {len(ho)} held-out questions; raise --trees")
    if done(w / "data"):
        if [r["id"] for r in read_jsonl(train)] != [p["id"] for p in tr]:
            raise RuntimeError(f"{w}: these flags change the training questions (only --heldout may change "
                               "on a finished --work); give a new --work")
        if [r["id"] for r in read_jsonl(held)] == [p["id"] for p in ho]:
            return train, held
        print(f"held-out set: {len(read_jsonl(held))} -> {len(ho)} questions (--heldout {cfg.heldout})", flush=True)
    write_jsonl(train, tr)
    write_jsonl(held, ho)
    write_atomic(w / "split.json", record)
    mark(w / "data", train=len(tr), heldout=len(ho))
    return train, held


def teacher_sft_data(cfg: LearnConfig, train: Path, log: Path) -> Path:
    """Teacher (extractive) trajectories on the train questions, pruned into SFT examples."""
    w = cfg.work
    out = w / "sft-data"
    want = repeat_counts(cfg)
    if not done(out):
        deepr(["run", "--queries", str(train), "--mode", "dag", "--corpus", cfg.corpus, "--top-k", str(cfg.top_k),
               "--out", str(w / "runs-teacher"),
               "--record", str(w / "trajectories.jsonl")], log, threads=cfg.threads)
        deepr(["prune-trajectories", str(w / "trajectories.jsonl"), "--rubrics", str(train), "--out-dir", str(out),
               "--heldout", "0", "--target-ratios", "none"], log, threads=cfg.threads)
        mark(out, **compact_sft(out / "sft.jsonl", out / "sft-compact.jsonl", actions=tuple(cfg.sft_actions.split(",")),
                                graph=cfg.sft_graph, form=cfg.profile, repeat=want))
    # a marker without "repeat" was written before the flag: each turn once
    made = json.loads((out / ".done").read_text(encoding="utf-8")).get("repeat") or dict.fromkeys(want, 1)
    if made != want:
        def flag(counts: dict[str, int]) -> str:
            return ",".join(f"{a}={n}" for a, n in counts.items())

        raise RuntimeError(f"{out} holds SFT data of {flag(made)}, not {flag(want)} (--sft-actions, "
                           "--sft-repeat); give a new --work")
    return out / "sft-compact.jsonl"


def teacher_heldout(cfg: LearnConfig, held: Path, log: Path) -> Path:
    """The teacher's runs on the held-out questions, recorded: the final-answer prompts that
    the answer probe (deepr.learn.answers) replays to every model. Never training data."""
    w = cfg.work
    runs, traj = w / "runs-teacher-heldout", w / "trajectories-heldout.jsonl"
    ids = [r["id"] for r in read_jsonl(held)]
    if not done(runs) or json.loads((runs / ".done").read_text(encoding="utf-8")).get("ids") != ids:
        # a grown held-out set: `deepr run` skips the questions it has run and records only the new ones
        deepr(["run", "--queries", str(held), "--mode", "dag", "--corpus", cfg.corpus, "--top-k", str(cfg.top_k),
               "--out", str(runs), "--record", str(traj)], log, threads=cfg.threads)
        mark(runs, ids=ids)
    return traj


_DANGLING = frozenset("the a an of in on and or to for is are was were be by with as at from that this its "
                      "which who their do does how what why".split())


def _words(text: Any, n: int) -> str:
    """The first ``n`` words, without the function words and commas a cut leaves at the end
    ("What roles do Liguria, Giacomo Casanova and" → "… Giacomo Casanova")."""
    words = str(text or "").replace("\u2026", " ").split()[:n]
    while len(words) > 2 and (words[-1].lower().strip(",;:") in _DANGLING):
        words.pop()
    return " ".join(words).rstrip(",;:")


def flatten(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One level of aggregates: aggregates that read another aggregate go, and ids are renumbered
    N1, N2, ... in order (inputs follow). Every plan then has the same two-layer shape (searches,
    aggregates over searches, the answer over the aggregates); SmolLM2 after 48 SFT steps on the
    teacher's graphs still wrote answers that skipped a second-level aggregate."""
    kinds = {n.get("id"): n.get("type") for n in nodes}
    kept = [n for n in nodes if not (n.get("type") == "aggregate"
                                     and any(kinds.get(i) == "aggregate" for i in n.get("inputs") or []))]
    return renumbered(kept)


def renumbered(nodes: list[dict[str, Any]], *, sort_inputs: bool = False) -> list[dict[str, Any]]:
    """``nodes`` in the order given, with ids N1, N2, ... and their inputs renamed to match (an
    input that is not among ``nodes`` is dropped); ``sort_inputs`` lists each node's inputs ascending."""
    new = {n.get("id"): f"N{k}" for k, n in enumerate(nodes, 1)}
    out = []
    for n in nodes:
        m = dict(n, id=new[n.get("id")])
        if "inputs" in n:
            m["inputs"] = [new[i] for i in n["inputs"] if i in new]
            if sort_inputs:
                m["inputs"].sort(key=lambda i: int(i[1:]))
        out.append(m)
    return out


def ordered(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same graph with ids in reading order: searches numbered by the aggregate that first reads
    them, then the aggregates, then the answer; each node's inputs ascending. "Every search feeds an
    aggregate" then looks local (each aggregate reads the next unread searches) where the teacher's
    numbering ("N1, N3", "N2, N5", "N1, N4") made it a rule over the whole plan, which SmolLM2 broke
    ("plan is not connected") after SFT."""
    kinds = {n.get("id"): n.get("type") for n in nodes}
    readers = [n for n in nodes if n.get("type") == "aggregate"]
    first: list[Any] = []
    for n in readers:
        first += [i for i in n.get("inputs") or [] if kinds.get(i) == "search" and i not in first]
    searches = first + [n.get("id") for n in nodes if n.get("type") == "search" and n.get("id") not in first]
    order = searches + [n.get("id") for n in readers] + [n.get("id") for n in nodes if n.get("type") == "answer"]
    by_id = {n.get("id"): n for n in nodes}
    return renumbered([by_id[i] for i in order], sort_inputs=True)


def compact_plan(reply: str, *, query_words: int = 7, graph: str = "teacher", form: str = "small") -> str | None:
    """The teacher's plan in the form the planner's decoding schema (``--formats schema``) admits:
    queries and needs cut to a few words, the optional key points and the search nodes' empty
    inputs dropped, the answer reading every aggregate (ids, types, the other inputs and fetch
    lists untouched; ``graph="flat"``/``"ordered"``: :func:`flatten`/:func:`ordered`); None when the reply is not a plan.
    ``form`` is the profile whose decoding schema the reply must follow: ``small`` (each node type its
    own fields) or ``default`` (every node with all six fields of ``PlanShape``, in its order, null or
    empty where the type has none: a model decoded under that schema writes exactly this). The
    extractive teacher copies whole evidence sentences into key points (~600 tokens a plan): a 135M
    model on CPU writes a plan of that length in minutes, so it learns the same graphs in short form."""
    try:
        value = json.loads(reply)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("nodes"), list):
        return None
    for node in value["nodes"]:
        if not isinstance(node, dict):
            return None
        if node.get("query"):
            node["query"] = _words(node["query"], query_words)
        if node.get("need"):
            node["need"] = _words(node["need"], query_words + 2)
        node.pop("key_points", None)  # optional; the teacher fills them with copied evidence sentences
        if node.get("type") == "search":
            # The decoding schema has no inputs on a search node: trained on `"inputs": []` there,
            # SmolLM2 was forced into `"key_points": [` instead, off its data, and lost the graph.
            node.pop("inputs", None)
    if graph == "flat" and not value.get("fetch"):  # a fetch list names result ids: renumbering would break it
        value["nodes"] = flatten(value["nodes"])
    aggregates = [n.get("id") for n in value["nodes"] if n.get("type") == "aggregate"]
    for node in value["nodes"]:
        if node.get("type") == "answer" and aggregates:
            # The teacher's answer reads only the aggregates no other aggregate reads: a rule over
            # the whole graph, which SFT'd SmolLM2 broke in most held-out plans ("aggregate N6 does
            # not lead to the answer node"). Reading every aggregate is one local rule, same graph.
            node["inputs"] = aggregates
    if graph == "ordered" and not value.get("fetch"):
        ids = {n.get("id") for n in value["nodes"]}
        if all(i in ids for n in value["nodes"] for i in n.get("inputs") or []):  # a dangling input has no new id
            value["nodes"] = ordered(value["nodes"])
    if form == "default":
        value = {"nodes": [default_node(n) for n in value["nodes"]],
                 **({"fetch": value["fetch"]} if "fetch" in value else {})}
    return json.dumps(value, ensure_ascii=False)


def default_node(node: dict[str, Any]) -> dict[str, Any]:
    """A node in the default planner schema's form: its six fields in order (pydantic's field order
    is the schema's, which the grammar engines decode in), null or empty where the type has none."""
    search = node.get("type") == "search"
    return {"id": node.get("id"), "type": node.get("type"), "query": node.get("query") if search else None,
            "need": None if search else node.get("need"), "key_points": [],
            "inputs": [] if search else list(node.get("inputs") or [])}


_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def compact_answer(reply: str, *, words: int = 90) -> str | None:
    """The teacher's final answer cut to whole sentences within ``words`` words, each kept sentence
    with its own citations, still in its ``<answer>`` tags; None when no cited sentence fits. The
    extractive writer copies evidence paragraphs (~600 tokens): more than the model's answer budget,
    so it would learn answers it is always cut off in."""
    m = re.search(r"<answer>(.*?)</answer>", reply, re.DOTALL)
    if not m:
        return None
    kept: list[str] = []
    for sentence in _SENTENCE.split(" ".join(m.group(1).split())):
        if sum(len(x.split()) for x in kept) + len(sentence.split()) > words:
            break
        kept.append(sentence)
    from deepr.evidence.citations import cited_ids

    if not any(cited_ids(x) for x in kept):
        return None
    return "<answer>" + " ".join(kept) + "</answer>"


_TAUGHT = {("planner", "plan"), ("planner", "revise"), ("answerer", "final")}


def compact_sft(src: Path, dest: Path, *, actions: tuple[str, ...] = ("plan",), graph: str = "teacher",
                form: str = "small", repeat: dict[str, int] | None = None) -> dict[str, Any]:
    """The examples of ``src`` whose action is in ``actions`` (planner ``plan``/``revise``,
    answerer ``final``), with compact replies (:func:`compact_plan` in the ``form`` of the profile
    the model is evaluated under, :func:`compact_answer`) → ``dest``, each ``repeat[action]`` times
    (the trainer shuffles them). A revision turn carries the
    search results (~2,500 prompt tokens against ~500), so it costs five plan turns of CPU training,
    and the model writes a revision in the same JSON form it learns from the plans: off by default."""
    from deepr.agent.planner import INITIAL, PlanAsk
    from deepr.roles import judge_reply

    kept, counts = [], {"planner_examples": 0, "answer_examples": 0, "not_a_plan": 0, "refused_by_the_run": 0,
                        "answer_without_citation": 0}
    for ex in read_jsonl(src):
        if ex.get("action") not in actions or (ex.get("role"), ex.get("action")) not in _TAUGHT:
            continue
        if ex["role"] == "answerer":
            short = compact_answer(ex["messages"][-1]["content"])
            counts["answer_without_citation" if short is None else "answer_examples"] += 1
        else:
            short = compact_plan(ex["messages"][-1]["content"], graph=graph, form=form)
            if short is None:
                counts["not_a_plan"] += 1
            # Teach only plans `deepr run` accepts: the cut can leave a query of one content word.
            elif ex["action"] == "plan" and judge_reply(INITIAL, PlanAsk(None, ""), short, ex["messages"][:-1])[0] is None:
                counts["refused_by_the_run"] += 1
                short = None
            else:
                counts["planner_examples"] += 1
        if short is not None:
            ex["messages"][-1] = {**ex["messages"][-1], "content": short}
            kept.extend([ex] * (repeat or {}).get(ex["action"], 1))
    write_jsonl(dest, kept)
    return {**counts, "rows": len(kept), **({"repeat": repeat} if repeat else {})}


def base_model(cfg: LearnConfig) -> str:
    """Folder of the base checkpoint (smollm2 is converted once into deepr's cache)."""
    if cfg.llm == "smollm2":
        from deepr.llm.smollm2 import smollm2_dir

        return str(smollm2_dir())
    if cfg.llm.startswith("hf:"):
        return cfg.llm[3:]
    raise ValueError(f"--llm {cfg.llm!r}: the experiment trains a local model; give smollm2 or hf:<folder>")


def evaluate(cfg: LearnConfig, spec: str, name: str, held: Path, seed: int, log: Path) -> Path:
    """`deepr run` on the held-out questions with ``spec`` (greedy), then `deepr eval`; returns the
    scores file. The same command for every stage: only --llm differs."""
    runs, scores = cfg.work / "runs" / name, cfg.work / "scores" / f"{name}.jsonl"
    ids = [r["id"] for r in read_jsonl(held)]
    if done(runs) and set(ids) <= _evaluated(runs):
        return scores
    deepr(["run", "--queries", str(held), "--mode", "dag", "--corpus", cfg.corpus, "--top-k", str(cfg.top_k), "--llm", spec, "--out", str(runs), "--no-cache",
           "--temperature", "0", "--seed", str(seed), "--max-tokens", str(cfg.eval_max_tokens), "--timeout", "900",
           "--max-reasks", "0", "--profile", cfg.profile, "--formats", cfg.formats, "--parallel", str(cfg.eval_parallel), "--allow-fallback"],
          log, threads=cfg.threads)
    scores.parent.mkdir(parents=True, exist_ok=True)
    deepr(["eval", str(runs), "--metric", "plan_reward,rubric,citation", "--rubrics", str(held), "--out",
           str(scores), "--allow-fallback"], log, threads=cfg.threads)
    mark(runs, spec=spec, ids=ids)
    return scores


def _evaluated(runs: Path) -> set[str]:
    """The held-out ids a finished evaluation covered (markers from before --heldout could grow
    list none: then the run's index and rejects say which questions ran)."""
    info = json.loads((runs / ".done").read_text(encoding="utf-8"))
    if "ids" in info:
        return set(info["ids"])
    return {r["id"] for r in read_jsonl(runs / "reports.jsonl")} | {
        r["id"] for r in read_jsonl(runs / "reports.rejects.jsonl")}


def train_sft(cfg: LearnConfig, base: str, sft_data: Path, seed: int, log: Path) -> Path:
    """SFT (LoRA, planner turns), then merge it into the base; returns the merged folder."""
    w = cfg.work / f"seed{seed}"
    sft, merged = w / "sft", w / "sft-merged"
    if not done(sft):
        deepr(["sft", "--model", base, "--data", str(sft_data), "--role", "all", "--out", str(sft),
               "--lora-r", str(cfg.lora_r), "--lora-alpha", str(2 * cfg.lora_r), "--lr", str(cfg.sft_lr),
               "--max-steps", str(cfg.sft_steps), "--grad-accum", "1", "--batch-size", str(cfg.sft_batch), "--max-length", "4096",
               "--logging-steps", "1", "--seed", str(seed), "--report-to", cfg.report_to, "--resume",
               "--gradient-checkpointing" if cfg.sft_checkpointing else "--no-gradient-checkpointing",
               "--bf16" if cfg.sft_bf16 else "--no-bf16"],
              log, threads=cfg.threads)
        mark(sft)
    if not done(merged):
        if merged.exists():  # a merge cut short: export wants an empty folder
            import shutil

            shutil.rmtree(merged)
        deepr(["export", str(sft), "--out", str(merged)], log, threads=cfg.threads)
        mark(merged)
    return merged


def train_grpo(cfg: LearnConfig, merged: Path, train: Path, seed: int, log: Path) -> Path:
    """GRPO planner from the merged SFT model; returns its adapter folder."""
    w = cfg.work / f"seed{seed}"
    grpo = w / "grpo"
    if not done(grpo):
        conf = {"seed": seed, "lora_r": cfg.lora_r, "lora_alpha": 2 * cfg.lora_r, "learning_rate": cfg.grpo_lr,
                "temperature": 0.8, "max_turn_tokens": cfg.eval_max_tokens, "zero_advantage": "warn", "save_steps": 1, "report_to": cfg.report_to,
                "use_vllm": cfg.use_vllm, "train_turns": cfg.grpo_train_turns or None,
                "dynamic_sampling": cfg.grpo_dynamic_sampling,
                "bf16": True if cfg.grpo_bf16 else None}  # None: bf16 where the GPU has it
        write_atomic(w / "grpo.json", conf)
        deepr(["grpo", "--stage", "planner", "--model", str(merged), "--data", str(train), "--out", str(grpo),
               "--config", str(w / "grpo.json"), "--corpus", cfg.corpus, "--k", str(cfg.top_k), "--max-steps", str(cfg.grpo_steps),
               "--num-generations", str(cfg.num_generations), "--prompts-per-step", str(cfg.prompts_per_step),
               "--max-completion-length", str(cfg.rollout_tokens), "--resume",
               *(["--rollout-formats", "schema"] if cfg.profile == "small" else [])], log, threads=cfg.threads, ok=(0,))
        mark(grpo)
    return grpo


# --- the experiment -----------------------------------------------------------------------------


def seed_pipeline(cfg: LearnConfig, base: str, sft_data: Path, train: Path, held: Path, seed: int,
                  held_ids: list[str]) -> dict[str, Any]:
    """One seed: SFT → merge → evaluate; GRPO → evaluate. Returns {stage: per-question metrics}.
    SFT is evaluated before GRPO starts, so a run cut short still has the SFT numbers."""
    from deepr.learn.report import collect

    log = cfg.work / f"learning-seed{seed}.log"
    merged = train_sft(cfg, base, sft_data, seed, log)
    evaluate(cfg, f"hf:{merged}", f"sft-s{seed}", held, seed, log)
    grpo = train_grpo(cfg, merged, train, seed, log)
    evaluate(cfg, f"hf:{grpo}", f"grpo-s{seed}", held, seed, log)
    return {"sft": collect(cfg, f"sft-s{seed}", held_ids), "grpo": collect(cfg, f"grpo-s{seed}", held_ids)}


def experiment(cfg: LearnConfig) -> dict[str, Any]:
    """Data and teacher first; then the base evaluation and the seeds, ``--jobs`` at a time
    (each job one process with ``--threads`` torch threads); a report after each finishes."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    from deepr.learn.report import collect, report

    budget, log = Budget(cfg.minutes), cfg.work / "learning.log"
    cfg.work.mkdir(parents=True, exist_ok=True)
    print(f"deepr learning experiment in {cfg.work} (logs: {cfg.work}/learning*.log); budget {cfg.minutes:g} min",
          flush=True)
    train, held = build_data(cfg, log)
    held_ids = [r["id"] for r in read_jsonl(held)]
    sft_data = teacher_sft_data(cfg, train, log)
    teacher_heldout(cfg, held, log)
    base = base_model(cfg)
    per_run: dict[str, dict[int, Any]] = {s: {} for s in STAGES}
    skipped: list[int] = []
    with ThreadPoolExecutor(max_workers=cfg.jobs) as pool:
        futures = {pool.submit(evaluate, cfg, f"hf:{base}", "base", held, 0, cfg.work / "learning-base.log"): "base"}
        queue = list(cfg.seeds)
        while futures or queue:  # with --jobs 1 the seeds wait until the base evaluation is done
            while queue and len(futures) < cfg.jobs:
                seed = queue.pop(0)
                if budget.left() <= 0:
                    skipped.append(seed)
                    continue
                futures[pool.submit(seed_pipeline, cfg, base, sft_data, train, held, seed, held_ids)] = seed
            if not futures:
                break
            finished, _ = wait(futures, return_when=FIRST_COMPLETED)
            for fut in finished:
                what = futures.pop(fut)
                result = fut.result()  # a failed command stops the experiment with its log named
                if what == "base":
                    rows = collect(cfg, "base", held_ids)
                    per_run["base"] = {s: rows for s in cfg.seeds}
                else:
                    per_run["sft"][what], per_run["grpo"][what] = result["sft"], result["grpo"]
                if per_run["base"]:
                    report(cfg, per_run, held_ids, budget, f"running: seeds done {sorted(per_run['grpo'])}")
    status = "complete" if not skipped else (f"partial: the {cfg.minutes:g}-minute budget ran out before seeds "
                                             f"{skipped} started")
    return report(cfg, per_run, held_ids, budget, status)


def main(argv: list[str] | None = None, results: Path | None = None, img: Path | None = None) -> int:
    from deepr.learn.report import rescore

    cfg = parse_args(argv, results=results, img=img)
    try:
        res = rescore(cfg) if cfg.report_only else experiment(cfg)
    except (RuntimeError, ValueError) as e:
        print(f"learning: {e}", file=sys.stderr)
        return 1
    r = res["differences"].get("grpo_minus_base", {}).get("r_plan")
    wall = f"{res['wall_seconds'] / 60:.1f} min" if res["wall_seconds"] is not None else "rescored"
    print(f"{res['status']}; {wall}; R_plan SFT+GRPO − base: {r}", flush=True)
    return 0

