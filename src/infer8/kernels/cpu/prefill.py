"""The native prefill attention (csrc/band_attention.c, two_value_attention.c) on float32 or
bf16 CPU tensors: split_prefill's band, two-value attention of a chunk or of whole prompts, and
the causal pass over a step's own K / V."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from infer8.kernels.cpu.library import NativeLibrary

if TYPE_CHECKING:
    from infer8.attention.cpu.split_prefill import Band


def _supported(x: torch.Tensor) -> bool:
    """Return whether x is float32 or bf16 on the CPU (what these kernels read)."""
    return x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu"


def _one_row_stride(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Return two [kvh, n, d] tensors as two_value_attention reads them: rows of d contiguous
    elements, one row stride for both (copied only where that does not hold)."""
    a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in pair)
    if a.stride(-2) != b.stride(-2):
        a, b = a.contiguous(), b.contiguous()
    return a, b


class PrefillKernels:
    """split_prefill's band, the two-value attention of a chunk or of whole prompts, and the
    causal pass over a step's own K / V."""

    def __init__(self, lib: NativeLibrary) -> None:
        self.lib = lib
        self._no_second = torch.zeros(0, dtype=torch.uint8)  # causal_attention: no second value

    def band_attention(
        self, q: torch.Tensor, band: Band, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (out [H, q_len, d], lse [H, q_len]) of split_prefill's band, float32 or bf16 CPU:
        query i sees keys i .. i + window - 1 of the band's [kvh, n, d] values, those below
        valid_from excepted, each in its block or tail value (Band; a query that sees none:
        lse -inf, zeros)."""
        num_heads, q_len, d = q.shape
        q = q.contiguous()
        k, v, kq, vq = (x.contiguous() for x in (band.k, band.v, band.kq, band.vq))
        assert _supported(q) and q.dtype == k.dtype == v.dtype == kq.dtype == vq.dtype
        out = torch.empty_like(q)
        lse = torch.empty((num_heads, q_len), dtype=torch.float32)
        self.lib.band_attention(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), kq.data_ptr(), vq.data_ptr(), num_heads,
            num_heads // k.shape[0], q_len, k.shape[1], d, band.window, band.valid_from,
            band.first_position, band.exact_start, band.segment, scale,
            int(q.dtype == torch.bfloat16),
            out.data_ptr(), lse.data_ptr(),
        )  # fmt: skip
        return out, lse

    @staticmethod
    def two_value_supported(q: torch.Tensor) -> bool:
        """Return whether two_value_attention runs on q [H, q_len, d] (float32 or bf16 on the
        CPU, d a multiple of 8)."""
        return _supported(q) and q.shape[-1] % 8 == 0

    def causal_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Causal attention of a chunk's queries q [H, q_len, d] (the last q_len of n
        positions) over keys / values [kvh, n, d]: the two-value pass reading first values only.
        Returns [H, q_len, d] (a view of a [q_len, H, d] tensor)."""
        q_len, n = q.shape[1], k.shape[1]
        if self._no_second.numel() < q_len * n:
            self._no_second = torch.zeros(q_len * n, dtype=torch.uint8)
        second = self._no_second[: q_len * n].view(q_len, n)
        return self.two_value_attention(q, (k, k), (v, v), second, n - q_len, scale)

    def two_value_prompts(
        self,
        q: torch.Tensor,
        keys: tuple[torch.Tensor, torch.Tensor],
        values: tuple[torch.Tensor, torch.Tensor],
        spans: Sequence[tuple[int, int]],
        seconds: Sequence[torch.Tensor] | None,
        scale: float,
        out: torch.Tensor,
        rotate_q: bool = False,
        rotate_out: bool = False,
    ) -> None:
        """two_value_attention of each prompt computed whole in this step, in one native call:
        q [n, H, d] (rows of d), keys / values [kvh, n, d] each (as two_value_attention takes
        them), spans (start, length) of the prompts' rows, seconds their [length, length] uint8
        reads (None: first values only, the causal pass); writes out [n, H, d] (contiguous) at
        the prompts' rows."""
        num_heads, d = q.shape[1], q.shape[2]
        kvh = keys[0].shape[0]
        keys, values = _one_row_stride(keys), _one_row_stride(values)
        assert all(x.dtype == q.dtype for x in (*keys, *values)) and q.stride(-1) == 1
        assert out.is_contiguous() and out.dtype == q.dtype and out.shape == q.shape
        assert not (rotate_q or rotate_out) or d & (d - 1) == 0
        starts = torch.tensor([a for a, _ in spans], dtype=torch.int64)
        lens = torch.tensor([n for _, n in spans], dtype=torch.int64)
        masks = None
        if seconds is not None:
            masks = torch.tensor([m.data_ptr() for m in seconds], dtype=torch.int64)
            assert all(m.dtype == torch.uint8 and m.is_contiguous() for m in seconds)
        k1, k2 = keys
        v1, v2 = values
        self.lib.call(
            "two_value_prompts",
            q=q.data_ptr(),
            q_tok=q.stride(0),
            q_head=q.stride(1),
            k1=k1.data_ptr(),
            k1_head=k1.stride(0),
            k2=k2.data_ptr(),
            k2_head=k2.stride(0),
            v1=v1.data_ptr(),
            v1_head=v1.stride(0),
            v2=v2.data_ptr(),
            v2_head=v2.stride(0),
            k_row=k1.stride(1),
            v_row=v1.stride(1),
            seconds=None if masks is None else masks.data_ptr(),
            num_seqs=len(spans),
            starts=starts.data_ptr(),
            lens=lens.data_ptr(),
            num_heads=num_heads,
            num_kv_heads=kvh,
            d=d,
            scale=scale,
            bf16=int(q.dtype == torch.bfloat16),
            out=out.data_ptr(),
            o_tok=num_heads * d,
            o_head=d,
            rotate_q=int(rotate_q),
            rotate_out=int(rotate_out),
        )

    def two_value_attention(
        self,
        q: torch.Tensor,
        keys: tuple[torch.Tensor, torch.Tensor],
        values: tuple[torch.Tensor, torch.Tensor],
        second: torch.Tensor,
        q_start: int,
        scale: float,
        rotate_q: bool = False,
        rotate_out: bool = False,
    ) -> torch.Tensor:
        """split_prefill.two_value_attention in one native pass (csrc/two_value_attention.c),
        computed in float32: q [H, q_len, d] (any strides with rows of d), keys / values
        ([kvh, n, d] each, q's dtype, rows of d: a pair's two tensors one row stride, e.g.
        views of a step's [n, kvh, d] K / V), second [q_len, n] bool or uint8; returns
        [H, q_len, d] in q's dtype (a view of a [q_len, H, d] tensor). rotate_q / rotate_out:
        q rotated before (exact_tail.rotate), the output after, bit for bit, in the same pass
        (d a power of two)."""
        num_heads, q_len, d = q.shape
        kvh, n, _ = keys[0].shape
        keys, values = _one_row_stride(keys), _one_row_stride(values)
        parts = (*keys, *values)
        assert all(x.dtype == q.dtype for x in parts) and q.stride(-1) == 1
        assert not (rotate_q or rotate_out) or d & (d - 1) == 0
        second = second.to(torch.uint8).contiguous()
        out = torch.empty((q_len, num_heads, d), dtype=q.dtype)
        k1, k2, v1, v2 = parts
        self.lib.call(
            "two_value_attention",
            q=q.data_ptr(),
            q_tok=q.stride(1),
            q_head=q.stride(0),
            k1=k1.data_ptr(),
            k1_head=k1.stride(0),
            k2=k2.data_ptr(),
            k2_head=k2.stride(0),
            v1=v1.data_ptr(),
            v1_head=v1.stride(0),
            v2=v2.data_ptr(),
            v2_head=v2.stride(0),
            k_row=k1.stride(1),
            v_row=v1.stride(1),
            second=second.data_ptr(),
            num_heads=num_heads,
            num_kv_heads=kvh,
            q_len=q_len,
            n=n,
            d=d,
            q_start=q_start,
            scale=scale,
            bf16=int(q.dtype == torch.bfloat16),
            out=out.data_ptr(),
            o_tok=num_heads * d,
            o_head=d,
            rotate_q=int(rotate_q),
            rotate_out=int(rotate_out),
        )
        return out.transpose(0, 1)
