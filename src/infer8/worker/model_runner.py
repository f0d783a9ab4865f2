"""execute(SchedulerOutput) -> ModelRunnerOutput: builds the flat batch, runs the model, samples."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from infer8.attention.exact_tail import build_tail_metadata
from infer8.attention.kv_cache import KVCacheSpec, LayerKVCache
from infer8.attention.metadata import (
    AttentionMetadata,
    build_attention_metadata,
    metadata_from_table,
    to_device,
    token_positions,
)
from infer8.core.exact_tail_seats import TailSeat
from infer8.core.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from infer8.lora.config import LoRARequest
from infer8.lora.slots import LoRAManager, LoRAStep, lora_requests_of
from infer8.models.llama import LlamaForCausalLM
from infer8.worker.block_tables import BlockTables
from infer8.worker.kv_offload import HostKVCache
from infer8.worker.penalties import SamplingState, uses_penalty_rows
from infer8.worker.sampler import Sampler
from infer8.worker.spec_decode import DraftRows, TailRingBackup, verify

if TYPE_CHECKING:  # triton is only needed (and installed) on CUDA machines
    from infer8.structured_output.manager import StructuredOutputManager
    from infer8.worker.cuda_graphs import CUDAGraphDecodeRunner


class ModelRunner:
    """Owns the model, the KV-cache tensors and each request's token and sampling state."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[LayerKVCache],
        block_size: int,
        device: torch.device,
        seed: int = 0,
        is_driver: bool = True,
        exact_tail: KVCacheSpec | None = None,
        host_kv_cache: HostKVCache | None = None,
        structured_output: StructuredOutputManager | None = None,
        sampler: Sampler | None = None,
        lora_manager: LoRAManager | None = None,
    ) -> None:
        # A tensor-parallel worker (is_driver False) runs the model but leaves sampling to rank 0.
        self.is_driver = is_driver
        self.model = model
        self.kv_caches = kv_caches
        self.host_kv_cache = host_kv_cache  # the host-memory tier (--kv-offloading-size)
        self.block_size = block_size
        self.device = device
        self.sampler = sampler or Sampler(device, seed)
        self.states: dict[str, SamplingState] = {}
        self.block_tables = BlockTables()  # each running request's blocks, kept across steps
        # Set by the worker on CUDA unless enforce_eager: replays captured decode graphs.
        self.graph_runner: CUDAGraphDecodeRunner | None = None
        # Rank 0's grammars (the engine's): mask constrained rows' logits before sampling.
        self.structured_output = structured_output
        # An FP8 cache's exact tail: the scheduler gives each running request a ring row and
        # sinks (ScheduledRequest.tail); the runner only builds the step's indices from them.
        self.exact_tail_tokens = exact_tail.exact_tail_tokens if exact_tail else 0
        self.exact_sink_tokens = exact_tail.exact_sink_tokens if exact_tail else 0
        self.has_tail = bool(
            self.exact_tail_tokens and kv_caches and kv_caches[0].tail_store is not None
        )
        # --enable-lora: the adapters' slots, and each running request's adapter
        self.lora_manager = lora_manager
        self.req_loras: dict[str, LoRARequest] = {}
        # speculative decoding: the ring slots a step's drafts overwrite, until verified
        self.ring_backup = TailRingBackup(self.exact_tail_tokens - 1) if self.has_tail else None

    def _add_tail_metadata(self, sched: SchedulerOutput, meta: AttentionMetadata) -> None:
        """Attach the tail's indices, from the seats the scheduler gave."""
        seats = [s.tail for s in sched.scheduled]
        assert all(seat is not None for seat in seats), "a running request without a tail seat"
        meta.tail = build_tail_metadata(
            self.exact_tail_tokens,
            self.exact_sink_tokens,
            [seat.row for seat in seats],  # type: ignore[union-attr]
            [seat.exact_start for seat in seats],  # type: ignore[union-attr]
            [(seat.sink_slot, seat.writes_sinks) for seat in seats],  # type: ignore[union-attr]
            [s.num_new_tokens for s in sched.scheduled],
            [s.num_computed_tokens for s in sched.scheduled],
            meta.decode_seq_ids,
            meta.decode_block_tables.shape[1] * self.block_size,
            self.device,
        )

    @torch.inference_mode()
    def score(
        self, token_ids: list[int], block_ids: list[int], seat: TailSeat | None, chunk_tokens: int
    ) -> torch.Tensor:
        """Return float32 log-probabilities [len(token_ids), vocab] of each next token.

        The sequence is prefilled in chunks of `chunk_tokens` as a request would be, into the
        blocks (and tail seat) the KV cache manager gave it, so an FP8 cache's numbers include
        its quantization.
        """
        out = []
        for start in range(0, len(token_ids), chunk_tokens):
            chunk = token_ids[start : start + chunk_tokens]
            sched = SchedulerOutput(
                scheduled=[ScheduledRequest("score", start, len(chunk), block_ids, tail=seat)]
            )
            meta = build_attention_metadata([len(chunk)], [start], [block_ids], self.block_size,
                                             self.device)  # fmt: skip
            if self.has_tail:
                self._add_tail_metadata(sched, meta)
            hidden = self.model(
                torch.tensor(chunk, device=self.device),
                torch.arange(start, start + len(chunk), device=self.device),
                meta,
                self.kv_caches,
            )
            out.append(torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1))
        return torch.cat(out)

    def _drop_state(self, req_id: str) -> None:
        """Forget a request's sampling state, giving back its penalty row."""
        state = self.states.pop(req_id, None)
        if state is not None and self.sampler.penalty_rows is not None:
            self.sampler.penalty_rows.release(state)

    def reset(self) -> None:
        """Forget every request (after a failed step): states and block rows."""
        for req_id in list(self.states):
            self._drop_state(req_id)
        self.req_loras.clear()
        self.block_tables.clear()
        if self.ring_backup is not None:
            self.ring_backup.clear()

    def _transfer_host_blocks(self, sched: SchedulerOutput) -> None:
        """Do the host tier's copies before the step writes any block: saves, then loads."""
        if not sched.host_save_block_ids and not sched.host_load_slots:
            return
        assert self.host_kv_cache is not None, "host copies without a host tier"
        self.host_kv_cache.save(self.kv_caches, sched.host_save_block_ids, sched.host_save_slots)
        self.host_kv_cache.load(self.kv_caches, sched.host_load_slots, sched.host_load_block_ids)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step of the model over the scheduled tokens and sample where due."""
        # Last step's tokens first: they are the inputs of this step's decodes.
        for req_id, token_ids in sched.new_token_ids.items():
            state = self.states.get(req_id)
            if state is not None:
                state.output_token_ids.extend(token_ids)
        if self.ring_backup is not None:  # last step's rejected drafts leave the ring
            gone = {*sched.finished_req_ids, *sched.preempted_req_ids}
            self.ring_backup.restore(self.kv_caches, sched.new_token_ids, gone)
        for req_id in sched.finished_req_ids:
            self._drop_state(req_id)
            self.req_loras.pop(req_id, None)
        for req_id in sched.finished_req_ids + sched.preempted_req_ids:
            self.block_tables.remove(req_id)
        self._transfer_host_blocks(sched)
        for new in sched.scheduled_new_reqs:
            self.block_tables.remove(new.req_id)  # its blocks come whole in this step
            p = new.sampling_params
            gen = None
            if p.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(p.seed)
            self._drop_state(new.req_id)  # a preempted request's earlier state
            state = SamplingState(p, list(new.prompt_token_ids), [], gen, list(new.eos_token_ids))
            if uses_penalty_rows(p) and self.sampler.penalty_rows is not None:
                self.sampler.penalty_rows.take(state)
            self.states[new.req_id] = state
            if new.lora_request is not None:
                self.req_loras[new.req_id] = new.lora_request
        if sched.is_empty:
            return ModelRunnerOutput()

        input_ids: list[int] = []
        for s in sched.scheduled:
            state = self.states[s.req_id]
            end = s.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids)
            input_ids.extend(_token_slice(state, s.num_computed_tokens, end))
            if s.spec_token_ids:
                input_ids.extend(s.spec_token_ids)
                if self.ring_backup is not None and s.tail is not None:
                    drafts = range(end, end + len(s.spec_token_ids))
                    self.ring_backup.save(self.kv_caches, s.req_id, s.tail.row, drafts)
        query_lens = np.fromiter((s.num_new_tokens for s in sched.scheduled), np.int64)
        computed = np.fromiter((s.num_computed_tokens for s in sched.scheduled), np.int64)
        rows = np.fromiter(
            (self.block_tables.append(s.req_id, s.new_block_ids) for s in sched.scheduled),
            np.int64,
        )
        ends = np.cumsum(query_lens)  # one past each request's last token in the flat batch
        num_drafts = np.fromiter((len(s.spec_token_ids) for s in sched.scheduled), np.int64)
        if num_drafts.any() and not self.has_tail:
            # a verification's tokens as decode rows of one sequence (same table, each its own
            # length): the decode path writes every row's K/V before any row attends, so each
            # reads the drafts before it; with an exact tail they stay one chunk (each row's
            # window would need the ring written in order)
            query_lens, computed, rows = _drafts_as_decode_rows(
                query_lens, computed, rows, num_drafts > 0
            )
        tables = self.block_tables
        meta = metadata_from_table(
            query_lens, computed, tables.table, rows, tables.num_blocks[rows], self.block_size,
            self.device,
        )  # fmt: skip
        positions = token_positions(query_lens, computed, np.asarray(meta.query_start_loc))
        # Static-batch padding: dummy tokens that go through every layer and attend to nothing.
        input_ids.extend([0] * sched.num_padding_tokens)
        positions = np.concatenate([positions, np.zeros(sched.num_padding_tokens, np.int64)])
        if self.has_tail:
            self._add_tail_metadata(sched, meta)
        ids_t = to_device(np.asarray(input_ids, dtype=np.int64), self.device)
        pos_t = to_device(positions, self.device)
        lora = self._lora_step(sched, len(input_ids)) if self.req_loras else None
        if (
            lora is None
            and self.graph_runner is not None
            and self.graph_runner.can_run(meta, len(input_ids))
        ):
            hidden = self.graph_runner.run(ids_t, pos_t, meta)  # a captured CUDA-graph decode
        else:
            hidden = self.model(ids_t, pos_t, meta, self.kv_caches, lora=lora)
        sample_rows = [i for i, s in enumerate(sched.scheduled) if s.sample]
        if not sample_rows:
            return ModelRunnerOutput()
        if any(sched.scheduled[i].spec_token_ids for i in sample_rows):
            return self._verify(sched, sample_rows, hidden, ends)
        last_token_idx = to_device(
            np.asarray([meta.query_start_loc[i + 1] - 1 for i in sample_rows], np.int64),
            self.device,
        )
        logits = self.model.compute_logits(hidden[last_token_idx])  # [num_sampled, vocab]
        if not self.is_driver:
            return ModelRunnerOutput()
        states = [self.states[sched.scheduled[i].req_id] for i in sample_rows]
        if self.structured_output is not None:
            req_ids = [sched.scheduled[i].req_id for i in sample_rows]
            self.structured_output.apply_bitmask(logits, req_ids)
        sampled = self.sampler(logits, states)
        out = ModelRunnerOutput()
        for j, i in enumerate(sample_rows):
            req_id = sched.scheduled[i].req_id
            if j in sampled.errors:
                out.failed_req_ids[req_id] = sampled.errors[j]
                continue
            # the token reaches this state (and every rank's) with the next SchedulerOutput
            out.sampled_token_ids[req_id] = sampled.token_ids[j]
            lp = sampled.logprobs[j]
            if lp is not None:
                out.logprobs[req_id] = lp
        return out

    def _lora_step(self, sched: SchedulerOutput, num_tokens: int) -> LoRAStep | None:
        """Return the step's adapters, each in a slot (None when no scheduled request has one)."""
        loras = [self.req_loras.get(s.req_id) for s in sched.scheduled]
        if self.lora_manager is None or not any(loras):
            return None
        lora_to_slot = self.lora_manager.activate(lora_requests_of(loras))
        token_slots = np.full(num_tokens, -1, np.int64)  # static padding: the base model
        start = 0
        for s, lora in zip(sched.scheduled, loras):
            if lora is not None:
                token_slots[start : start + s.num_new_tokens] = lora_to_slot[lora.lora_int_id]
            start += s.num_new_tokens
        return self.lora_manager.step(token_slots)

    def _verify(
        self,
        sched: SchedulerOutput,
        sample_rows: list[int],
        hidden: torch.Tensor,
        ends: np.ndarray,
    ) -> ModelRunnerOutput:
        """Sample a step that holds drafts: logits at each draft's position and the last one,
        drafts accepted or rejected (worker/spec_decode.py). Requests with drafts ask for no
        logprobs and follow no grammar (the scheduler's Speculator.is_eligible)."""
        token_idx: list[int] = []
        groups: list[DraftRows] = []
        row_states: list[SamplingState] = []
        for i in sample_rows:
            s = sched.scheduled[i]
            k, last = len(s.spec_token_ids), int(ends[i]) - 1
            groups.append(DraftRows(len(token_idx), s.spec_token_ids))
            token_idx.extend(range(last - k, last + 1))
            state = self.states[s.req_id]
            row_states.append(state)
            for j in range(1, k + 1):  # scored as if its first j drafts were its output
                row_states.append(dataclasses.replace(
                    state, output_token_ids=state.output_token_ids + s.spec_token_ids[:j]
                ))  # fmt: skip
        index = to_device(np.asarray(token_idx, np.int64), self.device)
        logits = self.model.compute_logits(hidden[index])  # [num_rows, vocab]
        if not self.is_driver:
            return ModelRunnerOutput()
        if self.structured_output is not None:  # rows of constrained requests, one each
            req_ids = [sched.scheduled[i].req_id for i, g in zip(sample_rows, groups)
                       for _ in range(len(g.draft_ids) + 1)]  # fmt: skip
            self.structured_output.apply_bitmask(logits, req_ids)
        out = ModelRunnerOutput()
        for i, result in zip(sample_rows, verify(self.sampler, logits, row_states, groups)):
            req_id = sched.scheduled[i].req_id
            if result.error is not None:
                out.failed_req_ids[req_id] = result.error
                continue
            out.sampled_token_ids[req_id] = result.token_id
            if result.logprobs is not None:
                out.logprobs[req_id] = result.logprobs
            if sched.scheduled[i].spec_token_ids:
                out.num_accepted_draft_tokens[req_id] = result.num_accepted
        return out


def _drafts_as_decode_rows(
    query_lens: np.ndarray, computed: np.ndarray, rows: np.ndarray, is_verify: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return the step's sequences with each verifying request's tokens as sequences of one
    token (position p + j sees p + j + 1 tokens), in the same flat order."""
    reps = np.where(is_verify, query_lens, 1)
    seq = np.repeat(np.arange(len(query_lens)), reps)
    offsets = np.arange(len(seq)) - np.repeat(np.cumsum(reps) - reps, reps)
    split = is_verify[seq]
    return (
        np.where(split, 1, query_lens[seq]),
        computed[seq] + np.where(split, offsets, 0),
        rows[seq],
    )


def _token_slice(state: SamplingState, start: int, end: int) -> list[int]:
    """Return tokens [start, end) of prompt + output without joining the two lists."""
    prompt, output = state.prompt_token_ids, state.output_token_ids
    n = len(prompt)
    assert end <= n + len(output), "scheduled past the request's known tokens"
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return output[start - n : end - n]
    return prompt[start:] + output[: end - n]
