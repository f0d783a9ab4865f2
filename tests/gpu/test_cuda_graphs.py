"""Decode CUDA graphs: buckets, padding that changes nothing, and (on a GPU) replay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (Linux x86_64 test extra)")

from tests.gpu import triton_modules  # noqa: E402

_MODULES = triton_modules.load()
triton_backend = _MODULES["backend"]
cuda_graphs = _MODULES["cuda_graphs"]
HAS_CUDA, DEVICE = triton_modules.HAS_CUDA, triton_modules.DEVICE

from infer8.attention.exact_tail import build_tail_metadata  # noqa: E402
from infer8.attention.kv_cache import KVCacheSpec, allocate_kv_cache  # noqa: E402
from infer8.attention.metadata import build_attention_metadata  # noqa: E402
from infer8.core.exact_tail_seats import ExactTailSeats  # noqa: E402
from infer8.models.loader import load_model  # noqa: E402
from tests.utils import float_ordinals  # noqa: E402

BLOCK_SIZE = 16


def test_buckets_cover_every_batch_size_up_to_max_num_seqs() -> None:
    buckets = cuda_graphs.batch_buckets(100)
    assert buckets[:4] == [1, 2, 4, 8] and buckets[-1] == 100 and buckets == sorted(buckets)
    assert cuda_graphs.bucket_for(3, buckets) == 4
    assert cuda_graphs.bucket_for(64, buckets) == 64
    assert cuda_graphs.bucket_for(97, buckets) == 100
    assert cuda_graphs.bucket_for(101, buckets) is None
    assert cuda_graphs.batch_buckets(1) == [1]
    # vLLM's steps: of 8 below 256, of 16 from there, so no batch pads more than 15 rows
    for max_num_seqs in (7, 100, 256, 257, 300, 511, 512, 1024):
        buckets = cuda_graphs.batch_buckets(max_num_seqs)
        assert buckets[-1] == max_num_seqs and buckets == sorted(set(buckets))
        for n in range(1, max_num_seqs + 1):
            bucket = cuda_graphs.bucket_for(n, buckets)
            assert bucket is not None and 0 <= bucket - n < (8 if n <= 256 else 16)
    assert 264 not in cuda_graphs.batch_buckets(512) and 272 in cuda_graphs.batch_buckets(512)


def _setup(
    llama_dir: Path, dtype: torch.dtype, kv_dtype: torch.dtype, tail_window: int = 0
) -> tuple:
    model, _, _ = load_model(str(llama_dir), dtype, DEVICE)
    backend = triton_backend.TritonAttention(DEVICE)
    model.set_attention_backend(backend)
    cfg = model.config
    spec = KVCacheSpec(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, BLOCK_SIZE, kv_dtype,
        tail_window, 4 if tail_window else 0, hadamard=bool(tail_window),
    )  # fmt: skip
    caches = allocate_kv_cache(spec, 32, DEVICE, num_tail_rows=4 if tail_window else 0)
    return model, backend, caches


class _Seats:
    """The model runner's tail seats for requests 0..n-1 (rows, sink slots), in one place."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.seats = ExactTailSeats(4, window, 4, BLOCK_SIZE) if window else None

    def attach(self, meta, q_lens: list[int], computed: list[int], block_ids: list) -> None:  # type: ignore[no-untyped-def]
        if self.seats is None:
            return
        held = [
            self.seats.get(str(i)) or self.seats.seat(str(i), c, b[0])
            for i, (c, b) in enumerate(zip(computed, block_ids))
        ]
        meta.tail = build_tail_metadata(
            self.window, 4, [x.row for x in held], [x.exact_start for x in held],
            [(x.sink_slot, x.writes_sinks) for x in held], q_lens, computed,
            meta.decode_seq_ids, meta.decode_block_tables.shape[1] * BLOCK_SIZE, DEVICE,
        )  # fmt: skip


def _prefill(
    model: torch.nn.Module, caches: list, prompts: list[list[int]], seats: _Seats | None = None
) -> list[list[int]]:
    """Run the prompts through the model; return each one's blocks (with room to decode)."""
    block_ids, next_block = [], 0
    for p in prompts:
        n = -(-(len(p) + 8) // BLOCK_SIZE)
        block_ids.append(list(range(next_block, next_block + n)))
        next_block += n
    meta = build_attention_metadata(
        [len(p) for p in prompts], [0] * len(prompts), block_ids, BLOCK_SIZE, DEVICE
    )
    if seats is not None:
        seats.attach(meta, [len(p) for p in prompts], [0] * len(prompts), block_ids)
    ids = torch.tensor([t for p in prompts for t in p], device=DEVICE)
    positions = torch.tensor([i for p in prompts for i in range(len(p))], device=DEVICE)
    with torch.inference_mode():
        model(ids, positions, meta, caches)
    return block_ids


def _cache_tensors(caches: list) -> list[torch.Tensor]:
    out = []
    for c in caches:
        out += [c.k, c.v, c.k_scale, c.v_scale, *(c.tail_store or ())]
    return out


class _FakeGraph:
    """A "graph" that runs the captured forward again on replay, into the static output."""

    def __init__(self, forward, out: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        self.forward, self.out = forward, out

    def replay(self) -> None:
        self.out.copy_(self.forward())


class _FakeGraphAPI:
    """The CUDA graph API's CPU stand-in: records the buckets captured, in order."""

    def __init__(self) -> None:
        self.captured: list[int] = []

    def pool(self) -> object:
        return object()

    def capture(self, forward, pool: object) -> tuple[_FakeGraph, torch.Tensor]:  # type: ignore[no-untyped-def]
        out = forward()
        self.captured.append(out.shape[0])
        return _FakeGraph(forward, out), out

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("tail_window", [0, 6], ids=["plain", "exact-tail"])
def test_padded_bucket_decode_equals_unpadded_and_writes_nothing_else(
    llama_dir: Path, tail_window: int
) -> None:
    """On CPU the graph API is a stand-in whose replay runs the captured forward again, so
    this checks capture, the buckets' static buffers and their padding, not CUDA's capture.

    With an exact tail (and rotated keys, the FP8 default where graphs run) the bucket's
    static tail tables must give what the eager step reads, and its padding rows must enter
    no ring and no sink slot; capturing (all rows padding) writes nothing either.
    """
    model, backend, caches = _setup(llama_dir, torch.float32, torch.float8_e4m3fn, tail_window)
    seats = _Seats(tail_window)
    prompts = [[3, 9, 27, 81, 11], list(range(5, 24)), list(range(40, 73))]
    block_ids = _prefill(model, caches, prompts, seats)
    lens = [len(p) for p in prompts]
    meta = build_attention_metadata([1, 1, 1], lens, block_ids, BLOCK_SIZE, DEVICE)
    seats.attach(meta, [1, 1, 1], lens, block_ids)
    ids = torch.tensor([7, 8, 9], device=DEVICE)
    positions = torch.tensor(lens, device=DEVICE)
    before = [t.clone() for t in _cache_tensors(caches)]
    with torch.inference_mode():
        want = model(ids, positions, meta, caches)
    after = [t.clone() for t in _cache_tensors(caches)]
    for t, old in zip(_cache_tensors(caches), before):  # the step again, from the same state
        t.copy_(old)

    api = _FakeGraphAPI()
    runner = cuda_graphs.CUDAGraphDecodeRunner(
        model, caches, backend, BLOCK_SIZE, 256, 8, buckets=[1, 4], tail_window=tail_window,
        graph_api=api,
    )  # fmt: skip
    runner.capture()
    assert api.captured == [4, 1]  # largest first, into one pool
    for t, old in zip(_cache_tensors(caches), before):  # capture wrote nothing
        assert torch.equal(float_ordinals(t), float_ordinals(old))
    assert runner.can_run(meta, 3) and not runner.can_run(meta, 4)  # static-batch padding
    got = runner.run(ids, positions, meta)  # bucket 4: one padding row, replayed
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for t, old, was in zip(_cache_tensors(caches), after, before):
        # what the eager step wrote, no more: elements it left alone are untouched, and those it
        # wrote hold its values to one rounding step (a 4-row matmul may round otherwise than
        # a 3-row one, and a residual near a rounding boundary lands on the next FP8 code)
        written = float_ordinals(old) != float_ordinals(was)
        assert torch.equal(float_ordinals(t)[~written], float_ordinals(old)[~written])
        steps = (float_ordinals(t)[written] - float_ordinals(old)[written]).abs()
        assert steps.numel() == 0 or int(steps.max()) <= 1
    if tail_window:  # and the step did write ring residuals
        assert any(not torch.equal(a, b) for a, b in zip(after, before))


# bf16 logits of two runs whose matmuls may round differently: norm-wise and element-wise
# bounds (relative to the largest logit), a few bf16 roundings through the tiny model's layers
LOGIT_REL_TOL = {torch.bfloat16: 2e-2, torch.float8_e4m3fn: 4e-2}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_graph_replay_logits_equal_eager_within_bf16_rounding(
    llama_dir: Path, kv_dtype: torch.dtype
) -> None:
    """3 rows replayed in the 4-row bucket against 3-row eager steps, fed the same tokens.

    cuBLAS may pick other kernels for 4 rows than for 3, so bf16 logits agree to rounding, not
    bit for bit: the bound is on the logits (comparing greedy tokens would fail on near ties).
    Both runs go on from eager's tokens.
    """
    prompts = [[3, 9, 27, 81, 11], list(range(5, 24)), list(range(40, 73))]
    eager_model, _, eager_caches = _setup(llama_dir, torch.bfloat16, kv_dtype)
    model, backend, caches = _setup(llama_dir, torch.bfloat16, kv_dtype)
    block_ids = _prefill(eager_model, eager_caches, prompts)
    assert _prefill(model, caches, prompts) == block_ids
    runner = cuda_graphs.CUDAGraphDecodeRunner(model, caches, backend, BLOCK_SIZE, 256, 8)
    runner.capture()
    assert cuda_graphs.bucket_for(3, runner.buckets) == 4  # the replay pads a row
    lens = [len(p) for p in prompts]
    tokens = torch.tensor([1, 2, 3], device=DEVICE)
    tol = LOGIT_REL_TOL[kv_dtype]
    for _ in range(6):
        positions = torch.tensor(lens, device=DEVICE)
        with torch.inference_mode():
            meta = build_attention_metadata([1] * 3, lens, block_ids, BLOCK_SIZE, DEVICE)
            want = eager_model.compute_logits(eager_model(tokens, positions, meta, eager_caches))
            meta = build_attention_metadata([1] * 3, lens, block_ids, BLOCK_SIZE, DEVICE)
            got = model.compute_logits(runner.run(tokens, positions, meta))
        want, got = want.float(), got.float()
        scale = want.abs().max()
        assert torch.isfinite(got).all() and (got - want).norm() <= tol * want.norm()
        # element-wise too: so greedy tokens agree wherever eager's top-2 margin is wider
        # than 4 * tol * scale
        assert (got - want).abs().max() <= 2 * tol * scale
        tokens = want.argmax(-1)
        lens = [n + 1 for n in lens]
