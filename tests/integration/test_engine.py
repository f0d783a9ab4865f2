"""Engine and LLM behaviour a user relies on: errors, stops, text, seeds, chat, loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from infer8 import LLM, SamplingParams
from infer8.config import EngineArgs, default_dtype
from infer8.engine import LLMEngine


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=128)


def test_prompt_too_long_or_empty_or_out_of_vocab_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(1, 200))], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[5, 100000]], SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.num_blocks


def test_generation_stops_at_max_model_len_with_length_reason(llm: LLM) -> None:
    out = llm.generate(
        [list(range(1, 121))], SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0)
    )[0]
    assert len(out.outputs[0].token_ids) == 8  # 120 + 8 = max_model_len 128
    assert out.outputs[0].finish_reason == "length"


def test_stop_token_ids_and_eos_and_ignore_eos(llm: LLM) -> None:
    prompt = [5, 6, 7]
    base = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[
        0
    ]
    toks = base.outputs[0].token_ids
    stop_tok = toks[3]
    first = toks.index(stop_tok)
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_tok])
    )[0]
    assert out.outputs[0].token_ids == toks[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    # min_tokens suppresses the stop token until enough tokens exist
    out = llm.generate(
        [prompt],
        SamplingParams(
            max_tokens=12, temperature=0.0, min_tokens=first + 2, stop_token_ids=[stop_tok]
        ),
    )[0]
    assert len(out.outputs[0].token_ids) >= first + 2


def test_stop_string_truncates_text_and_frees_blocks(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompt = tok.encode("Hello world! How are")
    base = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[
        0
    ]
    text = base.outputs[0].text
    assert len(text) >= 4, text
    stop = text[2:4]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    )[0]
    assert out.outputs[0].text == text[: text.index(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    out = llm.generate(
        [prompt],
        SamplingParams(
            max_tokens=16,
            temperature=0.0,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )[0]
    assert out.outputs[0].text == text[: text.index(stop) + len(stop)]
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.num_blocks


def test_text_prompts_token_prompts_and_detokenized_text_agree(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    a = llm.generate("The quick brown fox", params)[0]
    b = llm.generate({"prompt_token_ids": tok.encode("The quick brown fox")}, params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].text == tok.decode(a.outputs[0].token_ids)
    assert a.prompt == "The quick brown fox"


def test_streamed_deltas_add_up_to_the_final_text(llm: LLM) -> None:
    engine = llm.engine
    rid = engine.add_request(
        "Hello world",
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=["zzzz"]),
    )
    text, tokens = "", []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            text += out.outputs[0].delta_text
            tokens += out.outputs[0].delta_token_ids
            final = out
    assert final is not None and final.finished
    assert text == final.outputs[0].text and tokens == final.outputs[0].token_ids


def test_seeded_sampling_is_reproducible_across_batches(llm: LLM) -> None:
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], p)[0].outputs[0].token_ids
    batched = (
        llm.generate(
            [[9, 9, 9, 9], [5, 6, 7], [1, 2]],
            [
                SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True),
                p,
                SamplingParams(max_tokens=3),
            ],
        )[1]
        .outputs[0]
        .token_ids
    )
    assert alone == batched


def test_logprobs_are_returned_per_token(llm: LLM) -> None:
    out = llm.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and max(entry.values()) == entry[tok]  # greedy: the top token
        assert len(entry) == 3
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t] for t, e in zip(out.token_ids, out.logprobs))
    )


def test_chat_applies_the_template(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "Hello world"}]
    rendered = tok.apply_chat_template(msgs)
    assert rendered == "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"
    out = llm.chat(msgs, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids[0] == tok.encode("<|im_start|>", add_special_tokens=False)[0]


def test_unknown_options_and_bad_configs_fail_clearly(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unknown LLM option"):
        LLM(str(llama_dir), max_num_seq=3)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(llama_dir), kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="max_model_len .* KV cache"):
        LLM(str(llama_dir), dtype="float32", kv_cache_memory_bytes=1 << 16, max_model_len=500)
    with pytest.raises(ValueError, match="float16 is not accelerated on CPU"):
        LLM(str(llama_dir), dtype="float16", device="cpu")
    with pytest.raises(ValueError, match="not a local path"):
        LLM("meta-llama/Llama-3-8B")
    no_config = tmp_path / "empty"
    no_config.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(no_config))


def test_unsupported_architecture_is_named(llama_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "gpt2"
    shutil.copytree(llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(d))


def test_sharded_checkpoint_and_auto_dtype(llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    d = tmp_path / "sharded"
    shutil.copytree(llama_dir, d)
    (d / "model.safetensors").unlink()
    weights = load_file(str(llama_dir / "model.safetensors"))
    names = sorted(weights)
    half = len(names) // 2
    save_file({n: weights[n] for n in names[:half]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({n: weights[n] for n in names[half:]}, str(d / "model-00002-of-00002.safetensors"))
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    a = LLM(str(llama_dir), dtype="float32", kv_cache_memory_bytes=1 << 22).generate([[5, 6]], p)
    b = LLM(str(d), dtype="float32", kv_cache_memory_bytes=1 << 22).generate([[5, 6]], p)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    engine = LLMEngine(EngineArgs(model=str(d), kv_cache_memory_bytes=1 << 22))
    # auto: bf16 where this CPU has bf16 units, float32 where bf16 would be emulated
    expected = default_dtype(torch.device("cpu"))
    assert engine.model_config.dtype == expected != torch.float16
    assert all(p.dtype == expected for p in engine.worker.model.parameters())


def test_kv_cache_startup_line(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    LLM(str(llama_dir), dtype="float32", kv_cache_memory_bytes=1 << 20, block_size=16)
    err = capsys.readouterr().err  # a log line: level, time, module, then the fact
    line = [ln.split("] ", 1)[1] for ln in err.splitlines() if "] KV cache:" in ln][0]
    assert err.splitlines()[0].startswith("INFO ")
    # 2 layers x (K,V) x 2 heads x 16 dims x 4 bytes = 512 B/token -> 2048 tokens, 128 blocks
    assert line == (
        "KV cache: 0.00 GiB float32, room for 2,048 tokens = 4.00 requests of 512 tokens "
        "(the longest allowed), in 128 blocks of 16"
    )
