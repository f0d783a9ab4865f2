"""The exact tail's seats as a KV resource of the scheduler: rows, sinks, shortened hits."""

from __future__ import annotations

from infer8.core.exact_tail_seats import ExactTailSeats, TailSeat
from infer8.core.kv_cache_manager import KVCacheManager
from infer8.core.sched_output import ModelRunnerOutput, SchedulerOutput
from infer8.core.scheduler import Scheduler
from infer8.request import Request
from infer8.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=4)


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, PARAMS, [])


def test_rows_are_reused_and_a_resumed_request_starts_a_new_exact_range() -> None:
    seats = ExactTailSeats(2, segment=24, sink_tokens=0, block_size=4)
    assert seats.seat("a", 0, None) == TailSeat(0, 0, -1, False)
    assert seats.seat("b", 12, None).row == 1 and seats.num_free_rows == 0
    seats.release("a")  # finished or preempted
    assert seats.get("a") is None
    assert seats.seat("c", 24, None) == TailSeat(0, 24, -1, False)


def test_sinks_follow_first_block_hashes_and_recycle_the_least_recent_unread_one() -> None:
    seats = ExactTailSeats(2, segment=4, sink_tokens=2, block_size=4)
    assert seats.seat("a", 0, "h10").sink_slot == 0  # computes block 0: writes its sinks
    assert seats.usable_hit(8, "h10") == 8
    seats.release("a")
    hit = seats.seat("b", 8, "h10")  # hits h10's block: reads the sinks a wrote
    assert (hit.sink_slot, hit.writes_sinks) == (0, False)
    assert seats.seat("c", 0, "h20").sink_slot == 1
    seats.release("b")
    seats.release("c")
    assert seats.seat("d", 0, "h30").sink_slot == 0  # the least recently used unread slot
    assert seats.usable_hit(8, "h10") == 0  # h10 lost its sinks: no hit, recompute from 0
    assert seats.usable_hit(8, "h20") == 8


def test_hits_are_shortened_to_segment_and_block_boundaries() -> None:
    seats = ExactTailSeats(4, segment=72, sink_tokens=0, block_size=16)
    assert seats.hit_alignment == 144
    assert [seats.usable_hit(n, None) for n in (16, 128, 144, 272, 288)] == [0, 0, 144, 144, 288]
    assert ExactTailSeats(4, 96, 0, 16).usable_hit(112, None) == 96  # the default: 4 x 24


def _scheduler(num_rows: int, num_blocks: int = 64, num_host_blocks: int = 0) -> Scheduler:
    """A continuous scheduler over blocks of 4 tokens, with segments of 8 and 2 sinks."""
    kv = KVCacheManager(num_blocks, 4, num_host_blocks=num_host_blocks, exact_tail=(num_rows, 8, 2))
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=256)


def _sampled(out: SchedulerOutput) -> ModelRunnerOutput:
    """A runner's answer to a step: token 7 for every request that samples."""
    return ModelRunnerOutput(sampled_token_ids={s.req_id: 7 for s in out.scheduled if s.sample})


def test_the_scheduler_seats_admitted_requests_and_takes_hits_only_at_segment_starts() -> None:
    sched = _scheduler(num_rows=4)
    prompt = list(range(1, 30))  # 29 tokens: 7 full blocks of 4
    sched.add_request(_request("a", prompt))
    out = sched.schedule()
    (a,) = out.scheduled
    assert a.tail == TailSeat(0, 0, 0, True)  # row 0, exact from 0, writes its sinks
    sched.update_from_output(out, _sampled(out))
    # b shares a's first 26 tokens: 6 cached blocks (24 tokens), a multiple of the segment (8)
    sched.add_request(_request("b", prompt[:26] + [99, 98]))
    # c shares 21 tokens: 5 blocks (20 tokens), shortened to 16
    sched.add_request(_request("c", prompt[:21] + [97]))
    out = sched.schedule()
    by_id = {s.req_id: s for s in out.scheduled}
    assert by_id["b"].num_computed_tokens == 24 and by_id["c"].num_computed_tokens == 16
    assert by_id["b"].tail == TailSeat(1, 24, 0, False)  # a's sinks, read not written
    assert by_id["c"].tail == TailSeat(2, 16, 0, False)
    assert by_id["a"].tail == TailSeat(0, 0, 0, True)  # the same seat every step


def test_a_full_tail_holds_admission_and_preemption_or_abort_frees_the_row() -> None:
    sched = _scheduler(num_rows=2)
    for i in range(3):
        sched.add_request(_request(f"r{i}", [100 * i + j for j in range(1, 10)]))
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["r0", "r1"]  # two rows, not max_num_seqs
    sched.update_from_output(out, _sampled(out))
    sched.finish_requests(["r0"], sched.requests["r0"].status.FINISHED_ABORTED)
    out = sched.schedule()
    assert [(s.req_id, s.tail.row) for s in out.scheduled if s.tail] == [("r1", 1), ("r2", 0)]
    sched.update_from_output(out, _sampled(out))
    victim = sched.running.pop()  # preempted: its row goes back with its blocks
    sched._preempt(victim, out)
    assert sched.kv_cache_manager.get_seat(victim.request_id) is None
    assert sched.kv_cache_manager.can_seat()


def test_host_hits_are_shortened_too() -> None:
    kv = KVCacheManager(8, 4, num_host_blocks=16, exact_tail=(2, 8, 2))
    a = _request("a", list(range(1, 26)))  # 6 full blocks
    assert kv.allocate_slots(a, 25) is not None
    kv.seat(a)
    kv.free("a")
    b = _request("b", list(range(50, 82)))  # all 8 blocks: a's go to the host tier
    assert kv.allocate_slots(b, 32) is not None
    kv.free("b")
    c = _request("c", list(range(1, 23)) + [99])  # shares 22 tokens: 5 blocks, shortened to 16
    device, host = kv.find_prefix(c)
    assert device == [] and len(host) == 4
    # the sinks are keyed by content, so a first block loaded back from the host keeps them
    kv.allocate_slots(c, 23, device, host)
    c.num_computed_tokens = 16
    kv.seat(c)
    seat = kv.get_seat("c")
    assert seat is not None and (seat.exact_start, seat.writes_sinks) == (16, False)


def test_the_scheduler_loads_a_host_hit_cut_to_a_segment_with_its_sinks() -> None:
    sched = _scheduler(num_rows=2, num_blocks=8, num_host_blocks=16)
    kv = sched.kv_cache_manager
    prefix = list(range(1, 23))
    for req_id, tokens in (("a", prefix + [90, 91, 92]), ("b", list(range(50, 77)))):
        sched.add_request(_request(req_id, tokens))  # b needs every block: a's go to host
        while req_id in sched.requests:
            out = sched.schedule()
            sched.update_from_output(out, _sampled(out))
    sched.add_request(_request("c", prefix + [99]))
    out = sched.schedule()
    (c,) = out.scheduled
    assert c.num_computed_tokens == 16 and len(out.host_load_slots) == 4  # 5 blocks, cut to 4
    assert c.tail == TailSeat(c.tail.row, 16, c.tail.sink_slot, False) and c.tail.sink_slot >= 0
    assert kv.get_seat("c") == c.tail
