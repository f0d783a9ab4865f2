"""Host time of one decode step through ModelRunner.execute with the device work stubbed.

The model returns zeros and random logits over a small vocabulary, so what is timed is the
runner's own work per step: the step's inputs and metadata, the block tables, the sampler's
bookkeeping and the penalties. 512 sequences of 4K-token prompts sample with temperature,
top-p and a repetition penalty. --penalty-rows uses the GPU's penalty tables
(worker/penalties.PenaltyRows) on the CPU.

    python benchmarks/host_step.py [--num-seqs 512] [--context 4096] [--vocab 32] [--penalty-rows]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from infer8.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from infer8.sampling_params import SamplingParams
from infer8.worker.model_runner import ModelRunner


class _StubModel(torch.nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, positions, meta, kv_caches, lora=None):  # type: ignore[no-untyped-def]
        return torch.zeros(input_ids.shape[0], 8)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.randn(hidden.shape[0], self.vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=512)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32, help="small: the sampler's math ~0")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--penalty-rows", action="store_true", help="the GPU's penalty tables")
    args = parser.parse_args()
    n, ctx, block_size = args.num_seqs, args.context, 16
    runner = ModelRunner(_StubModel(args.vocab), [], block_size, torch.device("cpu"))
    if args.penalty_rows:
        from infer8.worker.penalties import PenaltyRows

        runner.sampler.penalty_rows = PenaltyRows(torch.device("cpu"))
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, max_tokens=10**6)
    rng = np.random.default_rng(0)
    blocks_per_seq = -(-(ctx + args.steps + 1) // block_size)
    new = [NewRequestData(f"r{i}", rng.integers(0, args.vocab, ctx).tolist(), params)
           for i in range(n)]  # fmt: skip
    runner.execute(SchedulerOutput(scheduled_new_reqs=new, scheduled=[
        ScheduledRequest(f"r{i}", 0, ctx, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
        for i in range(n)
    ]))  # fmt: skip
    times = []
    for step in range(args.steps):
        sched = SchedulerOutput(
            scheduled=[ScheduledRequest(f"r{i}", ctx + step, 1, []) for i in range(n)],
            new_token_ids={f"r{i}": [int(rng.integers(args.vocab))] for i in range(n)},
        )
        t0 = time.perf_counter()
        runner.execute(sched)
        times.append(1e3 * (time.perf_counter() - t0))
    print(f"{n} x {ctx}, vocab {args.vocab}, penalty rows {args.penalty_rows}: "
          f"median {statistics.median(times):.1f} ms per step (min {min(times):.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
