"""The device side on its own: loading without a full-precision copy, one memory estimate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from infer8 import plan, plan_presets
from infer8.attention import select_backend
from infer8.attention.kv_cache import KVCacheSpec
from infer8.config import EngineArgs
from infer8.engine import LLMEngine
from infer8.worker.cpu_linear import packing_applies
from infer8.worker.memory import device_memory_bytes
from tests.utils import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]

# Load in a fresh process and sample its anonymous memory (RssAnon) every millisecond.
_PEAK_SCRIPT = """
import json, sys, threading, time
import torch
from infer8.models.loader import load_model

def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

peak = [0]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.001)

quantization = sys.argv[3] if len(sys.argv) > 3 else None
# a small load first: torch's one-time set-up (thread pools, allocator arenas) is not loading
load_model(sys.argv[2], torch.bfloat16, torch.device("cpu"), quantization=quantization)
base = rss_anon()
thread = threading.Thread(target=sample)
thread.start()
model, _, _ = load_model(sys.argv[1], torch.bfloat16, torch.device("cpu"), quantization=quantization)
done.set()
thread.join()
weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
print(json.dumps({"peak_over_base": max(peak[0], rss_anon()) - base, "weights": weights}))
"""


@pytest.fixture(scope="module")
def medium_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ~75M parameters: a 300 MB float32 checkpoint, 150 MB of bf16 weights once loaded.
    return build_tiny_model(
        tmp_path_factory.mktemp("medium"),
        "llama",
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=4,
    )


def test_loading_never_holds_a_full_precision_copy(medium_model: Path, tmp_path: Path) -> None:
    small = build_tiny_model(tmp_path, "llama")
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(medium_model), str(small)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["weights"] > 100e6  # big enough for a float32 copy (2x) to show
    # the final bf16 weights plus one checkpoint tensor in flight; a float32 copy would be 3x
    assert figures["peak_over_base"] <= 1.25 * figures["weights"], figures


def test_fp8_quantization_never_holds_the_16_bit_model(medium_model: Path, tmp_path: Path) -> None:
    small = build_tiny_model(tmp_path, "llama")
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(medium_model), str(small), "fp8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["weights"] > 60e6  # FP8 linears, 16-bit embeddings and LM head
    # the FP8 weights plus one projection in flight: 1.4-1.8x here (RSS, so the allocator's
    # timing shows); the 16-bit model with its FP8 copies made beside it: 3.3x (241 vs 73 MB)
    assert figures["peak_over_base"] <= 2.3 * figures["weights"], figures


def test_plan_and_engine_agree_on_the_kv_budget(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path, "qwen2", num_hidden_layers=2)
    utilization = 0.001  # "what is left" decides, on any machine with over ~2 GiB of RAM
    engine = LLMEngine(
        EngineArgs(
            model=str(model_dir),
            dtype="bfloat16",
            device="cpu",
            gpu_memory_utilization=utilization,
            max_num_seqs=256,
            max_num_batched_tokens=512,
            max_model_len=512,
        )
    )
    shape = plan_presets.ModelShape.from_hf_config(
        json.loads((model_dir / "config.json").read_text()), "tiny"
    )
    ram = device_memory_bytes(torch.device("cpu"))
    inputs = plan.PlanInputs(
        model=shape,
        device=plan_presets.DeviceSpec(
            "this host's RAM",
            ram,
            1e10,
            packed_tied_lm_head=packing_applies(torch.device("cpu"), torch.bfloat16),
        ),
        gpu_memory_utilization=utilization,
        max_num_seqs=256,
        max_num_batched_tokens=512,
        max_model_len=512,
        use_kv_scales=False,
    )
    planned = plan.plan_capacity(inputs)
    kv_bytes_engine = engine.num_blocks * engine.kv_spec.bytes_per_block
    assert planned.max_kv_tokens == engine.num_blocks * engine.cache_config.block_size
    assert planned.kv_budget_bytes - kv_bytes_engine < engine.kv_spec.bytes_per_block


def _spec(dtype: torch.dtype, tail: int = 0) -> KVCacheSpec:
    return KVCacheSpec(
        num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
        exact_tail_tokens=tail, hadamard=False,
    )  # fmt: skip


def test_backend_selection_refuses_what_no_backend_runs_at_start_up() -> None:
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"fp8_e4m3 needs FP8 support \(sm_89\+.*sm_80"):
        select_backend(cuda, _spec(torch.float8_e4m3fn), capability=(8, 0))
    with pytest.raises(ValueError, match="older than Ampere"):
        select_backend(cuda, _spec(torch.bfloat16), capability=(7, 5))
    cpu_backend = select_backend(torch.device("cpu"), _spec(torch.float8_e4m3fn))
    assert type(cpu_backend).__name__ == "ReferenceAttention"  # no native kernels given
    # Ampere has no E4M3 for the tail's residuals: a tail there falls back to the reference
    ampere_tail = select_backend(cuda, _spec(torch.float8_e5m2, tail=8), capability=(8, 0))
    assert type(ampere_tail).__name__ == "ReferenceAttention"


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_backend_selection_refuses_fp8_on_a_gpu_with_only_fnuz_fp8(
    kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MI300X reports capability (9, 4): only its gfx name tells that its FP8 is fnuz
    from infer8.attention.triton import backend as triton_backend

    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"this GPU \(gfx942, MI300.*use --kv-cache-dtype auto"):
        select_backend(cuda, _spec(kv_dtype), capability=(9, 4), arch="gfx942:sramecc+:xnack-")
    # a 16-bit cache there, and FP8 on MI350 (gfx950: OCP FP8), reach the kernels
    monkeypatch.setattr(triton_backend, "TritonAttention", lambda device: "kernels")
    assert (
        select_backend(cuda, _spec(torch.bfloat16), capability=(9, 4), arch="gfx942") == "kernels"
    )
    assert select_backend(cuda, _spec(kv_dtype), capability=(9, 5), arch="gfx950") == "kernels"


def test_the_profiled_step_runs_the_largest_batch_the_scheduler_can_hand_out(
    tmp_path: Path,
) -> None:
    # On CUDA its allocator peak is the activation reserve; here it must at least run.
    from infer8.worker.memory_profile import profile_step
    from infer8.worker.worker import Worker

    model_dir = str(build_tiny_model(tmp_path, "llama"))
    args = EngineArgs(model=model_dir, dtype="float32", device="cpu", max_model_len=128)
    worker = Worker.from_args(args, model_dir)
    probs = profile_step(worker.model, worker.kv_spec, 300, 7, 128, torch.device("cpu"))
    assert probs.shape == (7, 512) and torch.allclose(probs.sum(-1), torch.ones(7))


def test_the_memory_profile_runs_on_a_freshly_loaded_model(tmp_path: Path) -> None:
    # the start-up profile runs before the KV cache exists: the model alone must run a step
    from infer8.models.loader import load_model
    from infer8.worker.memory_profile import profile_step

    model_dir = str(build_tiny_model(tmp_path, "llama"))
    from infer8.attention.reference import ReferenceAttention

    model, _, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    model.set_attention_backend(ReferenceAttention())  # as the worker does before profiling
    spec = KVCacheSpec(2, 2, 16, 16, torch.float32)
    probs = profile_step(model, spec, 600, 5, model.config.max_position_embeddings,
                         torch.device("cpu"))  # fmt: skip
    assert probs.shape == (5, 512) and torch.isfinite(probs).all()
    # the tables cover every position the model has, in float64 rounded once
    pos = model.config.max_position_embeddings - 1
    inv_freq = 1.0 / (model.config.rope_theta ** (torch.arange(0, 16, 2).double() / 16))
    torch.testing.assert_close(model.cos_table[pos], (pos * inv_freq).cos().float())


class FakeMemoryCounters:
    """Device counters for a CPU run of the CUDA start-up path, with a known truth.

    The throwaway cache of the profile adds to `allocated`; the profiled step itself peaks at
    `step_peak_bytes` above what was live; running it loads `loaded_bytes` of kernels and
    workspaces outside the allocator (so they show in mem_get_info only after the profile).
    """

    def __init__(self, total_bytes: int, other_process_bytes: int, events: list[str]) -> None:
        self.total_bytes, self.other_process_bytes = total_bytes, other_process_bytes
        self.events = events
        self.allocated = 50 << 20  # the weights, say
        self.step_peak_bytes = 300 << 20
        self.loaded_bytes = 20 << 20
        self.has_profiled = False
        self.peak_base = 0
        self.outside = 0  # live CUDA graphs' device memory outside the allocator

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        used = self.allocated + self.other_process_bytes
        used += self.loaded_bytes if self.has_profiled else 0
        used += self.outside
        return self.total_bytes - used, self.total_bytes

    def reserved_bytes(self) -> int:
        return self.allocated

    def allocated_bytes(self) -> int:
        return self.allocated

    def reset_peak(self) -> None:
        self.events.append("profile")
        self.peak_base = self.allocated

    def peak_allocated_bytes(self) -> int:
        self.has_profiled = True
        return self.peak_base + self.step_peak_bytes


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_start_up_profiles_then_allocates_the_cache_then_captures_graphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str
) -> None:
    # the CUDA start-up order with the device swapped for CPU: fake counters, graphs recorded;
    # an FP8 cache keeps its exact tail and rotation (the defaults) and still gets graphs
    from infer8.attention.kv_cache import allocate_kv_cache
    from infer8.worker import memory_profile, model_runner, worker
    from infer8.worker.memory import GiB

    events: list[str] = []
    counters = FakeMemoryCounters(4 * GiB, 100 << 20, events)

    def profile_cache(spec, num_blocks, device, num_tail_rows=0):  # type: ignore[no-untyped-def]
        caches = allocate_kv_cache(spec, num_blocks, device, num_tail_rows)
        counters.allocated += spec.bytes_per_block * num_blocks  # live until the step ends
        return caches

    def engine_cache(*args, **kwargs):  # type: ignore[no-untyped-def]
        events.append("kv cache")
        return allocate_kv_cache(*args, **kwargs)

    monkeypatch.setattr(memory_profile, "allocate_kv_cache", profile_cache)
    monkeypatch.setattr(worker, "allocate_kv_cache", engine_cache)
    monkeypatch.setattr(worker, "cuda_graphs_apply", lambda device, enforce_eager: True)
    monkeypatch.setattr(worker.Worker, "_capture_cuda_graphs", lambda self: events.append("graphs"))
    execute = model_runner.ModelRunner.execute

    def recorded_execute(self, sched):  # type: ignore[no-untyped-def]
        kind = "prefill" if sched.scheduled_new_reqs else "decode"
        events.append(f"warm-up {kind} x{len(sched.scheduled)}")
        return execute(self, sched)

    monkeypatch.setattr(model_runner.ModelRunner, "execute", recorded_execute)
    graph_device_bytes = 400 << 20  # what instantiating the graphs takes outside the allocator

    class Graphs:
        def __init__(self) -> None:
            counters.outside += graph_device_bytes

        def __del__(self) -> None:
            counters.outside -= graph_device_bytes

    def graph_capture(self, model, max_model_len):  # type: ignore[no-untyped-def]
        def capture(caches):  # type: ignore[no-untyped-def]
            assert caches[0].k.shape[1] < 64, "captured on the throwaway cache"
            events.append("warm-up graphs")
            return Graphs()

        return capture

    monkeypatch.setattr(worker.Worker, "_graph_capture", graph_capture)
    model_dir = str(build_tiny_model(tmp_path, "llama"))
    args = EngineArgs(
        model=model_dir, dtype="float32", device="cpu", gpu_memory_utilization=0.25,
        max_num_seqs=4096, max_num_batched_tokens=1024, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    w = worker.Worker.from_args(args, model_dir, memory_counters=counters)
    assert w.uses_exact_tail == (kv_cache_dtype == "fp8_e4m3")
    # the serving kernels (a prefill, a decode over every sampler path) and the graphs run
    # once on a throwaway cache before the budget is read
    assert events == [
        "profile", "warm-up prefill x4", "warm-up decode x4", "warm-up graphs", "kv cache", "graphs"
    ]  # fmt: skip
    plan_ = w.memory_plan
    assert plan_.is_measured and plan_.source == "left"
    # the step's own peak, not the throwaway cache it ran on
    assert plan_.activation_bytes == counters.step_peak_bytes
    # other processes, and what the profile loaded outside the allocator
    assert plan_.other_bytes == counters.other_process_bytes + counters.loaded_bytes
    left = int(0.25 * 4 * GiB) - plan_.weight_bytes - plan_.activation_bytes - plan_.other_bytes
    left -= plan_.graph_bytes
    # the graphs' reserve is what capturing them took on the device (above the estimate here)
    assert w._graph_reserve_bytes(w.model) < graph_device_bytes == plan_.graph_bytes
    assert plan_.kv_bytes == left
    assert w.num_blocks == w.kv_spec.num_blocks_for(left, w.num_tail_rows)


def test_the_cuda_graph_reserve_covers_the_split_k_partials() -> None:
    from infer8.worker.memory import GiB, cuda_graph_bytes

    # 512 rows of a 70B-shaped rank (64 heads of 128, 32 splits): the float32 partials
    # alone are 512 * 64 * 32 * 129 * 4 bytes, more than a fixed half GiB
    partial_bytes = 512 * 64 * 32 * 129 * 4
    reserve = cuda_graph_bytes(512, 8192, 28672, 64, 128, 32, num_bucket_rows=3000)
    assert partial_bytes > GiB // 2 and reserve > partial_bytes + 3000 * 8192 * 2
    # and it grows with the batch (a small max_num_seqs reserves little)
    assert cuda_graph_bytes(8, 8192, 28672, 64, 128, 32, num_bucket_rows=15) < reserve / 50


def test_memory_report_names_every_deduction() -> None:
    from infer8.worker.memory import GiB, plan_kv_memory

    plan_ = plan_kv_memory(
        80 * GiB, 0.9, 16 * GiB, 2 * GiB, 100 * GiB, is_cpu=False,
        other_bytes=3 * GiB, graph_bytes=GiB // 2, is_measured=True,
    )  # fmt: skip
    assert plan_.kv_bytes == int(0.9 * 80 * GiB) - 16 * GiB - 2 * GiB - 3 * GiB - GiB // 2
    report = plan_.report(is_cpu=False)
    assert "other processes 3.00 GiB" in report and "(measured)" in report
    assert "CUDA graphs 0.50 GiB" in report
    with pytest.raises(ValueError, match="other processes"):
        plan_kv_memory(80 * GiB, 0.5, 30 * GiB, 2 * GiB, GiB, False, other_bytes=9 * GiB)


def _gpu_check_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_the_gpu_checks_engine_smoke_runs_and_checks_on_cpu(tmp_path: Path) -> None:
    # benchmarks/gpu_check.py's engine section, run here so the first GPU hour is not its test
    out = _gpu_check_module().engine_smoke(torch.device("cpu"), tmp_path)
    assert out["failures"] == [] and out["eager_fp32_matches_cpu_reference"] is True
    assert out["prefix_cache_hit_tokens"] >= 144  # nine full 16-token blocks of 160 tokens
    assert out["fp8_uses_tail_and_rotation"] is True


def test_the_gpu_checks_fp8_agreement_bounds_hold_on_cpu(tmp_path: Path) -> None:
    out = _gpu_check_module().fp8_agreement(torch.device("cpu"), tmp_path)
    assert out["fp8_linear_layers"] == 4 * 4  # qkv, o, gate_up, down in each of 4 layers
    for name in ("fp8 cache, tail + rotation", "fp8 cache, no tail", "fp8 weights"):
        assert 0.0 < out[name]["kl_mean"] and out[name]["top1_agreement"] < 1.0  # not bf16 again


def test_the_gpu_checks_fp8_agreement_fails_past_its_bounds() -> None:
    fails = _gpu_check_module().agreement_failure
    ok = {"kl_mean": 1e-3, "top1_agreement": 0.9}
    assert fails("x", ok, 0.01, 0.85) is None
    assert "KL 2.00e-02" in str(fails("x", {**ok, "kl_mean": 0.02}, 0.01, 0.85))
    assert fails("x", {**ok, "top1_agreement": 0.8}, 0.01, 0.85) is not None
    assert fails("x", {**ok, "kl_mean": float("nan")}, 0.01, 0.85) is not None


def test_the_gpu_checks_memory_split_reports_every_part_on_cpu(tmp_path: Path) -> None:
    out = _gpu_check_module().memory_split(
        torch.device("cpu"), tmp_path, max_num_seqs=4, max_position_embeddings=256
    )
    assert out["failures"] == [] and out["source"] == "need"  # 4 x 256 tokens is all it needs
    assert out["num_blocks"] * 16 >= 256 and out["max_model_len"] == 256
    assert 0 < out["kv_allocated_gib"] <= out["kv_budget_gib"] and out["weights_gib"] > 0
    assert "KV cache" in out["report"] and "2 x 240" in out["workload"]


def test_the_gpu_checks_sampling_checks_hold_on_cpu() -> None:
    out = _gpu_check_module().sampling(torch.device("cpu"))
    assert out["seeds_reproduce"] is True and out["failures"] == []
    assert out["temperature_1_distinct_tokens"] >= 2
    # repetition: outputs 0, 1 and prompt 1, 2, 3 halved, so 4 (7.0) leads; presence and
    # frequency count outputs only: 0 drops below 1 (8.6)
    assert out["penalised_greedy_tokens"] == [4, 1, 1]


def test_the_gpu_checks_sampling_catches_a_support_violation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu_check = _gpu_check_module()
    from infer8.worker import sampler

    real = sampler.Sampler.__call__

    def ignore_top_k(self, logits, states, eos_token_ids=()):  # type: ignore[no-untyped-def]
        for s in states:  # a sampler that drops top-k must fail the support check
            s.params.top_k = 0
        return real(self, logits, states, eos_token_ids)

    monkeypatch.setattr(sampler.Sampler, "__call__", ignore_top_k)
    with pytest.raises(AssertionError, match="outside its support"):
        gpu_check.sampling(torch.device("cpu"))
