"""dtype "auto" follows what the CPU computes fast: bf16 with bf16 units, float32 without."""

from __future__ import annotations

import pytest
import torch

from infer8.config import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    EngineArgs,
    cpu_has_fast_bf16,
    cuda_max_num_batched_tokens,
    default_dtype,
)

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f amx_bf16 amx_tile\n"
AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\nprocessor\t: 1\nflags\t\t: avx2\n"
GRAVITON3 = "Features\t: fp asimd sve bf16 i8mm\n"


def test_bf16_units_are_recognised_on_x86_and_arm() -> None:
    assert cpu_has_fast_bf16(ZEN4)
    assert cpu_has_fast_bf16(SAPPHIRE_RAPIDS)
    assert cpu_has_fast_bf16(GRAVITON3)
    assert not cpu_has_fast_bf16(AVX2_ONLY)
    assert cpu_has_fast_bf16("")  # nothing known: keep the documented default


def test_auto_dtype_is_never_fp16_and_avoids_emulated_bf16() -> None:
    cpu = torch.device("cpu")
    assert default_dtype(cpu, ZEN4) == torch.bfloat16
    assert default_dtype(cpu, AVX2_ONLY) == torch.float32
    assert default_dtype(torch.device("cuda"), AVX2_ONLY) == torch.bfloat16


def test_engine_args_resolve_auto_to_this_machines_fast_dtype(tmp_path) -> None:
    model_config, _, _ = EngineArgs(model=str(tmp_path), device="cpu").create_configs(str(tmp_path))
    assert model_config.dtype == default_dtype(torch.device("cpu"))
    assert model_config.dtype != torch.float16
    explicit, _, _ = EngineArgs(model=str(tmp_path), device="cpu", dtype="bfloat16").create_configs(
        str(tmp_path)
    )
    assert explicit.dtype == torch.bfloat16


def test_max_num_batched_tokens_auto_follows_the_device() -> None:
    gib = 1 << 30
    # vLLM's serving defaults: large-memory GPUs except A100s get 8192, the rest 2048
    assert cuda_max_num_batched_tokens(int(139.8 * gib), "NVIDIA H200") == 8192
    assert cuda_max_num_batched_tokens(int(79.1 * gib), "NVIDIA H100 80GB HBM3") == 8192
    assert cuda_max_num_batched_tokens(int(79.2 * gib), "NVIDIA A100-SXM4-80GB") == 2048
    assert cuda_max_num_batched_tokens(int(22.0 * gib), "NVIDIA L4") == 2048


def test_max_num_batched_tokens_auto_on_cpu_and_explicit_values(tmp_path) -> None:
    _, _, sched = EngineArgs(device="cpu").create_configs(str(tmp_path))
    assert sched.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS
    _, _, sched = EngineArgs(device="cpu", max_num_batched_tokens=300).create_configs(str(tmp_path))
    assert sched.max_num_batched_tokens == 300
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        EngineArgs(device="cpu", max_num_batched_tokens=0).create_configs(str(tmp_path))
