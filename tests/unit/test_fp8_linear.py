"""FP8 weights: quantization, Fp8Linear's two matmul paths, and FP8 checkpoint loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from infer8.attention.kv_cache import KVCacheSpec, allocate_kv_cache
from infer8.attention.metadata import build_attention_metadata
from infer8.attention.reference import ReferenceAttention
from infer8.layers import fp8_linear
from infer8.layers.fp8_linear import Fp8Linear
from infer8.models import fp8_weights
from infer8.models.loader import load_model

# e4m3 keeps 4 significant bits: rounding moves a value by up to 2**-4 of itself, ~2.5% RMS.
WEIGHT_ONLY_TOL = 0.04
WEIGHT_AND_INPUT_TOL = 0.06


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _linear(seed: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(128, 96, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.mul_(torch.logspace(-4, 1, 96)[:, None].to(torch.bfloat16))  # uneven rows
    return linear


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_linear_reference_path_is_close_to_the_16_bit_matmul(per_channel: bool) -> None:
    linear = _linear(0)
    layer = Fp8Linear.from_linear(linear, per_channel=per_channel)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (96,)
    x = torch.randn(7, 128, dtype=torch.bfloat16)
    want = linear(x)
    if per_channel:
        assert _rel(layer(x), want) < WEIGHT_ONLY_TOL
    else:  # one scale for rows 1e5 apart: the small rows lose precision, the large do not
        assert _rel(layer.dequantized_weight(torch.float32), linear.weight) < WEIGHT_ONLY_TOL


def test_per_channel_scales_keep_small_rows_precise() -> None:
    linear = _linear(1)
    small = slice(0, 10)  # rows ~1e5 smaller than the largest: subnormal under one scale
    errs = {}
    for per_channel in (True, False):
        w = Fp8Linear.from_linear(linear, per_channel).dequantized_weight(torch.float32)
        errs[per_channel] = _rel(w[small], linear.weight[small])
    assert errs[True] < 0.04 < errs[False]


@pytest.mark.parametrize("static_input", [False, True])
def test_scaled_mm_path_matches_its_emulation(static_input: bool) -> None:
    """The _scaled_mm call (which also runs on CPU) uses the scales the way the math says."""
    linear = _linear(2)
    layer = Fp8Linear.from_linear(linear, per_channel=True, use_scaled_mm=True)
    x = torch.randn(5, 3, 128, dtype=torch.bfloat16)
    if static_input:
        layer.input_scale = x.abs().amax().float() / 448.0
    got = layer(x)
    assert got.shape == (5, 3, 96) and got.dtype == torch.bfloat16
    xq, x_scale = layer.quantize_input(x.reshape(-1, 128))
    emulated = (xq.float() * x_scale) @ layer.dequantized_weight(torch.float32).T
    emulated = (emulated + linear.bias.float()).reshape(5, 3, 96)
    assert _rel(got, emulated) < 4e-3  # bf16 output rounding only
    assert _rel(got, linear(x)) < WEIGHT_AND_INPUT_TOL


def test_scaled_mm_probe_runs_the_forwards_call_and_takes_a_tuple_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # older torch builds return (out, amax); the forward and the probe take the product
    real = torch._scaled_mm
    calls: list[tuple] = []

    def tuple_scaled_mm(a, b, *, scale_a, scale_b, out_dtype):  # type: ignore[no-untyped-def]
        calls.append((tuple(scale_a.shape), tuple(scale_b.shape), out_dtype))
        out = real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        return out, torch.zeros(())

    monkeypatch.setattr(torch, "_scaled_mm", tuple_scaled_mm)
    linear = _linear(3)
    layer = Fp8Linear.from_linear(linear, per_channel=True, use_scaled_mm=True)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    assert _rel(layer(x), linear(x)) < WEIGHT_AND_INPUT_TOL
    a = torch.ones((16, 16)).to(fp8_linear.WEIGHT_DTYPE)
    out = fp8_linear.scaled_mm(
        a, a.t(), torch.full((16, 1), 2.0), torch.full((1, 16), 0.5), torch.bfloat16
    )
    assert out.dtype == torch.bfloat16 and bool((out == 16.0).all())
    # the forward's call: row-wise scales, the model dtype out (what the CUDA probe now tries)
    assert calls[0] == ((4, 1), (1, 96), torch.bfloat16)
    assert calls[1] == ((16, 1), (1, 16), torch.bfloat16)


def test_module_to_dtype_keeps_fp8_weights_and_fp32_scales() -> None:
    layer = Fp8Linear.from_linear(_linear(3)).to(torch.float32).to(torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.dtype == torch.float32
    assert layer.bias is not None and layer.bias.dtype == torch.bfloat16


def _prefill_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    cfg = model.config
    spec = KVCacheSpec(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 16, torch.float32
    )
    caches = allocate_kv_cache(spec, 4, torch.device("cpu"))
    n = len(token_ids)
    meta = build_attention_metadata([n], [0], [[0, 1, 2, 3]], 16, torch.device("cpu"))
    model.set_attention_backend(ReferenceAttention())
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(n), meta, caches)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_checkpoint_loads_into_fp8_linears(
    llama_dir: Path, tmp_path: Path, per_channel: bool
) -> None:
    fp8_weights.save_fp8_checkpoint(llama_dir, tmp_path, per_channel=per_channel)
    model, hf_config, _ = fp8_weights.load_fp8_model(tmp_path, torch.float32, torch.device("cpu"))
    assert fp8_weights.fp8_checkpoint_scheme(hf_config) == {"static_input_scale": False}
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    assert isinstance(layer.mlp.gate_up_proj, Fp8Linear)

    reference, _, _ = load_model(str(llama_dir), torch.float32, torch.device("cpu"))
    # the fused QKV rows carry each shard's own scale: equal to quantizing q, k, v separately
    ckpt = load_file(str(tmp_path / "model.safetensors"))
    k_scale = ckpt["model.layers.0.self_attn.k_proj.weight_scale"].reshape(-1)
    q_rows = model.config.num_attention_heads * model.config.head_dim
    k_rows = slice(q_rows, q_rows + model.config.num_key_value_heads * model.config.head_dim)
    assert torch.equal(
        layer.self_attn.qkv_proj.weight_scale[k_rows], k_scale.expand(k_rows.stop - q_rows)
    )

    prompt = [5, 17, 42, 99, 7, 300, 12, 8, 64, 3, 200, 150]
    want = _prefill_logits(reference, prompt)
    got = _prefill_logits(model, prompt)
    # a tiny random model amplifies weight rounding (~9% here); swapped or misplaced shard
    # rows would be ~100% off
    assert _rel(got, want) < 0.15
    if per_channel:  # loading the checkpoint == quantizing the 16-bit model in memory
        fp8_weights.quantize_model_weights(reference, per_channel=True)
        assert torch.equal(got, _prefill_logits(reference, prompt))


@pytest.mark.parametrize("arch_dir", ["llama_dir", "qwen2_dir"])
def test_quantizing_on_load_equals_quantizing_the_loaded_16_bit_model(
    arch_dir: str, request: pytest.FixtureRequest
) -> None:
    # --quantization fp8 quantizes each tensor as it is loaded, never holding a 16-bit model
    model_dir = str(request.getfixturevalue(arch_dir))
    cpu = torch.device("cpu")
    got, _, _ = load_model(model_dir, torch.bfloat16, cpu, quantization="fp8")
    want, _, _ = load_model(model_dir, torch.bfloat16, cpu)
    fp8_weights.quantize_model_weights(want)
    got_state, want_state = got.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    for name, tensor in want_state.items():
        assert got_state[name].dtype == tensor.dtype, name
        assert torch.equal(got_state[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert isinstance(got.layers[1].mlp.down_proj, Fp8Linear)
    prompt = [5, 17, 42, 99, 7, 300, 12, 8]
    assert torch.equal(_prefill_logits(got, prompt), _prefill_logits(want, prompt))


def test_fp8_checkpoint_errors_are_clear(llama_dir: Path, tmp_path: Path) -> None:
    fp8_weights.save_fp8_checkpoint(llama_dir, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match="missing weight_scale for model.layers.1.mlp.gate_up_proj"
    ):
        fp8_weights.load_fp8_model(tmp_path, torch.float32, torch.device("cpu"))

    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="block-wise FP8"):
        fp8_weights.fp8_checkpoint_scheme(config)
    config["quantization_config"] = {"quant_method": "awq"}
    with pytest.raises(ValueError, match="unsupported quantization method 'awq'"):
        fp8_weights.fp8_checkpoint_scheme(config)


def test_scaled_mm_probe_says_why_it_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    from infer8.layers.fp8_linear import supports_scaled_mm

    with caplog.at_level("INFO", logger="infer8.layers.fp8_linear"):
        assert supports_scaled_mm(torch.device("cpu")) is False
    assert "dequantize then matmul" in caplog.text and "no FP8 matmul on cpu" in caplog.text
