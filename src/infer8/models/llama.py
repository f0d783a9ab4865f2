"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) over flat, unpadded token batches."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infer8.attention.backend import AttentionBackend
from infer8.attention.kv_cache import LayerKVCache
from infer8.attention.metadata import AttentionMetadata
from infer8.distributed.parallel_state import TensorParallelGroup
from infer8.layers.elementwise import ElementwiseOps, TorchElementwise
from infer8.layers.parallel import lm_head, row_parallel_linear, vocab_embedding
from infer8.models.config_check import check_hf_config_fields

if TYPE_CHECKING:
    from infer8.lora.slots import LoRAStep

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class LlamaArchConfig:
    """The architecture fields of a Hugging Face config.json that the model needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str | None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> LlamaArchConfig:
        """Parse a config.json dict, refusing architectures this model does not implement."""
        archs = cfg.get("architectures") or []
        arch = (
            archs[0]
            if archs
            else {
                "llama": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "mistral": "MistralForCausalLM",
            }.get(cfg.get("model_type", ""), "")
        )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch or cfg.get('model_type')!r}; infer8 supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        check_hf_config_fields(cfg)  # a missing, zero or negative size fails here, by name
        num_heads = cfg["num_attention_heads"]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
            rope_theta = cfg["rope_parameters"].get("rope_theta")
            if (
                rope_scaling is None
                and cfg["rope_parameters"].get("rope_type", "default") != "default"
            ):
                rope_scaling = cfg["rope_parameters"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=_max_positions(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(
                arch == "Qwen2ForCausalLM"
                if cfg.get("attention_bias") is None
                else cfg["attention_bias"]
            ),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )


def _max_positions(cfg: dict[str, Any]) -> int:
    """Return the usable context: sliding-window attention is not implemented, so cap at it."""
    limit = cfg.get("max_position_embeddings", 4096)
    window = cfg.get("sliding_window")
    uses_window = cfg.get(
        "use_sliding_window", True
    )  # Qwen2 configs carry a window but turn it off
    if window and uses_window and window < limit:
        logger.warning("sliding_window=%d is not implemented: limiting the context to it", window)
        return int(window)
    return int(limit)


def rope_inv_freq(cfg: LlamaArchConfig) -> tuple[torch.Tensor, float]:
    """Return RoPE inverse frequencies [head_dim / 2] and a position scale, per rope_scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d)
    )
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq, 1.0 / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)"
    )


class RMSNorm(nn.Module):
    """Root-mean-square layer norm's weight (the pass itself is ElementwiseOps.rms_norm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps


class Attention(nn.Module):
    """GQA self-attention's projections (fused QKV); RoPE, the cache and attention happen in
    DecoderLayer.forward through the ops and the backend the model was handed."""

    def __init__(self, cfg: LlamaArchConfig, tp_group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = row_parallel_linear(self.q_size, cfg.hidden_size, tp_group)
        self.scale = self.head_dim**-0.5
        # A constant [kv_heads, d] subtracted from every key after RoPE (set_key_offsets), or
        # None. q.(k - c) = q.k - q.c, and q.c is the same for all of a query's keys: the
        # softmax, hence the attention output, is unchanged in exact arithmetic.
        self.k_offset: torch.Tensor | None = None


class MLP(nn.Module):
    """SwiGLU feed-forward's projections (fused gate/up)."""

    def __init__(self, cfg: LlamaArchConfig, tp_group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = row_parallel_linear(cfg.intermediate_size, cfg.hidden_size, tp_group)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, cfg: LlamaArchConfig, tp_group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp_group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp_group)

    def forward(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: Any,
        cache: LayerKVCache,
        ops: ElementwiseOps,
        backend: AttentionBackend,
        lora: LoRAStep | None = None,
        layer_index: int = 0,
    ) -> torch.Tensor:
        """Run one layer on the residual stream x (updated in place); return its MLP output.

        `pending` is the previous layer's MLP output, not yet added to x: each residual add
        happens inside the next norm's pass (vLLM's fused add + RMSNorm). Submodules are read
        for their weights only, with no module call in between (a layer's Python glue is a
        visible share of a small model's decode step on CPU). `lora`: the step's adapters,
        added to each projection's output (None: the base model alone).
        """
        attn, mlp, norm = self.self_attn, self.mlp, self.input_layernorm
        t = x.shape[0]
        h = ops.rms_norm(x, norm.weight, norm.eps, pending)
        qkv = attn.qkv_proj.forward(h)
        if lora is not None:
            lora.add("qkv", layer_index, h, qkv)
        heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        # q and k heads rotate in one pass (half the small element-wise ops of a decode step)
        qk = ops.rope_(qkv[:, : attn.q_size + attn.kv_size].view(t, heads + kv_heads, d), cos, sin)
        v = qkv[:, attn.q_size + attn.kv_size :].view(t, kv_heads, d)
        q, k = qk[:, :heads], qk[:, heads:]
        if attn.k_offset is not None:
            k.sub_(attn.k_offset)
        o = backend.write_and_attend(q, k, v, cache, attn_metadata, attn.scale).reshape(t, -1)
        norm = self.post_attention_layernorm
        if lora is None:
            h = ops.rms_norm(x, norm.weight, norm.eps, attn.o_proj.forward(o))
            return mlp.down_proj.forward(ops.silu_and_mul(mlp.gate_up_proj.forward(h)))
        o_out = attn.o_proj.forward(o)
        lora.add("o", layer_index, o, o_out)
        h = ops.rms_norm(x, norm.weight, norm.eps, o_out)
        gate_up = mlp.gate_up_proj.forward(h)
        lora.add("gate_up", layer_index, h, gate_up)
        act = ops.silu_and_mul(gate_up)
        down = mlp.down_proj.forward(act)
        lora.add("down", layer_index, act, down)
        return down


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head; forward takes a flat batch of tokens.

    Holds no attention code: the worker hands it an attention backend and the element-wise
    ops (set_attention_backend, set_elementwise_ops) before the first forward.
    """

    def __init__(self, cfg: LlamaArchConfig, tp_group: TensorParallelGroup | None = None) -> None:
        # Under tensor parallelism cfg is this rank's view (its heads and MLP columns).
        super().__init__()
        self.config = cfg
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size, tp_group)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp_group) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = lm_head(cfg.hidden_size, cfg.vocab_size, tp_group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.ops: ElementwiseOps = TorchElementwise()
        self.attention_backend: AttentionBackend | None = None
        # cos/sin for every position the model has: buffers (not in the state dict) that move
        # and cast with the model, so any forward (the start-up memory profile's included) has
        # them; built here, and again by init_rope_tables after a meta-device to_empty
        half = cfg.head_dim // 2
        self.register_buffer("cos_table", torch.empty(cfg.max_position_embeddings, half),
                             persistent=False)  # fmt: skip
        self.register_buffer("sin_table", torch.empty(cfg.max_position_embeddings, half),
                             persistent=False)  # fmt: skip
        self.init_rope_tables()
        for p in self.parameters():
            p.requires_grad_(False)

    def set_key_offsets(self, max_len: int | None = None) -> int:
        """Store every layer's keys less the mean over positions [0, max_len) (None: every
        position the model has) of its rotated k bias; return how many layers got an offset (those with a k bias).

        Qwen2's k_proj bias reaches 100-211 in a few channels of some layers, all in RoPE's
        slowest-turning pairs: after RoPE those channels carry a near-constant offset that
        sets an FP8 key's per-token scale, leaving 3 bits of mantissa for the small channels
        that carry the information. Subtracting a constant per channel from every key leaves
        the softmax unchanged (Attention.k_offset), so the cache quantizes what varies.
        """
        num_layers = 0
        length = max(1, min(max_len or self.cos_table.shape[0], self.cos_table.shape[0]))
        mean_cos = self.cos_table[:length].double().mean(0)  # [head_dim / 2]
        mean_sin = self.sin_table[:length].double().mean(0)
        for layer in self.layers:
            attn = layer.self_attn
            bias = attn.qkv_proj.bias
            if bias is None:
                attn.k_offset = None
                continue
            b = bias[attn.q_size : attn.q_size + attn.kv_size].double()
            b = b.view(attn.num_kv_heads, attn.head_dim)
            b1, b2 = b.chunk(2, dim=-1)  # rotate_half's halves
            offset = torch.cat([b1 * mean_cos - b2 * mean_sin, b2 * mean_cos + b1 * mean_sin], -1)
            attn.k_offset = offset.to(bias.dtype)
            num_layers += 1
        return num_layers

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Attend through `backend` in every layer (chosen once at start-up)."""
        self.attention_backend = backend

    def set_elementwise_ops(self, ops: ElementwiseOps) -> None:
        """Compute norms, RoPE and silu * up with `ops` (the CPU backend's native passes)."""
        self.ops = ops

    def init_rope_tables(self) -> None:
        """Fill cos_table / sin_table [max_position_embeddings, head_dim / 2] in place.

        Computed in float64 and rounded once to the tables' dtype, on their device; a no-op on
        the meta device (the loader calls it again once the tensors are real).
        """
        if self.cos_table.is_meta:
            return
        inv_freq, pos_scale = rope_inv_freq(self.config)
        pos = torch.arange(self.cos_table.shape[0], dtype=torch.float64, device="cpu") * pos_scale
        freqs = torch.outer(pos, inv_freq)  # [max_position_embeddings, head_dim / 2]
        with torch.no_grad():
            self.cos_table.copy_(freqs.cos())
            self.sin_table.copy_(freqs.sin())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[LayerKVCache],
        attn_metadata: Any = None,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        """Return final hidden states [num_tokens, hidden] for input_ids [num_tokens].

        attn_metadata: the backend's metadata of this step where the caller built it (a CUDA
        graph's static buffers); else the backend builds it from `meta` here, once. lora: the
        step's LoRA adapters (None: the base model for every token).
        """
        backend = self.attention_backend
        assert backend is not None, "set_attention_backend before the first forward"
        if attn_metadata is None:
            attn_metadata = backend.build_metadata(meta)
        x = self.embed_tokens(input_ids)  # a fresh tensor: the layers add to it in place
        cos = self.cos_table[positions]  # [num_tokens, head_dim / 2]
        sin = self.sin_table[positions]
        ops, pending = self.ops, None
        if lora is None:
            for layer, cache in zip(self.layers, kv_caches):
                pending = layer.forward(x, pending, cos, sin, attn_metadata, cache, ops, backend)
        else:
            for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
                pending = layer.forward(
                    x, pending, cos, sin, attn_metadata, cache, ops, backend, lora, i
                )
        return ops.rms_norm(x, self.norm.weight, self.norm.eps, pending)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Return float32 logits [n, vocab] for hidden states [n, hidden]."""
        return self.lm_head(hidden).float()
