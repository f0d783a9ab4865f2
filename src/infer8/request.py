"""A request's scheduler-side state: its tokens, progress and status."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from infer8.sampling_params import SamplingParams

if TYPE_CHECKING:
    from infer8.core.block_pool import BlockHash
    from infer8.lora.config import LoRARequest


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; finished states come last."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # this request alone failed inside a step; the others went on

    @property
    def is_finished(self) -> bool:
        """Return whether the request has left the engine."""
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    """OpenAI's finish_reason values."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_STATUS_TO_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Owns one request's token ids, sampling params and scheduling progress."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int],
        arrival_time_s: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = list(eos_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why it failed, for FINISHED_ERROR
        self.arrival_time_s = time.monotonic() if arrival_time_s is None else arrival_time_s
        # The priority policy admits lower values first (vLLM's meaning); FCFS ignores it.
        self.priority = priority
        self.first_scheduled_time_s: float | None = None
        # The cap on prompt + output tokens, resolved by the engine against max_model_len.
        self.max_num_tokens = len(self.prompt_token_ids) + (sampling_params.max_tokens or 0)
        # Prefix caching: requests with different salts never share KV blocks.
        self.cache_salt = cache_salt
        # Its LoRA adapter (None: the base model); its blocks are cached under the adapter.
        self.lora_request = lora_request
        # Hash chain of the full blocks of all_token_ids, extended by the KV cache manager.
        self.block_hashes: list[BlockHash] = []

    @property
    def num_prompt_tokens(self) -> int:
        """Return the prompt length."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Return prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Return prompt and output token ids."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        """Return whether the request has finished."""
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        """Return OpenAI's finish reason, or None while running."""
        return _STATUS_TO_REASON.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        """Record a sampled token and stop if it ends the request."""
        self.output_token_ids.append(token_id)
        params = self.sampling_params
        num_output = len(self.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return
            if token_id in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = token_id
                return
        if self.num_tokens >= self.max_num_tokens:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_computed_tokens}/{self.num_tokens})"
        )
