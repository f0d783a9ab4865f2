"""SamplingParams validation and the sampler's behaviour on hand-made logits."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from infer8.kernels.cpu import NativeKernels
from infer8.sampling_params import SamplingParams
from infer8.worker.penalties import PenaltyRows, uses_penalty_rows
from infer8.worker.sampler import Sampler, SamplingState, apply_penalties


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_sampling_params_raise_clear_errors(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_stop_string_is_normalised_to_list_and_top_k_minus_one_disables() -> None:
    p = SamplingParams(stop="END", top_k=-1)
    assert p.stop == ["END"] and p.top_k == 0


def _state(**kwargs: object) -> SamplingState:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return SamplingState(params, [1, 2, 3], [], gen)


def test_greedy_takes_argmax_and_top_k_one_is_greedy() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    tokens, _, _ = Sampler(torch.device("cpu"), 0)(
        logits, [_state(temperature=0.0), _state(temperature=1.0, top_k=1)], [99]
    )
    assert tokens == [1, 0]


def test_seeded_sampling_is_reproducible_and_depends_on_seed() -> None:
    logits = torch.zeros(1, 1000)

    def draw(seed: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"), 123)
        st_ = _state(temperature=1.0, seed=seed)
        out = []
        for _ in range(8):
            out.append(sampler(logits, [st_], [])[0][0])
        return out

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_p_and_min_p_and_top_k_restrict_the_support() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(torch.device("cpu"), 0)
    for params, allowed in [
        (dict(top_p=0.6), {0, 1}),
        (dict(top_p=0.5), {0}),
        (dict(min_p=0.5), {0, 1}),
        (dict(top_k=3), {0, 1, 2}),
    ]:
        seen = set()
        for seed in range(200):
            seen.add(sampler(logits, [_state(temperature=1.0, seed=seed, **params)], [])[0][0])
        assert seen == allowed, params


def test_penalties_change_the_choice() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0]])
    sampler = Sampler(torch.device("cpu"), 0)
    st_ = _state(temperature=0.0, frequency_penalty=1.0)
    st_.output_token_ids = [1]
    assert sampler(logits, [st_], [])[0] == [2]
    st_ = _state(temperature=0.0, repetition_penalty=2.0)
    st_.prompt_token_ids = [1]  # 2.0 / 2 = 1.0 < 1.9
    assert sampler(logits, [st_], [])[0] == [2]
    st_ = _state(temperature=0.0, presence_penalty=0.5)
    st_.output_token_ids = [1, 1]
    assert sampler(logits, [st_], [])[0] == [2]
    assert torch.equal(logits, torch.tensor([[0.0, 2.0, 1.9, 0.0]])), "logits modified in place"


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])
    sampler = Sampler(torch.device("cpu"), 0)
    st_ = _state(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert sampler(logits, [st_], eos_token_ids=[1])[0] == [3]
    st_.output_token_ids = [7, 7]
    assert sampler(logits, [st_], eos_token_ids=[1])[0] == [1]


def test_logprobs_are_raw_log_softmax_with_top_k() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    tokens, lps, _ = Sampler(torch.device("cpu"), 0)(
        logits, [_state(temperature=0.0, logprobs=2)], []
    )
    ref = torch.log_softmax(logits[0], dim=-1)
    sampled_lp, top = lps[0]  # type: ignore[misc]
    assert tokens == [1]
    assert math.isclose(sampled_lp, ref[1].item(), rel_tol=1e-6)
    assert [t for t, _ in top] == [1, 2]
    assert math.isclose(top[1][1], ref[2].item(), rel_tol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1.0, "repetition_penalty": 1e-38},  # the engine killer of issue #18
        {"temperature": 1.0, "repetition_penalty": 1e38},
        {"temperature": 1e-4, "repetition_penalty": 1e-30, "top_p": 1e-9},
        {"temperature": 1e30, "top_k": 2, "min_p": 1.0},
        {"temperature": 2.0, "presence_penalty": 2.0, "frequency_penalty": -2.0, "min_p": 1e-30},
    ],
)
def test_extreme_parameters_sample_a_valid_token(kwargs: dict) -> None:
    logits = torch.tensor([[30.0, -40.0, 5.0, float("nan"), float("inf")] + [0.0] * 59] * 2)
    st_ = _state(**kwargs)
    st_.output_token_ids = [0, 2, 0]
    out = Sampler(torch.device("cpu"), 0)(logits, [st_, _state(temperature=0.0)], [99])
    assert out.errors == {}
    assert all(0 <= t < logits.shape[1] for t in out.token_ids)
    assert out.token_ids[1] == 4  # +inf logit is the largest finite value for the greedy row


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_parameters_are_refused(value: float) -> None:
    for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "min_p"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: value})


def test_a_failing_row_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import infer8.worker.sampler as sampler_mod

    real = sampler_mod.apply_penalties

    def fail_on_penalty_two(
        logits: torch.Tensor, rows: list[int], states: list[SamplingState], stop_ids: list,
        tables: object = None,
    ) -> dict[int, str]:  # fmt: skip
        if any(states[i].params.repetition_penalty == 2.0 for i in rows):
            raise RuntimeError("boom")
        return real(logits, rows, states, stop_ids, tables)

    monkeypatch.setattr(sampler_mod, "apply_penalties", fail_on_penalty_two)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)
    states = [
        _state(temperature=0.0),
        _state(temperature=1.0, repetition_penalty=2.0),
        _state(temperature=1.0, seed=3, repetition_penalty=1.5),
    ]
    out = Sampler(torch.device("cpu"), 0)(logits, states, [])
    assert set(out.errors) == {1}
    assert out.token_ids[0] == 1 and out.token_ids[1] == -1 and 0 <= out.token_ids[2] < 4


def test_batched_sampling_matches_each_rows_distribution() -> None:
    # One batch mixing top-k, top-p, min-p and plain rows: each row keeps its own support.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    sampler = Sampler(torch.device("cpu"), 0)
    rows = [dict(top_k=2), dict(top_p=0.5), dict(min_p=0.4), dict()]
    allowed = [{0, 1}, {0}, {0, 1}, {0, 1, 2, 3}]
    seen: list[set[int]] = [set() for _ in rows]
    counts = [0] * 4
    for seed in range(400):
        states = [_state(temperature=1.0, **r) for r in rows]
        states[3] = _state(temperature=1.0, seed=seed)
        tokens = sampler(logits, states, []).token_ids
        for i, t in enumerate(tokens):
            seen[i].add(t)
        counts[tokens[3]] += 1
    assert seen == allowed
    # the plain seeded row follows the distribution (0.5, 0.3, 0.15, 0.05)
    assert 150 < counts[0] < 250 and 80 < counts[1] < 160 and counts[3] < 45


def test_masked_tokens_stay_masked_under_any_penalty() -> None:
    # A grammar's bitmask sets -inf; a repetition penalty below 1 must not revive those tokens.
    logits = torch.tensor([[-float("inf"), -5.0, -float("inf"), -7.0] * 16])
    for kwargs in ({"repetition_penalty": 1e-38}, {"presence_penalty": -2.0}):
        st_ = _state(temperature=1.0, **kwargs)
        st_.prompt_token_ids = list(range(64))
        st_.output_token_ids = [0, 2, 4]
        sampler = Sampler(torch.device("cpu"), 0)
        tokens = {sampler(logits, [st_], []).token_ids[0] for _ in range(50)}
        assert all(t % 2 == 1 for t in tokens), (kwargs, tokens)


def test_top_p_among_candidates_keeps_the_full_vocabularys_support_and_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Row 0 is peaked (its top-p set fits in the first tier of candidates), row 1 flatter (the
    # second tier), row 2 nearly flat (larger than both: the sorted-vocabulary path). Each must
    # keep the sorted-vocabulary rule's support and probabilities.
    import infer8.worker.sampler as sampler_mod

    gen = torch.Generator().manual_seed(0)
    vocab = 5000
    logits = torch.randn(3, vocab, generator=gen)
    logits[0] *= 4.0
    logits[2] = -0.0001 * torch.arange(vocab)[torch.randperm(vocab, generator=gen)]
    params = dict(temperature=0.7, top_p=0.9)
    expected = []
    for row in logits:
        probs = torch.softmax(row / 0.7, dim=0)
        sorted_probs, order = probs.sort(descending=True)
        keep = (sorted_probs.cumsum(0) - sorted_probs) < 0.9
        kept = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        expected.append(kept / kept.sum())
    sizes = [int((e > 0).sum()) for e in expected]
    first, second = sampler_mod.CANDIDATES
    assert sizes[0] <= first < sizes[1] <= second < sizes[2], sizes
    calls: list[tuple[int, int]] = []  # (rows, candidates; 0: the whole vocabulary)
    real_candidates, real_probs = sampler_mod._candidate_probs, sampler_mod._probs

    def candidates(x: torch.Tensor, p: list[SamplingParams], k: int) -> tuple:
        calls.append((x.shape[0], k))
        return real_candidates(x, p, k)

    def whole(x: torch.Tensor, p: list[SamplingParams]) -> torch.Tensor:
        calls.append((x.shape[0], 0))
        return real_probs(x, p)

    monkeypatch.setattr(sampler_mod, "_candidate_probs", candidates)
    monkeypatch.setattr(sampler_mod, "_probs", whole)
    sampler = Sampler(torch.device("cpu"), 0)
    draws, copies = 2000, 250  # each call samples `copies` independent rows of each kind
    counts = torch.zeros(3, vocab)
    batch = logits.repeat(copies, 1)  # rows 0, 1, 2, 0, 1, 2, ...
    for _ in range(draws // copies):
        tokens = sampler(batch, [_state(**params) for _ in range(3 * copies)], []).token_ids
        for i, token in enumerate(tokens):
            counts[i % 3, token] += 1
    # each row left at its tier
    assert calls == [(3 * copies, first), (2 * copies, second), (copies, 0)] * (draws // copies)
    for row in range(3):
        assert bool((counts[row][expected[row] == 0] == 0).all()), f"row {row}: outside top-p"
        top = expected[row].topk(3)
        for p, token in zip(top.values.tolist(), top.indices.tolist()):
            sigma = math.sqrt(draws * p * (1 - p))
            assert abs(counts[row, token] - draws * p) < 5 * sigma + 1, (row, token)


def test_native_candidates_keep_the_sorted_vocabularys_support_and_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On CPU the sampler takes each filtered row's candidates from one native pass: a peaked
    # row (few candidates), a flatter one (hundreds), one with top-k, and a nearly flat one
    # (more than the cap: left to the tiers) must each keep the sorted-vocabulary rule's
    # support and probabilities.
    import infer8.worker.sampler as sampler_mod

    kernels = NativeKernels.load()  # the shared build (compiled once per version)
    assert kernels is not None
    native = kernels.sampling
    gen = torch.Generator().manual_seed(0)
    vocab = 5000
    logits = torch.randn(4, vocab, generator=gen)
    logits[0] *= 4.0
    logits[2] *= 3.0
    logits[3] = -0.0001 * torch.arange(vocab)[torch.randperm(vocab, generator=gen)]
    params = [dict(temperature=0.7, top_p=0.9)] * 2 + [dict(temperature=1.0, top_k=20)]
    params.append(dict(temperature=0.7, top_p=0.9))
    expected = []
    for row, p in zip(logits, params):
        scaled = row / p["temperature"]
        if "top_k" in p:
            scaled = scaled.masked_fill(scaled < scaled.topk(p["top_k"]).values[-1], -math.inf)
        probs = torch.softmax(scaled, dim=0)
        sorted_probs, order = probs.sort(descending=True)
        keep = (sorted_probs.cumsum(0) - sorted_probs) < p.get("top_p", 1.0)
        kept = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        expected.append(kept / kept.sum())
    sizes = [int((e > 0).sum()) for e in expected]
    assert sizes[0] < 20 < sizes[1] < sampler_mod.NATIVE_CAP < sizes[3], sizes
    tiers: list[int] = []
    real_candidates = sampler_mod._candidate_probs

    def candidates(x: torch.Tensor, p: list[SamplingParams], k: int) -> tuple:
        tiers.append(x.shape[0])
        return real_candidates(x, p, k)

    monkeypatch.setattr(sampler_mod, "_candidate_probs", candidates)
    sampler = Sampler(torch.device("cpu"), 0)
    sampler.candidates = native.nucleus_candidates
    draws, copies = 2000, 250  # each call samples `copies` independent rows of each kind
    counts = torch.zeros(4, vocab)
    batch = logits.repeat(copies, 1)
    for _ in range(draws // copies):
        tokens = sampler(batch, [_state(**p) for p in params * copies], []).token_ids
        for i, token in enumerate(tokens):
            counts[i % 4, token] += 1
    assert set(tiers) == {copies}  # only the nearly flat rows reached the tiers
    for row in range(4):
        assert bool((counts[row][expected[row] == 0] == 0).all()), f"row {row}: outside"
        top = expected[row].topk(3)
        for p, token in zip(top.values.tolist(), top.indices.tolist()):
            sigma = math.sqrt(draws * p * (1 - p))
            assert abs(counts[row, token] - draws * p) < 5 * sigma + 1, (row, token)


def _penalise_row(row: torch.Tensor, state: SamplingState, stop_ids: list[int]) -> None:
    """The row-by-row reference: Python sets and one row's tensors at a time."""
    p = state.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(state.prompt_token_ids) | set(state.output_token_ids)))
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and state.output_token_ids:
        counts = torch.bincount(torch.tensor(state.output_token_ids), minlength=row.shape[0])
        counts = counts.to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    row.nan_to_num_(nan=-1e20, posinf=1e20, neginf=-1e20).clamp_(-1e20, 1e20)
    if len(state.output_token_ids) < p.min_tokens and stop_ids:
        row[torch.tensor(stop_ids)] = -float("inf")


def test_batched_penalties_equal_the_row_by_row_reference() -> None:
    vocab = 300
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 40, (n,), generator=gen).tolist()  # many repeats

    rows = [  # (params, prompt, output, stop ids)
        ({"repetition_penalty": 1.3}, ids(50), ids(9), []),
        ({"repetition_penalty": 0.7, "frequency_penalty": 0.4}, ids(20), ids(30), []),
        ({"presence_penalty": -1.5}, ids(5), ids(12), []),
        ({}, ids(10), ids(3), []),  # nothing to apply: the row stays as it is
        (
            {"frequency_penalty": 1.1, "presence_penalty": 0.3, "repetition_penalty": 1.05},
            ids(64),
            ids(64),
            [],
        ),  # fmt: skip
        ({"min_tokens": 5, "max_tokens": 9, "repetition_penalty": 1.2}, ids(8), ids(2), [4, 7]),
        ({"repetition_penalty": 1e-38}, ids(8), ids(4), []),  # to +-inf, then clamped
        ({"min_tokens": 2, "max_tokens": 9}, ids(8), ids(3), [4]),  # min_tokens already met
        ({"repetition_penalty": 1.3}, [5, vocab + 3], [], []),  # a bad id fails its row alone
    ]
    states = [
        SamplingState(SamplingParams(temperature=1.0, **kw), prompt, out)
        for kw, prompt, out, _ in rows
    ]
    logits = torch.randn(len(rows) + 1, vocab, generator=gen) * 5  # + a row not penalised
    want = logits.clone()
    for i, (state, row) in enumerate(zip(states[:-1], rows[:-1])):
        _penalise_row(want[i], state, row[3])
    got = logits.clone()
    errors = apply_penalties(got, list(range(len(rows))), states, [r[3] for r in rows])
    assert list(errors) == [len(rows) - 1] and "ValueError" in errors[len(rows) - 1]
    assert torch.equal(got[:-2], want[:-2])  # bit for bit
    assert torch.equal(got[-1], logits[-1]) and torch.equal(got[3], logits[3])
    assert torch.isinf(got[5, [4, 7]]).all() and not torch.isinf(got[7]).any()


def _with_rows(states: list[SamplingState], tables: PenaltyRows) -> list[SamplingState]:
    """Copies of states, each holding a row of tables (as the model runner gives them)."""
    copies = []
    for s in states:
        c = SamplingState(s.params, list(s.prompt_token_ids), list(s.output_token_ids))
        if uses_penalty_rows(c.params):
            tables.take(c)
        copies.append(c)
    return copies


def test_penalty_rows_equal_the_token_lists_step_after_step() -> None:
    """The runner's rows (filled once, then given each step's new tokens) penalise as the
    token lists do, bit for bit, while requests come and go and rows are reused."""
    vocab, gen = 300, torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 40, (n,), generator=gen).tolist()

    kinds = [
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.7, "frequency_penalty": 0.4},
        {"presence_penalty": -1.5},
        {"frequency_penalty": 1.1, "presence_penalty": 0.3, "repetition_penalty": 1.05},
        {"min_tokens": 3, "max_tokens": 9, "repetition_penalty": 1.2},
        {},
    ]
    tables = PenaltyRows(torch.device("cpu"))
    lists = [SamplingState(SamplingParams(temperature=1.0, **kw), ids(30), []) for kw in kinds]
    tabled = _with_rows(lists, tables)
    stops = [[4, 7]] * len(kinds)
    for step in range(6):
        if step == 3:  # the first request finishes; a new one takes its (zeroed) row
            tables.release(tabled[0])
            lists[0] = SamplingState(SamplingParams(temperature=1.0, repetition_penalty=1.4),
                                     ids(7), [])  # fmt: skip
            tabled[0] = _with_rows([lists[0]], tables)[0]
        logits = torch.randn(len(kinds), vocab, generator=gen) * 5
        want, got = logits.clone(), logits.clone()
        rows = list(range(len(kinds)))
        assert not apply_penalties(want, rows, lists, stops)
        assert not apply_penalties(got, rows, tabled, stops, tables)
        assert torch.equal(got, want), f"step {step}"
        for a, b in zip(lists, tabled):  # this step's sampled token, on both sides
            token = ids(1)
            a.output_token_ids.extend(token)
            b.output_token_ids.extend(token)
    assert tabled[0].penalty_row is not None and tabled[0].penalty_row.row == 0  # reused


def test_penalty_rows_take_only_new_tokens_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's table work grows with the tokens its requests gained, not with their context:
    a 4,000-token prompt is scattered once, then one token a step."""
    import infer8.worker.penalties as penalties

    tables = PenaltyRows(torch.device("cpu"))
    state = SamplingState(SamplingParams(repetition_penalty=1.1, frequency_penalty=0.2),
                          list(range(4000)), [])  # fmt: skip
    tables.take(state)
    scattered: list[int] = []
    real = penalties.torch.from_numpy

    def spy(array):  # type: ignore[no-untyped-def]
        scattered.append(len(array))
        return real(array)

    monkeypatch.setattr(penalties.torch, "from_numpy", spy)
    for token in (5, 9, 9, 4001, None):
        tables.sync([state], 5000)
        if token is not None:
            state.output_token_ids.append(token)
    assert scattered == [4000, 1, 1, 1, 1]
    assert tables.seen is not None and tables.counts is not None
    assert int(tables.seen[0].sum()) == 4001 and bool(tables.seen[0, 4001])
    assert int(tables.counts[0, 9]) == 2 and int(tables.counts[0].sum()) == 4


def test_rows_outside_the_tables_take_the_token_lists() -> None:
    """A draft row (a copy with drafts appended) and a request whose prompt holds an id
    outside the vocabulary leave the tables: the first is penalised from its lists, drafts
    included; the second fails alone, as before."""
    vocab = 50
    tables = PenaltyRows(torch.device("cpu"))
    base = _with_rows([SamplingState(SamplingParams(repetition_penalty=2.0), [1, 2], [3])],
                      tables)[0]  # fmt: skip
    draft = dataclasses.replace(base, output_token_ids=[*base.output_token_ids, 40])
    assert base.penalty_row is not None and draft.penalty_row is None
    bad = _with_rows([SamplingState(SamplingParams(repetition_penalty=2.0), [1, vocab + 5], [])],
                     tables)[0]  # fmt: skip
    logits = torch.full((3, vocab), 4.0)
    errors = apply_penalties(logits, [0, 1, 2], [base, draft, bad], [[], [], []], tables)
    assert list(errors) == [2] and bad.penalty_row is None
    assert logits[0, 40] == 4.0 and logits[1, 40] == 2.0  # the draft's token, in its row only
    assert (logits[:2, [1, 2, 3]] == 2.0).all()
