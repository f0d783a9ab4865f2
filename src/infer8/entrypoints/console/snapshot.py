"""What the engine view shows, as plain JSON-ready data: engine info, KV block map, metric figures."""

from __future__ import annotations

import base64
import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from infer8.entrypoints.openai.protocol import CompletionRequest
from infer8.generation_config import SAMPLING_KEYS
from infer8.request import RequestStatus

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from infer8.engine import LLMEngine

# Cell values of the KV block map; request owners take CELL_FIRST_OWNER.. (a colour slot each).
CELL_FREE = 0
CELL_CACHED = 1  # free, but holds a reusable prefix (prefix cache)
CELL_SHARED = 2  # held by more than one request (a shared cached prefix)
CELL_FIRST_OWNER = 3
NUM_OWNER_SLOTS = 256 - CELL_FIRST_OWNER
# A larger cache is sent as cells of several blocks each: a map the page can draw cell by cell
# (a few pixels each), and a record of at most this many bytes whatever the cache size.
MAX_MAP_CELLS = 4096
QUANTILES = (0.5, 0.9, 0.99)


def engine_info(engine: LLMEngine) -> dict[str, Any]:
    """Return what the view shows once: model, cache dtype and capacity, batch limits."""
    spec, cache = engine.kv_spec, engine.cache_config
    capacity_tokens = engine.num_blocks * cache.block_size
    memory_bytes = engine.num_blocks * spec.bytes_per_block
    # a plain bf16 cache of the same shape: FP8's tail, sinks and rotation do not apply to it
    bf16_spec = dataclasses.replace(
        spec, dtype=torch.bfloat16, exact_tail_tokens=0, exact_sink_tokens=0, hadamard=False
    )
    model = engine.model_config
    return {
        "model": model.served_model_name or model.model,
        "kv_cache_dtype": str(spec.dtype).removeprefix("torch."),
        "is_fp8": spec.is_fp8,
        "kv_scale": engine.kv_scale_source,
        "block_size": cache.block_size,
        "num_blocks": engine.num_blocks,
        "kv_cache_memory_bytes": memory_bytes,
        "capacity_tokens": capacity_tokens,
        # The same memory as a bf16 cache, so the view can show what FP8 buys.
        "bf16_capacity_tokens": bf16_spec.num_blocks_for(memory_bytes) * cache.block_size,
        "num_layers": spec.num_layers,
        "max_num_seqs": engine.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": engine.scheduler_config.max_num_batched_tokens,
        "max_model_len": engine.max_model_len,
        "enable_prefix_caching": engine.kv_cache_manager.enable_caching,
    }


def served_defaults(engine: LLMEngine) -> dict[str, Any]:
    """Return what a request that leaves the sampling fields out gets: the chat page's placeholders.

    Computed the way the API computes it (the API's defaults under the model's generation
    config), so the page can never promise other values than the server applies.
    """
    request = CompletionRequest(model=engine.served_model_name, prompt="")
    params = request.sampling_params(1, None, defaults=engine.default_sampling)
    return {
        "model": engine.served_model_name,
        "max_model_len": engine.max_model_len,
        "sampling": {field: getattr(params, field) for field in SAMPLING_KEYS.values()},
        "generation_config": dict(engine.default_sampling),
    }


class OwnerSlots:
    """Owns the colour slot of each request in the map, stable for the request's life."""

    def __init__(self) -> None:
        self.req_id_to_slot: dict[str, int] = {}
        self._next = 0

    def slot(self, req_id: str) -> int:
        """Return the request's slot, giving it the next one on first sight."""
        slot = self.req_id_to_slot.get(req_id)
        if slot is None:
            slot = self.req_id_to_slot[req_id] = self._next
            self._next = (self._next + 1) % NUM_OWNER_SLOTS
        return slot

    def keep_only(self, req_ids: set[str]) -> None:
        """Forget requests that hold no blocks any more."""
        for req_id in [r for r in self.req_id_to_slot if r not in req_ids]:
            del self.req_id_to_slot[req_id]


def kv_state(engine: LLMEngine, slots: OwnerSlots) -> dict[str, Any]:
    """Return the block map (base64, one byte per block) and the requests holding blocks.

    Reads the block tables with C-level copies, so a read from outside the engine thread
    sees at worst a map one step old (it never raises on a table changing size).
    """
    kv = engine.kv_cache_manager
    pool = kv.block_pool
    req_to_block_ids = dict(kv.req_to_block_ids)
    cached = list(pool.cached_block_hash_to_block.values())
    cells = np.zeros(pool.num_blocks, dtype=np.uint8)  # [num_blocks]
    if cached:
        cells[cached] = CELL_CACHED
    held: list[int] = []
    reqs = []
    requests = engine.scheduler.requests
    for req_id, block_ids in req_to_block_ids.items():
        if not block_ids:
            continue
        slot = slots.slot(req_id)
        block_ids = list(block_ids)
        cells[block_ids] = CELL_FIRST_OWNER + slot
        held.extend(block_ids)
        request = requests.get(req_id)
        num_prompt = request.num_prompt_tokens if request is not None else 0
        num_output = request.num_tokens - num_prompt if request is not None else 0
        reqs.append([slot, req_id, num_prompt, num_output, len(block_ids)])
    if held:
        counts = np.bincount(np.asarray(held, dtype=np.int64), minlength=pool.num_blocks)
        cells[counts > 1] = CELL_SHARED
    slots.keep_only(set(req_to_block_ids))
    num_cell_blocks = math.ceil(pool.num_blocks / MAX_MAP_CELLS) if pool.num_blocks else 1
    map_cells = aggregate_cells(cells, num_cell_blocks)
    return {
        "kv": base64.b64encode(map_cells.tobytes()).decode("ascii"),
        "kv_cell_blocks": num_cell_blocks,
        "kv_total": pool.num_blocks,
        "kv_used": pool.num_used_blocks,
        "kv_cached": len(cached),
        "reqs": reqs,
    }


def aggregate_cells(cells: np.ndarray, num_cell_blocks: int) -> np.ndarray:
    """Return one cell per `num_cell_blocks` consecutive blocks, showing what they hold.

    A cell with any held block shows its most frequent holder (a request's colour slot, or
    shared), so one held block among free ones is never hidden; otherwise it shows a cached
    prefix if any block holds one, else free. The last cell may cover fewer blocks.
    """
    if num_cell_blocks <= 1:
        return cells
    num_cells = math.ceil(len(cells) / num_cell_blocks)
    rows = np.full(num_cells * num_cell_blocks, CELL_FREE, dtype=np.uint8)
    rows[: len(cells)] = cells
    rows = rows.reshape(num_cells, num_cell_blocks)  # [num_cells, num_cell_blocks]
    out = np.where((rows == CELL_CACHED).any(axis=1), CELL_CACHED, CELL_FREE).astype(np.uint8)
    # The most frequent held value per row: runs of equal values in each sorted row, then the
    # longest run of each row (ties: the higher value, for a deterministic map).
    held = np.where(rows >= CELL_SHARED, rows.astype(np.int16), -1)
    flat = np.sort(held, axis=1).ravel()
    index = np.arange(1, flat.size)
    is_start = np.r_[True, (flat[1:] != flat[:-1]) | (index % num_cell_blocks == 0)]
    starts = np.flatnonzero(is_start)
    lengths = np.diff(np.r_[starts, flat.size])
    is_held = flat[starts] >= 0
    if not is_held.any():
        return out
    run_rows, run_values = starts[is_held] // num_cell_blocks, flat[starts][is_held]
    order = np.lexsort((lengths[is_held], run_rows))
    run_rows, run_values = run_rows[order], run_values[order]
    is_last = np.r_[run_rows[1:] != run_rows[:-1], True]
    out[run_rows[is_last]] = run_values[is_last]
    return out


def num_preempted(engine: LLMEngine) -> int:
    """Return how many waiting requests were preempted (they will recompute)."""
    waiting = list(engine.scheduler.waiting)
    return sum(1 for r in waiting if r.status == RequestStatus.PREEMPTED)


def decode_token_count(engine: LLMEngine, scheduled_req_ids: list[str]) -> int:
    """Return how many of a step's scheduled requests decoded (computed an output token).

    A request the step finished is gone from the scheduler; it counts as decoding.
    """
    requests = engine.scheduler.requests
    num = 0
    for req_id in scheduled_req_ids:
        request = requests.get(req_id)
        if request is None or request.num_computed_tokens > request.num_prompt_tokens:
            num += 1
    return num


# -- figures from /metrics ---------------------------------------------------------------------
def histogram_quantile(
    q: float, upper_bounds: list[float], cumulative: list[float]
) -> float | None:
    """Return the q-quantile of a Prometheus histogram as histogram_quantile() computes it.

    Linear interpolation inside the bucket holding the rank; a rank in the +Inf bucket
    answers the highest finite bound. None if the histogram is empty.
    """
    if not cumulative or cumulative[-1] <= 0:
        return None
    rank = q * cumulative[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(upper_bounds, cumulative):
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def sample_quantiles(values: Sequence[float]) -> list[float | None]:
    """Return the QUANTILES of samples, interpolated between order statistics (None if empty).

    Order-preserving: when each request's TTFT is at most its end-to-end latency, each quantile
    of the TTFTs is at most the same quantile of the latencies.
    """
    if not values:
        return [None] * len(QUANTILES)
    return [float(v) for v in np.quantile(np.asarray(values, dtype=np.float64), QUANTILES)]


def metric_figures(registry: CollectorRegistry) -> dict[str, Any]:
    """Return the view's figures from the server's Prometheus registry (what /metrics says).

    TTFT and end-to-end percentiles are not among them: /metrics observes TTFT at the first token
    and end-to-end latency at the finish, so its two histograms hold different requests. The
    recorder computes both over the same finished requests (RequestLatencies).
    """
    buckets: dict[str, list[tuple[float, float]]] = {}
    values: dict[str, float] = {}
    finished: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                buckets.setdefault(sample.name, []).append((le, sample.value))
            elif sample.name == "vllm:request_success_total":
                finished[sample.labels["finished_reason"]] = sample.value
            else:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value

    def quantiles(name: str) -> list[float | None]:
        pairs = sorted(buckets.get(f"{name}_bucket", []))
        bounds, counts = [b for b, _ in pairs], [c for _, c in pairs]
        return [histogram_quantile(q, bounds, counts) for q in QUANTILES]

    queries = values.get("vllm:prefix_cache_queries_total", 0.0)
    hits = values.get("vllm:prefix_cache_hits_total", 0.0)
    drafted = values.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
    accepted = values.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    return {
        "quantiles": list(QUANTILES),
        "tpot_s": quantiles("vllm:inter_token_latency_seconds"),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "spec_decode_num_draft_tokens": drafted,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": accepted / drafted if drafted else None,
        "fp8_saturated": values.get("infer8:kv_cache_fp8_saturated_total", 0.0),
        "num_preemptions": values.get("vllm:num_preemptions_total", 0.0),
        "generation_tokens": values.get("vllm:generation_tokens_total", 0.0),
        "prompt_tokens": values.get("vllm:prompt_tokens_total", 0.0),
        "finished": finished,
        "running": values.get("vllm:num_requests_running", 0.0),
        "waiting": values.get("vllm:num_requests_waiting", 0.0),
    }
