"""SamplingParams validation and the sampler's behaviour on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from infer8.sampling_params import SamplingParams
from infer8.worker.sampler import Sampler, SamplingState


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
    tokens, _ = Sampler(torch.device("cpu"), 0)(
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
    tokens, lps = Sampler(torch.device("cpu"), 0)(logits, [_state(temperature=0.0, logprobs=2)], [])
    ref = torch.log_softmax(logits[0], dim=-1)
    sampled_lp, top = lps[0]  # type: ignore[misc]
    assert tokens == [1]
    assert math.isclose(sampled_lp, ref[1].item(), rel_tol=1e-6)
    assert [t for t, _ in top] == [1, 2]
    assert math.isclose(top[1][1], ref[2].item(), rel_tol=1e-6)
