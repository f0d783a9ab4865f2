"""The native kernels' element-wise, sampling and rotation wrappers (csrc/elementwise.c,
sampling.c, hadamard.c) on float32 or bf16 CPU tensors: a part of cpu_native.NativeFP8Gather,
which binds the functions they call."""

from __future__ import annotations

from typing import Any

import torch


class NativeElementwise:
    """RMSNorm, silu * up, RoPE, the greedy and nucleus samplers' passes, the rotation."""

    _hadamard: Any
    _rms_norm: Any
    _silu_and_mul: Any
    _greedy: Any
    _candidates: Any
    _rope: Any

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Return x [n, heads, d] times the orthonormal Hadamard matrix (exact_tail.rotate).

        The fast Walsh-Hadamard transform in float32, in x's dtype (bf16 or float32); rows may
        be strided (a view of a fused projection), the result is contiguous.
        """
        n, heads, d = x.shape
        assert x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu"
        assert x.stride(-1) == 1 and d & (d - 1) == 0 and d <= 1024
        out = torch.empty((n, heads, d), dtype=x.dtype)
        self._hadamard(
            x.data_ptr(), n, heads, d, x.stride(0), x.stride(1), int(x.dtype == torch.float32),
            out.data_ptr(),
        )  # fmt: skip
        return out

    # -- the layer's element-wise passes (csrc/elementwise.c), float32 or bf16 CPU tensors -----
    @staticmethod
    def elementwise_supported(x: torch.Tensor) -> bool:
        """Return whether rms_norm, silu_and_mul, rope_ and band_attention run on x (float32 or
        bf16, CPU)."""
        return x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu"

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
        self._rms_norm(
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
        self._silu_and_mul(gate_up.data_ptr(), n, width // 2, bf16, out.data_ptr())
        return out

    def greedy(self, logits: torch.Tensor, limit: float) -> list[int]:
        """Return each row's argmax of float32 logits [rows, vocab] after the sampler's
        sanitizing (NaN -> -limit, clamped to [-limit, limit]; the first of equal maxima), as
        torch's argmax of that sanitized copy returns it, in one pass without the copy."""
        assert logits.dtype == torch.float32 and logits.dim() == 2 and logits.device.type == "cpu"
        logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._greedy(logits.data_ptr(), logits.shape[0], logits.shape[1], limit, out.data_ptr())
        return out.tolist()

    def nucleus_candidates(
        self, logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, cap: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return each row's top-k / top-p candidates (csrc/sampling.c): (ids [rows, cap],
        their count per row or -1 where the row is left to the caller, the row's maximum, the
        softmax denominator sum(e^max(x - max, -87))). logits: finite float32 [rows, vocab];
        top_p float32, top_k int64 [rows] (vocab: off). A row's candidates are every token
        above its smallest one, in index order."""
        assert logits.dtype == torch.float32 and logits.dim() == 2 and logits.device.type == "cpu"
        logits = logits.contiguous()
        rows, vocab = logits.shape
        top_p = top_p.to(torch.float32).contiguous()
        top_k = top_k.to(torch.int64).contiguous()
        assert top_p.shape == top_k.shape == (rows,)
        ids = torch.empty((rows, cap), dtype=torch.int64)
        count = torch.empty(rows, dtype=torch.int64)
        row_max = torch.empty(rows, dtype=torch.float32)
        row_sum = torch.empty(rows, dtype=torch.float32)
        self._candidates(
            logits.data_ptr(), rows, vocab, top_p.data_ptr(), top_k.data_ptr(), cap,
            row_max.data_ptr(), row_sum.data_ptr(), ids.data_ptr(), count.data_ptr(),
        )  # fmt: skip
        return ids, count, row_max, row_sum

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [n, heads, d] in place (rotate_half convention) by cos, sin [n, d / 2]."""
        n, heads, d = x.shape
        assert x.stride(2) == 1 and x.stride(1) == d and cos.shape == (n, d // 2)
        assert cos.dtype == sin.dtype == x.dtype
        cos, sin = cos.contiguous(), sin.contiguous()
        bf16 = int(x.dtype == torch.bfloat16)
        self._rope(x.data_ptr(), x.stride(0), n, heads, d, cos.data_ptr(), sin.data_ptr(), bf16)
        return x
