"""Who drafts how many tokens this step: the proposer, each request's recent acceptance, and a
cost model of the step time fitted from the steps the engine ran (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from infer8.request import Request

if TYPE_CHECKING:
    from infer8.core.sched_output import SchedulerOutput
from infer8.spec_decode.config import SpeculativeConfig
from infer8.spec_decode.ngram import NgramProposer
from infer8.spec_decode.suffix import SuffixProposer

# A request's acceptance estimate: the share of its draft tokens accepted, averaged with this
# weight on the newest verification; requests start at the prior.
_ACCEPTANCE_WEIGHT = 0.3
_PRIOR_ACCEPTANCE = 0.5
# A request that stopped drafting drifts back to the prior this much per step, so it tries again.
_RECOVERY_PER_STEP = 0.02
_STEP_DECAY = 0.97  # weight of the older steps in the step-time fit
_MAX_BACKOFF_STEPS = 16


@dataclass
class SpecDecodeStats:
    """Counters of one step's verifications (vLLM's spec_decode metrics)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one request's verified draft."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos += [0] * (
                num_draft_tokens - len(self.num_accepted_tokens_per_pos)
            )
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1


class StepCostModel:
    """Fits step time = fixed + per_token x scheduled tokens + verify_jump x the step's
    requests, if it verifies drafts, over the recent decode steps (weighted least squares,
    older steps decayed).

    The jump is what a step pays once any request in it verifies: where a verification cannot
    run as decode rows (an FP8 cache's exact tail), every request of the step leaves the fused
    decode kernel for the prefill path, at a cost per request.
    """

    def __init__(self) -> None:
        self._xx = np.zeros((3, 3))  # decayed sums of x x^T, x = (1, tokens, verify requests)
        self._xy = np.zeros(3)
        self.fixed_s = 0.0
        self.per_token_s = 0.0  # until steps of different sizes are seen, drafts look free
        self.verify_jump_s = 0.0  # per request of a step that verifies

    def observe(self, num_tokens: int, step_time_s: float, num_verify_reqs: int = 0) -> None:
        """Add one step's size and time; num_verify_reqs: its requests if it verified drafts
        (else 0)."""
        x = np.array([1.0, num_tokens, num_verify_reqs])
        self._xx = _STEP_DECAY * self._xx + np.outer(x, x)
        self._xy = _STEP_DECAY * self._xy + step_time_s * x
        # a little ridge: a column that never varied (no verifying step yet, or one size
        # only) gets a coefficient of ~0 instead of an undetermined one
        ridge = 1e-6 * self._xx[0, 0] * np.array([0.0, 1.0, 1.0])
        fixed, per_token, jump = np.linalg.lstsq(self._xx + np.diag(ridge), self._xy, rcond=None)[0]
        self.fixed_s, self.per_token_s = float(fixed), max(0.0, float(per_token))
        self.verify_jump_s = max(0.0, float(jump))

    def step_time_s(self, num_tokens: int) -> float:
        """Return the predicted time of a decode step of `num_tokens` tokens."""
        return max(0.0, self.fixed_s + self.per_token_s * num_tokens)


class Speculator:
    """Owns the proposer, each request's acceptance estimate and the step cost model."""

    def __init__(self, config: SpeculativeConfig, max_num_draft_tokens: int) -> None:
        self.config = config
        self.max_num_draft_tokens = min(config.num_speculative_tokens, max_num_draft_tokens)
        self.proposer: NgramProposer | SuffixProposer
        if config.method == "suffix":
            self.proposer = SuffixProposer(
                config.suffix_decoding_max_tree_depth,
                config.suffix_decoding_max_cached_requests,
                config.suffix_decoding_max_spec_factor,
                config.suffix_decoding_min_token_prob,
            )
        else:
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.cost = StepCostModel()
        self._acceptance: dict[str, float] = {}
        self._backoff: dict[str, tuple[int, int]] = {}  # req_id -> (steps to skip, last wait)
        self.stats = SpecDecodeStats()

    @staticmethod
    def is_eligible(request: Request) -> bool:
        """Return whether a request's outputs keep their meaning under verification here:
        per-token logprobs and grammars are not verified over drafts (yet)."""
        p = request.sampling_params
        return p.logprobs is None and p.structured_outputs is None

    def num_draft_tokens(self, request: Request, batch_size: int, num_step_tokens: int) -> int:
        """Return how many drafts pay for their verification for this request this step.

        Drafting i tokens costs per_token_s each for the whole batch; the i-th is accepted with
        probability ~ acceptance^i and then saves a step's share of one token
        (step_time / batch_size). So draft while acceptance^i * step_time / batch_size exceeds
        per_token_s: a long batch (time per request small against a token's cost) stops on
        its own, and so does a request whose drafts keep failing.
        """
        limit = self.config.disable_by_batch_size
        if limit is not None and batch_size > limit:
            return 0
        room = request.max_num_tokens - request.num_tokens - 1  # the bonus token needs a place
        k_max = min(self.max_num_draft_tokens, room)
        if k_max < 1:
            return 0
        alpha = self._acceptance.get(request.request_id, _PRIOR_ACCEPTANCE)
        share_s = self.cost.step_time_s(num_step_tokens) / max(1, batch_size)
        k, gain = 0, 1.0
        while k < k_max:
            gain *= alpha
            if gain * share_s < self.cost.per_token_s:  # (both 0 before any step: free)
                break
            k += 1
        if k == 0:  # not worth it now: drift back toward the prior, to try again later
            self._acceptance[request.request_id] = alpha + _RECOVERY_PER_STEP * (
                _PRIOR_ACCEPTANCE - alpha
            )
        return k

    def plan_step(self, requests: list[Request], batch_size: int) -> dict[str, list[int]]:
        """Return this step's drafts for these decoding requests (req_id -> drafts).

        Each request's draft length comes from num_draft_tokens; then the step as a whole:
        if the time the drafts are expected to save (acceptance^i x a request's share of a
        step, summed) is below what they cost (their tokens, plus the jump each of the step's
        requests pays once it verifies anything), nobody drafts this step.
        """
        share_s = self.cost.step_time_s(batch_size) / max(1, batch_size)
        plans: dict[str, list[int]] = {}
        saved_s = cost_s = 0.0
        for request in requests:
            k = self.num_draft_tokens(request, batch_size, batch_size)
            drafts = self.propose(request, k)
            if not drafts:
                continue
            plans[request.request_id] = drafts
            alpha = self._acceptance.get(request.request_id, _PRIOR_ACCEPTANCE)
            saved_s += share_s * sum(alpha**i for i in range(1, len(drafts) + 1))
            cost_s += self.cost.per_token_s * len(drafts)
        if plans and saved_s < cost_s + self.cost.verify_jump_s * batch_size:
            return {}
        return plans

    def propose(self, request: Request, num_draft_tokens: int) -> list[int]:
        """Return up to `num_draft_tokens` drafts for a decoding request.

        A request whose text gave no draft is asked again after 1, 2, 4, ... steps (up to
        _MAX_BACKOFF_STEPS), so one without anything to copy costs no search every step.
        """
        if num_draft_tokens < 1:
            return []
        req_id = request.request_id
        skip, wait = self._backoff.get(req_id, (0, 0))
        if skip > 0:
            self._backoff[req_id] = (skip - 1, wait)
            return []
        drafts = self.proposer.propose(
            req_id, request.prompt_token_ids, request.output_token_ids, num_draft_tokens
        )
        if drafts:
            self._backoff.pop(req_id, None)
        else:
            wait = min(_MAX_BACKOFF_STEPS, max(1, 2 * wait))
            self._backoff[req_id] = (wait, wait)
        return drafts

    def on_verified(self, req_id: str, num_draft_tokens: int, num_accepted: int) -> None:
        """Update a request's acceptance estimate and the step's counters."""
        self.stats.record(num_draft_tokens, num_accepted)
        alpha = self._acceptance.get(req_id, _PRIOR_ACCEPTANCE)
        rate = num_accepted / num_draft_tokens
        self._acceptance[req_id] = alpha + _ACCEPTANCE_WEIGHT * (rate - alpha)

    def observe_step(self, sched_out: SchedulerOutput, step_time_s: float) -> None:
        """Fit the step-time model on a step of decodes and verifications only: a prefill
        chunk's tokens cost less each (larger matmuls), and drafts compete with decodes."""
        if sched_out.scheduled and all(
            s.num_new_tokens - len(s.spec_token_ids) == 1 for s in sched_out.scheduled
        ):
            verifies = any(s.spec_token_ids for s in sched_out.scheduled)
            num_reqs = len(sched_out.scheduled) if verifies else 0
            self.cost.observe(sched_out.total_num_scheduled_tokens, step_time_s, num_reqs)

    def take_stats(self) -> SpecDecodeStats:
        """Return the counters since the last call."""
        stats, self.stats = self.stats, SpecDecodeStats()
        return stats

    def remove(self, request: Request) -> None:
        """Forget a request that left (its output may join the proposer's response cache)."""
        self.proposer.remove(request.request_id, request.output_token_ids)
        self._acceptance.pop(request.request_id, None)
        self._backoff.pop(request.request_id, None)
