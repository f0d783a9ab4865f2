"""The continuous (iteration-level) scheduler: schedule() -> SchedulerOutput; update_from_output()."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable

from infer8.core.kv_cache_manager import KVCacheManager
from infer8.core.request_queue import (
    RequestQueue,
    SchedulingPolicy,
    create_request_queue,
    priority_key,
)
from infer8.core.sched_output import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from infer8.request import Request, RequestStatus
from infer8.spec_decode.speculator import Speculator


class SchedulerBase:
    """Owns the requests, the waiting queue and the KV cache manager shared by both schedulers."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: SchedulingPolicy | str = SchedulingPolicy.FCFS,
        speculator: Speculator | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        # --enable-lora: the most distinct adapters running at once (a step's device slots)
        self.max_loras = max_loras
        self.speculator = speculator  # drafts for decoding requests (continuous scheduler)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = SchedulingPolicy(policy)
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(self.policy)
        self.running: list[Request] = []
        self._seen_by_runner: set[str] = set()
        self._finished_since_last_step: list[str] = []
        # appended last step (accepted drafts, then the sampled token), sent with the next one
        self._new_token_ids: dict[str, list[int]] = {}
        self._num_blocks_sent: dict[str, int] = {}  # block ids the runner holds, per request
        self._stats = SchedulerStats()

    # -- request lifecycle ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request (the engine has validated that it can ever fit)."""
        assert request.request_id not in self.requests, "duplicate request id"
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (stop string, abort) requests now and free their blocks."""
        assert status.is_finished
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            request.status = status
            self._remove(request)
            finished.append(request)
        return finished

    def _remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove_request(request)
        self._release(request)

    def _release(self, request: Request) -> None:
        """Free a finished request's blocks and forget it."""
        self.kv_cache_manager.free(request.request_id)
        self._num_blocks_sent.pop(request.request_id, None)
        if self.speculator is not None:
            self.speculator.remove(request)
        del self.requests[request.request_id]
        self._stats.finished_req_ids.append(request.request_id)
        if request.request_id in self._seen_by_runner:
            self._seen_by_runner.discard(request.request_id)
            self._finished_since_last_step.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        """Return whether any request is waiting or running."""
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        """Return waiting + running."""
        return len(self.requests)

    def num_waiting_by_priority(self) -> dict[int, int]:
        """Return how many requests wait at each priority value (all at 0 under FCFS)."""
        return self.waiting.num_requests_by_priority()

    # -- one step ----------------------------------------------------------------------------
    def _new_output(self) -> SchedulerOutput:
        out = SchedulerOutput(
            finished_req_ids=self._finished_since_last_step, new_token_ids=self._new_token_ids
        )
        self._finished_since_last_step = []
        self._new_token_ids = {}
        self._stats = SchedulerStats()
        return out

    def _schedule_request(
        self,
        out: SchedulerOutput,
        request: Request,
        num_new_tokens: int,
        spec_token_ids: list[int] | None = None,
    ) -> None:
        """Append one request's slice to the step's output: `num_new_tokens` known tokens, then
        any drafts."""
        if request.request_id not in self._seen_by_runner:
            self._seen_by_runner.add(request.request_id)
            out.scheduled_new_reqs.append(
                NewRequestData(
                    request.request_id,
                    list(request.all_token_ids),
                    request.sampling_params,
                    request.eos_token_ids,
                    request.lora_request,
                )
            )
        if request.first_scheduled_time_s is None:
            request.first_scheduled_time_s = time.monotonic()
        end = request.num_computed_tokens + num_new_tokens
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        num_sent = self._num_blocks_sent.get(request.request_id, 0)
        self._num_blocks_sent[request.request_id] = len(block_ids)
        out.scheduled.append(
            ScheduledRequest(
                req_id=request.request_id,
                num_computed_tokens=request.num_computed_tokens,
                num_new_tokens=num_new_tokens + len(spec_token_ids or ()),
                new_block_ids=block_ids[num_sent:],
                sample=end == request.num_tokens,
                tail=self.kv_cache_manager.get_seat(request.request_id),
                spec_token_ids=spec_token_ids or [],
            )
        )
        self._stats.scheduled_req_ids.append(request.request_id)

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[tuple[Request, list[int]]]:
        """Advance progress, append sampled tokens and retire finished requests in this step.

        Returns (request, new token ids) for every request that got a token this step.
        """
        progressed: list[tuple[Request, list[int]]] = []
        for sched in sched_out.scheduled:
            request = self.requests.get(sched.req_id)
            if request is None:  # aborted while the step ran
                continue
            drafts = sched.spec_token_ids
            num_accepted = runner_out.num_accepted_draft_tokens.get(sched.req_id, 0)
            # rejected drafts were computed but are not the request's: they leave its progress
            request.num_computed_tokens += sched.num_new_tokens - (len(drafts) - num_accepted)
            token_id = runner_out.sampled_token_ids.get(sched.req_id)
            if token_id is None:
                continue
            if drafts and self.speculator is not None:
                self.speculator.on_verified(sched.req_id, len(drafts), num_accepted)
            appended = []
            for token in [*drafts[:num_accepted], token_id]:
                request.append_output_token(token)
                appended.append(token)
                if request.is_finished:  # EOS, a stop token or the length cap: the rest goes
                    break
            self._new_token_ids[request.request_id] = appended
            progressed.append((request, appended))
            if request.is_finished:
                self._on_finished(request)
        return progressed

    def _on_finished(self, request: Request) -> None:
        """Retire a request that finished on its own (EOS, stop token, length)."""
        self._remove(request)

    def make_stats(self) -> SchedulerStats:
        """Return the stats of the step just completed."""
        stats = self._stats
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting)
        stats.num_kv_blocks_used = self.kv_cache_manager.block_pool.num_used_blocks
        stats.num_kv_blocks_total = self.kv_cache_manager.num_blocks
        if self.speculator is not None:
            stats.spec_decode = self.speculator.take_stats()
        if self.max_loras is not None:
            stats.running_lora_adapters = _lora_names(self.running)
            stats.waiting_lora_adapters = _lora_names(self.waiting)
        return stats

    def schedule(self) -> SchedulerOutput:  # pragma: no cover - abstract
        """Pick this step's work."""
        raise NotImplementedError


class Scheduler(SchedulerBase):
    """Iteration-level scheduling: requests join and leave the batch at every step.

    FCFS admits in arrival order and, when blocks run out, preempts the most recently admitted
    request. The priority policy (vLLM's) admits by (priority, arrival time), keeps `running`
    in that order so that the preempted request is the one with the largest key, and lets a
    waiting request preempt running ones of larger key when it lacks the blocks to join.
    """

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running requests first, then waiting ones in policy order."""
        out = self._new_output()
        token_budget = self.max_num_batched_tokens
        if self.policy == SchedulingPolicy.PRIORITY:
            self._preempt_for_waiting(out)
        preempted = False

        # Running requests: decodes and the rest of chunked prefills, never stalled by admissions.
        plans = self._plan_drafts()
        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
            assert num_new > 0
            # drafts within the budget (a decoding request's one token comes first)
            drafts = plans.get(request.request_id, [])[: max(0, token_budget - num_new)]
            end = request.num_computed_tokens + num_new
            if drafts and self.kv_cache_manager.allocate_slots(request, end + len(drafts)) is None:
                drafts = []  # no blocks for them: a plain decode
            while (
                self.kv_cache_manager.allocate_slots(request, request.num_computed_tokens + num_new)
                is None
            ):
                # The last one is not scheduled yet this step: the most recently admitted
                # (FCFS), or the largest (priority, arrival time).
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
            else:
                self._schedule_request(out, request, num_new, drafts)
                token_budget -= num_new + len(drafts)
                i += 1
                continue
            break  # the request preempted itself: nothing further fits

        # Waiting requests join while seats, budget and blocks allow; not after a preemption
        # for lack of blocks, nor a request preempted this step. One whose LoRA adapter would
        # exceed --max-loras waits (skipped, in its place) while the others may join.
        running_loras = self._running_lora_ids()
        skipped: list[Request] = []
        while (
            not preempted
            and self.waiting
            and len(self.running) < self.max_num_seqs
            and self.kv_cache_manager.can_seat()
            and token_budget > 0
        ):
            request = self.waiting.peek_request()
            if request.request_id in out.preempted_req_ids:
                break
            lora = request.lora_request
            if (
                lora is not None
                and running_loras is not None
                and lora.lora_int_id not in running_loras
                and len(running_loras) >= self.max_loras  # type: ignore[operator]
            ):
                skipped.append(self.waiting.pop_request())
                continue
            assert request.num_computed_tokens == 0  # new, or preempted and recomputed
            # The longest cached prefix (a preempted request often finds its own blocks again),
            # continued in the host tier (those blocks are loaded, not computed), as far as an
            # exact tail can restore it.
            kv = self.kv_cache_manager
            computed_block_ids, host_slots = kv.find_prefix(request)
            num_device_computed = len(computed_block_ids) * kv.block_size
            num_computed = num_device_computed + len(host_slots) * kv.block_size
            num_new = min(request.num_tokens - num_computed, token_budget)
            if (
                kv.allocate_slots(request, num_computed + num_new, computed_block_ids, host_slots)
                is None
            ):
                break
            self.waiting.pop_request()
            request.num_computed_tokens = num_computed
            kv.seat(request)
            request.status = RequestStatus.RUNNING
            self._add_running(request)
            self._stats.admitted_req_ids.append(request.request_id)
            self._record_prefix_cache_query(request, num_device_computed, num_computed)
            self._schedule_request(out, request, num_new)
            token_budget -= num_new
            if lora is not None and running_loras is not None:
                running_loras.add(lora.lora_int_id)
        for request in reversed(skipped):  # back in their places, ahead of the rest
            self.waiting.prepend_request(request)

        self._take_host_transfers(out)
        self._stats.num_scheduled_tokens = out.total_num_scheduled_tokens
        return out

    def _running_lora_ids(self) -> set[int] | None:
        """Return the adapters of the running requests (None: LoRA is off)."""
        if self.max_loras is None:
            return None
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _plan_drafts(self) -> dict[str, list[int]]:
        """Return this step's drafts of the decoding running requests (req_id -> drafts)."""
        spec = self.speculator
        if spec is None:
            return {}
        tail = self.kv_cache_manager.tail
        decoding = [
            r for r in self.running
            if r.num_tokens - r.num_computed_tokens == 1 and spec.is_eligible(r)
            # a rejected draft would be written over sinks still being computed
            and (tail is None or r.num_computed_tokens >= tail.sink_tokens)
        ]  # fmt: skip
        return spec.plan_step(decoding, len(self.running)) if decoding else {}

    def _add_running(self, request: Request) -> None:
        """Put an admitted request in `running`: last (FCFS), or in (priority, arrival) order."""
        if self.policy == SchedulingPolicy.PRIORITY:
            bisect.insort(self.running, request, key=priority_key)
        else:
            self.running.append(request)

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Preempt running requests of larger (priority, arrival) than the first waiting one,
        lowest priority first, while it lacks the blocks to join this step.

        Done before anything is scheduled, so no victim has blocks for this step's tokens (or
        prefix-cache entries for them) to take back.
        """
        if not self.waiting:
            return
        head = self.waiting.peek_request()
        while self.running and priority_key(self.running[-1]) > priority_key(head):
            num_blocks_short = self._num_blocks_short(head)
            if num_blocks_short is None or num_blocks_short <= 0:
                return
            self._preempt(self.running.pop(), out)

    def _num_blocks_short(self, request: Request) -> int | None:
        """Return how many blocks a waiting request lacks to join this step after the running
        requests took theirs; None when the token budget leaves it nothing to compute."""
        kv = self.kv_cache_manager
        token_budget = self.max_num_batched_tokens
        num_running_blocks = 0
        for running in self.running:  # what the running loop will take, in its order
            num_new = min(running.num_tokens - running.num_computed_tokens, token_budget)
            if num_new <= 0:
                break
            end = running.num_computed_tokens + num_new
            num_running_blocks += kv.num_blocks_needed(running.request_id, end)
            token_budget -= num_new
        if token_budget <= 0:
            return None
        computed_block_ids, host_slots = kv.find_prefix(request)
        num_computed = (len(computed_block_ids) + len(host_slots)) * kv.block_size
        num_new = min(request.num_tokens - num_computed, token_budget)
        num_blocks = kv.num_blocks_to_allocate(
            request.request_id, num_computed + num_new, computed_block_ids
        )
        return num_running_blocks + num_blocks - kv.num_free_blocks

    def _take_host_transfers(self, out: SchedulerOutput) -> None:
        """Put the step's copies to and from the host tier into its output."""
        transfers = self.kv_cache_manager.take_host_transfers()
        out.host_save_block_ids = transfers.save_block_ids
        out.host_save_slots = transfers.save_slots
        out.host_load_slots = transfers.load_slots
        out.host_load_block_ids = transfers.load_block_ids

    def _record_prefix_cache_query(
        self, request: Request, num_device_tokens: int, num_cached_tokens: int
    ) -> None:
        """Count a new request's prefix lookup in tokens (vLLM leaves preempted ones out): the
        device cache's hits, then what the host tier was asked and found."""
        if self.kv_cache_manager.enable_caching and request.num_preemptions == 0:
            self._stats.num_prefix_cache_queries += request.num_tokens
            self._stats.num_prefix_cache_hits += num_device_tokens
            if self.kv_cache_manager.host_tier is not None:
                self._stats.num_host_cache_queries += request.num_tokens - num_device_tokens
                self._stats.num_host_cache_hits += num_cached_tokens - num_device_tokens

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free a running request's blocks and requeue it at the front for recomputation.

        Its full blocks stay in the prefix cache, so unless they are evicted meanwhile it
        recomputes only what follows them.
        """
        self.kv_cache_manager.free(request.request_id)
        self._num_blocks_sent.pop(request.request_id, None)  # the runner drops its row
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.prepend_request(request)
        out.preempted_req_ids.append(request.request_id)
        self._stats.num_preemptions += 1


def _lora_names(requests: Iterable[Request]) -> list[str]:
    """Return the distinct LoRA adapter names of requests, sorted."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
