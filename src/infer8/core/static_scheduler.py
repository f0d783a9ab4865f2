"""The static-batching baseline: pad to the longest prompt, run until the longest finishes."""

from __future__ import annotations

from infer8.core.request_queue import SchedulingPolicy
from infer8.core.sched_output import ModelRunnerOutput, SchedulerOutput
from infer8.core.scheduler import SchedulerBase
from infer8.request import Request, RequestStatus


class StaticScheduler(SchedulerBase):
    """Owns one fixed batch at a time; admits the next batch only when the whole batch is done.

    Each admitted request reserves blocks for prompt + max_tokens up front. The prefill of the
    batch is padded to its longest prompt, and every decode step computes a padding token for
    each request that already finished but still holds its seat. Those dummy tokens go through
    the model like real ones and are reported as `num_padded_tokens`. It takes no prefix-cache
    hits (the engine gives it a KV cache manager with caching off).
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        assert self.policy == SchedulingPolicy.FCFS, "static batches are admitted in arrival order"
        self.batch_size = 0  # seats in the current batch, finished requests included
        self.batch: list[Request] = []

    def schedule(self) -> SchedulerOutput:
        """Start a new padded batch when the last one is done, else decode the current one."""
        out = self._new_output()
        if not self.batch:
            self._admit_batch()
            if not self.batch:
                return out
            longest = max(r.num_tokens - r.num_computed_tokens for r in self.batch)
            for request in self.batch:
                num_new = request.num_tokens - request.num_computed_tokens
                out.num_padding_tokens += longest - num_new
                self._schedule_request(out, request, num_new)
        else:
            for request in self.batch:
                if request.is_finished:
                    out.num_padding_tokens += 1
                else:
                    self._schedule_request(out, request, 1)
        self._stats.num_scheduled_tokens = out.total_num_scheduled_tokens
        self._stats.num_padded_tokens = out.num_padding_tokens
        return out

    def _admit_batch(self) -> None:
        """Take up to max_num_seqs waiting requests whose full reservation fits."""
        kv = self.kv_cache_manager
        while self.waiting and len(self.batch) < self.max_num_seqs and kv.can_seat():
            request = self.waiting.peek_request()
            if kv.allocate_slots(request, request.max_num_tokens) is None:
                break
            kv.seat(request)
            self.waiting.pop_request()
            request.status = RequestStatus.RUNNING
            self.batch.append(request)
            self.running.append(request)
            self._stats.admitted_req_ids.append(request.request_id)

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[tuple[Request, list[int]]]:
        """Advance the batch; free its blocks only once every request in it is done."""
        progressed = super().update_from_output(sched_out, runner_out)
        self._maybe_end_batch()
        return progressed

    def _maybe_end_batch(self) -> None:
        """Free the batch's reserved blocks once all of its requests are done."""
        if self.batch and all(r.is_finished for r in self.batch):
            for request in self.batch:
                self.kv_cache_manager.free(request.request_id)
            self.batch = []

    def _on_finished(self, request: Request) -> None:
        """Keep the finished request's seat and blocks until its batch ends."""
        self.running.remove(request)
        self._num_blocks_sent.pop(request.request_id, None)
        del self.requests[request.request_id]
        self._stats.finished_req_ids.append(request.request_id)
        self._seen_by_runner.discard(request.request_id)
        self._finished_since_last_step.append(request.request_id)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish requests (stop string, abort); seats in the batch stay reserved."""
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            request.status = status
            if request in self.batch:
                self._on_finished(request)
                self._maybe_end_batch()
            else:
                self._remove(request)
            finished.append(request)
        return finished
