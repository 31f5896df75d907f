"""deepr export: a trained LoRA adapter merged into its base reloads as a plain checkpoint that
reproduces the adapter model's logits; bad inputs fail with one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deepr.records import ChatExample

PLAN_REPLY = '{"nodes": [{"id": "S1", "type": "search", "query": "museum"}]}'


def example(i: int) -> ChatExample:
    return ChatExample(id=f"e{i}", role="planner", action="plan", query_id=f"q{i}", messages=[
        {"role": "user", "content": f"Question {i}: when did the museum open?"},
        {"role": "assistant", "content": PLAN_REPLY}])


@pytest.fixture(scope="module")
def adapter(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real `deepr sft` LoRA adapter on the tiny model (a few steps at a high lr)."""
    from deepr.train.sft import SftConfig, train_sft

    out = tmp_path_factory.mktemp("sft") / "planner"
    train_sft([example(i) for i in range(4)], SftConfig(
        model=str(tiny), out=out, role="planner", learning_rate=5e-2, max_steps=3, batch_size=4, grad_accum=1,
        logging_steps=1, save_steps=100, max_length=256, lora_r=8, lora_alpha=16))
    return out


def adapter_logits(tiny: Path, adapter: Path, ids):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32),
                                      str(adapter)).eval()
    with torch.no_grad():
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        return model(input_ids=ids).logits, base


def test_export_reloads_with_the_adapter_models_logits(tiny: Path, adapter: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepr.cli import app

    lora_b = [t for k, t in load_file(str(adapter / "adapter_model.safetensors")).items() if "lora_B" in k]
    assert lora_b and max(float(t.abs().max()) for t in lora_b) > 1e-3  # training moved the adapter

    out = tmp_path / "merged"
    res = CliRunner().invoke(app, ["export", str(adapter), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert not (out / "adapter_config.json").exists() and (out / "config.json").is_file()
    assert (out / "model.safetensors").is_file() and (out / "chat_template.jinja").is_file()
    cfg = json.loads((out / "config.json").read_text())  # servers on transformers 4 read the old names
    assert cfg["torch_dtype"] == "float32" and cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    info = json.loads((out / "deepr_export.json").read_text())
    assert info["chain"] == [str(tiny), str(adapter)] and info["status"] == "done"
    assert info["check"]["max_abs_logit_diff"] <= 1e-3

    # What a user does: load the folder with plain transformers (no PEFT), same prompt, same logits.
    tok = AutoTokenizer.from_pretrained(str(out))
    msgs = [{"role": "user", "content": "Question 7: when did the museum open?"}]
    ids = torch.tensor([tok.apply_chat_template(msgs, tokenize=True, return_dict=False, add_generation_prompt=True)])
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    want, base = adapter_logits(tiny, adapter, ids)
    assert float((got - want).abs().max()) <= 1e-3
    assert float((want - base).abs().max()) > 1e-2  # the adapter matters, so the comparison means something


def test_export_errors_are_one_line(tiny: Path, adapter: Path, tmp_path: Path) -> None:
    from deepr.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o1")])
    assert res.exit_code == 2 and "no such folder" in res.output and "Traceback" not in res.output

    res = runner.invoke(app, ["export", str(adapter), "--out", str(tmp_path / "o2"), "--no-check", "--gguf",
                              "--llama-cpp", str(tmp_path / "no-llama")])
    assert res.exit_code == 2 and "convert_hf_to_gguf.py" in res.output
    assert not (tmp_path / "o2").exists()  # checked before any slow work

    (tmp_path / "o2").mkdir()
    (tmp_path / "o2" / "keep.txt").write_text("x")
    res = runner.invoke(app, ["export", str(adapter), "--out", str(tmp_path / "o2")])
    assert res.exit_code == 2 and "not empty" in res.output

    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    res = runner.invoke(app, ["export", str(stray), "--out", str(tmp_path / "o3")])
    assert res.exit_code == 2 and "no base model recorded" in res.output and "--base" in res.output
