"""LoRA pieces without an engine: the step's grouped products, slots, adapter checks, flags."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from infer8.config import EngineArgs
from infer8.lora.config import LoRAConfig, LoRAModulePath, LoRARequest
from infer8.lora.peft import read_adapter
from infer8.lora.slots import LoRAManager, LoRASlots, LoRAStep, build_mapping
from infer8.models.llama import LlamaArchConfig

ARCH = LlamaArchConfig.from_hf_config(dict(
    architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
))  # fmt: skip
PREFIX = "base_model.model.model.layers"


def write_adapter(
    path: Path, rank: int = 4, config: dict | None = None, **tensors: torch.Tensor
) -> Path:
    """Write a PEFT-format adapter of q_proj and down_proj (plus `tensors`) into path."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}
    cfg.update(config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(rank)
    weights = {
        f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.randn(rank, 32, generator=gen),
        f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.randn(32, rank, generator=gen),
        f"{PREFIX}.1.mlp.down_proj.lora_A.weight": torch.randn(rank, 48, generator=gen),
        f"{PREFIX}.1.mlp.down_proj.lora_B.weight": torch.randn(32, rank, generator=gen),
    }
    weights.update(tensors)
    save_file(weights, str(path / "adapter_model.safetensors"))
    return path


def test_grouped_products_equal_a_per_token_reference() -> None:
    """Tokens of three slots and the base, interleaved: each row gets its own slot's x A^T B
    (float32 rounding), base rows stay bit for bit; one adapter for all tokens likewise."""
    gen = torch.Generator().manual_seed(0)
    slots = LoRASlots(
        ARCH, max_loras=4, max_rank=8, dtype=torch.float32, device=torch.device("cpu")
    )
    for buf in slots.buffers():
        buf.copy_(torch.randn(buf.shape, generator=gen))
    x = torch.randn(9, 32, generator=gen)
    y0 = torch.randn(9, 32 + 2 * 16, generator=gen)
    a, b = slots.tensors("qkv", 1)
    for token_slots in ([0, -1, 2, 2, 0, 3, -1, 0, 3], [1] * 9, [-1, 3, -1, -1, 3, 3, 3, -1, -1]):
        ts = np.asarray(token_slots)
        mapping = build_mapping(ts, torch.device("cpu"), torch.float32, rank=8)
        assert mapping is not None
        y = y0.clone()
        LoRAStep(slots, mapping).add("qkv", 1, x, y)
        for t, s in enumerate(token_slots):
            want = y0[t] if s < 0 else y0[t] + (x[t] @ a[s].T) @ b[s]
            if s < 0:
                assert torch.equal(y[t], want)
            else:
                torch.testing.assert_close(y[t], want, rtol=1e-5, atol=1e-4)
    assert build_mapping(np.full(4, -1), torch.device("cpu"), torch.float32, 8) is None


def test_slots_hold_each_adapter_in_its_fused_place_and_evict_lru(tmp_path: Path) -> None:
    """An adapter's q_proj lands in qkv's rank-major rows (rank j of q at row 3j) and q
    columns (scaled by alpha/r), everything else zero; a step reads only the rows of its
    adapters' largest rank; a third adapter takes the least recently used of two slots."""
    slots = LoRASlots(
        ARCH, max_loras=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu")
    )
    manager = LoRAManager(slots, ARCH, LoRAConfig(2, 8, 2), torch.float32, torch.device("cpu"))
    loras = [
        LoRARequest(f"l{r}", r, str(write_adapter(tmp_path / f"l{r}", rank=r))) for r in (2, 4, 8)
    ]
    assert manager.activate(loras[:2]) == {2: 0, 4: 1}
    a, b = slots.tensors("qkv", 0)
    w = read_adapter(loras[0].lora_path, ARCH, 8, torch.float32)
    qa, qb = w.modules[(0, "q_proj")]
    assert torch.equal(a[0, 0:6:3], qa) and a[0].abs().sum() == qa.abs().sum()
    assert torch.equal(b[0, 0:6:3, :32], qb.t()) and b[0].abs().sum() == qb.abs().sum()
    x = torch.randn(3, 32)
    step = manager.step(np.array([0, 0, 0]))
    assert step is not None and step.mapping.rank == 2
    y = torch.zeros(3, 64)
    step.add("qkv", 0, x, y)
    torch.testing.assert_close(y[:, :32], x @ qa.T @ qb.T)
    assert y[:, 32:].abs().sum() == 0
    torch.testing.assert_close(
        qb, read_adapter(loras[0].lora_path, ARCH, 8, torch.float32).modules[(0, "q_proj")][1]
    )
    assert slots.tensors("o", 0)[0].abs().sum() == 0  # o_proj not targeted
    manager.activate([loras[0]])  # l2 used last: l4 is the least recently used
    assert manager.activate([loras[2]]) == {8: 1}
    assert manager.activate([loras[0], loras[2]]) == {2: 0, 8: 1}


def test_scaling_follows_alpha_and_rslora(tmp_path: Path) -> None:
    plain = read_adapter(write_adapter(tmp_path / "p", rank=4), ARCH, 8, torch.float32)
    rs = read_adapter(write_adapter(tmp_path / "r", rank=4, config={"use_rslora": True}), ARCH, 8,
                      torch.float32)  # fmt: skip
    # alpha 8, r 4: 2 (plain) vs 8 / sqrt(4) = 4 (rsLoRA)
    torch.testing.assert_close(rs.modules[(0, "q_proj")][1], 2 * plain.modules[(0, "q_proj")][1])


def _corrupt(path: Path) -> None:
    (path / "adapter_model.safetensors").write_bytes(b"\x00" * 20)


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing", "no such directory"),
    (lambda p: (p.mkdir(), p)[1], "no adapter_config.json"),
    (lambda p: (write_adapter(p), (p / "adapter_config.json").write_text("{"), p)[2], "not valid JSON"),
    (lambda p: write_adapter(p, config={"use_dora": True}), "DoRA"),
    (lambda p: write_adapter(p, config={"bias": "all"}), "trained biases"),
    (lambda p: write_adapter(p, config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (lambda p: write_adapter(p, config={"peft_type": "IA3"}), "peft_type IA3"),
    (lambda p: write_adapter(p, config={"alpha_pattern": {"q_proj": 4}}), "alpha_pattern"),
    (lambda p: write_adapter(p, rank=32), "rank 32 is above --max-lora-rank 16"),
    (lambda p: write_adapter(p, **{f"{PREFIX}.0.self_attn.k_proj.lora_A.weight": torch.zeros(4, 32),
                                   f"{PREFIX}.0.self_attn.k_proj.lora_B.weight": torch.zeros(32, 4)}),
     "do not fit the base model's [16, 32]"),
    (lambda p: write_adapter(p, **{f"{PREFIX}.5.mlp.up_proj.lora_A.weight": torch.zeros(4, 32),
                                   f"{PREFIX}.5.mlp.up_proj.lora_B.weight": torch.zeros(48, 4)}),
     "layer 5, but the base model has 2 layers"),
    (lambda p: write_adapter(p, **{f"{PREFIX}.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 32)}),
     "lacks its lora_B"),
    (lambda p: write_adapter(p, **{"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 100)}),
     "embedding or LM-head targets"),
    (lambda p: write_adapter(p, **{f"{PREFIX}.0.mlp.fc1.lora_A.weight": torch.zeros(4, 32)}),
     "target module 'fc1' is not supported"),
    (lambda p: (write_adapter(p), _corrupt(p), p)[2], "not a safetensors file"),
    (lambda p: (write_adapter(p), (p / "adapter_model.safetensors").rename(p / "adapter_model.bin"), p)[2],
     "adapter_model.bin: convert it"),
])  # fmt: skip
def test_bad_adapters_are_refused_in_one_line(tmp_path: Path, make, message: str) -> None:
    path = make(tmp_path / "adapter")
    with pytest.raises(ValueError, match="LoRA adapter") as info:
        read_adapter(path, ARCH, 16)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_lora_flags_are_checked_before_anything_loads() -> None:
    assert LoRAModulePath.parse("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    parsed = LoRAModulePath.parse('{"name": "sql", "path": "/a", "base_model_name": "m"}')
    assert parsed == LoRAModulePath("sql", "/a", "m")
    for bad in ("sql", "=/a", '{"name": "x"}', '{"name": "x", "path": "/a", "rank": 2}', "{oops"):
        with pytest.raises(ValueError, match="--lora-modules"):
            LoRAModulePath.parse(bad)
    with pytest.raises(ValueError, match="--max-cpu-loras .2. must be at least --max-loras .4."):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="continuous scheduler"):
        EngineArgs(enable_lora=True, scheduler="static").create_lora_config()
    with pytest.raises(ValueError, match="tensor-parallel"):
        EngineArgs(enable_lora=True, tensor_parallel_size=2).create_lora_config()
    assert EngineArgs().create_lora_config() is None
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "/a")


def test_serve_flags(tmp_path: Path) -> None:
    from infer8.entrypoints.openai.cli_args import make_serve_parser, serve_args_from

    parser = make_serve_parser()
    ns = parser.parse_args(["m", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64",
                            "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}'])  # fmt: skip
    engine_args, server = serve_args_from(ns)
    assert (engine_args.enable_lora, engine_args.max_loras, engine_args.max_lora_rank) == (
        True,
        4,
        64,
    )
    assert server.lora_modules == ("a=/x", '{"name": "b", "path": "/y"}')
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--lora-modules", "a=/x"])  # without --enable-lora
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--enable-lora", "--lora-modules", "a=/x", "a=/y"])  # twice


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_equals_the_reference(dtype: torch.dtype) -> None:
    """csrc/lora.c over tokens of three slots and the base, interleaved (blocks of one adapter
    end at a slot change or after four tokens), fused modules of odd widths and a rank below
    the slots': each row gets its own slot's x A^T B (float32 arithmetic, y rounded once),
    base rows stay bit for bit."""
    from infer8.kernels.cpu import NativeKernels

    native = NativeKernels.load()
    if native is None:
        pytest.skip("no C compiler: the torch path serves LoRA")
    gen = torch.Generator().manual_seed(1)
    arch = LlamaArchConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=40, intermediate_size=56,
        num_hidden_layers=1, num_attention_heads=5, num_key_value_heads=1,
        max_position_embeddings=64, head_dim=8,
    ))  # fmt: skip
    slots = LoRASlots(
        arch, max_loras=3, max_rank=8, dtype=torch.float32, device=torch.device("cpu")
    )
    for fused, cols in slots.cols.items():  # module i's rows (j * n + i) reach its columns only
        a, b = getattr(slots, f"a_{fused}"), getattr(slots, f"b_{fused}")
        a.copy_(torch.randn(a.shape, generator=gen))
        n = len(cols) - 1
        for i in range(n):
            b[:, :, i::n, cols[i] : cols[i + 1]] = torch.randn(
                b[:, :, i::n, cols[i] : cols[i + 1]].shape, generator=gen
            )
    token_slots = np.array([0, 0, 0, 0, 0, 2, -1, 1, 1, 2, 2, -1, 0])
    step = LoRAStep(
        slots, build_mapping(token_slots, torch.device("cpu"), torch.float32, 5, native=True),
        native=native.elementwise,
    )  # fmt: skip
    for fused, (in_features, out_features) in {
        "qkv": (40, 56),
        "gate_up": (40, 112),
        "down": (56, 40),
    }.items():
        x = torch.randn(13, in_features, generator=gen).to(dtype)
        y0 = torch.randn(13, out_features, generator=gen).to(dtype)
        y = y0.clone()
        step.add(fused, 0, x, y)
        a, b = slots.tensors(fused, 0)
        rows = 5 * len(slots.cols[fused]) - 5  # rank 5 x n modules
        for t, s in enumerate(token_slots):
            if s < 0:
                assert torch.equal(y[t], y0[t])
                continue
            want = y0[t].double() + (x[t].double() @ a[s, :rows].double().T) @ b[s, :rows].double()
            tol = 1e-4 if dtype == torch.float32 else 2.0**-7 * want.abs().max().item()
            torch.testing.assert_close(y[t].double(), want, rtol=0, atol=tol)


def test_bf16_slots_keep_float32_copies_for_the_kernel(tmp_path: Path) -> None:
    """A bf16 model's slots hold each adapter twice: bf16 for the batched matmuls (prefill
    chunks), float32 (not the bf16 values widened) for the CPU kernel."""
    slots = LoRASlots(ARCH, max_loras=1, max_rank=4, dtype=torch.bfloat16,
                      device=torch.device("cpu"), with_float32=True)  # fmt: skip
    weights = read_adapter(write_adapter(tmp_path / "a", rank=4), ARCH, 8, torch.float32)
    slots.load(0, weights)
    qa = weights.modules[(0, "q_proj")][0]
    a16, _ = slots.tensors("qkv", 0)
    a32, _ = slots.float32_views()["qkv"][0]
    assert a16.dtype == torch.bfloat16 and a32.dtype == torch.float32
    assert torch.equal(a32[0, 0:12:3], qa) and torch.equal(a16[0, 0:12:3], qa.bfloat16())


def test_prefix_blocks_and_kv_events_are_keyed_by_adapter() -> None:
    """The same tokens under two adapters and the base hash to three chains; each BlockStored
    names its adapter (vLLM's lora_id / lora_name) on the wire."""
    import msgspec

    from infer8.core.kv_cache_manager import KVCacheManager
    from infer8.kv_events import KVEventEncoder
    from infer8.request import Request
    from infer8.sampling_params import SamplingParams

    kv = KVCacheManager(16, 4, enable_caching=True, enable_kv_cache_events=True)
    loras = [LoRARequest("sql", 1, "/a"), LoRARequest("chat", 2, "/b"), None]
    hashes = []
    for i, lora in enumerate(loras):
        request = Request(
            f"r{i}", list(range(8)), SamplingParams(max_tokens=1), [0], lora_request=lora
        )
        assert kv.find_prefix(request)[0] == []  # no chain of another adapter is a hit
        assert kv.allocate_slots(request, 8) is not None
        hashes.append(tuple(kv.block_hashes(request, 2)))
    assert len(set(hashes)) == 3
    events = kv.block_pool.take_events()
    assert [(e.lora_id, e.lora_name) for e in events] == [(1, "sql"), (2, "chat"), (None, None)]
    wire = msgspec.msgpack.decode(KVEventEncoder().encode(events[:1], 0.0))
    assert (wire[1][0]["lora_id"], wire[1][0]["lora_name"]) == (1, "sql")


def test_host_tier_events_name_the_adapter() -> None:
    """A block of an adapter evicted to the host tier is announced there with its adapter."""
    from infer8.core.kv_cache_manager import KVCacheManager
    from infer8.core.kv_events import MEDIUM_HOST
    from infer8.request import Request
    from infer8.sampling_params import SamplingParams

    kv = KVCacheManager(4, 4, enable_caching=True, enable_kv_cache_events=True, num_host_blocks=8)
    params = SamplingParams(max_tokens=1)
    first = Request("a", list(range(8)), params, [0], lora_request=LoRARequest("sql", 3, "/a"))
    assert kv.allocate_slots(first, 8) is not None
    kv.free("a")
    second = Request("b", list(range(50, 66)), params, [0])  # takes every block: A's are evicted
    assert kv.allocate_slots(second, 16) is not None
    host = [e for e in kv.block_pool.take_events() if getattr(e, "medium", None) == MEDIUM_HOST]
    stored = [e for e in host if hasattr(e, "lora_id")]
    assert stored and all((e.lora_id, e.lora_name) == (3, "sql") for e in stored)
