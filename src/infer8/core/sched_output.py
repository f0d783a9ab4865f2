"""Plain-data records crossing the scheduler / model-runner boundary (no tensors, no Requests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from infer8.core.exact_tail_seats import TailSeat
from infer8.lora.config import LoRARequest
from infer8.sampling_params import SamplingParams
from infer8.spec_decode.speculator import SpecDecodeStats


@dataclass
class NewRequestData:
    """A request the runner sees for the first time: what it needs to build inputs and sample."""

    req_id: str
    prompt_token_ids: list[int]  # with any tokens generated before a preemption
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)


@dataclass
class ScheduledRequest:
    """One request's slice of this step: tokens [num_computed_tokens, +num_new_tokens)."""

    req_id: str
    num_computed_tokens: int
    num_new_tokens: int
    # Blocks appended to its table since the runner last saw it: the whole table the first
    # time (and again after a preemption), then only the new ones (vLLM's new_block_ids).
    new_block_ids: list[int]
    # False for a prefill chunk that stops short of the last known token: nothing to sample.
    sample: bool = True
    # An FP8 cache's exact tail: where this request's ring and sinks are (None without one).
    tail: TailSeat | None = None
    # Speculative decoding: draft tokens computed after its known ones, the last
    # len(spec_token_ids) of num_new_tokens; the runner verifies them (sample is True).
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What to run this step, in batch order."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests that left since the last step; the runner drops their state.
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Static batching: dummy tokens computed to keep the padded batch rectangular.
    num_padding_tokens: int = 0
    # The tokens the previous step appended (req_id -> token ids: accepted drafts, then the
    # sampled one), for requests the runner already knows: every rank appends them before
    # building this step's inputs.
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # The host KV tier's copies, done before the step writes any block, saves first: device
    # block host_save_block_ids[i] -> host slot host_save_slots[i], then host slot
    # host_load_slots[i] -> device block host_load_block_ids[i] (core/host_tier.py).
    host_save_block_ids: list[int] = field(default_factory=list)
    host_save_slots: list[int] = field(default_factory=list)
    host_load_slots: list[int] = field(default_factory=list)
    host_load_block_ids: list[int] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Return the real (unpadded) tokens in this step."""
        return sum(r.num_new_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Return whether there is nothing to compute."""
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Tokens sampled this step, for requests whose scheduled tokens reached their end."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # req_id -> how many of its drafts were accepted (they come before its sampled token);
    # absent for a request without drafts
    num_accepted_draft_tokens: dict[str, int] = field(default_factory=dict)
    # req_id -> (logprob of the sampled token, [(token_id, logprob)] top-k by logprob)
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)
    # req_id -> what went wrong, for requests that failed alone this step (the rest went on)
    failed_req_ids: dict[str, str] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    """A per-step record for metrics, benchmarks and tests."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    num_padded_tokens: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    # Prefix caching, over requests admitted for the first time this step (vLLM's counters).
    num_prefix_cache_queries: int = 0  # prompt tokens looked up
    num_prefix_cache_hits: int = 0  # of those, tokens found cached (not computed)
    # The host KV tier (vLLM's external prefix cache counters): tokens looked up there after
    # the device cache, and tokens found (loaded, not computed).
    num_host_cache_queries: int = 0
    num_host_cache_hits: int = 0
    step_time_s: float = 0.0
    spec_decode: SpecDecodeStats | None = None  # the step's verified drafts (None: speculation off)
    # --enable-lora: the adapters of running and waiting requests (vllm:lora_requests_info)
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    scheduled_req_ids: list[str] = field(default_factory=list)
    admitted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def kv_cache_usage(self) -> float:
        """Return the fraction of KV blocks in use after the step."""
        return self.num_kv_blocks_used / max(1, self.num_kv_blocks_total)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Return the fraction of this step's queried prompt tokens found cached (0 if none)."""
        return self.num_prefix_cache_hits / max(1, self.num_prefix_cache_queries)
