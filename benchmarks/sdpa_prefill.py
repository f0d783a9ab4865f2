"""CPU SDPA for one 2,048-token causal prefill: 3-D vs 4-D inputs (the fused path needs 4-D).

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


if __name__ == "__main__":
    main()
