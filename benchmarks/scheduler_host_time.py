"""Host time of the scheduler's decode step, no model: schedule() + update_from_output() with
every running request decoding, and the block ids the step sends to the runner.

    python benchmarks/scheduler_host_time.py                      # 512 sequences x 4K context
    python benchmarks/scheduler_host_time.py --num-seqs 64 --context 32768

Run it with PYTHONPATH pointing at another tree's src/ to compare trees in one session.
"""

from __future__ import annotations

import argparse
import statistics
import time

from infer8.core.kv_cache_manager import KVCacheManager
from infer8.core.sched_output import ModelRunnerOutput, SchedulerOutput
from infer8.core.scheduler import Scheduler
from infer8.request import Request
from infer8.sampling_params import SamplingParams


def _sampled(out: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled_token_ids={s.req_id: 7 for s in out.scheduled})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=512)
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens per sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    ns = parser.parse_args(argv)
    n, ctx, bs = ns.num_seqs, ns.context, ns.block_size
    kv = KVCacheManager(n * (ctx // bs + ns.steps // bs + 2), bs, enable_caching=False)
    sched = Scheduler(kv, n, n * ctx + n)
    params = SamplingParams(max_tokens=ns.steps + 2, ignore_eos=True)
    for i in range(n):
        sched.add_request(Request(f"r{i}", [1 + (i + j) % 1000 for j in range(ctx)], params, []))
    out = sched.schedule()  # every prompt in one step
    sched.update_from_output(out, _sampled(out))
    times, sent = [], []
    for _ in range(ns.steps):
        start = time.perf_counter()
        out = sched.schedule()
        sched.update_from_output(out, _sampled(out))
        times.append(time.perf_counter() - start)
        # this tree's field, or an older tree's whole-table field
        sent.append(
            sum(
                len(getattr(s, "new_block_ids", getattr(s, "block_ids", []))) for s in out.scheduled
            )
        )
    print(
        f"{n} sequences x {ctx} tokens: decode step host time median "
        f"{statistics.median(times) * 1e3:.2f} ms; block ids sent per step: median "
        f"{statistics.median(sent):.0f}, max {max(sent)}"
    )


if __name__ == "__main__":
    main()
