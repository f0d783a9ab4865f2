"""Checks that run before any model is loaded (or fetched): one clear line each, never a traceback.

`infer8 serve` calls `preflight()` first: a wrong device, an impossible tensor-parallel size, a
port in use, bad sampling defaults, a malformed config.json or safetensors header, or a model
or --kv-offloading-size that memory cannot hold are reported in a second, not after minutes of
loading.
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path
from typing import Any

import torch

from infer8.config import EngineArgs, resolve_device
from infer8.distributed.sharding import check_tensor_parallel_size
from infer8.generation_config import sampling_defaults
from infer8.models.llama import LlamaArchConfig
from infer8.models.safetensors_check import check_num_layers, check_safetensors_files
from infer8.sampling_params import SamplingParams
from infer8.worker.fit_check import check_fits_memory

# The default model's config.json (SmolLM2-135M-Instruct), so its checks need no download.
DEFAULT_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def check_device(args: EngineArgs) -> torch.device:
    """Return the device, or raise ValueError naming why it cannot be used."""
    device = resolve_device(args.device)
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise ValueError(
                f"--device cuda: this torch build has no CUDA support (torch {torch.__version__}); "
                "install a CUDA build of torch or use --device cpu"
            )
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible (check the driver)")
        if args.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(
                f"--tensor-parallel-size {args.tensor_parallel_size} needs that many GPUs; "
                f"{torch.cuda.device_count()} visible"
            )
    return device


def model_hf_config(model: str | None) -> dict[str, Any]:
    """Return the model's config.json dict (read from the directory or GGUF header only)."""
    if model is None:
        return DEFAULT_MODEL_CONFIG
    from infer8.models.loader import read_hf_config, resolve_model_path

    # a name `infer8 pull` knows is fetched once here; anything else must be a local path
    path = Path(resolve_model_path(model))
    if path.is_dir():
        return read_hf_config(path)
    from infer8.models.gguf_loader import gguf_hf_config

    return gguf_hf_config(path)


def check_checkpoint(model_dir: Path, arch: LlamaArchConfig) -> None:
    """Check every *.safetensors header against its file and the layer count against the
    config (headers only: a corrupt or mismatched shard fails in a second, by name)."""
    headers = check_safetensors_files(model_dir)
    check_num_layers(headers, arch.num_hidden_layers, model_dir / "config.json")


def check_port(host: str, port: int) -> socket.socket:
    """Bind the server's socket now (no race with the load); raise ValueError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY on accepted connections only
    # when the listening socket says TCP. Without it every response waited ~40 ms (Nagle's
    # algorithm against the client's delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def preflight(args: EngineArgs) -> None:
    """Check what can be checked without loading the model; raise ValueError with the reason."""
    device = check_device(args)
    resolved = dataclasses.replace(args, device=device.type)
    resolved.create_configs(args.model or "")  # dtype x device, block size, budgets ...
    hf_config = model_hf_config(args.model)
    arch = LlamaArchConfig.from_hf_config(hf_config)
    if args.tensor_parallel_size > 1:
        check_tensor_parallel_size(arch, args.tensor_parallel_size)
        if args.quantization == "fp8":
            raise ValueError("--quantization fp8 does not support tensor parallelism yet")
    if args.max_model_len is not None and args.max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {args.max_model_len} exceeds the model's limit of "
            f"{arch.max_position_embeddings} tokens"
        )
    if args.model is not None:
        defaults = sampling_defaults(
            args.model, args.generation_config, args.override_generation_config
        )
    else:
        defaults = sampling_defaults("", "vllm", args.override_generation_config)
    SamplingParams(**defaults)  # bad values in the generation config fail here
    if args.model is not None and Path(args.model).is_dir():
        check_checkpoint(Path(args.model), arch)
    # the weights (and on CPU the KV budget) against the device, --kv-offloading-size against
    # the RAM left beside them: arithmetic over config.json, nothing allocated
    check_fits_memory(resolved.create_engine_config(args.model or "", hf_config), hf_config)
    if args.chat_template is not None and "{" not in args.chat_template:
        if not Path(args.chat_template).is_file():
            raise ValueError(f"--chat-template {args.chat_template!r}: no such file")
