"""`infer8 plan` against hand-computed numbers for real model shapes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from infer8.cli import main
from infer8.cli import main as cli_main
from infer8.config import KVCacheDType
from infer8.entrypoints.args import CHOICES
from infer8.plan import PlanInputs, estimate_activation_bytes, plan_capacity
from infer8.plan_claims import evaluate_claim
from infer8.plan_presets import (
    DEVICE_PRESETS,
    MODEL_PRESETS,
    GiB,
    load_model_shape,
)

H100 = DEVICE_PRESETS["h100-80gb"]
QWEN72 = load_model_shape("qwen2-72b-instruct")
SEED = PlanInputs(
    model=QWEN72,
    device=H100,
    weight_dtype="bf16",
    kv_cache_dtype="fp8_e4m3",
    gpu_memory_utilization=0.94,
    max_num_seqs=512,
    max_num_batched_tokens=16384,
)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["plan", *argv])
    return code, capsys.readouterr().out


def test_parameter_counts_match_the_published_totals() -> None:
    published = {
        "qwen2-72b-instruct": 72_706_203_648,
        "qwen2-7b-instruct": 7_615_616_512,
        "llama-3-8b": 8_030_261_248,
        "llama-3-70b": 70_553_706_496,
        "smollm2-135m": 134_515_008,
    }
    assert {name: load_model_shape(name).num_params for name in MODEL_PRESETS} == published


def test_qwen2_72b_count_by_hand_includes_the_qkv_biases() -> None:
    h, inter, vocab, layers, q, kv = 8192, 29568, 152064, 80, 64 * 128, 8 * 128
    per_layer = h * (q + 2 * kv) + (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    assert QWEN72.num_params == layers * per_layer + h + 2 * vocab * h
    assert QWEN72.attention_bias and not load_model_shape("llama-3-70b").attention_bias


def test_qwen2_72b_kv_bytes_per_token() -> None:
    def per_token(kv_cache_dtype: str, use_kv_scales: bool = True) -> int:
        inputs = dataclasses.replace(
            SEED, kv_cache_dtype=kv_cache_dtype, use_kv_scales=use_kv_scales
        )
        return plan_capacity(inputs).kv_bytes_per_token

    # 80 layers x 8 KV heads x 128 head_dim x (K and V)
    assert per_token("bfloat16") == 80 * 8 * 128 * 2 * 2 == 327_680
    assert per_token("auto") == 327_680
    assert per_token("fp8_e4m3", use_kv_scales=False) == 163_840
    # infer8's FP8 cache: + one bf16 scale per token per KV head, for K and V, in every layer
    assert per_token("fp8_e4m3") == 163_840 + 80 * 8 * 2 * 2 == 166_400


def test_kv_bytes_per_token_agree_with_the_engine_cache_spec() -> None:
    torch = pytest.importorskip("torch")
    from infer8.attention.kv_cache import KVCacheSpec

    for kv_cache_dtype, torch_dtype in [
        ("bfloat16", torch.bfloat16),
        ("fp8_e4m3", torch.float8_e4m3fn),
    ]:
        spec = KVCacheSpec(
            num_layers=80, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch_dtype
        )
        plan = plan_capacity(dataclasses.replace(SEED, kv_cache_dtype=kv_cache_dtype))
        assert plan.kv_bytes_per_token == spec.bytes_per_token


def test_qwen2_72b_bf16_does_not_fit_one_80gb_card() -> None:
    plan = plan_capacity(SEED)
    rope = 32768 * 128 * 2  # the rotary tables: cos and sin for every position, in bf16
    assert QWEN72.weight_bytes("bf16") == 2 * 72_706_203_648 + rope
    assert 135 < plan.weight_bytes_per_device / GiB < 136
    assert not plan.fits
    assert plan.max_concurrent_sessions == 0 and plan.decode_tokens_per_s_bound is None
    assert "weights (bf16) need 135.43 GiB" in plan.problems[0]


def test_seed_shapes_under_tensor_parallelism() -> None:
    tp4 = plan_capacity(dataclasses.replace(SEED, tensor_parallel_size=4))
    assert tp4.fits
    assert tp4.weight_bytes_per_device == -(-QWEN72.weight_bytes("bf16") // 4)
    assert tp4.kv_bytes_per_token_per_device == 166_400 // 4  # 2 of 8 KV heads per rank
    # Past the 8 KV heads each rank keeps one head: replicated, not split further.
    tp16 = plan_capacity(dataclasses.replace(SEED, tensor_parallel_size=16))
    assert tp16.kv_bytes_per_token_per_device == 166_400 // 8


@pytest.mark.parametrize(("model", "tp"), [("qwen2-72b-instruct", 3), ("smollm2-135m", 2)])
def test_tensor_parallel_size_must_divide_the_attention_heads(model: str, tp: int) -> None:
    with pytest.raises(ValueError, match="does not divide the .* attention heads"):
        dataclasses.replace(SEED, model=load_model_shape(model), tensor_parallel_size=tp)


def test_tensor_parallel_size_must_split_or_replicate_kv_heads() -> None:
    # Qwen2-7B: 28 heads, 4 KV heads; TP 14 divides 28 but is no multiple of 4.
    with pytest.raises(ValueError, match="KV heads"):
        dataclasses.replace(
            SEED, model=load_model_shape("qwen2-7b-instruct"), tensor_parallel_size=14
        )


def test_quantized_weight_bytes() -> None:
    linear = QWEN72.num_linear_params
    rest = QWEN72.num_params - linear  # embeddings, LM head, norms, biases stay bf16
    rope = 32768 * 128 * 2  # the rotary tables (bf16)
    assert QWEN72.weight_bytes("fp8") == linear + 2 * rest + rope
    assert QWEN72.weight_bytes("int4") == linear // 2 + 2 * (linear // 128) + 2 * rest + rope
    assert 70.0 < QWEN72.weight_bytes("fp8") / GiB < 70.1


def test_activation_reserve_is_the_engine_estimate() -> None:
    expected = 4 * 16384 * (4 * 8192 + 2 * 29568) * 2 + 512 * 152064 * 4 * 2
    assert estimate_activation_bytes(SEED) == expected
    assert plan_capacity(SEED).activation_reserve_bytes == expected
    given = dataclasses.replace(SEED, activation_reserve_bytes=2 * GiB)
    assert plan_capacity(given).activation_reserve_bytes == 2 * GiB


def test_llama3_8b_plan_by_hand() -> None:
    inputs = PlanInputs(
        model=load_model_shape("llama-3-8b"),
        device=H100,
        kv_cache_dtype="bfloat16",
        gpu_memory_utilization=0.9,
        max_model_len=8192,
        activation_reserve_bytes=2 * GiB,
    )
    plan = plan_capacity(inputs)
    weights = 8_030_261_248 * 2 + 8192 * 128 * 2  # parameters and rotary tables, bf16
    per_token = 32 * 8 * 128 * 2 * 2
    budget = int(0.9 * int(79.11 * GiB)) - weights - 2 * GiB
    num_blocks = budget // (per_token * 16)
    sessions = num_blocks // (8192 // 16)
    assert plan.kv_bytes_per_token == per_token == 131_072
    assert plan.kv_budget_bytes == budget
    assert plan.max_kv_tokens == num_blocks * 16
    assert plan.max_concurrent_sessions == sessions == 54
    step_s = (weights + sessions * 8192 * per_token) / 3350e9
    assert plan.decode_tokens_per_s_bound == pytest.approx(sessions / step_s)
    assert plan.fits


def test_a_context_longer_than_the_kv_budget_does_not_fit() -> None:
    inputs = PlanInputs(
        model=load_model_shape("llama-3-8b"),
        device=DEVICE_PRESETS["l4-24gb"],
        max_model_len=65536,
    )
    plan = plan_capacity(inputs)
    assert plan.max_kv_tokens > 0 and plan.max_concurrent_sessions == 0
    assert not plan.fits and "one 65536-token session needs" in plan.problems[0]


def test_seed_claim_needs_more_than_fp8_kv() -> None:
    claim = evaluate_claim(SEED, 64, 384)
    assert claim.kv_factor == pytest.approx(327_680 / 166_400)
    assert claim.missing_factor == pytest.approx(6 / (327_680 / 166_400))
    text = "\n".join(claim.lines)
    assert "no bf16-weight baseline of 64 sessions can exist here" in text
    assert "verdict: cannot hold" in text
    scale_less = evaluate_claim(dataclasses.replace(SEED, use_kv_scales=False), 64, 384)
    assert scale_less.kv_factor == 2.0 and scale_less.missing_factor == 3.0
    # Four cards per replica with fp8 weights: fp8 weights add budget, still short of 6x.
    tp4 = evaluate_claim(
        dataclasses.replace(SEED, weight_dtype="fp8", tensor_parallel_size=4), 64, 384
    )
    assert tp4.weights_factor is not None and 1.0 < tp4.weights_factor < 3.0
    assert 1.0 < tp4.missing_factor < claim.missing_factor
    plan = plan_capacity(dataclasses.replace(SEED, weight_dtype="fp8", tensor_parallel_size=4))
    assert tp4.max_context_for_claim == plan.max_kv_tokens // 384 // 16 * 16


def test_cli_json_has_the_documented_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(
        capsys,
        *("--model", "qwen2-72b-instruct", "--device", "h100-80gb", "--kv-cache-dtype", "fp8"),
        *("--gpu-memory-utilization", "0.94", "--json"),
    )
    obj = json.loads(out)
    assert code == 1 and obj["fits"] is False
    assert obj["kv_bytes_per_token"] == 166_400
    for key in (
        "weights_gib_per_device",
        "kv_budget_gib",
        "max_kv_tokens",
        "max_concurrent_sessions",
        "decode_tokens_per_s_bound",
    ):
        assert key in obj
    assert obj["weights_gib_per_device"] == 135.43


def test_cli_sweep_prints_one_row_per_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "qwen2-72b-instruct", "--kv-cache-dtype", "fp8_e4m3"]
    argv += ["--weight-dtype", "bf16", "fp8", "--tensor-parallel-size", "1", "2", "4"]
    code, out = run_cli(capsys, *argv, "--json")
    plans = json.loads(out)["plans"]
    assert [(p["weight_dtype"], p["tensor_parallel_size"]) for p in plans] == [
        (w, tp) for w in ("bf16", "fp8") for tp in (1, 2, 4)
    ]
    assert code == 1  # bf16 at TP 1 does not fit
    _, table = run_cli(capsys, *argv)
    assert len([line for line in table.splitlines() if line.startswith("| bf16")]) == 3


def test_cli_reads_a_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = dict(MODEL_PRESETS["qwen2-7b-instruct"], model_type="qwen2", torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, from_dir = run_cli(capsys, "--model", str(tmp_path), "--json")
    _, from_file = run_cli(capsys, "--model", str(tmp_path / "config.json"), "--json")
    _, preset = run_cli(capsys, "--model", "qwen2-7b-instruct", "--json")
    for out in (from_dir, from_file):
        obj, expected = json.loads(out), json.loads(preset)
        assert obj["num_params"] == expected["num_params"] == 7_615_616_512
        assert obj["max_concurrent_sessions"] == expected["max_concurrent_sessions"]


def test_cli_reports_bad_input_as_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "qwen2-72b-instruct", "-tp", "3"]) == 2
    assert (
        "does not divide the model's 64 attention heads; choose one of" in capsys.readouterr().err
    )
    assert main(["plan", "--model", "no-such-model"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_cli_custom_device_and_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(
        capsys, "--model", "smollm2-135m", "--memory-gib", "16", "--bandwidth-gbps", "100"
    )
    assert code == 0
    assert "(16.00 GiB, 100 GB/s)" in out and "fits                yes" in out
    assert "assumptions:" in out


def test_plan_flags_follow_the_engine_flags() -> None:
    from infer8.config import EngineArgs, cuda_max_num_batched_tokens

    defaults = EngineArgs()
    inputs = PlanInputs(model=QWEN72, device=H100)
    for name in ("block_size", "max_num_seqs", "gpu_memory_utilization"):
        assert getattr(inputs, name) == getattr(defaults, name), name
    # both resolve "auto" with the same rule: the engine from the GPU it runs on
    assert defaults.max_num_batched_tokens is None
    assert (
        inputs.max_num_batched_tokens
        == 8192
        == cuda_max_num_batched_tokens(H100.memory_bytes, H100.name)
    )
    assert inputs.kv_cache_dtype == defaults.kv_cache_dtype
    assert KVCacheDType.choices() == CHOICES["kv_cache_dtype"]


@pytest.mark.parametrize(
    ("name", "preset"),
    [
        ("Qwen/Qwen2-72B-Instruct", "qwen2-72b-instruct"),
        ("Qwen2-72B-Instruct", "qwen2-72b-instruct"),
        ("qwen2-72b", "qwen2-72b-instruct"),
        ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
    ],
)
def test_models_are_found_by_hugging_face_id_and_plain_name(name: str, preset: str) -> None:
    """Check the ids and names users type resolve to the preset of that shape."""
    shape = load_model_shape(name)
    assert shape == load_model_shape(preset) and shape.name == preset


@pytest.mark.parametrize(("device", "preset"), [("H100", "h100-80gb"), ("h200", "h200-141gb")])
def test_devices_are_found_in_any_case(
    device: str, preset: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Check `--device H100` / `h200` plan on the preset of that device."""
    _, out = run_cli(capsys, "--device", device, "--json")
    assert json.loads(out)["device"] == preset


def test_an_unknown_device_names_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    """Check a device typo is one line naming the closest preset, exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--device", "h300"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "(did you mean h200?)" in err, err


def test_verdict_names_every_way_to_fit_with_its_sessions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Check bf16 Qwen2-72B on one H200 lists FP8 weights, TP 2, and both, with sessions."""
    code, out = run_cli(capsys, "--model", "Qwen/Qwen2-72B-Instruct", "--device", "H200")
    assert code == 1
    base = PlanInputs(model=QWEN72, device=DEVICE_PRESETS["h200-141gb"])
    assert not plan_capacity(base).fits
    fp8 = plan_capacity(dataclasses.replace(base, weight_dtype="fp8"))
    tp2 = plan_capacity(dataclasses.replace(base, tensor_parallel_size=2))
    both = plan_capacity(dataclasses.replace(base, weight_dtype="fp8", tensor_parallel_size=2))
    assert fp8.fits and 0 < fp8.max_concurrent_sessions < tp2.max_concurrent_sessions
    assert both.max_concurrent_sessions > tp2.max_concurrent_sessions
    assert (
        "  ways to fit (32,768 tokens a session):\n"
        f"    FP8 weights (--quantization fp8): {fp8.max_concurrent_sessions} sessions\n"
        f"    --tensor-parallel-size 2: {tp2.max_concurrent_sessions} sessions\n"
        f"    FP8 weights (--quantization fp8) + --tensor-parallel-size 2: "
        f"{both.max_concurrent_sessions} sessions\n"
    ) in out
    _, as_json = run_cli(capsys, "--model", "qwen2-72b", "--device", "h200", "--json")
    assert json.loads(as_json)["ways_to_fit"] == [
        {"weight_dtype": "fp8", "tensor_parallel_size": 1, "sessions": fp8.max_concurrent_sessions},
        {
            "weight_dtype": "bf16",
            "tensor_parallel_size": 2,
            "sessions": tp2.max_concurrent_sessions,
        },
        {
            "weight_dtype": "fp8",
            "tensor_parallel_size": 2,
            "sessions": both.max_concurrent_sessions,
        },
    ]


def test_verdict_on_h100_fits_fp8_weights_on_fewer_devices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Check FP8 weights are offered at the smallest TP where they fit (2), not bf16's (4)."""
    _, out = run_cli(capsys, "--model", "qwen2-72b", "--device", "h100", "--json")
    ways = [(w["weight_dtype"], w["tensor_parallel_size"]) for w in json.loads(out)["ways_to_fit"]]
    assert ways == [("bf16", 4), ("fp8", 2)]


def test_plan_takes_the_model_positionally_as_serve_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = cli_main(["plan", "Qwen/Qwen2-72B-Instruct", "--device", "H200"])
    positional = capsys.readouterr().out
    assert positional.startswith("qwen2-72b-instruct (72.71 B params) on h200-141gb")
    assert cli_main(["plan", "--model", "Qwen/Qwen2-72B-Instruct", "--device", "H200"]) == code
    assert capsys.readouterr().out == positional
    assert cli_main(["plan", "qwen2-72b", "--model", "smollm2-135m"]) == 2
    assert "two models given" in capsys.readouterr().err
