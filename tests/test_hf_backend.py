"""The tiny offline model builder and the local transformers backend with per-role LoRA adapters."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from deepr.llm import LLMError, get_llm
from deepr.llm.base import run_sync
from deepr.llm.hf_backend import HFLLM
from deepr.train.tiny import ADDED, build_tiny_model, build_tokenizer, default_texts

PROMPT = [{"role": "system", "content": "You plan searches."},
          {"role": "user", "content": "Which river flows through London?"}]
SMALL_TEXT = ["The river flows east to the sea.", "A museum opened in 1901 with 3,452 paintings."] * 30


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def adapters(tiny_dir, tmp_path_factory):
    """Two randomly initialised LoRA adapters, so each role's outputs differ from the base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, role in enumerate(("planner", "answerer")):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
        lora = LoraConfig(r=4, lora_alpha=16, init_lora_weights=False,
                          target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
        get_peft_model(base, lora).save_pretrained(root / role)
        out[role] = str(root / role)
    return out


# -- tiny model builder -----------------------------------------------------------------

def test_tokenizer_reload_round_trips(tiny_dir):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template

    built = build_tokenizer(default_texts(), 3000)
    loaded = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    samples = ["Hello, World!  Two  spaces\tand a tab\n\nnew paragraph",
               "naïve café — ÅÉ 東京 🙂 12345 don't",
               "<|im_start|>user\n<think>\nhmm\n</think>\n\n<tool_call>{\"name\": \"search\"}</tool_call><|im_end|>"]
    for s in samples:
        assert loaded(s)["input_ids"] == built(s)["input_ids"]
        assert loaded.decode(loaded(s)["input_ids"]) == s
    for t in ["<|im_start|>", "<|im_end|>", *ADDED]:  # each chat token is one id
        assert len(loaded(t, add_special_tokens=False)["input_ids"]) == 1
    assert loaded.chat_template == qwen3_chat_template  # TRL picks its tool parser by this match
    assert (loaded.eos_token, loaded.pad_token) == ("<|im_end|>", "<|endoftext|>")
    # Thinking / tool tags survive decoding that drops special tokens, as with real Qwen models.
    ids = loaded("<think>x</think><|im_end|>")["input_ids"]
    assert loaded.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_tiny_model_shape_and_sidecar(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is True
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 256, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["max_position_embeddings"]) == (4, 2, 4096)
    meta = json.loads(tiny_dir.with_name("model.meta.json").read_text())
    assert meta["stage"] == "tiny-model" and 200_000 < meta["counts"]["parameters"] < 500_000


def test_tiny_model_is_deterministic_per_seed(tmp_path):
    import torch
    from safetensors.torch import load_file

    dirs = [build_tiny_model(tmp_path / name, corpus_texts=SMALL_TEXT, vocab_size=400, seed=s)
            for name, s in (("a", 1), ("b", 1), ("c", 2))]
    a, b, c = (load_file(d / "model.safetensors") for d in dirs)
    assert (dirs[0] / "tokenizer.json").read_text() == (dirs[1] / "tokenizer.json").read_text()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    with pytest.raises(ValueError, match="divisible by the 4 attention heads"):
        build_tiny_model(tmp_path / "bad", corpus_texts=SMALL_TEXT, hidden=66)


def test_module_entry_point(tmp_path, monkeypatch):
    from deepr.train import tiny

    assert tiny.main([]) == 2  # usage error, not a traceback
    monkeypatch.setattr(tiny, "default_texts", lambda max_docs=0: SMALL_TEXT)
    assert tiny.main([str(tmp_path / "m")]) == 0 and (tmp_path / "m" / "model.safetensors").is_file()


# -- HF backend -------------------------------------------------------------------------

def test_roles_switch_adapters(tiny_dir, adapters):
    spec = f"hf:{tiny_dir},adapter=planner:{adapters['planner']},adapter=answerer:{adapters['answerer']}"
    llm = get_llm(spec)
    planner = llm.chat(PROMPT, role="planner", max_tokens=12)
    answerer = llm.chat(PROMPT, role="answerer", max_tokens=12)
    base = llm.chat(PROMPT, role="writer", max_tokens=12)  # no adapter: the bare base model
    assert len({planner, answerer, base}) == 3
    assert llm.chat(PROMPT, role="planner", max_tokens=12) == planner  # greedy, same adapter
    plain = HFLLM(tiny_dir)
    assert plain.chat(PROMPT, max_tokens=12) == base
    assert llm.describe()["adapters"] == adapters and llm.usage.by_role["planner"] == 2


def test_token_accounting(tiny_dir):
    llm = HFLLM(tiny_dir)
    n_prompt = len(llm.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"])
    llm.chat(PROMPT, max_tokens=5)
    llm.chat(PROMPT, max_tokens=5)
    assert llm.usage.calls == 2 and llm.usage.prompt_tokens == 2 * n_prompt
    assert 2 <= llm.usage.completion_tokens <= 10


def test_sampling_repeats_with_a_seed(tiny_dir):
    runs = [[HFLLM(tiny_dir, seed=7).chat(PROMPT, temperature=1.0, max_tokens=8)] for _ in range(2)]
    assert runs[0] == runs[1]


def test_clear_errors_for_bad_folders(tiny_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFLLM(tmp_path / "nope")
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    (weights_only / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="has no tokenizer"):
        HFLLM(weights_only)
    no_template = tmp_path / "no_template"
    no_template.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (no_template / f).write_text((tiny_dir / f).read_text())
    with pytest.raises(ValueError, match="no chat template"):
        HFLLM(no_template)
    with pytest.raises(FileNotFoundError, match="adapter for role 'planner'"):
        HFLLM(tiny_dir, adapters={"planner": tmp_path / "missing"})


def test_generation_errors_are_llm_errors(tiny_dir):
    llm = HFLLM(tiny_dir)
    with pytest.raises(LLMError, match="exceeds the model's context of 4096"):
        llm.chat([{"role": "user", "content": "word " * 5000}], max_tokens=2)
    assert llm.usage.failures == 1


# -- formats, generation controls, adapter folders ------------------------------------------

def test_constrained_formats_hold_even_for_a_random_model(tiny_dir):
    """An untrained model writes noise; the grammar still forces the requested shape."""
    pytest.importorskip("xgrammar")
    from deepr.llm import OutputFormat

    llm = HFLLM(tiny_dir)
    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 12}},
              "required": ["q"], "additionalProperties": False}
    out = llm.chat(PROMPT, max_tokens=60, fmt=OutputFormat("plan", json_schema=schema))
    assert out.constrained and not out.truncated
    assert set(json.loads(out)) == {"q"} and len(json.loads(out)["q"]) <= 12
    tag = llm.chat(PROMPT, max_tokens=40, fmt=OutputFormat("search", regex=r"<search>[a-z]{2,8}</search>"))
    assert tag.constrained and re.fullmatch(r"<search>[a-z]{2,8}</search>", tag)
    free = llm.chat(PROMPT, max_tokens=8)
    assert not free.constrained


def test_the_grammar_ends_the_reply_on_every_token_generation_stops_at(tiny_dir):
    """The tiny models stop at <|endoftext|> as well as at the tokenizer's eos. Taken for text, it
    could be sampled inside a JSON string: generation then ended the row and padded it while the
    grammar still waited, and xgrammar's processor failed an assertion on the next token of a
    batch (seen in `deepr grpo --rollout-formats schema`). The grammar now takes it only where the
    reply may end, as the end."""
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer, GenerationConfig

    from deepr.llm import OutputFormat
    from deepr.llm.hf_backend import _as_list
    from deepr.llm.hf_constrain import Constrainer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    stops = _as_list(GenerationConfig.from_pretrained(tiny_dir).eos_token_id)
    extra = [t for t in stops if t != tok.eos_token_id]
    assert extra, "the tiny model's generation config names a second stop token"
    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"],
              "additionalProperties": False}
    grammar = Constrainer(tok, len(tok), stops).compile(OutputFormat("x", json_schema=schema))

    def matcher_after(text: str):
        m = xgr.GrammarMatcher(grammar)
        assert all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False))
        return m

    inside = matcher_after('{"q": "ab')
    assert not any(inside.accept_token(t) for t in extra)  # not text inside the string
    for t in extra:  # ... but the end once the object is complete
        done = matcher_after('{"q": "ab"}')
        assert done.accept_token(t) and done.is_terminated()


def test_budget_cut_is_flagged_truncated(tiny_dir):
    llm = HFLLM(tiny_dir)
    cut = llm.chat(PROMPT, max_tokens=3)
    assert cut.truncated and llm.usage.completion_tokens <= 3


def test_call_seed_makes_sampling_repeat_in_any_order(tiny_dir):
    llm = HFLLM(tiny_dir)
    a = llm.chat(PROMPT, temperature=1.0, max_tokens=10, seed=3)
    b = llm.chat(PROMPT, temperature=1.0, max_tokens=10, seed=4)
    assert llm.chat(PROMPT, temperature=1.0, max_tokens=10, seed=3) == a
    assert a != b
    # top_p near 0 keeps only the most likely token: sampling becomes greedy decoding.
    assert llm.chat(PROMPT, temperature=1.0, top_p=1e-6, max_tokens=10, seed=3) == llm.chat(PROMPT, max_tokens=10)


def test_adapter_folder_as_the_model(tiny_dir, adapters, tmp_path):
    planner = adapters["planner"]
    base = get_llm(f"hf:{tiny_dir}")
    explicit = get_llm(f"hf:{tiny_dir},adapter=planner:{planner}")
    # A plain peft folder (no deepr_meta.json): base from adapter_config.json, every role.
    cfg = json.loads((Path(planner) / "adapter_config.json").read_text())
    assert cfg.get("base_model_name_or_path")  # peft recorded where the base came from
    plain = tmp_path / "plain"
    shutil.copytree(planner, plain)
    cfg["base_model_name_or_path"] = str(tiny_dir)
    (plain / "adapter_config.json").write_text(json.dumps(cfg))
    everywhere = get_llm(f"hf:{plain}")
    assert everywhere.describe()["adapters"] == {"*": str(plain)}
    want = explicit.chat(PROMPT, role="planner", max_tokens=10)
    assert everywhere.chat(PROMPT, role="writer", max_tokens=10) == want
    # With deepr_meta.json: the recorded base and only the recorded role.
    meta_dir = tmp_path / "meta"
    shutil.copytree(plain, meta_dir)
    cfg["base_model_name_or_path"] = "/nowhere"
    (meta_dir / "adapter_config.json").write_text(json.dumps(cfg))
    (meta_dir / "deepr_meta.json").write_text(json.dumps({"role": "planner", "base_model": str(tiny_dir)}))
    scoped = get_llm(f"hf:{meta_dir}")
    assert scoped.describe()["adapters"] == {"planner": str(meta_dir)}
    assert scoped.chat(PROMPT, role="planner", max_tokens=10) == want
    assert scoped.chat(PROMPT, role="writer", max_tokens=10) == base.chat(PROMPT, role="writer", max_tokens=10)
    orphan = tmp_path / "orphan"
    orphan.mkdir()
    (orphan / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no base model recorded"):
        get_llm(f"hf:{orphan}")


def test_an_adapter_naming_its_base_relative_to_another_directory_still_loads(tiny_dir, adapters, tmp_path,
                                                                                monkeypatch):
    """Trained from /work with --model runs/x/merged, an adapter used to record that relative path,
    so `deepr run --llm hf:/work/runs/x/grpo` from anywhere else failed (learning run, issue 20).
    Training now records absolute paths; older adapters are found under their folder's ancestors."""
    from deepr.llm.hf_adapters import adapter_base
    from deepr.train.grpo import GrpoConfig
    from deepr.train.sft import SftConfig

    work = tmp_path / "work"
    shutil.copytree(tiny_dir, work / "runs" / "x" / "merged")
    adapter = work / "runs" / "x" / "grpo"
    shutil.copytree(adapters["planner"], adapter)
    (adapter / "deepr_meta.json").unlink(missing_ok=True)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "runs/x/merged"}))
    monkeypatch.chdir(tmp_path)  # not where training ran
    assert adapter_base(adapter) == str(work / "runs" / "x" / "merged")
    assert get_llm(f"hf:{adapter}").chat(PROMPT, max_tokens=4)
    assert adapter_base(_with_base(tmp_path / "hub", adapter, "org/some-model")) == "org/some-model"  # a hub name
    monkeypatch.chdir(work)
    assert SftConfig(model="runs/x/merged", out=tmp_path / "o").model == str(work / "runs" / "x" / "merged")
    assert GrpoConfig(stage="planner", model="runs/x/merged", out=tmp_path / "o").model == str(
        work / "runs" / "x" / "merged")
    assert SftConfig(model="org/some-model", out=tmp_path / "o").model == "org/some-model"


def _with_base(dest: Path, adapter: Path, base: str) -> Path:
    shutil.copytree(adapter, dest)
    cfg = json.loads((dest / "adapter_config.json").read_text())
    (dest / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": base}))
    return dest


def test_the_hf_backend_reports_its_context_so_roles_trim_evidence_instead_of_failing(tiny_dir):
    """SmolLM2 in tools mode once failed a call outright: 7,196 prompt tokens + 1,024 reply tokens
    over its 8,192 context (bench/results/real_model.json), because the hf backend told the roles
    neither its context nor its token counts, so nothing was trimmed before the call."""
    from dataclasses import dataclass

    from deepr.roles import Recorder, Role, TaggedReply, context_length, perform, prompt_tokens

    llm = HFLLM(tiny_dir)
    assert context_length(llm) == 4096
    msgs = [{"role": "user", "content": "What is lava? " * 20}]
    assert prompt_tokens(llm, msgs) == len(llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                                             return_dict=True)["input_ids"])

    @dataclass
    class Ask:
        evidence: list[str]

    def messages(a: Ask):
        lines = "\n".join(f"[N1-R{i}] Source {i}: {t}" for i, t in enumerate(a.evidence, start=1))
        return [{"role": "user", "content": f"Question: what is lava?\nEvidence:\n{lines}\nAnswer:"}]

    role = Role(name="writer", action="answer", output=TaggedReply("answer"), messages=messages,
                extractive=lambda a: "Lava is rock.", max_tokens=8, fallback=None)
    long = "molten rock that flows from a volcano and cools into basalt " * 60
    ask = Ask([long] * 8)
    assert prompt_tokens(llm, messages(ask)) + 8 > 4096  # as sent whole, it would not fit
    rec = Recorder()
    run_sync(perform(role, ask, llm=llm, rec=rec, max_reasks=0))
    trimmed = [d for d in rec.decisions if "trimmed" in d["what"]]
    assert trimmed and trimmed[0]["context"] == 4096 and trimmed[0]["tokens_after"] + 8 <= 4096
    assert llm.usage.calls == 1 and not [f for f in rec.failures if "context" in f["reason"]]


def queued_behind_a_busy_model(llm, calls, **kw):
    """Send ``calls`` while the model is held busy, so all of them wait together, then free it."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        assert llm._gate.acquire()
        futures = [pool.submit(llm.chat, m, fmt=f, **kw) for m, f in calls]
        t0 = time.monotonic()
        while len(llm._queue.waiting) < len(calls) and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        llm._gate.release()
        return [f.result(timeout=60) for f in futures]


def test_greedy_calls_waiting_together_are_decoded_as_one_batch(tiny_dir):
    """Four calls queued behind a busy model come back as they would one at a time: same text,
    flags and token counts, whatever their prompt lengths and formats."""
    pytest.importorskip("xgrammar")
    from deepr.llm import OutputFormat

    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 30}},
              "required": ["q"], "additionalProperties": False}
    plan = OutputFormat("plan", json_schema=schema)
    calls = [([{"role": "user", "content": text}], fmt) for text, fmt in
             [("Which river flows through London?", None), ("Name a planet " * 9, None),
              ("Plan the search.", plan), ("Plan a much longer search about museums and rivers " * 4, plan)]]
    alone = HFLLM(tiny_dir, batch_size=1)
    expected = [alone.chat(m, max_tokens=24, fmt=f) for m, f in calls]
    llm = HFLLM(tiny_dir)
    got = queued_behind_a_busy_model(llm, calls, max_tokens=24)
    assert got == expected
    assert [(r.constrained, r.truncated) for r in got] == [(r.constrained, r.truncated) for r in expected]
    assert [bool(r.constrained) for r in got] == [False, False, True, True]
    assert llm.batched_calls == 4 and not llm._queue.waiting
    assert (llm.usage.prompt_tokens, llm.usage.completion_tokens) == (alone.usage.prompt_tokens,
                                                                        alone.usage.completion_tokens)


def test_sampled_calls_long_prompts_and_batch_size_one_run_alone(tiny_dir):
    import asyncio

    llm = HFLLM(tiny_dir)
    asyncio.run(llm.abatch([PROMPT, PROMPT], temperature=1.0, max_tokens=6, seed=5))
    assert llm.batched_calls == 0  # sampled: each call keeps its own seed
    one = HFLLM(tiny_dir, batch_size=1)
    asyncio.run(one.abatch([PROMPT, PROMPT], max_tokens=6))
    assert one.batched_calls == 0 and one.usage.calls == 2
    # a prompt over batch_max_prompt runs alone: a padded prefill is slower than one by one
    n = len(llm.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True)["input_ids"])
    long, short = HFLLM(tiny_dir, batch_max_prompt=n - 1), HFLLM(tiny_dir, batch_max_prompt=n)
    for model in (long, short):
        assert queued_behind_a_busy_model(model, [(PROMPT, None)] * 2, max_tokens=6) == [llm.chat(PROMPT, max_tokens=6)] * 2
    assert long.batched_calls == 0 and short.batched_calls == 2


def test_a_windowed_repetition_penalty_reads_only_the_last_tokens(tiny_dir):
    """llama.cpp penalises the last 64 tokens (repeat_last_n); transformers' processor reads every
    token it is handed, so the hf backend hands it only the window."""
    import torch

    llm = HFLLM(tiny_dir, repetition_penalty=2.0, repetition_window=3)
    (proc,) = llm._penalty(5, llm._repetition(None))
    ids = torch.tensor([[7, 8, 9, 10, 11]])
    scores = proc(ids, torch.ones(1, 20))
    assert scores[0, [9, 10, 11]].tolist() == [0.5, 0.5, 0.5] and scores[0, [7, 8]].tolist() == [1.0, 1.0]
    assert llm.chat(PROMPT, max_tokens=6)  # generation runs with it
    assert HFLLM(tiny_dir)._penalty(5, HFLLM(tiny_dir)._repetition(None)) == []  # off unless asked for


def test_sampled_calls_draw_only_from_the_likeliest_tokens_the_format_allows(tiny_dir):
    """Re-asks sample; like llama.cpp's server, the hf backend cuts the tail first (top_k, min_p),
    after the grammar's mask, so a cut can narrow a format's choices but never empty them."""
    pytest.importorskip("xgrammar")
    from deepr.llm import OutputFormat

    greedy = HFLLM(tiny_dir).chat(PROMPT, max_tokens=12)
    for cut in ({"top_k": 1, "min_p": None}, {"top_k": None, "min_p": 0.999}):
        llm = HFLLM(tiny_dir, **cut)
        assert [llm.chat(PROMPT, temperature=1.5, max_tokens=12, seed=s) for s in (1, 2)] == [greedy, greedy]
    wide = HFLLM(tiny_dir, top_k=None, min_p=None)
    assert len({wide.chat(PROMPT, temperature=1.5, max_tokens=12, seed=s) for s in (1, 2, 3)}) > 1
    fmt = OutputFormat("search", regex=r"<search>[a-z]{2,8}</search>")
    tag = HFLLM(tiny_dir, top_k=1).chat(PROMPT, temperature=1.5, max_tokens=40, fmt=fmt)
    assert tag.constrained and re.fullmatch(r"<search>[a-z]{2,8}</search>", tag)
    assert HFLLM(tiny_dir).describe()["top_k"] == 40 and HFLLM(tiny_dir).describe()["min_p"] == 0.05


def test_decoding_options_ride_on_the_spec(tiny_dir):
    """``--llm hf:<dir>,repetition_penalty=1.1,...`` sets the hf backend's decoding from any command."""
    llm = get_llm(f"hf:{tiny_dir},repetition_penalty=1.1,repetition_window=64,top_k=none,min_p=0.1")
    d = llm.describe()
    assert (d["repetition_penalty"], d["repetition_window"], d["top_k"], d["min_p"]) == (1.1, 64, None, 0.1)
    assert llm.chat(PROMPT, max_tokens=4)
    with pytest.raises(ValueError, match=r"repetition_penalty: Input should be a valid number"):
        get_llm(f"hf:{tiny_dir},repetition_penalty=strong")
    with pytest.raises(ValueError, match=r"top_k: Input should be greater than or equal to 1"):
        get_llm(f"hf:{tiny_dir},top_k=0")


def test_weights_in_bf16_ride_on_the_spec_and_keep_formats(tiny_dir):
    """``hf:<dir>,dtype=bfloat16`` loads the weights in bf16 (faster matrix-vector products on CPU);
    a constrained reply still holds its format, and a dtype torch has no name for is refused."""
    pytest.importorskip("xgrammar")
    import torch

    from deepr.llm import OutputFormat

    llm = get_llm(f"hf:{tiny_dir},dtype=bfloat16")
    assert llm.describe()["dtype"] == "bfloat16"
    assert next(llm.model.parameters()).dtype is torch.bfloat16
    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 12}},
              "required": ["q"], "additionalProperties": False}
    out = llm.chat(PROMPT, max_tokens=60, fmt=OutputFormat("plan", json_schema=schema))
    assert out.constrained and set(json.loads(out)) == {"q"}
    with pytest.raises(ValueError, match=r"dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'"):
        get_llm(f"hf:{tiny_dir},dtype=int3")


def test_a_repeated_run_ban_reads_the_reply_only_and_never_breaks_a_format(tiny_dir):
    """no_repeat_ngram: no run of n tokens twice in a reply; a format that demands a repeat
    (a constant recurring) still gets it, and the prompt's own runs stay free to quote."""
    pytest.importorskip("xgrammar")
    from deepr.llm import OutputFormat

    def runs(ids, n):
        return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]

    def reply_ids(llm):
        prompt = list(llm.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True)["input_ids"])
        return llm._alone(prompt, None, llm._kwargs(40, None, None, None), None, None)

    ids = reply_ids(HFLLM(tiny_dir))
    assert len(set(runs(ids, 3))) < len(runs(ids, 3))  # the random model loops when let
    banned = HFLLM(tiny_dir, no_repeat_ngram=3)
    ids = reply_ids(banned)
    assert len(ids) > 10 and len(set(runs(ids, 3))) == len(runs(ids, 3))
    fmt = OutputFormat("list", regex=r"<list>(?:item one; ){4}[a-z]{2,6}</list>")
    forced = banned.chat(PROMPT, max_tokens=60, fmt=fmt)
    assert re.fullmatch(r"<list>(?:item one; ){4}[a-z]{2,6}</list>", forced)
    assert banned.describe()["no_repeat_ngram"] == 3


def test_a_format_brings_its_repetition_rules_to_its_own_calls_unless_the_spec_sets_them(tiny_dir):
    """OutputFormat.decoding: the calls decoded under the format get its n-gram ban, other calls of
    the same backend do not, and a setting the spec gives (even ``none``) wins over the format's."""
    pytest.importorskip("xgrammar")
    from deepr.llm import OutputFormat

    pattern = r"<a>[a-z ]{1,120}</a>"
    plain, banning = OutputFormat("free", regex=pattern), OutputFormat("free", regex=pattern, decoding={"no_repeat_ngram": 3})

    def reply_ids(llm, fmt):
        assert llm._constrains(fmt)
        prompt = list(llm.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True)["input_ids"])
        return llm._alone(prompt, None, llm._kwargs(60, None, None, None), fmt, None)

    def repeats(ids):
        runs = [tuple(ids[i:i + 3]) for i in range(len(ids) - 2)]
        return len(runs) - len(set(runs))

    llm = HFLLM(tiny_dir)
    assert repeats(reply_ids(llm, plain)) > 0  # the random model loops inside the format when let
    assert len(reply_ids(llm, banning)) > 10 and repeats(reply_ids(llm, banning)) == 0
    assert llm._repetition(plain)["no_repeat_ngram"] is None and llm._repetition(banning)["no_repeat_ngram"] == 3
    off = get_llm(f"hf:{tiny_dir},no_repeat_ngram=none")
    assert off._repetition(banning)["no_repeat_ngram"] is None and repeats(reply_ids(off, banning)) > 0
    assert HFLLM(tiny_dir, no_repeat_ngram=5)._repetition(banning)["no_repeat_ngram"] == 5


def test_the_stutter_ban_never_breaks_a_format_that_demands_a_repeat(tiny_dir):
    """no_repeat_word (tested on SmolLM2 in test_smollm2.py) keeps a row's choices where the
    ban would leave the grammar nothing, and is off unless asked for."""
    pytest.importorskip("xgrammar")
    from deepr.llm import OutputFormat

    banned = HFLLM(tiny_dir, no_repeat_word=True)
    fmt = OutputFormat("echo", regex=r"<q>river river [a-z]{2,6}</q>")
    assert re.fullmatch(r"<q>river river [a-z]{2,6}</q>", banned.chat(PROMPT, max_tokens=30, fmt=fmt))
    assert banned._stutter is not None and banned._stutter.banned("the river") and not banned._stutter.banned("the river.")
    assert banned.describe()["no_repeat_word"] is True and HFLLM(tiny_dir).describe()["no_repeat_word"] is False
