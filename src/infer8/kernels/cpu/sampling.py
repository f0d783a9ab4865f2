"""The sampler's native passes (csrc/elementwise.c, sampling.c) over float32 CPU logits: the
greedy argmax and the top-k / top-p candidates, each one pass without a sanitized copy."""

from __future__ import annotations

import torch

from infer8.kernels.cpu.library import NativeLibrary


class NativeSampling:
    """Passes the sampler calls where they apply (worker/sampler.py)."""

    def __init__(self, lib: NativeLibrary) -> None:
        self.lib = lib

    def greedy(self, logits: torch.Tensor, limit: float) -> list[int]:
        """Return each row's argmax of float32 logits [rows, vocab] after the sampler's
        sanitizing (NaN -> -limit, clamped to [-limit, limit]; the first of equal maxima), as
        torch's argmax of that sanitized copy returns it, in one pass without the copy."""
        assert logits.dtype == torch.float32 and logits.dim() == 2 and logits.device.type == "cpu"
        logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self.lib.greedy_rows(
            logits.data_ptr(), logits.shape[0], logits.shape[1], limit, out.data_ptr()
        )
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
        self.lib.nucleus_candidates(
            logits.data_ptr(), rows, vocab, top_p.data_ptr(), top_k.data_ptr(), cap,
            row_max.data_ptr(), row_sum.data_ptr(), ids.data_ptr(), count.data_ptr(),
        )  # fmt: skip
        return ids, count, row_max, row_sum
