"""Plan validity in a minute: each model's greedy first plan for every held-out question, decoded
under the planner's schema (`--formats schema`) and judged by `deepr run`'s own checks
(:func:`deepr.roles.judge_reply`). The planner turn alone, against ~13 minutes for a full held-out
evaluation of 4 questions on 2 cores, so a training change can be checked before a learning run.

    python bench/plan_probe.py hf:learn-work/seed0/sft-merged hf:learn-work/seed0/more-sft \
        --questions learn-work/heldout.jsonl --label "SFT 24 steps" --label "SFT 24+24 steps"

With ``--samples G`` each question gets G plans sampled at GRPO's temperature instead: a question
none of whose samples is accepted is a planner group with nothing to learn from.

    python bench/plan_probe.py hf:learn-work/seed0/sft-merged --questions learn-work/train.jsonl \
        --samples 4 --limit 6 --max-tokens 640

Writes bench/results/plan_probe.json: per model, how many first plans were accepted (per question
too) and each refusal's reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


async def probe(spec: str, questions: list[str], max_tokens: int, samples: int = 1,
                temperature: float = 0.0, schema: bool = True) -> list[list[str | None]]:
    """Per question, per sample: None for an accepted plan, else why `deepr run` would refuse it.
    One greedy plan a question, or ``samples`` plans sampled at ``temperature`` (seeds 0, 1, ...);
    decoded under the planner's schema as `deepr run` decodes, or free (``schema=False``) as GRPO's
    on-policy rollouts are sampled."""
    from deepr.agent.planner import INITIAL, PlanAsk, initial_messages
    from deepr.llm import get_llm
    from deepr.llm.base import GenDefaults
    from deepr.roles import judge_reply

    llm = get_llm(spec, gen=GenDefaults(max_tokens=max_tokens, temperature=temperature, top_p=None, seed=0))
    out: list[list[str | None]] = []
    for q in questions:
        msgs, verdicts = initial_messages(q), []
        for seed in range(samples):
            reply = await llm.achat(msgs, role="planner", temperature=temperature, max_tokens=max_tokens,
                                    fmt=INITIAL.output.fmt("plan") if schema else None, seed=seed)
            if reply.truncated:
                verdicts.append(f"cut at {max_tokens} tokens")
            else:
                verdicts.append(judge_reply(INITIAL, PlanAsk(None, q), reply, msgs)[1])  # type: ignore[arg-type]
        out.append(verdicts)
    return out


def summary(verdicts: list[list[str | None]]) -> dict:
    """Counts, and for sampled plans the share of questions none of whose samples was accepted: GRPO
    scores a refused plan 0 (DecomposeR Eq. 17), so such a question's group has no advantage to learn
    from (a lower bound on the zero-advantage share: the revision turn can still be refused)."""
    flat = [v for per_q in verdicts for v in per_q]
    per_q = [sum(v is None for v in vs) for vs in verdicts]
    return {"accepted": sum(v is None for v in flat), "plans": len(flat), "questions": len(verdicts),
            "accepted_per_question": per_q,
            "questions_with_none_accepted": round(sum(n == 0 for n in per_q) / max(len(per_q), 1), 3),
            "refusals": [v for v in flat if v is not None]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+", help="--llm specs, e.g. hf:learn-work/seed0/sft-merged")
    ap.add_argument("--questions", type=Path, default=Path("learn-work/heldout.jsonl"))
    ap.add_argument("--label", action="append", default=[], help="a name per spec, in order")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--samples", type=int, default=1, help="plans per question (1: greedy)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature with --samples > 1 (default 0.8, make learn's GRPO rollouts)")
    ap.add_argument("--limit", type=int, default=None, help="first N questions only")
    ap.add_argument("--no-schema", action="store_true",
                    help="decode without the planner's schema, as GRPO's on-policy rollouts sample")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "plan_probe.json")
    args = ap.parse_args()
    if not args.questions.exists():
        sys.exit(f"--questions {args.questions}: no such file (run `make learn` first, or give a queries JSONL)")
    temperature = 0.0 if args.samples == 1 else (0.8 if args.temperature is None else args.temperature)
    questions = [json.loads(line)["question"] for line in args.questions.read_text().splitlines()
                 if line.strip()][:args.limit]
    labels = args.label + args.specs[len(args.label):]
    results = {}
    for label, spec in zip(labels, args.specs):
        results[label] = {"spec": spec, **summary(asyncio.run(
            probe(spec, questions, args.max_tokens, args.samples, temperature, not args.no_schema)))}
        print(f"{label}: {results[label]['accepted']} of {results[label]['plans']} first plans accepted; "
              f"per question {results[label]['accepted_per_question']}")
    how = ("greedy" if args.samples == 1 else f"{args.samples} samples a question at temperature {temperature}")
    how += ", free (as GRPO's rollouts)" if args.no_schema else ", under the planner's schema (as deepr run)"
    args.out.write_text(json.dumps({"command": "python bench/plan_probe.py " + shlex.join(sys.argv[1:]),
                                    "decoding": f"{how}, judged by deepr run's checks", "results": results},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
