"""Model-written final answers in minutes. Each model writes the answer node of every held-out
question from the prompt the extractive teacher's run built for it (the plan, the branch findings,
the cited evidence). The turn is performed by `deepr run`'s executor (:func:`deepr.roles.perform`
with the ``FINAL`` role): the answer tags, the free-text checks, citations only of the evidence
shown and at least one, ``--reasks`` re-asks (default 0, as `make learn` evaluates), no fallback.
An accepted answer gets the rubric score of the answer text alone (extractive judge), next to the
teacher's answer to the same prompt (what `deepr run` puts in a refused answer's place) and that
answer cut to what the SFT data teaches (deepr.learn.pipeline.compact_answer).

Only the final turn runs, minutes a model where a whole `deepr run` + `deepr eval` of the same
questions takes over an hour on 2 cores. `make learn` records the prompts
(learn-work/trajectories-heldout.jsonl); by hand:

    deepr run --queries learn-work/heldout.jsonl --mode dag --top-k 3 --out learn-work/runs-teacher-heldout \
        --record learn-work/trajectories-heldout.jsonl
    python -m deepr.learn answers hf:learn-work/seed0/sft-merged --label "SFT seed 0" \
        --trajectories learn-work/trajectories-heldout.jsonl --rubrics learn-work/heldout.jsonl
    python -m deepr.learn answers --pool "SFT seed 0" --pool "SFT seed 1" --pool "SFT seed 2"

Writes answer_probe.json in the results folder (``--out``; earlier labels are kept): per model, the share
of accepted answers with a 95 % bootstrap interval (and an exact binomial one, which still says
something when every answer was accepted), the rubric means, each refusal's reason and the start
of the refused reply; ``--pool`` adds seeds of one setting pooled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

OUTPUT = "answer_probe.json"

_EVIDENCE_HEAD = "Cited evidence collected so far:"
_ENTRY = re.compile(r"^\[([A-Za-z0-9][\w.-]*)\]", re.M)


def final_turns(path: Path, rubrics: dict[str, list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """The accepted final-answer turn of each recorded run: its prompt, the ids it may cite (the
    evidence entries of its prompt), the teacher's answer and the question's rubric (recorded with
    the run, else ``rubrics[id]``). A run without such a turn, or without a rubric, is an error:
    the probe would otherwise score fewer questions than it names."""
    from deepr.io import read_records
    from deepr.records import Trajectory

    out = []
    for n, traj in enumerate(read_records(path, Trajectory), 1):
        turn = next((t for t in traj.turns if (t.role, t.action) == ("answerer", "final") and t.ok), None)
        if turn is None:
            raise ValueError(f"{path}: record {n} ({traj.query[:60]!r}) has no accepted final-answer turn")
        user = turn.messages[-1]["content"]
        if _EVIDENCE_HEAD not in user:
            raise ValueError(f"{path}: record {n}: the final turn's prompt has no '{_EVIDENCE_HEAD}' block")
        ids = _ENTRY.findall(user.split(_EVIDENCE_HEAD, 1)[1])
        rubric = [r.model_dump() for r in traj.rubrics] or (rubrics or {}).get(traj.id)
        if not rubric:
            raise ValueError(f"{path}: record {n} (id {traj.id}) has no rubric; give --rubrics with its question")
        out.append({"id": traj.id, "query": traj.query, "rubrics": rubric,
                    "messages": turn.messages, "ids": ids, "teacher": turn.completion})
    return out


def replay_ask(turn: dict[str, Any]) -> Any:
    """The final turn's input as the executor sees it: the recorded prompt, and what the FINAL
    role's check reads, a catalog holding exactly the evidence ids that prompt showed (the ids the
    run lets the answer cite)."""
    from types import SimpleNamespace

    from deepr.evidence.citations import Catalog, Entry

    catalog = Catalog()
    for cid in turn["ids"]:
        catalog.entries[cid] = Entry(cid, "search", cid.split("-")[0], cid, cid, "", "")
    return SimpleNamespace(ctx=SimpleNamespace(catalog=catalog), ids=turn["ids"], messages=turn["messages"])


def judge(turn: dict[str, Any], reply: str) -> tuple[Any, str | None]:
    """``(answer, None)`` when `deepr run` would accept ``reply`` to ``turn``'s prompt, else ``(None, why)``."""
    from deepr.agent.answerer import FINAL
    from deepr.roles import judge_reply

    return judge_reply(FINAL, replay_ask(turn), reply, turn["messages"])


async def write_answers(spec: str, turns: list[dict[str, Any]], max_tokens: int, base_url: str | None = None,
                        *, reasks: int = 0, profile: str = "default",
                        formats: str = "schema,answerer=strict") -> list[dict[str, Any]]:
    """One final answer per recorded prompt, performed by `deepr run`'s executor (the role's format
    under ``profile`` and ``formats`` as `deepr run --formats` takes them, its checks, up to ``reasks``
    re-asks with the refusal's reason), greedy;
    no fallback, so a refused answer stays refused."""
    from dataclasses import replace

    from deepr.agent.answerer import FINAL
    from deepr.llm import get_llm
    from deepr.llm.base import GenDefaults
    from deepr.profiles import get_profile
    from deepr.roles import Recorder, perform

    llm = get_llm(spec, base_url=base_url, cache=False,
                  gen=GenDefaults(max_tokens=max_tokens, temperature=0.0, top_p=None, seed=0))
    policy = get_profile(profile, spec=spec, formats=formats)
    replay = replace(FINAL, messages=lambda a: a.messages, fallback=None)
    rows = []
    for t in turns:
        out = await perform(replay, replay_ask(t), llm=llm, rec=Recorder(), max_reasks=reasks, temperature=0.0,
                            max_tokens=max_tokens, profile=policy)
        ok = out.by == "llm"
        rows.append({"id": t["id"], "accepted": ok, "refused": None if ok else out.error, "attempts": out.attempts,
                     "answer": out.value, "words": len(str(out.value or out.reply or "").split()),
                     **({} if ok else {"reply_head": str(out.reply or "")[:300]})})
        print(f"  {spec} {len(rows)}/{len(turns)} {t['id']}: {'accepted' if ok else str(out.error)[:120]}",
              file=sys.stderr, flush=True)
    return rows


async def rubric_scores(turns: list[dict[str, Any]], texts: list[str | None]) -> list[float | None]:
    """Rubric score of each text alone (extractive judge); None where there is no text."""
    from deepr.agent.answerer import FINAL
    from deepr.corpus.embed import get_embedder
    from deepr.rewards import rubric_score
    from deepr.rewards.judges import Judge

    judge = Judge(None, get_embedder().encode)
    out: list[float | None] = []
    for t, text in zip(turns, texts):
        if text is None:
            out.append(None)
            continue
        body, _ = FINAL.output.parse(text) if "<answer>" in text else (text, None)
        r = await rubric_score(t["query"], body or "", t["rubrics"], judge)
        if r.get("failure"):
            raise RuntimeError(f"rubric score of {t['id']}: {r['failure']}")
        out.append(round(r["R_rubric"], 4))
    return out


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over the rows that have it, rounded to 4 places; None when none has."""
    xs = [r[key] for r in rows if r.get(key) is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def exact_interval(k: int, n: int) -> list[float]:
    """Clopper-Pearson 95 % interval of k successes in n, each answer taken as independent. The
    bootstrap's interval collapses to a point when every answer (or none) is accepted."""
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return [round(ci.low, 4), round(ci.high, 4)]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Accepted share (95 % bootstrap over questions) and mean rubric scores."""
    from deepr.learn.stats import bootstrap_ci

    share, lo, hi = bootstrap_ci([[1.0 if r["accepted"] else 0.0] for r in rows])
    ok = [r for r in rows if r["accepted"]]
    return {"accepted": len(ok), "questions": len(rows),
            "accepted_share": round(share, 4), "ci95": [round(lo, 4), round(hi, 4)],
            "exact95": exact_interval(len(ok), len(rows)), "rubric_model_accepted": _mean(ok, "rubric"),
            # the extractive writer's answer (what a refused answer is replaced with), and the same cut to
            # the ~90 words SFT teaches, on the questions the model answered, then on all of them
            "rubric_teacher_same_questions": _mean(ok, "teacher_rubric"),
            "rubric_taught_same_questions": _mean(ok, "taught_rubric"),
            "rubric_teacher_all": _mean(rows, "teacher_rubric"), "rubric_taught_all": _mean(rows, "taught_rubric"),
            "refusals": [r["refused"] for r in rows if not r["accepted"]]}


def pooled(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The runs (label -> per-question rows) taken as seeds of one setting: the accepted share over
    the questions every run answered, its 95 % interval resampling questions and seeds
    independently (as `make learn`'s intervals do), and the rubric means over the accepted cells."""
    from deepr.learn.stats import bootstrap_ci

    if len(runs) < 2:
        raise ValueError("--pool needs two labelled runs or more")
    by_run = [{r["id"]: r for r in rows} for rows in runs.values()]
    qids = [q for q in by_run[0] if all(q in b for b in by_run)]
    if not qids:
        raise ValueError("no question was answered in every pooled run")
    share, lo, hi = bootstrap_ci([[1.0 if b[q]["accepted"] else 0.0 for b in by_run] for q in qids])
    cells = [b[q] for q in qids for b in by_run]
    ok = [c for c in cells if c["accepted"]]
    return {"runs": list(runs), "questions": len(qids), "seeds": len(by_run), "accepted": len(ok),
            "answers": len(cells), "accepted_share": round(share, 4), "ci95": [round(lo, 4), round(hi, 4)],
            "exact95": exact_interval(len(ok), len(cells)), "rubric_model_accepted": _mean(ok, "rubric"),
            "rubric_teacher_same_questions": _mean(ok, "teacher_rubric"),
            "rubric_taught_same_questions": _mean(ok, "taught_rubric")}


def main(argv: list[str] | None = None, results: Path = Path("learn-results")) -> None:
    ap = argparse.ArgumentParser(prog="answers", description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="*", help="--llm specs, e.g. hf:learn-work/seed0/sft-merged")
    ap.add_argument("--trajectories", type=Path, default=Path("learn-work/trajectories-heldout.jsonl"))
    ap.add_argument("--rubrics", type=Path, default=None,
                    help="questions JSONL (id, rubrics), for recorded runs that carry no rubric")
    ap.add_argument("--label", action="append", default=[], help="a name per spec, in order")
    ap.add_argument("--max-tokens", type=int, default=640)
    ap.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint for openai:<model> specs")
    ap.add_argument("--reasks", type=int, default=0,
                    help="re-asks after a refused answer (make learn's evaluation: 0; deepr run's default: 2)")
    ap.add_argument("--formats", default="schema,answerer=strict",
                    help="decoding formats as deepr run --formats takes them: schema,answerer=strict (make learn's "
                         "evaluation and the default: the small profile's cited prose over exactly the evidence ids "
                         "shown, with its repetition rules) or schema (the answer's own tags)")
    ap.add_argument("--limit", type=int, default=None, help="first N questions only")
    ap.add_argument("--pool", action="append", default=[], metavar="LABEL",
                    help="score nothing: pool the runs of --out with these labels (seeds of one setting)")
    ap.add_argument("--out", type=Path, default=results / OUTPUT)
    args = ap.parse_args(argv)
    if args.pool:
        return pool_main(args)
    if not args.specs:
        ap.error("give the models to probe (--llm specs), or --pool earlier runs")
    if not args.trajectories.exists():
        sys.exit(f"--trajectories {args.trajectories}: no such file (record a teacher run on the held-out "
                 "questions first: deepr run --queries ... --record FILE)")
    try:
        from deepr.io import read_jsonl

        rubrics = {r["id"]: r.get("rubrics") for r in read_jsonl(args.rubrics)} if args.rubrics else None
        turns = final_turns(args.trajectories, rubrics)[:args.limit]
    except (ValueError, OSError) as e:
        sys.exit(f"answer_probe: {e}")
    from deepr.learn.pipeline import compact_answer

    teacher = asyncio.run(rubric_scores(turns, [t["teacher"] for t in turns]))
    taught = asyncio.run(rubric_scores(turns, [compact_answer(t["teacher"]) for t in turns]))
    labels = args.label + args.specs[len(args.label):]
    data = json.loads(args.out.read_text()) if args.out.exists() else {}  # its pooled runs and notes are kept
    results = data.setdefault("results", {})
    for label, spec in zip(labels, args.specs):
        rows = asyncio.run(write_answers(spec, turns, args.max_tokens, args.base_url, reasks=args.reasks,
                                         formats=args.formats))
        scores = asyncio.run(rubric_scores(turns, [r["answer"] for r in rows]))
        for r, s, ts, cs in zip(rows, scores, teacher, taught):
            r["rubric"], r["teacher_rubric"], r["taught_rubric"] = s, ts, cs
        results[label] = {"command": shlex.join(["python", *sys.argv]), "spec": spec,
                          "reasks": args.reasks, "formats": args.formats, **summary(rows), "per_question": rows}
        s = results[label]
        print(f"{label}: {s['accepted']} of {s['questions']} answers accepted {s['ci95']}; rubric of the model's "
              f"{s['rubric_model_accepted']} vs the teacher's {s['rubric_teacher_same_questions']} on the same questions",
              flush=True)
    data["decoding"] = ("greedy, the final turn performed by deepr run's executor under the default profile (each "
                        "result says its re-asks and formats); rubric scores by the extractive judge over the answer alone")
    args.out.write_text(json.dumps(data, indent=1) + "\n")


def pool_main(args: argparse.Namespace) -> None:
    """--pool: the labelled runs of --out pooled as seeds, written under its "pooled" key."""
    data = json.loads(args.out.read_text()) if args.out.exists() else {"results": {}}
    missing = [x for x in args.pool if x not in data["results"]]
    if missing:
        sys.exit(f"--pool: {args.out} has no run labelled {', '.join(map(repr, missing))}")
    try:
        p = pooled({x: data["results"][x]["per_question"] for x in args.pool})
    except ValueError as e:
        sys.exit(f"answer_probe: {e}")
    data.setdefault("pooled", {})[args.label[0] if args.label else " + ".join(args.pool)] = p
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"pooled {p['seeds']} runs: {p['accepted']} of {p['answers']} answers accepted, share {p['accepted_share']} "
          f"{p['ci95']}; rubric of the model's {p['rubric_model_accepted']} vs the taught answers' "
          f"{p['rubric_taught_same_questions']}", flush=True)

