"""Plan validity in a minute: each model's greedy first plan for every held-out question, decoded
under the planner's schema (`--formats schema`) and judged by `deepr run`'s own checks
(:func:`deepr.roles.judge_reply`). The planner turn alone, against ~13 minutes for a full held-out
evaluation of 4 questions on 2 cores, so a training change can be checked before a learning run.

    python bench/plan_probe.py hf:learn-work/seed0/sft-merged hf:learn-work/seed0/more-sft \
        --questions learn-work/heldout.jsonl --label "SFT 24 steps" --label "SFT 24+24 steps"

Writes bench/results/plan_probe.json: per model, how many first plans were accepted and each
refusal's reason.
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


async def probe(spec: str, questions: list[str], max_tokens: int) -> list[str | None]:
    """None for an accepted plan, else why `deepr run` would refuse it."""
    from deepr.agent.planner import INITIAL, PlanAsk, initial_messages
    from deepr.llm import get_llm
    from deepr.llm.base import GenDefaults
    from deepr.roles import judge_reply

    llm = get_llm(spec, gen=GenDefaults(max_tokens=max_tokens, temperature=0.0, top_p=None, seed=0))
    out: list[str | None] = []
    for q in questions:
        msgs = initial_messages(q)
        reply = await llm.achat(msgs, role="planner", temperature=0.0, max_tokens=max_tokens,
                                fmt=INITIAL.output.fmt("plan"), seed=0)
        if reply.truncated:
            out.append(f"cut at {max_tokens} tokens")
        else:
            out.append(judge_reply(INITIAL, PlanAsk(None, q), reply, msgs)[1])  # type: ignore[arg-type]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+", help="--llm specs, e.g. hf:learn-work/seed0/sft-merged")
    ap.add_argument("--questions", type=Path, default=Path("learn-work/heldout.jsonl"))
    ap.add_argument("--label", action="append", default=[], help="a name per spec, in order")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "plan_probe.json")
    args = ap.parse_args()
    if not args.questions.exists():
        sys.exit(f"--questions {args.questions}: no such file (run `make learn` first, or give a queries JSONL)")
    questions = [json.loads(line)["question"] for line in args.questions.read_text().splitlines() if line.strip()]
    labels = args.label + args.specs[len(args.label):]
    results = {}
    for label, spec in zip(labels, args.specs):
        reasons = asyncio.run(probe(spec, questions, args.max_tokens))
        results[label] = {"spec": spec, "accepted": sum(r is None for r in reasons), "questions": len(questions),
                          "refusals": [r for r in reasons if r is not None]}
        print(f"{label}: {results[label]['accepted']} of {len(questions)} first plans accepted")
    args.out.write_text(json.dumps({"command": "python bench/plan_probe.py " + shlex.join(sys.argv[1:]),
                                    "greedy, --formats schema, judged by deepr run's checks": True,
                                    "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
