"""Helpers the GRPO stage tests share: scripted turn generators and mask segments."""

from __future__ import annotations


def scripted(tok, replies: list[str]):
    """A generator writing reply[t] at model turn t (each closed with the eos token)."""
    def generate(seqs, first, max_new):
        turn = generate.calls
        generate.calls += 1
        ids = tok(replies[min(turn, len(replies) - 1)], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return [list(ids)[:max_new] for _ in seqs], None
    generate.calls = 0
    return generate


def scripted_rows(tok, turns: list[list[str]]):
    """A generator writing turns[t][i] as row i's reply at model turn t (closed with eos)."""
    def generate(seqs, first, max_new):
        replies = turns[min(generate.calls, len(turns) - 1)]
        generate.calls += 1
        ids = [tok(replies[i % len(replies)], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
               for i in range(len(seqs))]
        return [list(x)[:max_new] for x in ids], None
    generate.calls = 0
    return generate


def segments(rollout) -> list[tuple[int, list[int]]]:
    """(mask value, token ids) runs of a rollout's completion."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(rollout.completion_ids, rollout.env_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


def capture_batches(store: list):
    """Records what TRL feeds the loss: wraps the trainer's scoring step once training begins.
    ``store[0]`` must be the trainer; every scored batch is appended after it."""
    from transformers import TrainerCallback

    class Capture(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            trainer = store[0]
            inner = trainer._generate_and_score_completions

            def wrapped(inputs):
                out = inner(inputs)
                store.append(out)
                return out

            trainer._generate_and_score_completions = wrapped

    return Capture()
