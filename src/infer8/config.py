"""Frozen configuration dataclasses; "auto" values are resolved once, into an EngineConfig
(EngineArgs.create_engine_config) that the engine hands to its executor and every worker."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from infer8.lora.config import LoRAConfig
from infer8.spec_decode.config import SpeculativeConfig
from infer8.utils import check_known_keys, json_object_flag

if TYPE_CHECKING:
    import torch

# torch is imported where a value is resolved, not here: the command line's flags come from
# this module, and `infer8 serve --help` should not wait for torch.
_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
}


class KVCacheDType(str, enum.Enum):
    """What one KV-cache element is stored as (the --kv-cache-dtype choices)."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @classmethod
    def aliases(cls) -> dict[str, str]:
        """Return the other names a flag may give (vLLM's "fp8" is E4M3)."""
        return {"fp8": "fp8_e4m3", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

    @classmethod
    def choices(cls) -> list[str]:
        """Return the --kv-cache-dtype values listed in --help (vLLM's: "fp8" and the rest)."""
        return ["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"]

    @classmethod
    def parse(cls, value: str | KVCacheDType) -> KVCacheDType:
        """Parse a flag value; "fp8" means E4M3 as in vLLM."""
        if isinstance(value, KVCacheDType):
            return value
        value = cls.aliases().get(value, value)
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown kv_cache_dtype {value!r}; choose one of: {', '.join(cls.choices())}"
            ) from None

    @property
    def is_fp8(self) -> bool:
        """Return whether elements are one byte."""
        return self in (KVCacheDType.FP8_E4M3, KVCacheDType.FP8_E5M2)

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """Return the storage dtype; auto follows the model's compute dtype."""
        import torch

        return {
            KVCacheDType.AUTO: model_dtype,
            KVCacheDType.BFLOAT16: torch.bfloat16,
            KVCacheDType.FLOAT16: torch.float16,
            KVCacheDType.FLOAT32: torch.float32,
            KVCacheDType.FP8_E4M3: torch.float8_e4m3fn,
            KVCacheDType.FP8_E5M2: torch.float8_e5m2,
        }[self]


def parse_dtype(value: str | torch.dtype) -> torch.dtype | None:
    """Parse a --dtype value; None means auto."""
    import torch

    if isinstance(value, torch.dtype):
        return value
    if value == "auto":
        return None
    if value not in _DTYPES:
        raise ValueError(
            f"unknown dtype {value!r}; choose one of: auto, bfloat16, float16, float32"
        )
    return getattr(torch, _DTYPES[value])


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Return whether this CPU computes bf16 natively (AVX512-BF16, AMX, or Arm's BF16).

    Without those units torch emulates bf16 matmuls: ~2 GFLOP/s on an AVX2-only EPYC against
    ~140 in float32, so "auto" must not pick bf16 there. Unknown platforms count as fast.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return True
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    if not flags:
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def default_dtype(device: torch.device, cpuinfo: str | None = None) -> torch.dtype:
    """Resolve dtype "auto": bf16 where it is fast, float32 on CPUs without bf16 units."""
    import torch

    if device.type == "cpu" and not cpu_has_fast_bf16(cpuinfo):
        return torch.float32
    return torch.bfloat16


# --max-num-batched-tokens when not given (see docs/benchmarks.md, "Chunk size on CPU").
CPU_MAX_NUM_BATCHED_TOKENS = 2048
_GIB = 1 << 30


def cuda_max_num_batched_tokens(total_memory_bytes: int, device_name: str) -> int:
    """Return vLLM's serving default for a GPU: 8192 tokens on GPUs with >= 70 GiB except A100s
    (H100, H200, MI300X), 2048 elsewhere. Not re-measured by infer8 (no GPU here)."""
    if total_memory_bytes >= 70 * _GIB and "a100" not in device_name.lower():
        return 8192
    return 2048


def default_max_num_batched_tokens(device: torch.device) -> int:
    """Resolve --max-num-batched-tokens "auto" for this device."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return cuda_max_num_batched_tokens(props.total_memory, props.name)
    return CPU_MAX_NUM_BATCHED_TOKENS


def resolve_device(device: str) -> torch.device:
    """Resolve "auto" to cuda when present, else cpu."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how to compute with it."""

    model: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int | None = None
    seed: int = 0
    enforce_eager: bool = False
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.device.type == "cpu" and str(self.dtype) == "torch.float16":
            raise ValueError(
                "dtype float16 is not accelerated on CPU (~3 GFLOP/s); use bfloat16 or float32"
            )


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is laid out and sized."""

    block_size: int = 16
    kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_scale: str = "dynamic"
    kv_scales_path: str | None = None
    enable_prefix_caching: bool = True
    # FP8 only (see attention/exact_tail.py): None = auto, resolved by create_engine_config.
    kv_cache_exact_tail_tokens: int | None = None
    kv_cache_exact_sink_tokens: int | None = None
    kv_cache_hadamard: bool | None = None
    # GiB of host memory for evicted prefix blocks (vLLM's --kv-offloading-size); None/0: off.
    kv_offloading_size: float | None = None

    def __post_init__(self) -> None:
        size = self.kv_offloading_size
        if size is not None:
            if not 0 <= size < math.inf:  # NaN fails both
                raise ValueError(
                    f"kv_offloading_size (GiB of host memory, a finite number) must be >= 0, "
                    f"got {size}"
                )
            if size * _GIB >= 1 << 63:  # no host has it; int() of 1e300 GiB would overflow
                raise ValueError(
                    f"kv_offloading_size {size:g} GiB is more memory than any host has"
                )
        for name in ("kv_cache_exact_tail_tokens", "kv_cache_exact_sink_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        if self.kv_scale not in ("dynamic", "static"):
            raise ValueError(f"kv_scale must be dynamic or static, got {self.kv_scale!r}")
        if self.kv_scales_path is not None and self.kv_scale != "static":
            raise ValueError("kv_scales_path is only used with kv_scale static")


@dataclass(frozen=True)
class SchedulerConfig:
    """How many requests and tokens one step may hold, and which policy picks them."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    scheduler: str = "continuous"
    # vLLM's SchedulerConfig.policy: "fcfs", or "priority" (requests' priority, then arrival).
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.scheduler not in ("continuous", "static"):
            raise ValueError(f"scheduler must be continuous or static, got {self.scheduler!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.policy!r}")
        if self.policy == "priority" and self.scheduler == "static":
            raise ValueError(
                "scheduling_policy priority needs the continuous scheduler: the static baseline "
                "admits whole batches first come, first served (drop --scheduler static or "
                "--scheduling-policy priority)"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks split the model (tensor parallelism: one process per device)."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class KVEventsConfig:
    """Publishing prefix-cache events (vLLM's KVEventsConfig: same fields, names, defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null"; from_json resolves vLLM's unset default
    endpoint: str = "tcp://*:5557"  # bound when it holds * or :: or is ipc/inproc, else connected
    replay_endpoint: str | None = None  # a ROUTER socket that resends buffered batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (messages beyond it are dropped)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv-events publisher must be zmq or null, got {self.publisher!r}")
        if not self.endpoint:
            raise ValueError("kv-events endpoint must not be empty")
        # hwm 0 is ZeroMQ's "no limit"; the buffers need room for one batch.
        for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"kv-events {name} must be an integer >= {least}, got {value!r}")

    @property
    def is_enabled(self) -> bool:
        """Return whether events are recorded and published."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse `--kv-events-config` (a JSON object, as vLLM takes it); unknown keys fail."""
        values = json_object_flag("--kv-events-config", text)
        check_known_keys("--kv-events-config", values, (f.name for f in fields(cls)))
        if values.get("publisher") is None:
            # vLLM's default: zmq when events are enabled, else null.
            values["publisher"] = "zmq" if values.get("enable_kv_cache_events") else "null"
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    """Every setting the engine and its workers run with, resolved once from EngineArgs and the
    model's config.json: the cache's exact tail and rotation are values here, not autos.

    Static KV scales are a request in cache_config.kv_scale: a worker that finds none in the
    checkpoint or --kv-scales-path says so loudly and stores dynamic scales instead.
    """

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    kv_events_config: KVEventsConfig
    quantization: str | None = None
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None


@dataclass(frozen=True)
class EngineArgs:
    """The flat user-facing options (LLM(...) kwargs and CLI flags); one source of truth."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    enforce_eager: bool = False
    served_model_name: str | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_scale: str = "dynamic"
    kv_scales_path: str | None = None
    enable_prefix_caching: bool = True
    kv_cache_exact_tail_tokens: int | None = None
    kv_cache_exact_sink_tokens: int | None = None
    kv_cache_hadamard: bool | None = None
    kv_offloading_size: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    scheduler: str = "continuous"
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    generation_config: str = "auto"
    override_generation_config: str | None = None
    quantization: str | None = None
    chat_template: str | None = None
    kv_events_config: str | None = None
    speculative_config: str | dict[str, Any] | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def create_lora_config(self) -> LoRAConfig | None:
        """Validate and return the LoRA settings (None: --enable-lora is off)."""
        if not self.enable_lora:
            return None
        if self.scheduler == "static":
            raise ValueError(
                "--enable-lora needs the continuous scheduler (drop --scheduler static)"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError("--enable-lora is not supported with --tensor-parallel-size > 1 yet")
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def create_speculative_config(self) -> SpeculativeConfig | None:
        """Validate and return the speculative decoding settings (None: off)."""
        if self.speculative_config is None:
            return None
        if self.scheduler == "static":
            raise ValueError(
                "--speculative-config needs the continuous scheduler (drop --scheduler static)"
            )
        return SpeculativeConfig.from_json(self.speculative_config)

    def create_kv_events_config(self) -> KVEventsConfig:
        """Validate and return the KV events settings (off unless --kv-events-config enables)."""
        if self.kv_events_config is None:
            return KVEventsConfig()
        return KVEventsConfig.from_json(self.kv_events_config)

    def create_parallel_config(self) -> ParallelConfig:
        """Validate and return the parallel layout (head counts are checked against the model)."""
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size)

    def create_configs(self, model_path: str) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
        """Validate and split into the three configs (dtype auto is resolved by the loader)."""
        self.create_parallel_config()  # fails here, with the other values, when invalid
        self.create_kv_events_config()
        self.create_speculative_config()
        self.create_lora_config()
        if self.quantization not in (None, "fp8", "none"):
            raise ValueError(
                f"quantization {self.quantization!r} is not supported; infer8 quantizes weights "
                "to fp8 online (--quantization fp8) and loads FP8 checkpoints as they are"
            )
        device = resolve_device(self.device)
        dtype = parse_dtype(self.dtype)
        if dtype is None:
            # On CPU bf16 is the fast path where the CPU has bf16 units (fp16 never is); on
            # GPU the loader may refine this from the checkpoint's torch_dtype.
            dtype = default_dtype(device)
        model_config = ModelConfig(
            model=model_path,
            dtype=dtype,
            device=device,
            max_model_len=self.max_model_len,
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            served_model_name=self.served_model_name,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_dtype=KVCacheDType.parse(self.kv_cache_dtype),
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_scale=self.kv_scale,
            kv_scales_path=self.kv_scales_path,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_exact_tail_tokens=self.kv_cache_exact_tail_tokens,
            kv_cache_exact_sink_tokens=self.kv_cache_exact_sink_tokens,
            kv_cache_hadamard=self.kv_cache_hadamard,
            kv_offloading_size=self.kv_offloading_size,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=default_max_num_batched_tokens(device)
            if self.max_num_batched_tokens is None
            else self.max_num_batched_tokens,
            scheduler=self.scheduler,
            policy=self.scheduling_policy,
        )
        return model_config, cache_config, scheduler_config

    def create_engine_config(self, model_path: str, hf_config: dict[str, Any]) -> EngineConfig:
        """Validate and resolve every auto once, for a model whose config.json is hf_config."""
        from infer8.attention.exact_tail import resolve_exact_tail
        from infer8.device_probe import tail_kernels_available

        model_config, cache_config, scheduler_config = self.create_configs(model_path)
        num_heads = hf_config["num_attention_heads"]
        head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads
        tail = resolve_exact_tail(
            cache_config.kv_cache_exact_tail_tokens,
            cache_config.kv_cache_hadamard,
            is_fp8=cache_config.kv_cache_dtype.is_fp8,
            kernels_read_tail=tail_kernels_available(model_config.device),
            has_static_scales=cache_config.kv_scale == "static",
            head_dim=head_dim,
            sink_tokens=cache_config.kv_cache_exact_sink_tokens,
            block_size=cache_config.block_size,
        )
        cache_config = dataclasses.replace(
            cache_config,
            kv_cache_exact_tail_tokens=tail.tokens,
            kv_cache_exact_sink_tokens=tail.sink_tokens,
            kv_cache_hadamard=tail.hadamard,
        )
        config = EngineConfig(
            dataclasses.replace(model_config, model=model_path),
            cache_config,
            scheduler_config,
            self.create_parallel_config(),
            self.create_kv_events_config(),
            None if self.quantization == "none" else self.quantization,
            self.create_speculative_config(),
            self.create_lora_config(),
        )
        return config

    @classmethod
    def field_names(cls) -> list[str]:
        """Return the option names (for CLI generation and kwargs checks)."""
        return [f.name for f in fields(cls)]
