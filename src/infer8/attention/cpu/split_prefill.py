"""Prefill attention over key ranges that queries see differently, merged by log-sum-exp.

A chunk's queries see some keys all alike (a cached prefix), some causally (the chunk's own
tokens) and, with an FP8 cache's exact tail, a band of the W newest positions in other values
than the rest. One SDPA call with an explicit mask covers all of it but drops to SDPA's unfused
math path on CPU (a [q_len, keys] mask, bmm, softmax: most of a long prompt's time). Here each
range runs through the fused flash kernel (which also returns each row's log-sum-exp), the band
as a small explicit [q_len, W] product, and the parts are merged exactly:
out = sum_p exp(lse_p - lse) * out_p with lse = logsumexp_p lse_p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infer8.kernels.cpu.prefill import PrefillKernels

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass
class KeyRange:
    """Keys and values [kvh, n, d] that queries q[q_start:] see: all of them, or causally."""

    k: torch.Tensor
    v: torch.Tensor
    causal: bool = False
    q_start: int = 0  # causal: query q_start + t sees keys [0, t]


@dataclass
class Band:
    """Keys and values of positions [first, first + q_len + W - 1) ([kvh, n, d]), in two
    values: query i sees window positions i .. i + W - 1 of them (those below `valid_from`
    excepted), those before band index `exact_from[i]` (its segment's start) in their first
    value (kq, vq, the FP8 blocks'), the rest in their second (k, v, at tail precision)."""

    k: torch.Tensor
    v: torch.Tensor
    window: int
    valid_from: int
    kq: torch.Tensor
    vq: torch.Tensor
    first_position: int  # the band's position 0, and the first query's position - (W - 1)
    exact_start: int  # a query at a reads exactly from max(a's segment start, exact_start)
    segment: int  # (its window's start aside: the band starts there)

    def exact_from(self, q_len: int, device: torch.device) -> torch.Tensor:
        """Return each query's first band index read at tail precision ([q_len] int64)."""
        a = torch.arange(q_len, device=device) + self.first_position + self.window - 1
        first = torch.clamp(a // self.segment * self.segment, min=self.exact_start)
        return first - self.first_position


def _expand(x: torch.Tensor, group: int) -> torch.Tensor:
    """[kvh, n, d] -> [1, kvh * group, n, d] (query head h reads KV head h // group)."""
    kvh, n, d = x.shape
    return x[:, None].expand(kvh, group, n, d).reshape(1, kvh * group, n, d)


def _range_part(q: torch.Tensor, part: KeyRange, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (out [H, q_len, d], lse [H, q_len]) of one key range; rows that see none: -inf."""
    num_heads, q_len, d = q.shape
    group = num_heads // part.k.shape[0]
    out = torch.zeros_like(q)
    lse = torch.full((num_heads, q_len), -float("inf"), dtype=torch.float32, device=q.device)
    if part.k.shape[1] == 0 or part.q_start >= q_len:
        return out, lse
    qs = q[:, part.q_start :]
    if q.device.type == "cpu":  # the flash kernel reads KV head h // group itself (GQA)
        o, s = _flash(qs[None], part.k[None], part.v[None], 0.0, part.causal, scale=scale)
        o, s = o[0], s[0]
    else:  # the reference backend on a GPU: the same numbers, computed explicitly
        keys, values = _expand(part.k, group), _expand(part.v, group)
        scores = torch.einsum("hqd,hkd->hqk", qs.float(), keys[0].float()) * scale
        if part.causal:
            rows = torch.arange(qs.shape[1], device=q.device)[:, None]
            cols = torch.arange(keys.shape[2], device=q.device)[None, :]
            scores.masked_fill_(cols > rows, -float("inf"))
        s = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - s[..., None]).nan_to_num_(0.0)
        o = torch.einsum("hqk,hkd->hqd", probs, values[0].float()).to(q.dtype)
    out[:, part.q_start :] = o
    lse[:, part.q_start :] = s
    return out, lse


def _band_part(
    q: torch.Tensor, band: Band, scale: float, block: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (out, lse) of the band, in query blocks of `block` rows.

    Query i sees keys i .. i + W - 1 of the band; a block of B queries reads B + W - 1 keys,
    so each block is one small matmul ([G * B, d] x [d, B + W - 1]) and the cost is linear in
    q_len (a full [q_len, q_len] product would be quadratic, a per-query one all overhead).
    """
    num_heads, q_len, d = q.shape
    kvh = band.k.shape[0]
    group, w = num_heads // kvh, band.window
    block = min(block, q_len)
    nb = -(-q_len // block)
    span = block + w - 1
    pad_q = nb * block - q_len
    # [kvh, G, q_len, d] -> [kvh * nb, G * B, d]: each block's queries, all heads of a group
    qb = torch.nn.functional.pad(q.reshape(kvh, group, q_len, d), (0, 0, 0, pad_q))
    qb = qb.view(kvh, group, nb, block, d).permute(0, 2, 1, 3, 4).reshape(kvh * nb, -1, d)
    kv = []
    for x in (band.k, band.v):  # [kvh, q_len + W - 1, d] -> [kvh * nb, B + W - 1, d]
        if pad_q:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad_q))
        kv.append(x.unfold(1, span, block).transpose(2, 3).reshape(kvh * nb, span, d))
    kv_q = []
    for x in (band.kq, band.vq):
        if pad_q:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad_q))
        kv_q.append(x.unfold(1, span, block).transpose(2, 3).reshape(kvh * nb, span, d))
    rows = torch.arange(block, device=q.device)[:, None]
    cols = torch.arange(span, device=q.device)[None, :]
    first = torch.arange(nb, device=q.device)[:, None, None] * block  # each block's first key
    exact_from = torch.nn.functional.pad(band.exact_from(q_len, q.device), (0, pad_q))
    exact = (first + cols >= exact_from.view(nb, block, 1))[None, :, None]  # [1, nb, 1, B, span]
    scores_e = torch.bmm(qb, kv[0].transpose(1, 2)).float() * scale  # [kvh*nb, G*B, span]
    scores_q = torch.bmm(qb, kv_q[0].transpose(1, 2)).float() * scale
    shape = (kvh, nb, group, block, span)
    scores = torch.where(exact, scores_e.view(shape), scores_q.view(shape))
    seen = (cols >= rows) & (cols < rows + w) & (first + cols >= band.valid_from)
    scores.masked_fill_(~seen[None, :, None], -float("inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [kvh, nb, G, B]
    probs = torch.exp(scores - lse[..., None]).nan_to_num_(0.0).to(q.dtype)
    p_e = (probs * exact).view(kvh * nb, group * block, span)
    p_q = (probs * ~exact).view(kvh * nb, group * block, span)
    out = torch.bmm(p_e, kv[1]) + torch.bmm(p_q, kv_q[1])  # [kvh*nb, G*B, d]
    out = out.view(kvh, nb, group, block, d).permute(0, 2, 1, 3, 4).reshape(kvh, group, -1, d)
    lse = lse.permute(0, 2, 1, 3).reshape(kvh, group, -1)
    return (
        out[:, :, :q_len].reshape(num_heads, q_len, d),
        lse[:, :, :q_len].reshape(num_heads, q_len),
    )


def split_prefill_attention(
    q: torch.Tensor,
    ranges: list[KeyRange],
    band: Band | None,
    scale: float,
    native: PrefillKernels | None = None,
) -> torch.Tensor:
    """Attend q [H, q_len, d] over key ranges and an optional band; [H, q_len, d].

    Every query must see at least one key (a chunk's own token always does). `native`: the
    band in one C pass for float32 or bf16 CPU tensors (csrc/band_attention.c).
    """
    parts = [_range_part(q, r, scale) for r in ranges]
    if band is not None and native is not None and q.dtype in (torch.float32, torch.bfloat16):
        parts.append(native.band_attention(q, band, scale))
    elif band is not None:
        parts.append(_band_part(q, band, scale))
    lse = torch.logsumexp(torch.stack([s for _, s in parts]), dim=0)  # [H, q_len]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for o, s in parts:
        out += torch.exp(s - lse)[..., None] * o.float()
    return out.to(q.dtype)


def two_value_attention(
    q: torch.Tensor,
    keys: tuple[torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor],
    second: torch.Tensor,
    q_start: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention where each (query, key) pair reads one of two values of that key.

    q: [H, q_len, d] at positions q_start..; keys, values: ([kvh, n, d], [kvh, n, d]); second:
    [q_len, n] bool, True where the pair reads the second value. Dense: [H, q_len, n] scores
    twice, for short sequences (an FP8 cache's exact tail on a short prompt), where the key
    ranges and band of split_prefill_attention cost more in per-call overhead than in math.
    """
    num_heads, q_len, d = q.shape
    kvh, n, _ = keys[0].shape
    group = num_heads // kvh
    qg = q.reshape(kvh, group * q_len, d)
    s1 = torch.bmm(qg, keys[0].transpose(1, 2)).view(kvh, group, q_len, n)
    s2 = torch.bmm(qg, keys[1].transpose(1, 2)).view(kvh, group, q_len, n)
    scores = torch.where(second, s2, s1).float() * scale
    rows = torch.arange(q_len, device=q.device)[:, None] + q_start
    scores.masked_fill_(torch.arange(n, device=q.device)[None, :] > rows, -float("inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    p2 = probs * second
    p1 = (probs - p2).view(kvh, group * q_len, n)
    out = torch.bmm(p1, values[0]) + torch.bmm(p2.view(kvh, group * q_len, n), values[1])
    return out.view(num_heads, q_len, d)
