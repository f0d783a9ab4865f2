"""CPU SDPA for one 2,048-token causal prefill: 3-D vs 4-D inputs (the fused path needs 4-D),
and a query-tiled torch alternative (bmm of each tile against its keys, softmax in float32, bmm
with the values: every matmul on oneDNN) with its achieved rate.

python benchmarks/sdpa_prefill.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def main() -> None:
    torch.manual_seed(0)
    num_tokens, num_heads, num_kv_heads, head_dim = 2048, 9, 3, 64  # the default model's shape
    q = torch.randn(num_heads, num_tokens, head_dim, dtype=torch.bfloat16)
    k = torch.randn(num_kv_heads, num_tokens, head_dim, dtype=torch.bfloat16)
    v = torch.randn(num_kv_heads, num_tokens, head_dim, dtype=torch.bfloat16)

    def best_of(fn, runs: int = 3) -> float:  # type: ignore[no-untyped-def]
        fn()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    t3 = best_of(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    t4 = best_of(
        lambda: F.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, enable_gqa=True
        )
    )
    print(f"3-D inputs: {t3:.3f} s; 4-D inputs: {t4:.3f} s; {t3 / t4:.1f}x")
    ref = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)
    # causal: QK^T and PV, 2 flops per multiply-add, half of the square
    flops = 2 * 2 * num_heads * head_dim * num_tokens * num_tokens / 2
    print(f"SDPA 4-D: {flops / t4 / 1e9:.0f} GFLOP/s")
    for tile in (128, 256):
        out = tiled_attention(q, k, v, tile)
        err = (out.float() - ref[0].float()).abs().max().item()
        t = best_of(lambda tile=tile: tiled_attention(q, k, v, tile))
        print(
            f"query tiles of {tile}: {t:.3f} s ({flops / t / 1e9:.0f} GFLOP/s, max error {err:.3g})"
        )


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: int) -> torch.Tensor:
    """Causal attention, tile query rows at a time, each KV head's query group in one bmm."""
    num_heads, num_tokens, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    qg = q.view(num_kv_heads, group, num_tokens, head_dim)
    out = torch.empty_like(qg)
    kt = k.transpose(1, 2)
    for start in range(0, num_tokens, tile):
        end = min(start + tile, num_tokens)
        rows = end - start
        scores = (
            torch.bmm(
                qg[:, :, start:end].reshape(num_kv_heads, group * rows, head_dim), kt[:, :, :end]
            )
            .float()
            .mul_(head_dim**-0.5)
        )
        scores = scores.view(num_kv_heads, group, rows, end)
        future = torch.ones(rows, rows, dtype=torch.bool).triu_(1)
        scores[..., start:end].masked_fill_(future, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(q.dtype).view(num_kv_heads, group * rows, end)
        out[:, :, start:end] = torch.bmm(p, v[:, :end]).view(num_kv_heads, group, rows, head_dim)
    return out.view(num_heads, num_tokens, head_dim)


if __name__ == "__main__":
    main()
