"""The native element-wise passes (csrc/elementwise.c, hadamard.c) on float32 or bf16 CPU
tensors: the decoder's RMSNorm, RoPE and silu * up (layers.elementwise.ElementwiseOps, handed to
the model by the worker) and the Hadamard rotation of the attention backend."""

from __future__ import annotations

import torch

from infer8.kernels.cpu.library import NativeLibrary


class NativeElementwise:
    """ElementwiseOps in native passes, and the rotation."""

    def __init__(self, lib: NativeLibrary) -> None:
        self.lib = lib

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Return x [n, heads, d] times the orthonormal Hadamard matrix (exact_tail.rotate).

        The fast Walsh-Hadamard transform in float32, in x's dtype (bf16 or float32); rows may
        be strided (a view of a fused projection), the result is contiguous.
        """
        n, heads, d = x.shape
        assert x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu"
        assert x.stride(-1) == 1 and d & (d - 1) == 0 and d <= 1024
        out = torch.empty((n, heads, d), dtype=x.dtype)
        self.lib.hadamard_rows(
            x.data_ptr(), n, heads, d, x.stride(0), x.stride(1), int(x.dtype == torch.float32),
            out.data_ptr(),
        )  # fmt: skip
        return out

    # -- the layer's element-wise passes (csrc/elementwise.c), float32 or bf16 CPU tensors -----
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Return weight * x / sqrt(mean(x^2) + eps) over x's rows [n, h]; with `add`, x += add
        first, in place (x rows may be strided, the last dim contiguous)."""
        n, h = x.shape
        assert x.stride(1) == 1 and weight.is_contiguous() and weight.dtype == x.dtype
        if add is not None:
            add = add.contiguous()
            assert add.shape == x.shape and add.dtype == x.dtype
        out = torch.empty((n, h), dtype=x.dtype)
        self.lib.rms_norm(
            x.data_ptr(), x.stride(0), None if add is None else add.data_ptr(),
            weight.data_ptr(), n, h, eps, int(x.dtype == torch.bfloat16), out.data_ptr(),
        )  # fmt: skip
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Return silu(gate) * up for gate_up [n, 2 * inter] (gate first): [n, inter]."""
        gate_up = gate_up.contiguous()
        n, width = gate_up.shape
        out = torch.empty((n, width // 2), dtype=gate_up.dtype)
        bf16 = int(gate_up.dtype == torch.bfloat16)
        self.lib.silu_and_mul(gate_up.data_ptr(), n, width // 2, bf16, out.data_ptr())
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [n, heads, d] in place (rotate_half convention) by cos, sin [n, d / 2]."""
        n, heads, d = x.shape
        assert x.stride(2) == 1 and x.stride(1) == d and cos.shape == (n, d // 2)
        assert cos.dtype == sin.dtype == x.dtype
        cos, sin = cos.contiguous(), sin.contiguous()
        bf16 = int(x.dtype == torch.bfloat16)
        self.lib.rope(x.data_ptr(), x.stride(0), n, heads, d, cos.data_ptr(), sin.data_ptr(), bf16)
        return x

    # -- multi-LoRA (csrc/lora.c) -----------------------------------------------------------
    def lora_add(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        order: torch.Tensor,
        slot_ids: torch.Tensor,
        rank: int,
        cols: torch.Tensor,
    ) -> None:
        """y[t] += (x[t] A_s^T) B_s in place for the tokens t in `order` (sorted by their slot
        s = slot_ids[t] >= 0).

        a [slots, rows, in], b [slots, rows, out]: LoRASlots' float32 rank-major rows, of
        which the first rank x n are read (n = len(cols) - 1 modules, module i writing
        columns [cols[i], cols[i + 1])); x, y float32 or bf16, rows may be strided.
        """
        _, in_features = x.shape
        out_features = y.shape[1]
        n = cols.numel() - 1
        assert x.stride(1) == y.stride(1) == 1 and x.dtype == y.dtype
        assert a.dtype == b.dtype == torch.float32 and a.stride(2) == b.stride(2) == 1
        assert a.stride(1) == in_features and b.stride(1) == out_features
        assert 0 < rank * n <= 1024 and order.dtype == cols.dtype == torch.int64
        assert slot_ids.dtype == torch.int32 and slot_ids.is_contiguous() and order.is_contiguous()
        self.lib.lora_add(
            x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), a.data_ptr(), a.stride(0),
            b.data_ptr(), b.stride(0), order.data_ptr(), slot_ids.data_ptr(), order.numel(),
            in_features, out_features, n, rank, cols.data_ptr(), int(x.dtype == torch.bfloat16),
        )  # fmt: skip
