"""GGUF loading: a tiny random Llama/Qwen2 GGUF written here, read back through load_gguf."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file
from tokenizers import Tokenizer

from infer8.models.gguf_loader import convert_gguf_to_hf, load_gguf, load_gguf_tokenizer

HIDDEN = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN // NUM_HEADS
INTERMEDIATE = 96
NUM_LAYERS = 2
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "2 0"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)

# GGUF tensor name -> the type it is stored as, covering each supported type on both q and k.
TENSOR_TYPES = {
    "token_embd.weight": QType.Q8_0,
    "blk.0.attn_q.weight": QType.F32,
    "blk.0.attn_k.weight": QType.F32,
    "blk.0.attn_v.weight": QType.Q4_0,
    "blk.0.attn_output.weight": QType.Q4_1,
    "blk.0.ffn_gate.weight": QType.F16,
    "blk.0.ffn_up.weight": QType.BF16,
    "blk.0.ffn_down.weight": QType.Q8_0,
    "blk.1.attn_q.weight": QType.Q4_0,
    "blk.1.attn_k.weight": QType.Q4_1,
    "blk.1.attn_v.weight": QType.F32,
    "blk.1.attn_output.weight": QType.F16,
    "blk.1.ffn_gate.weight": QType.Q8_0,
    "blk.1.ffn_up.weight": QType.Q4_0,
    "blk.1.ffn_down.weight": QType.BF16,
}


def bytes_to_unicode() -> dict[int, str]:
    """Return GPT-2's byte -> character table, written out independently of the loader."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: chr(b) for b in printable}
    extra = iter(range(256, 512))
    return {b: table.get(b) or chr(next(extra)) for b in range(256)}


def vocab_tokens() -> list[str]:
    """Return the tiny vocabulary: specials, the 256 byte characters, then each merge result."""
    merged = [merge.replace(" ", "") for merge in MERGES]
    return SPECIAL_TOKENS + list(bytes_to_unicode().values()) + merged


def llamacpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Interleave q/k rows the way llama.cpp's convert_hf_to_gguf.py LlamaModel.permute does."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def quant_round_trip(values: np.ndarray, qtype: QType) -> np.ndarray:
    """Return what a tensor stored as `qtype` reads back as."""
    if qtype == QType.F32:
        return values
    if qtype == QType.F16:
        return values.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype)


@dataclass
class TinyGGUF:
    """A GGUF file written by the test, plus the Hugging Face weights it was made from."""

    path: Path
    hf_weights: dict[str, np.ndarray]
    stored_types: dict[str, QType] = field(default_factory=dict)


def hf_shapes(arch: str, tied: bool, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Return the Hugging Face parameter shapes of the tiny model."""
    q, kv = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab_size, HIDDEN),
        "model.norm.weight": (HIDDEN,),
    }
    if not tied:
        shapes["lm_head.weight"] = (vocab_size, HIDDEN)
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (q, HIDDEN),
            p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, q),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
        if arch == "qwen2":
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return shapes


def gguf_name(hf_name: str) -> str:
    """Return llama.cpp's name for a Hugging Face parameter name."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    leaves = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{leaves[module]}.{suffix}"


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    tied: bool = True,
    pre: str = "smollm",
    tensor_types: dict[str, QType] | None = None,
    skip_tensors: tuple[str, ...] = (),
    add_bos: bool = False,
    eot_token_id: int | None = None,
) -> TinyGGUF:
    """Write a tiny random model as llama.cpp's converter would, and return its HF weights."""
    rng = np.random.default_rng(0)
    tokens = vocab_tokens()
    tensor_types = TENSOR_TYPES if tensor_types is None else tensor_types
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)

    tiny = TinyGGUF(path=path, hf_weights={})
    for hf_name, shape in hf_shapes(arch, tied, len(tokens)).items():
        values = rng.standard_normal(shape, dtype=np.float32)
        if hf_name.endswith("norm.weight"):
            values = 1.0 + 0.1 * values
        tiny.hf_weights[hf_name] = values
        name = gguf_name(hf_name)
        if name in skip_tensors:
            continue
        stored = values
        if arch == "llama" and ".attn_q." in name:
            stored = llamacpp_permute(values, NUM_HEADS, NUM_HEADS)
        elif arch == "llama" and ".attn_k." in name:
            stored = llamacpp_permute(values, NUM_HEADS, NUM_KV_HEADS)
        qtype = tensor_types.get(name, QType.F32)
        tiny.stored_types[hf_name] = qtype
        if qtype == QType.F32:
            writer.add_tensor(name, stored)
        elif qtype == QType.F16:
            writer.add_tensor(name, stored.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tiny


@pytest.fixture
def tiny_llama(tmp_path: Path) -> TinyGGUF:
    """Return a tiny tied Llama GGUF with mixed tensor types."""
    return write_tiny_gguf(tmp_path / "tiny-llama.gguf")


def test_config_matches_metadata(tiny_llama: TinyGGUF) -> None:
    """Check the config.json dict built from the GGUF metadata."""
    config = load_gguf(tiny_llama.path).hf_config
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "model_type": "llama",
        "vocab_size": len(vocab_tokens()),
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {key: config[key] for key in expected} == expected


def test_weights_round_trip_with_unpermuted_qk(tiny_llama: TinyGGUF) -> None:
    """Check every weight equals the original after dequantizing and undoing the q/k permutation."""
    state_dict = load_gguf(tiny_llama.path).state_dict
    assert set(state_dict) == set(tiny_llama.hf_weights)
    for name, original in tiny_llama.hf_weights.items():
        qtype = tiny_llama.stored_types[name]
        loaded = state_dict[name]
        assert loaded.dtype == torch.float32
        assert tuple(loaded.shape) == original.shape, name
        if qtype == QType.F32:
            torch.testing.assert_close(loaded, torch.from_numpy(original), rtol=0, atol=0)
            continue
        # Quantization blocks run along rows, so the row permutation commutes with it.
        expected = quant_round_trip(original, qtype)
        torch.testing.assert_close(loaded, torch.from_numpy(expected), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("qtype", "bound"),
    [
        (QType.Q8_0, lambda w: np.abs(w).max() / 127),
        (QType.Q4_0, lambda w: np.abs(w).max() / 8),
        (QType.Q4_1, lambda w: (w.max() - w.min()) / 15),
        (QType.BF16, lambda w: np.abs(w).max() * 2.0**-8),
        (QType.F16, lambda w: np.abs(w).max() * 2.0**-10),
    ],
)
def test_dequantized_error_within_format_bound(tmp_path: Path, qtype: QType, bound: object) -> None:
    """Check each quantized format reads back within (twice) its rounding error."""
    types = {name: qtype for name in TENSOR_TYPES}
    tiny = write_tiny_gguf(tmp_path / "q.gguf", tensor_types=types)
    state_dict = load_gguf(tiny.path).state_dict
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        original = tiny.hf_weights[name]
        error = np.abs(state_dict[name].numpy() - original).max()
        assert 0 < error <= bound(original), (name, error)  # type: ignore[operator]


def test_q_and_k_are_stored_permuted(tiny_llama: TinyGGUF) -> None:
    """Check the test file really stores q/k rows permuted, so the round trip proves the undo."""
    reader = gguf.GGUFReader(tiny_llama.path)
    stored = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data
    original = tiny_llama.hf_weights["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(stored, original)
    assert np.array_equal(stored, llamacpp_permute(original, NUM_HEADS, NUM_HEADS))


def test_dtype_and_untied_lm_head(tmp_path: Path) -> None:
    """Check dtype conversion and that an output tensor becomes lm_head with untied embeddings."""
    tiny = write_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    model = load_gguf(tiny.path, dtype=torch.bfloat16)
    assert model.hf_config["tie_word_embeddings"] is False
    assert model.hf_config["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in model.state_dict.values())
    torch.testing.assert_close(
        model.state_dict["lm_head.weight"],
        torch.from_numpy(tiny.hf_weights["lm_head.weight"]).to(torch.bfloat16),
        rtol=0,
        atol=0,
    )


def test_qwen2_has_biases_and_no_permutation(tmp_path: Path) -> None:
    """Check a Qwen2 GGUF: q/k/v biases, attention_bias, and q/k taken as stored."""
    tiny = write_tiny_gguf(tmp_path / "qwen2.gguf", arch="qwen2", pre="qwen2")
    model = load_gguf(tiny.path)
    assert model.hf_config["architectures"] == ["Qwen2ForCausalLM"]
    assert model.hf_config["model_type"] == "qwen2"
    assert model.hf_config["attention_bias"] is True
    for name in ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.k_proj.weight"):
        name = f"model.layers.0.{name}"
        torch.testing.assert_close(
            model.state_dict[name], torch.from_numpy(tiny.hf_weights[name]), rtol=0, atol=0
        )


def test_tokenizer_json_encodes_specials_merges_and_bytes(tiny_llama: TinyGGUF) -> None:
    """Check the rebuilt byte-level BPE tokenizer: merges, special tokens, lossless bytes."""
    model = load_gguf(tiny_llama.path)
    tokenizer = Tokenizer.from_str(model.tokenizer_json)
    tokens = vocab_tokens()
    ids = tokenizer.encode("<|im_start|>hello world<|im_end|>").ids
    assert ids == [1, tokens.index("hello"), tokens.index("Ġworld"), 2]
    text = "héllo 世界 🤖\n\tnaïve"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world"
    added = json.loads(model.tokenizer_json)["added_tokens"]
    assert [(t["id"], t["content"], t["special"]) for t in added] == [
        (i, token, True) for i, token in enumerate(SPECIAL_TOKENS)
    ]


@pytest.mark.parametrize(
    ("pre", "num_digit_tokens"), [("smollm", 4), ("gpt-2", 3), ("llama-bpe", 3), ("qwen2", 4)]
)
def test_pre_tokenizer_follows_ggml_pre(tmp_path: Path, pre: str, num_digit_tokens: int) -> None:
    """Check digits split per `ggml.pre`: singly for SmolLM and Qwen2, so "2 0" never merges."""
    tiny = write_tiny_gguf(tmp_path / f"{pre}.gguf", pre=pre)
    tokenizer = Tokenizer.from_str(load_gguf(tiny.path).tokenizer_json)
    assert len(tokenizer.encode("2024").ids) == num_digit_tokens


def test_add_bos_token_adds_bos(tmp_path: Path) -> None:
    """Check a file whose tokenizer adds BOS gets a tokenizer.json that prepends it."""
    tiny = write_tiny_gguf(tmp_path / "bos.gguf", add_bos=True)
    model = load_gguf(tiny.path)
    tokenizer = Tokenizer.from_str(model.tokenizer_json)
    assert tokenizer.encode("hello").ids == [1, vocab_tokens().index("hello")]
    assert model.tokenizer_config["add_bos_token"] is True


def test_tokenizer_config(tiny_llama: TinyGGUF) -> None:
    """Check special token strings, the chat template and the BOS policy."""
    config = load_gguf(tiny_llama.path).tokenizer_config
    assert config["bos_token"] == "<|im_start|>"
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|im_end|>"
    assert config["unk_token"] == "<|endoftext|>"
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["add_bos_token"] is False


def test_load_gguf_tokenizer(tiny_llama: TinyGGUF) -> None:
    """Check the engine-facing Tokenizer built from metadata alone: ids, EOS, chat template."""
    tokenizer = load_gguf_tokenizer(tiny_llama.path)
    assert tokenizer.encode("hello<|im_end|>") == [vocab_tokens().index("hello"), 2]
    assert tokenizer.eos_token_ids == [2]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered.startswith("<|im_start|>user\nhi<|im_end|>")


def test_end_of_turn_token_is_an_eos(tmp_path: Path) -> None:
    """Check an end-of-turn token joins EOS in the generation config and the tokenizer."""
    tiny = write_tiny_gguf(tmp_path / "eot.gguf", eot_token_id=0)
    assert load_gguf(tiny.path).generation_config["eos_token_id"] == [2, 0]
    assert sorted(load_gguf_tokenizer(tiny.path).eos_token_ids) == [0, 2]


def test_convert_gguf_to_hf_writes_model_dir(tiny_llama: TinyGGUF, tmp_path: Path) -> None:
    """Check the converted directory's files, replacing an old one, and no temp dirs left."""
    out_dir = tmp_path / "converted"
    out_dir.mkdir()
    (out_dir / "stale.txt").write_text("old")
    assert convert_gguf_to_hf(tiny_llama.path, out_dir, progress=False) == out_dir
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted", "tiny-llama.gguf"]
    config = json.loads((out_dir / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    generation = json.loads((out_dir / "generation_config.json").read_text())
    assert generation["bos_token_id"] == 1 and generation["eos_token_id"] == 2
    assert json.loads((out_dir / "tokenizer_config.json").read_text())["chat_template"]
    weights = load_file(out_dir / "model.safetensors")
    expected = load_gguf(tiny_llama.path, dtype=torch.bfloat16).state_dict
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0)
    Tokenizer.from_file(str(out_dir / "tokenizer.json"))


def test_convert_gguf_to_hf_writes_generation_defaults(
    tiny_llama: TinyGGUF, tmp_path: Path
) -> None:
    """Check sampling defaults given to the converter land beside the token ids."""
    out_dir = convert_gguf_to_hf(
        tiny_llama.path,
        tmp_path / "converted",
        progress=False,
        generation_defaults={"temperature": 0.2, "top_p": 0.9},
    )
    generation = json.loads((out_dir / "generation_config.json").read_text())
    assert generation["temperature"] == 0.2 and generation["top_p"] == 0.9
    assert generation["bos_token_id"] == 1 and generation["eos_token_id"] == 2


@pytest.mark.parametrize("keep_fraction", [0.5, 0.9, 0.02])
def test_truncated_file_is_a_value_error(tiny_llama: TinyGGUF, keep_fraction: float) -> None:
    """Check a file cut short (in the tensor data or the metadata) is reported as truncated."""
    data = tiny_llama.path.read_bytes()
    tiny_llama.path.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(ValueError, match="truncated") as info:
        load_gguf(tiny_llama.path)
    assert str(tiny_llama.path) in str(info.value)


@pytest.mark.parametrize("prefix", [b"", b"GGUF\x03\x00\x00\x00"])
def test_random_bytes_are_a_value_error(tmp_path: Path, prefix: bytes) -> None:
    """Check random bytes, with or without GGUF's header, give a ValueError naming the file."""
    path = tmp_path / "random.gguf"
    path.write_bytes(prefix + np.random.default_rng(1).bytes(4096))
    with pytest.raises(ValueError, match="not a GGUF file|corrupt") as info:
        load_gguf(path)
    assert str(path) in str(info.value)


def test_empty_file_is_not_a_gguf(tmp_path: Path) -> None:
    """Check an empty file is reported as not a GGUF file."""
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    """Check an architecture other than llama/qwen2 is refused by name."""
    path = tmp_path / "mamba.gguf"
    write_tiny_gguf(path, arch="mamba")
    with pytest.raises(ValueError, match="architecture 'mamba'"):
        load_gguf(path)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    """Check a tensor type outside the supported set is refused, naming tensor and type."""
    path = tmp_path / "mxfp4.gguf"
    write_tiny_gguf(path, tensor_types={"blk.1.ffn_up.weight": QType.MXFP4})
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_up\.weight' has type MXFP4"):
        load_gguf(path)


@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.Q5_1])
def test_five_bit_tensors_load_as_the_gguf_package_dequantizes_them(
    tmp_path: Path, qtype: QType
) -> None:
    """Q5_0 / Q5_1 (a Q4_K_M file's other types) load to gguf's reference values."""
    path = tmp_path / "q5.gguf"
    write_tiny_gguf(path, tensor_types={"blk.1.ffn_up.weight": qtype})
    model = load_gguf(path)
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    expected = gguf.quants.dequantize(tensor.data, qtype).reshape(
        tuple(int(d) for d in reversed(tensor.shape.tolist()))
    )
    got = model.state_dict["model.layers.1.mlp.up_proj.weight"].float().numpy()
    assert (got == expected).all()


def test_missing_tensor(tmp_path: Path) -> None:
    """Check a file without a needed tensor is refused, naming what is missing."""
    path = tmp_path / "missing.gguf"
    write_tiny_gguf(path, skip_tensors=("blk.1.attn_v.weight",))
    with pytest.raises(ValueError, match=r"lacks the tensors for model\.layers\.1\.self_attn\.v"):
        load_gguf(path)


def test_missing_file_is_file_not_found(tmp_path: Path) -> None:
    """Check a path that does not exist raises FileNotFoundError."""
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "nope.gguf")
