"""Prometheus metrics under vLLM's names (plus infer8's own), in a per-server registry."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from infer8.config import CacheConfig
from infer8.core.sched_output import SchedulerStats

# vLLM's buckets, so dashboards built for vLLM read the same.
_TTFT_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0]
_TTFT_BUCKETS_S += [2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0]
_ITL_BUCKETS_S += [2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_REQUEST_BUCKETS_S = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0]
_REQUEST_BUCKETS_S += [50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISHED_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    """Owns one server's collectors; the engine thread feeds them after each step and request."""

    def __init__(
        self,
        model_name: str,
        cache_config: CacheConfig,
        num_blocks: int,
        registry: CollectorRegistry | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, name = self.registry, ["model_name"]
        self.num_requests_running = Gauge(
            "vllm:num_requests_running", "Requests in the running batch.", name, registry=r
        ).labels(model_name)
        self.num_requests_waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to run.", name, registry=r
        ).labels(model_name)
        # infer8's own (vLLM has no per-priority gauge): one series per priority value that has
        # requests waiting; "0" always, others removed once empty (clients pick the values).
        self._waiting_by_priority = Gauge(
            "infer8:num_requests_waiting_by_priority",
            "Requests waiting to run, by their priority (lower values run first under "
            "--scheduling-policy priority).",
            ["model_name", "priority"],
            registry=r,
        )
        self._model_name = model_name
        self._waiting_priorities: set[int] = set()
        self._waiting_by_priority.labels(model_name, "0").set(0)
        self.kv_cache_usage_perc = Gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (0-1).",
            name,
            registry=r,
        ).labels(model_name)
        self.num_preemptions = Counter(
            "vllm:num_preemptions", "Cumulative preemptions.", name, registry=r
        ).labels(model_name)
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            name,
            registry=r,
        ).labels(model_name)
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            name,
            registry=r,
        ).labels(model_name)
        # vLLM counts hits of a KV connector's cache (its CPU offloading) under these names.
        self.external_prefix_cache_queries = Counter(
            "vllm:external_prefix_cache_queries",
            "Host KV tier queries, in terms of number of queried tokens.",
            name,
            registry=r,
        ).labels(model_name)
        self.external_prefix_cache_hits = Counter(
            "vllm:external_prefix_cache_hits",
            "Host KV tier hits, in terms of number of tokens loaded instead of computed.",
            name,
            registry=r,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefilled prompt tokens.", name, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens.", name, registry=r
        ).labels(model_name)
        success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.request_success = {
            reason: success.labels(model_name, reason) for reason in FINISHED_REASONS
        }
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            name,
            buckets=_TTFT_BUCKETS_S,
            registry=r,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens.",
            name,
            buckets=_ITL_BUCKETS_S,
            registry=r,
        ).labels(model_name)
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            name,
            buckets=_REQUEST_BUCKETS_S,
            registry=r,
        ).labels(model_name)
        self.request_queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            name,
            buckets=_REQUEST_BUCKETS_S,
            registry=r,
        ).labels(model_name)
        config_labels = {
            "block_size": str(cache_config.block_size),
            "cache_dtype": cache_config.kv_cache_dtype.value,
            "gpu_memory_utilization": str(cache_config.gpu_memory_utilization),
            "num_gpu_blocks": str(num_blocks),
            "kv_scale": cache_config.kv_scale,
            "enable_prefix_caching": str(cache_config.enable_prefix_caching),
        }
        Gauge(
            "vllm:cache_config_info",
            "Information of the cache config.",
            list(config_labels),
            registry=r,
        ).labels(**config_labels).set(1)
        # infer8's own
        Gauge(
            "infer8:kv_cache_capacity_tokens", "Tokens the KV cache holds.", name, registry=r
        ).labels(model_name).set(num_blocks * cache_config.block_size)
        self.fp8_saturated = Counter(
            "infer8:kv_cache_fp8_saturated",
            "KV values clipped to the FP8 range when written.",
            name,
            registry=r,
        ).labels(model_name)
        self.padded_tokens = Counter(
            "infer8:padded_tokens",
            "Dummy tokens computed to pad static batches.",
            name,
            registry=r,
        ).labels(model_name)
        self.rejected_requests = Counter(
            "infer8:requests_rejected",
            "Requests refused with 503 because the waiting queue was full.",
            name,
            registry=r,
        ).labels(model_name)
        self.engine_restarts = Counter(
            "infer8:engine_restarts",
            "Times the engine loop failed and was rebuilt in-process (weights and KV memory kept).",
            name,
            registry=r,
        ).labels(model_name)
        self.request_errors = Counter(
            "infer8:request_errors",
            "Requests failed by the engine (alone, or in flight when the engine failed).",
            name,
            registry=r,
        ).labels(model_name)
        self._num_saturated_seen = 0
        # speculative decoding, as vLLM counts it (per verified draft, its tokens, the accepted
        # ones, and the accepted ones by their position in the draft)
        self.spec_decode_num_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Drafts verified.", name, registry=r
        ).labels(model_name)
        self.spec_decode_num_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", name, registry=r
        ).labels(model_name)
        self.spec_decode_num_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", name, registry=r
        ).labels(model_name)
        self._spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft.",
            ["model_name", "position"],
            registry=r,
        )

        # --enable-lora: vLLM's info gauge, one series labelled with the running and waiting
        # adapters (comma-separated names) whose value is when they last changed
        self._max_loras = max_loras
        self._lora_labels: tuple[str, str, str] | None = None
        self._lora_info = None
        if max_loras is not None:
            self._lora_info = Gauge(
                "vllm:lora_requests_info", "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r,
            )  # fmt: skip
            self._set_lora_info([], [])

    def _set_lora_info(self, running: list[str], waiting: list[str]) -> None:
        labels = (str(self._max_loras), ",".join(waiting), ",".join(running))
        if labels == self._lora_labels or self._lora_info is None:
            return
        if self._lora_labels is not None:
            self._lora_info.remove(*self._lora_labels)
        self._lora_info.labels(*labels).set(time.time())
        self._lora_labels = labels

    def on_step(self, stats: SchedulerStats) -> None:
        """Count one step's preemptions, padding and prefix cache lookups."""
        if self._lora_info is not None:
            self._set_lora_info(stats.running_lora_adapters, stats.waiting_lora_adapters)
        if stats.num_prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.num_prefix_cache_queries)
            self.prefix_cache_hits.inc(stats.num_prefix_cache_hits)
        if stats.num_host_cache_queries:
            self.external_prefix_cache_queries.inc(stats.num_host_cache_queries)
            self.external_prefix_cache_hits.inc(stats.num_host_cache_hits)
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
        if stats.num_padded_tokens:
            self.padded_tokens.inc(stats.num_padded_tokens)
        spec = stats.spec_decode
        if spec is not None and spec.num_drafts:
            self.spec_decode_num_drafts.inc(spec.num_drafts)
            self.spec_decode_num_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(spec.num_accepted_tokens)
            for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                self._spec_accepted_per_pos.labels(self._model_name, str(pos)).inc(n)

    def set_load(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Set the gauges of what the engine holds now."""
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        self.kv_cache_usage_perc.set(kv_cache_usage)

    def set_waiting_by_priority(self, num_waiting_by_priority: dict[int, int]) -> None:
        """Set the waiting queue's depth per priority value; drop the series that emptied."""
        gauge, name = self._waiting_by_priority, self._model_name
        for priority in self._waiting_priorities - num_waiting_by_priority.keys() - {0}:
            gauge.remove(name, str(priority))
        gauge.labels(name, "0").set(num_waiting_by_priority.get(0, 0))
        for priority, num in num_waiting_by_priority.items():
            gauge.labels(name, str(priority)).set(num)
        self._waiting_priorities = set(num_waiting_by_priority)

    def set_fp8_saturated(self, num_saturated: int) -> None:
        """Advance the saturation counter to the cache's cumulative count."""
        if num_saturated > self._num_saturated_seen:
            self.fp8_saturated.inc(num_saturated - self._num_saturated_seen)
        self._num_saturated_seen = num_saturated

    def on_admitted(self, queue_time_s: float) -> None:
        """Record a request's first scheduling."""
        self.request_queue_time.observe(queue_time_s)

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        """Record a request's prefill and first token."""
        self.time_to_first_token.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_next_tokens(self, inter_token_latency_s: float) -> None:
        """Record the latency of a later token."""
        self.inter_token_latency.observe(inter_token_latency_s)

    def on_generation_tokens(self, num_tokens: int) -> None:
        """Count generated tokens."""
        self.generation_tokens.inc(num_tokens)

    def on_finished(self, finish_reason: str, e2e_latency_s: float) -> None:
        """Record a finished request (stop, length or abort)."""
        self.request_success[finish_reason].inc()
        self.e2e_request_latency.observe(e2e_latency_s)

    def on_engine_restart(self) -> None:
        """Count an in-process engine restart."""
        self.engine_restarts.inc()

    def on_rejected(self) -> None:
        """Count a request refused for overload."""
        self.rejected_requests.inc()
