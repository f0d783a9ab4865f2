"""Speculative decoding's pure parts: the flag, the n-gram proposer, who drafts how much, the
scheduler's rollback of rejected drafts, the tail ring's backup, and speculative sampling's
distribution."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from infer8.config import EngineArgs
from infer8.core.kv_cache_manager import KVCacheManager
from infer8.core.sched_output import ModelRunnerOutput, SchedulerOutput
from infer8.core.scheduler import Scheduler
from infer8.request import Request
from infer8.sampling_params import SamplingParams
from infer8.spec_decode.config import SpeculativeConfig
from infer8.spec_decode.ngram import NgramProposer
from infer8.spec_decode.speculator import Speculator, StepCostModel
from infer8.spec_decode.suffix import SuffixProposer, _chain
from infer8.worker.penalties import SamplingState
from infer8.worker.sampler import Sampler
from infer8.worker.spec_decode import DraftRows, TailRingBackup, verify

EOS = 0


# -- the flag ------------------------------------------------------------------------------
def test_config_follows_vllm_defaults() -> None:
    assert SpeculativeConfig.from_json('{"method": "ngram"}').prompt_lookup_min == 5
    one = SpeculativeConfig.from_json('{"method": "ngram", "prompt_lookup_max": 3}')
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    old_form = SpeculativeConfig.from_json('{"model": "[ngram]", "num_speculative_tokens": 2}')
    assert old_form.method == "ngram" and old_form.num_speculative_tokens == 2


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"method": "eagle", "model": "x"}', "needs a draft model"),
        ('{"method": "mtp"}', "supported: ngram, suffix"),
        ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}', "in [0, 1]"),
        ('{"method": "suffix", "suffix_decoding_max_spec_factor": 0}', "> 0"),
        ('{"model": "org/draft-model"}', "not supported"),
        ('{"method": "ngram", "lookahead": 3}', "unknown key(s) lookahead"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', ">= 1"),
        ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "must not exceed"),
        ("[1, 2]", "JSON object"),
        ("{method: ngram}", "not valid JSON"),
    ],
)
def test_config_errors_are_one_line(text: str, words: str) -> None:
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.from_json(text)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_static_scheduler_refuses_speculation() -> None:
    args = EngineArgs(scheduler="static", speculative_config='{"method": "ngram"}')
    with pytest.raises(ValueError, match="continuous scheduler"):
        args.create_speculative_config()


def test_suffix_config_takes_vllms_names_and_defaults() -> None:
    config = SpeculativeConfig.from_json('{"method": "suffix"}')
    assert config.num_speculative_tokens == config.suffix_decoding_max_tree_depth == 24
    assert config.suffix_decoding_max_cached_requests == 10_000
    deep = SpeculativeConfig.from_json('{"method": "suffix", "suffix_decoding_max_tree_depth": 8}')
    assert deep.num_speculative_tokens == 8


# -- the proposers -------------------------------------------------------------------------
def test_ngram_prefers_the_longest_then_the_latest_match() -> None:
    p = NgramProposer(1, 3)
    # "7 8 9" occurs once, "8 9" twice more recently: the longest suffix wins
    tokens = [7, 8, 9, 1, 2, 8, 9, 3, 4, 8, 9, 5, 6, 7, 8, 9]
    assert p.propose("a", tokens[:4], tokens[4:], 3) == [1, 2, 8]
    # among equal lengths, the latest occurrence
    q = NgramProposer(2, 2)
    tokens = [1, 2, 10, 1, 2, 20, 1, 2]
    assert q.propose("b", tokens, [], 2) == [20, 1]
    assert q.propose("c", [1, 2, 3], [], 2) == []  # no earlier occurrence
    assert NgramProposer(3, 3).propose("d", [5, 6, 5, 6], [], 2) == []  # shorter than min_n


def test_ngram_keeps_up_with_a_growing_request() -> None:
    p = NgramProposer(2, 2)
    prompt = [3, 4, 5, 6]
    assert p.propose("a", prompt, [], 2) == []
    assert p.propose("a", prompt, [9, 3, 4], 2) == [5, 6]
    assert p.propose("a", prompt, [9, 3, 4, 5, 6, 9], 3) == [3, 4, 5]
    p.remove("a", [9, 3, 4, 5, 6, 9])
    assert p.propose("a", [1, 1, 1], [], 1) == [1]


def test_suffix_chain_follows_the_most_frequent_continuation() -> None:
    tokens = np.array([1, 2, 5, 6, 1, 2, 5, 7, 1, 2, 8, 1, 2])
    ends = np.array([1, 5, 9])  # "1 2" occurred three times before the last
    # 5 follows two of three (p 2/3), then 6 and 7 split the two (p 1/3 each)
    assert _chain(tokens, ends, 4, 0.5) == ([5], pytest.approx(2 / 3))
    chain, expected = _chain(tokens, ends, 2, 0.3)
    assert chain == [5, 6] and expected == pytest.approx(2 / 3 + 1 / 3)
    # a continuation never crosses a separator (-1: the end of a cached response)
    assert _chain(np.array([3, 4, -1, 9]), np.array([0]), 4, 0.0)[0] == [4]


def test_suffix_proposer_drafts_from_the_request_and_from_earlier_responses() -> None:
    p = SuffixProposer(max_depth=8, max_cached_requests=1, max_spec_factor=2.0, min_prob=0.1)
    prompt = [9, 1, 2, 3, 4, 5, 6, 9, 1, 2]
    # "9 1 2" matched (3 tokens) drafts up to 5 (depth 8 - 3): "3 4 5 6 9"; "1 2" (2 tokens)
    # up to 4 (2 x 2); the longer chain wins
    assert p.propose("a", prompt, [], 10) == [3, 4, 5, 6, 9]
    # a finished request's output joins the response cache: a later request that writes the
    # same opening gets the rest of it
    p.remove("b", [40, 41, 42, 43, 44, 45])  # (it never needed a draft)
    assert p.propose("c", [80], [40, 41], 3) == [42, 43, 44]
    # the cache holds one request: the next one evicts b's output
    p.remove("d", [50, 51, 52])
    assert p.propose("e", [82], [40, 41], 3) == []
    # a continuation seen once in ten tries is below min_prob = 0.2
    q = SuffixProposer(max_depth=4, max_cached_requests=0, max_spec_factor=4.0, min_prob=0.2)
    tokens = [5, 6] * 1 + [t for k in range(10) for t in (7, 100 + k)] + [7]
    assert q.propose("f", tokens, [], 4) == []


# -- who drafts how much -------------------------------------------------------------------
def _request(req_id: str, prompt: list[int], max_tokens: int = 50) -> Request:
    req = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), [EOS])
    req.max_num_tokens = len(prompt) + max_tokens
    return req


def test_cost_model_fits_the_per_token_time() -> None:
    cost = StepCostModel()
    for n in (1, 6, 1, 6, 32, 1, 64, 6):
        cost.observe(n, 0.010 + 0.0005 * n)
    assert cost.per_token_s == pytest.approx(0.0005, rel=1e-4)
    assert cost.step_time_s(100) == pytest.approx(0.060, rel=1e-4)
    assert cost.verify_jump_s == pytest.approx(0.0, abs=1e-6)  # no step verified yet
    # steps that verify pay 1 ms more per request (rows off the fused decode kernel)
    for n, reqs in ((32, 0), (40, 32), (32, 0), (52, 32), (12, 8), (1, 0), (6, 1)):
        cost.observe(n, 0.010 + 0.0005 * n + 0.001 * reqs, reqs)
    assert cost.verify_jump_s == pytest.approx(0.001, rel=1e-3)
    assert cost.per_token_s == pytest.approx(0.0005, rel=1e-3)


def test_a_step_drafts_only_where_the_drafts_pay_for_the_jump_too() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2), 4)
    for n, reqs in ((1, 0), (5, 1), (32, 0), (36, 32), (1, 0), (64, 0), (20, 16)):
        spec.cost.observe(n, 0.010 + 0.0005 * n + 0.003 * reqs, reqs)
    # one request with something to copy among 32: its drafts could save ~0.8 ms (a share of
    # 26 ms / 32 each at the prior acceptance of 0.5), but cost 2 ms and the jump 3 ms x 32:
    # nobody drafts
    copying = _request("a", [5, 6, 7, 8, 5, 6, 7])
    assert spec.plan_step([copying], batch_size=32) == {}
    # alone, its 4 drafts save ~9.8 ms of a 10.5 ms step: more than its jump and tokens (5 ms)
    assert spec.plan_step([_request("b", [5, 6, 7, 8, 5, 6, 7])], batch_size=1) == {
        "b": [8, 5, 6, 7]
    }


def test_drafting_stops_where_it_does_not_pay() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=5), 5)
    for n in (1, 6, 1, 6, 256, 1):  # 10 ms a step plus 0.5 ms a token
        spec.cost.observe(n, 0.010 + 0.0005 * n)
    req = _request("a", list(range(1, 20)))
    # alone, at the prior acceptance of 0.5: the 4th draft still pays (0.5^4 x 10.5 ms >
    # 0.5 ms), the 5th not
    assert spec.num_draft_tokens(req, batch_size=1, num_step_tokens=1) == 4
    # a long batch: each request's share of a step is below what a draft token costs
    assert spec.num_draft_tokens(req, batch_size=256, num_step_tokens=256) == 0
    # drafts that keep failing stop on their own, and the request tries again later
    for _ in range(10):
        spec.on_verified("a", 5, 0)
    assert spec.num_draft_tokens(req, batch_size=8, num_step_tokens=8) == 0
    assert spec._acceptance["a"] < 0.05
    for _ in range(200):
        spec.num_draft_tokens(req, batch_size=8, num_step_tokens=8)
    assert spec.num_draft_tokens(req, batch_size=8, num_step_tokens=8) >= 1
    # never past the request's length cap (the token after the drafts needs a place)
    short = _request("b", list(range(1, 20)), max_tokens=3)
    assert spec.num_draft_tokens(short, batch_size=1, num_step_tokens=1) == 2
    limited = Speculator(SpeculativeConfig(disable_by_batch_size=4), 5)
    assert limited.num_draft_tokens(req, batch_size=5, num_step_tokens=5) == 0


def test_a_request_without_drafts_is_asked_again_less_and_less_often() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3), 3)
    calls: list[int] = []
    answers = iter([[]] * 5 + [[7]] + [[]] * 30)

    class Counting:
        def propose(self, req_id: str, prompt: list[int], output: list[int], k: int) -> list[int]:
            calls.append(len(output))
            return next(answers)

        def remove(self, req_id: str, output_ids: list[int]) -> None: ...

    spec.proposer = Counting()  # type: ignore[assignment]
    req = _request("a", [1, 2, 3])
    drafts = []
    for step in range(40):
        req.output_token_ids.append(step)
        drafts.append(spec.propose(req, 3))
    # asked at steps 0, 2, 5, 10, 19 (waits of 1, 2, 4, 8), found a draft at 36 (16), then
    # asked again at the next step
    assert calls[:6] == [1, 3, 6, 11, 20, 37] and calls[6] == 38
    assert drafts[36] == [7]


# -- the scheduler's side ------------------------------------------------------------------
class DraftChecker:
    """A fake runner whose "model" continues every request with `truth`: drafts are accepted
    while they match it (greedy verification), and the next true token is sampled."""

    def __init__(self, truth: dict[str, list[int]]) -> None:
        self.truth = truth
        self.num_out: dict[str, int] = {}

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        for s in sched.scheduled:
            if not s.sample:
                continue
            n, truth = self.num_out.get(s.req_id, 0), self.truth[s.req_id]
            a = 0
            while a < len(s.spec_token_ids) and s.spec_token_ids[a] == truth[n + a]:
                a += 1
            out.sampled_token_ids[s.req_id] = truth[n + a]
            if s.spec_token_ids:
                out.num_accepted_draft_tokens[s.req_id] = a
            self.num_out[s.req_id] = n + a + 1
        return out


def _scheduler(num_blocks: int = 64, k: int = 4) -> Scheduler:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=2), k)
    return Scheduler(KVCacheManager(num_blocks, 4), 8, 256, speculator=spec)


def _run(sched: Scheduler, runner: DraftChecker, max_steps: int = 200) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for s in out.scheduled:  # the drafts fit in the blocks the request holds
            held = len(sched.kv_cache_manager.get_block_ids(s.req_id)) * 4
            assert s.num_computed_tokens + s.num_new_tokens <= held
        sched.update_from_output(out, runner.execute(out))
        outs.append(out)
    return outs


def test_scheduler_appends_accepted_drafts_and_rolls_back_the_rest() -> None:
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]  # "5 6 7" then "8 9 5 6 7 ..." is what it predicts
    truth = [8, 9, 5, 6, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    sched = _scheduler()
    req = _request("a", prompt, max_tokens=len(truth))
    sched.add_request(req)
    runner = DraftChecker({"a": truth})
    outs = _run(sched, runner)
    stats = sched.make_stats().spec_decode
    assert req.output_token_ids == truth  # every token the model would have given, no others
    assert len(outs) < len(truth)  # in fewer steps
    assert stats is not None and stats.num_accepted_tokens > 0
    second = outs[1].scheduled[0]
    assert second.spec_token_ids == [9, 5, 6, 7]  # after "7 8": what followed "7 8" before
    # the first three drafts were right, the fourth not: progress counts the accepted ones
    assert outs[2].new_token_ids["a"] == [9, 5, 6, 1]
    # computed: the prompt, its first output, and the three accepted drafts (not the fourth)
    assert outs[2].scheduled[0].num_computed_tokens == len(prompt) + 1 + 3


def test_drafts_stop_at_eos_and_at_the_length_cap() -> None:
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    sched = _scheduler()
    # EOS inside the accepted drafts: the output ends there, nothing after it
    eos_req = _request("eos", prompt, max_tokens=20)
    cap_req = _request("cap", [5, 6, 7, 8, 9, 5, 6, 7, 8], max_tokens=3)
    sched.add_request(eos_req)
    sched.add_request(cap_req)
    runner = DraftChecker({"eos": [8, 9, 5, EOS, 7, 8, 9], "cap": [9, 5, 6, 7, 8]})
    _run(sched, runner)
    assert eos_req.output_token_ids == [8, 9, 5, EOS]
    assert cap_req.output_token_ids == [9, 5, 6]
    assert not sched.requests and sched.kv_cache_manager.block_pool.num_used_blocks == 0


def test_drafts_give_way_when_blocks_run_short() -> None:
    # 3 blocks of 4: the prompt takes 2; a draft that would need a third block is dropped
    sched = _scheduler(num_blocks=3)
    prompt = [5, 6, 7, 5, 6, 7, 5]
    req = _request("a", prompt, max_tokens=5)
    sched.add_request(req)
    runner = DraftChecker({"a": [6, 7, 5, 6, 7]})
    outs = _run(sched, runner)
    assert req.output_token_ids == [6, 7, 5, 6, 7]
    assert all(s.num_computed_tokens + s.num_new_tokens <= 12 for o in outs for s in o.scheduled)


# -- the tail ring's backup ----------------------------------------------------------------
class _Layer:
    def __init__(self, store: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.tail_store = store
        self.k = store[1]


def test_ring_backup_restores_rejected_drafts_only() -> None:
    ring, sinks = 5, 2
    residuals = torch.randn(4, 3, ring + sinks, 8).to(torch.float8_e4m3fn)
    scales = torch.rand(4, 3, ring + sinks).to(torch.bfloat16)
    layer = _Layer((residuals, scales))
    before = (residuals.float().clone(), scales.clone())
    backup = TailRingBackup(ring)
    backup.save([layer], "a", 1, range(8, 11))  # drafts at 8, 9, 10: slots 3, 4, 0
    residuals[:, 1, [3, 4, 0]] = torch.ones(4, 3, 8).to(torch.float8_e4m3fn)
    scales[:, 1, [3, 4, 0]] = 7.0
    backup.restore([layer], {"a": [11, 12]}, gone=set())  # one draft accepted: 9, 10 rejected
    assert torch.equal(residuals[:, 1, 3].float(), torch.ones(4, 8))  # the accepted draft's
    assert torch.equal(residuals[:, 1, [4, 0]].float(), before[0][:, 1, [4, 0]])
    assert torch.equal(scales[:, 1, [4, 0]], before[1][:, 1, [4, 0]])
    assert torch.equal(residuals[:, [0, 2]].float(), before[0][:, [0, 2]])  # other rows
    backup.save([layer], "b", 2, range(3, 5))
    residuals[:, 2, [3, 4]] = torch.ones(4, 2, 8).to(torch.float8_e4m3fn)
    backup.restore([layer], {"b": [1]}, gone={"b"})  # it left: its row is not touched
    assert torch.equal(residuals[:, 2, [3, 4]].float(), torch.ones(4, 2, 8))


# -- speculative sampling ------------------------------------------------------------------
def _state(temperature: float, seed: int | None = None) -> SamplingState:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingState(SamplingParams(temperature=temperature, max_tokens=8), [1], [], gen)


def test_greedy_verification_accepts_while_the_draft_is_the_argmax() -> None:
    logits = torch.full((4, 6), -5.0)
    logits[0, 2] = logits[1, 3] = logits[2, 1] = logits[3, 5] = 5.0
    state = _state(0.0)
    out = verify(Sampler(torch.device("cpu"), 0), logits, [state] * 4, [DraftRows(0, [2, 3, 4])])
    assert (out[0].num_accepted, out[0].token_id) == (2, 1)
    all_right = verify(
        Sampler(torch.device("cpu"), 0), logits, [state] * 4, [DraftRows(0, [2, 3, 1])]
    )
    assert (all_right[0].num_accepted, all_right[0].token_id) == (3, 5)  # and the bonus token


def test_sampled_verification_keeps_the_target_distribution() -> None:
    """Chi-square over a 6-token vocabulary: the first token emitted after a draft of token 2
    (p = 0.25) follows p; the second, when the first draft was accepted, follows row 1's p.

    With 6 - 1 degrees of freedom, 20.5 is the 0.999 quantile: a correct sampler fails one
    seed in a thousand; the seed is fixed, so the test is deterministic. Drawing a rejected
    draft's replacement from p with the draft left in gives ~1,200 for the first token.
    """
    p0 = torch.tensor([0.1, 0.15, 0.25, 0.3, 0.05, 0.15])
    p1 = torch.tensor([0.3, 0.3, 0.1, 0.1, 0.1, 0.1])
    n = 6000
    logits = torch.stack([p0.log(), p1.log(), p1.log()] * n)  # per request: 2 drafts + bonus
    states = [_state(1.0)] * (3 * n)
    groups = [DraftRows(3 * i, [2, 0]) for i in range(n)]
    sampler = Sampler(torch.device("cpu"), seed=1234)
    out = verify(sampler, logits, states, groups)
    first = torch.tensor([2 if o.num_accepted >= 1 else o.token_id for o in out])
    second = torch.tensor(
        [0 if o.num_accepted == 2 else o.token_id for o in out if o.num_accepted >= 1]
    )

    def chi2(samples: torch.Tensor, p: torch.Tensor) -> float:
        counts = torch.bincount(samples, minlength=len(p)).double()
        expected = p.double() * len(samples)
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi2(first, p0) < 20.5, torch.bincount(first, minlength=6)
    assert chi2(second, p1) < 20.5, torch.bincount(second, minlength=6)
    accept_rate = sum(o.num_accepted >= 1 for o in out) / n
    assert abs(accept_rate - 0.25) < 4 * (0.25 * 0.75 / n) ** 0.5  # accepted with p(x)


def test_json_of_the_config_round_trips() -> None:
    config = SpeculativeConfig.from_json(
        json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    )
    assert config.num_speculative_tokens == 3


def test_the_response_cache_overwrites_its_oldest_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from infer8.spec_decode import suffix

    monkeypatch.setattr(suffix, "CACHE_TOKENS", 16)
    p = SuffixProposer(max_depth=8, max_cached_requests=100, max_spec_factor=4.0, min_prob=0.1)
    for k in range(5):  # responses of 5 tokens + a separator: two fit before the end
        p.remove(f"r{k}", [10 * k + i for i in range(1, 6)])
    assert list(p._cached) == [(6, 5), (0, 5)] and p._head == 6  # r3 at 6, then r4 at 0
    assert p.propose("x", [99], [41, 42], 3) == [43, 44, 45]  # r4 is there
    assert p.propose("y", [99], [31, 32], 3) == [33, 34, 35]  # r3 too
    assert p.propose("z", [99], [21, 22], 3) == []  # r2 was overwritten
