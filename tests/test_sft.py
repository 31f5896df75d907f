"""deepr sft on the tiny offline model: masking, learning, saving, loading, Ctrl-C and --resume."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.records import ChatExample
from deepr.train.sft import SftConfig, build_trainer, drop_too_long, load_tokenizer, select_examples, train_sft

PLAN_REPLY = '{"nodes": [{"id": "S1", "type": "search", "query": "museum"}]}'
TOOL_TEXT = "SNIPPET museum opened in 1901 by the river"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from deepr.train.tiny import build_tiny_model, wiki_texts

    texts = wiki_texts(300) or None  # a small tokenizer corpus keeps the build to a second or two
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", corpus_texts=texts)


def planner_example(i: int, role: str = "planner") -> ChatExample:
    """A revision turn whose prompt holds a system message, the earlier plan (assistant), a tool
    result and a user instruction; only the final reply may be trained on."""
    return ChatExample(id=f"e{i}", role=role, action="revise", query_id=f"q{i % 2}", messages=[
        {"role": "system", "content": "You plan research as a JSON graph."},
        {"role": "user", "content": f"Question {i % 2}: when did the museum open?"},
        {"role": "assistant", "content": '{"nodes": []}'},
        {"role": "tool", "content": TOOL_TEXT},
        {"role": "user", "content": "Revise the plan."},
        {"role": "assistant", "content": PLAN_REPLY},
    ])


def config(tiny: Path, out: Path, **over) -> SftConfig:
    base = dict(model=str(tiny), out=out, role="planner", learning_rate=1e-2, max_steps=4, batch_size=4,
                grad_accum=1, logging_steps=1, save_steps=100, max_length=512, lora_r=16, lora_alpha=32)
    return SftConfig(**{**base, **over})


def trained_text(trainer, row: int = 0) -> tuple[str, str]:
    """(text of tokens that carry loss, text of masked tokens) for one prepared example."""
    ex = trainer.train_dataset[row]
    tok = trainer.processing_class
    kept = [t for t, lab in zip(ex["input_ids"], ex["labels"]) if lab != -100]
    masked = [t for t, lab in zip(ex["input_ids"], ex["labels"]) if lab == -100]
    return tok.decode(kept), tok.decode(masked)


def test_prompt_and_tool_tokens_carry_no_loss(tiny: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(str(tiny))
    trainer = build_trainer(config(tiny, tmp_path / "o"), [planner_example(0)], tok)
    kept, masked = trained_text(trainer)
    assert kept.strip().endswith(PLAN_REPLY + "<|im_end|>")
    for prompt_text in ("JSON graph", "Question 0", TOOL_TEXT, "Revise the plan", '{"nodes": []}'):
        assert prompt_text not in kept and prompt_text in masked
    # The collator passes the same mask on to the loss.
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert batch["labels"][0].tolist() == trainer.train_dataset[0]["labels"]


def test_assistant_loss_trains_every_assistant_turn_but_no_prompt(tiny: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(str(tiny))
    trainer = build_trainer(config(tiny, tmp_path / "o", loss="assistant"), [planner_example(0)], tok)
    kept, masked = trained_text(trainer)
    assert PLAN_REPLY in kept and '{"nodes": []}' in kept
    for prompt_text in ("JSON graph", "Question 0", TOOL_TEXT, "Revise the plan"):
        assert prompt_text not in kept and prompt_text in masked


def test_role_filter_and_rejects(tiny: Path) -> None:
    ex = [planner_example(0), planner_example(1, role="answerer"),
          ChatExample(id="bad", role="planner", action="plan", messages=[{"role": "user", "content": "q"}])]
    chosen, rejects = select_examples(ex, "planner")
    assert [e.id for e in chosen] == ["e0"] and rejects[0].id == "bad" and "bad_shape" in rejects[0].reason
    assert [e.id for e in select_examples(ex, "all")[0]] == ["e0", "e1"]
    with pytest.raises(ValueError, match="roles present: answerer, planner"):
        select_examples(ex, "writer")
    tok = load_tokenizer(str(tiny))
    keep, too_long = drop_too_long([planner_example(0)], tok, 20)
    assert keep == [] and "too_long" in too_long[0].reason
    tok.chat_template = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}" \
                        "{% endif %}{{ m.content }}{% endfor %}"
    keep, bad = drop_too_long([planner_example(0)], tok, 512)
    assert keep == [] and bad[0].reason.startswith("template_error") and "no tool role" in bad[0].reason


def test_loss_decreases_and_adapter_loads_in_hf_backend(tiny: Path, tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from deepr.llm import get_llm

    out = tmp_path / "planner"
    result = train_sft([planner_example(i) for i in range(8)], config(tiny, out, max_steps=8))
    first, last = sum(result.losses[:2]) / 2, sum(result.losses[-2:]) / 2
    assert result.steps == 8 and last < first - 0.1, result.losses
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    meta = json.loads((out / "deepr_meta.json").read_text())
    assert (meta["status"], meta["role"], meta["base_model"], meta["adapter"]) == ("done", "planner", str(tiny), True)

    # The saved adapter holds what was learned: the reply is likelier with it than without.
    tok = load_tokenizer(str(tiny))
    msgs = planner_example(0).messages
    ids = torch.tensor([tok.apply_chat_template(msgs, tokenize=True, return_dict=False)])
    n_prompt = len(tok.apply_chat_template(msgs[:-1], tokenize=True, return_dict=False, add_generation_prompt=True))
    labels = ids.clone()
    labels[:, :n_prompt] = -100
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny)), str(out))
    with torch.no_grad():
        tuned = model(input_ids=ids, labels=labels).loss.item()
        with model.disable_adapter():
            base = model(input_ids=ids, labels=labels).loss.item()
    assert tuned < base - 0.1

    llm = get_llm(f"hf:{tiny},adapter=planner:{out}", max_new_tokens=8)
    reply = llm.chat(msgs[:-1], role="planner")
    assert isinstance(reply, str) and llm.usage.by_role == {"planner": 1} and llm.usage.completion_tokens > 0



def test_bf16_mixed_precision_trains_on_cpu_and_keeps_fp32_adapter_weights(tiny: Path, tmp_path: Path) -> None:
    """`deepr sft --bf16` without a GPU: transformers refuses bf16 there unless the run is marked
    CPU-only; the loss still falls and the saved LoRA weights stay fp32 (mixed precision computes
    in bf16, it does not store in it)."""
    from safetensors.torch import load_file

    from deepr.cli import app

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(planner_example(i).model_dump_json() + "\n" for i in range(8)))
    out = tmp_path / "p"
    res = CliRunner().invoke(app, ["sft", "--model", str(tiny), "--data", str(data), "--role", "planner",
                                   "--out", str(out), "--max-steps", "8", "--batch-size", "4", "--grad-accum", "1",
                                   "--lr", "1e-2", "--lora-r", "16", "--lora-alpha", "32", "--logging-steps", "1",
                                   "--bf16", "--no-gradient-checkpointing"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "p.meta.json").read_text())["config"]["bf16"] is True
    losses = json.loads((out / "deepr_meta.json").read_text())["losses"]
    assert len(losses) == 8 and sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.1, losses
    weights = load_file(str(out / "adapter_model.safetensors"))
    assert weights and {str(w.dtype) for w in weights.values()} == {"torch.float32"}

def test_ctrl_c_checkpoints_and_resume_finishes(tiny: Path, tmp_path: Path) -> None:
    from transformers import TrainerCallback

    class CtrlC(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGINT)

    out = tmp_path / "run"
    cfg = config(tiny, out, max_steps=4)
    data = [planner_example(i) for i in range(8)]
    first = train_sft(data, cfg, callbacks=[CtrlC()])
    assert first.interrupted and first.steps < 4 and (out / f"checkpoint-{first.steps}").is_dir()
    assert json.loads((out / "deepr_meta.json").read_text())["status"] == "interrupted"
    assert not (out / "adapter_model.safetensors").exists()
    with pytest.raises(ValueError, match="--resume"):
        train_sft(data, cfg)
    with pytest.raises(ValueError, match="data changed"):
        train_sft(data[:4], cfg.model_copy(update={"resume": True}))
    second = train_sft(data, cfg.model_copy(update={"resume": True}))
    assert not second.interrupted and second.steps == 4 and (out / "adapter_model.safetensors").is_file()
    assert len(second.losses) == 4  # the log of the first part is restored with the checkpoint


def test_cli_prune_then_sft(tiny: Path, tmp_path: Path) -> None:
    from deepr.cli import app
    from test_trajectories import dag_traj  # the constructed, known-valid dag trajectories

    trajs = [dag_traj(f"d{i}", query=f"Question {i}?") for i in range(6)]
    (tmp_path / "traj.jsonl").write_text("".join(t.model_dump_json() + "\n" for t in trajs))
    runner = CliRunner()
    res = runner.invoke(app, ["prune-trajectories", str(tmp_path / "traj.jsonl"), "--out-dir", str(tmp_path / "d")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["sft", "--model", str(tiny), "--data", str(tmp_path / "d" / "sft.jsonl"),
                              "--role", "answerer", "--out", str(tmp_path / "ans"), "--max-steps", "1",
                              "--batch-size", "2", "--grad-accum", "1", "--max-length", "1024", "--lora-r", "4",
                              "--lora-alpha", "8", "--logging-steps", "1"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "ans" / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "ans.meta.json").read_text())["counts"]["steps"] == 1
    res = runner.invoke(app, ["sft", "--model", str(tiny), "--data", str(tmp_path / "d" / "sft.jsonl"),
                              "--role", "writer", "--out", str(tmp_path / "w")])
    assert res.exit_code == 2 and "roles present: answerer, planner" in res.output


def test_cpu_lm_head_scores_only_labelled_tokens_with_the_same_loss(tiny: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory fix of issue 14.7: on CPU TRL's fused LM head projects only the positions that
    carry loss (the reply), not every prompt token; loss and gradients stay those of the full head."""
    import torch
    from trl.trainer import utils as trl_utils

    from deepr.train.memory import lean_lm_head

    if torch.cuda.is_available():
        pytest.skip("the change applies to CPU training only")
    trainer = build_trainer(config(tiny, tmp_path / "o", full=True), [planner_example(0)], load_tokenizer(str(tiny)))
    batch = trainer.data_collator([trainer.train_dataset[0]])
    model = trainer.model.eval()  # no dropout: both passes see the same function
    projected = []
    head = trl_utils._ChunkedLogProbFunction

    class Spy:
        @staticmethod
        def apply(hidden, *args):
            projected.append(hidden.shape[0])
            return head.apply(hidden, *args)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Spy)

    def loss_and_grads() -> tuple[float, dict]:
        model.zero_grad()
        out = model(**batch, fused_lm_head=True)
        out.loss.backward()
        return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    before_compact, before_chunk = trl_utils._use_triton, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    full_loss, full_grads = loss_and_grads()
    with lean_lm_head() as changed:
        lean_loss, lean_grads = loss_and_grads()
    labelled = int((batch["labels"][:, 1:] != -100).sum())
    assert changed and projected == [batch["input_ids"].shape[1] - 1, labelled] and 0 < labelled < projected[0] / 2
    assert lean_loss == pytest.approx(full_loss, rel=1e-6)
    assert full_grads.keys() == lean_grads.keys()
    for name, g in full_grads.items():
        torch.testing.assert_close(lean_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert (trl_utils._use_triton, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE) == (before_compact, before_chunk)


def test_cli_sft_counts_examples_dropped_by_max_length(tiny: Path, tmp_path: Path) -> None:
    from deepr.cli import app

    long = planner_example(9)
    long.messages[1]["content"] += " more evidence about the museum" * 200
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(e.model_dump_json() + "\n" for e in [planner_example(0), planner_example(1), long]))
    res = CliRunner().invoke(app, ["sft", "--model", str(tiny), "--data", str(data), "--role", "planner",
                                   "--out", str(tmp_path / "p"), "--max-steps", "1", "--batch-size", "2",
                                   "--grad-accum", "1", "--max-length", "400", "--lora-r", "4", "--lora-alpha", "8",
                                   "--no-gradient-checkpointing"])
    assert res.exit_code == 0, res.output
    assert "too long (> 400 tokens)" in res.output
    assert json.loads((tmp_path / "p.meta.json").read_text())["config"]["gradient_checkpointing"] is False
    sidecar = json.loads((tmp_path / "p.meta.json").read_text())["counts"]
    meta = json.loads((tmp_path / "p" / "deepr_meta.json").read_text())["counts"]
    assert sidecar["rejected_by_reason"] == meta["rejected_by_reason"] == {"too_long": 1}
    assert (sidecar["examples"], sidecar["rejected"]) == (2, 1)
    rejects = [json.loads(x) for x in (tmp_path / "p" / "sft.rejects.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rejects] == ["e9"] and "> max_length 400" in rejects[0]["reason"]


def test_cli_sft_bad_seed_is_one_line_naming_the_flag(tiny: Path, tmp_path: Path) -> None:
    from deepr.cli import app

    data = tmp_path / "sft.jsonl"
    data.write_text(planner_example(0).model_dump_json() + "\n")
    res = CliRunner().invoke(app, ["sft", "--model", str(tiny), "--data", str(data), "--out", str(tmp_path / "o"),
                                   "--seed", "-1"])
    # the one line names the setting and its range, before any weights load
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "seed=-1" in res.output and "between 0 and 2**32 - 1" in res.output and "Loading weights" not in res.output


def test_a_run_shorter_than_the_logging_interval_still_reports_its_loss(tiny: Path, tmp_path: Path) -> None:
    """`deepr sft --max-steps 4` with the default --logging-steps 10 logged no loss, and the summary
    printed "nan" for both losses (make demo-llm); the interval now shrinks to the run's length."""
    result = train_sft([planner_example(i) for i in range(4)], config(tiny, tmp_path / "short", max_steps=2,
                                                                       logging_steps=10))
    assert result.steps == 2 and len(result.losses) == 1 and result.losses[0] > 0
