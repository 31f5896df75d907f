"""`deepr export`: flags around :mod:`deepr.train.export`."""

from __future__ import annotations

from pathlib import Path

import typer

from deepr.cli.app import app, console, fail, summary_table, user_errors


@app.command("export")
def export_cmd(
    adapter: Path = typer.Argument(..., help="Adapter folder written by `deepr sft` or `deepr grpo` (base model "
                                   "read from its deepr_meta.json / adapter_config.json)."),
    out: Path = typer.Option(..., "--out", "-o", help="New folder for the merged checkpoint (must be empty)."),
    base: str | None = typer.Option(None, "--base", help="Base model folder, overriding the one the adapter "
                                    "records (e.g. after moving it)."),
    dtype: str = typer.Option("auto", "--dtype", help="Weights written: auto (the base's dtype), float32, "
                              "bfloat16 or float16."),
    no_check: bool = typer.Option(False, "--no-check", help="Skip reloading the checkpoint and comparing its "
                                  "logits with base+adapter on one prompt."),
    gguf: bool = typer.Option(False, "--gguf", help="Also write model-<outtype>.gguf for llama.cpp / Ollama. "
                              "Needs llama.cpp's convert_hf_to_gguf.py (the `gguf` package alone has no "
                              "Hugging Face converter): --llama-cpp, $LLAMA_CPP_DIR or PATH; it imports sentencepiece "
                              "(pip install -e '.[gguf-export]' in the deepr checkout)."),
    gguf_outtype: str = typer.Option("f16", "--gguf-outtype", help="GGUF tensor type: f32, f16, bf16, q8_0."),
    llama_cpp: Path | None = typer.Option(None, "--llama-cpp", help="llama.cpp checkout (or the llama-cpp-python "
                                          "sdist's vendor/llama.cpp) holding convert_hf_to_gguf.py."),
) -> None:
    """Merge a LoRA adapter into its base and write a checkpoint transformers and vLLM load
    (`vllm serve <out>`), with the tokenizer and chat template."""
    from deepr.train.export import ExportConfig, export_model

    with user_errors():
        config = ExportConfig(adapter=adapter, out=out, base=base, dtype=dtype, check=not no_check, gguf=gguf,
                              gguf_outtype=gguf_outtype, llama_cpp=llama_cpp)
        try:
            info = export_model(config)
        except RuntimeError as e:  # the GGUF converter failed; the merged checkpoint is already written
            raise fail(f"{e} (the merged checkpoint in {out} is complete)") from None
    rows = [("merged", " + ".join(info["chain"])), ("dtype", info["dtype"]), ("output", str(out))]
    if "check" in info:
        rows.append(("max |Δlogit| vs adapter", info["check"]["max_abs_logit_diff"]))
    if "gguf" in info:
        rows.append(("gguf", info["gguf"]))
    summary_table("export", rows)
    console.print(f"serve it: vllm serve {out}   then: deepr run --llm openai:{out} --base-url "
                  "http://127.0.0.1:8000/v1 ...", highlight=False, soft_wrap=True, markup=False)
