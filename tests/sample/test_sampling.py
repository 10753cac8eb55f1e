"""Tests for sampling params, the batched sampler (penalties, filters, seeded draws), logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from deltaspec.errors import DeltaspecError
from deltaspec.sample.logprobs import Logprob, gather_logprobs
from deltaspec.sample.params import SamplingParams
from deltaspec.sample.sampler import apply_penalties, make_generator, processed_probs, sample

# ---------------------------------------------------------------- params


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("n", {"n": 0}),
        ("temperature", {"temperature": -1}),
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": 2.5}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -2}),
        ("top_k", {"top_k": 2.5}),
        ("min_p", {"min_p": 1.5}),
        ("min_p", {"min_p": -0.1}),
        ("max_tokens", {"max_tokens": 0}),
        ("min_tokens", {"min_tokens": -1}),
        ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
        ("stop", {"stop": [""]}),
        ("stop", {"stop": 7}),
        ("stop_token_ids", {"stop_token_ids": [-1]}),
        ("stop_token_ids", {"stop_token_ids": ["a"]}),
        ("ignore_eos", {"ignore_eos": "yes"}),
        ("seed", {"seed": 2**64}),
        ("seed", {"seed": 1.5}),
        ("logprobs", {"logprobs": -1}),
        ("prompt_logprobs", {"prompt_logprobs": -1}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("repetition_penalty", {"repetition_penalty": 1e-300}),
        ("repetition_penalty", {"repetition_penalty": 101.0}),
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("frequency_penalty", {"frequency_penalty": -3}),
        ("skip_special_tokens", {"skip_special_tokens": None}),
    ],
)
def test_params_reject_bad_values_with_one_sentence(field: str, kwargs: dict) -> None:
    with pytest.raises(DeltaspecError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{field} must be "), message
    assert f"got {kwargs[field]!r}." in message, message
    assert message.endswith(".") and ". " not in message, message


def test_params_normalise() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(3, 4), top_k=-1)
    assert p.stop == ["###"]
    assert p.stop_token_ids == [3, 4]
    assert p.top_k == 0
    q = SamplingParams()
    assert q.stop == [] and q.stop_token_ids == []
    assert (q.n, q.temperature, q.top_p, q.max_tokens, q.logprobs) == (1, 1.0, 1.0, 16, None)


def test_greedy_threshold() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert not SamplingParams().greedy


# ---------------------------------------------------------------- filtering and drawing


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()[None]  # [1, V]


def test_greedy_picks_first_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [5.0, 1.0, 5.0, 0.0]])  # [2, 4]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-7)]
    tokens = sample(logits, params, [make_generator(0, "cpu"), None])
    assert tokens.dtype == torch.long and tokens.tolist() == [1, 0]
    probs = processed_probs(logits, params)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_greedy_rows_in_mixed_batch() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))  # [6, 40]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(6)]
    gens = [make_generator(i, "cpu") for i in range(6)]
    tokens = sample(logits, params, gens)
    assert tokens[1::2].tolist() == logits.argmax(-1)[1::2].tolist()


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))  # [8, 50]
    params = [SamplingParams(temperature=0.7, top_k=1)] * 8
    for seed in range(5):
        tokens = sample(logits, params, [make_generator(seed * 8 + i, "cpu") for i in range(8)])
        assert tokens.tolist() == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_max() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))  # [4, 30]
    params = [SamplingParams(temperature=2.0, top_p=1e-6)] * 4
    probs = processed_probs(logits, params)
    expected = torch.nn.functional.one_hot(logits.argmax(-1), 30).float()
    assert torch.equal(probs, expected)
    tokens = sample(logits, params, [make_generator(i, "cpu") for i in range(4)])
    assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, [0.5, 0.3, 0.15, 0.05]),
        ({"top_k": 2}, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        ({"top_p": 0.7}, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        ({"top_p": 0.85}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        ({"min_p": 0.2}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        ({"min_p": 0.5}, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
        ({"top_k": 3, "top_p": 0.99, "min_p": 0.35}, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
    ],
)
def test_filters_by_hand(kwargs: dict, expected: list[float]) -> None:
    probs = processed_probs(_logits_of([0.15, 0.5, 0.05, 0.3]), [SamplingParams(**kwargs)])
    # Token order in the vocabulary is [2nd-least, most, least, 2nd-most]; undo that for the check.
    got = probs[0, [1, 3, 0, 2]]
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6), got


def test_temperature_scales_logits() -> None:
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(4))  # [2, 20]
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=2.0)]
    probs = processed_probs(logits, params)
    assert torch.allclose(probs[0], torch.softmax(logits[0] / 0.5, -1), atol=1e-6)
    assert torch.allclose(probs[1], torch.softmax(logits[1] / 2.0, -1), atol=1e-6)


def test_processed_probs_rows_sum_to_one_and_zero_where_filtered() -> None:
    vocab = 64
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(5)) * 3  # [5, 64]
    params = [
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.6, temperature=0.8),
        SamplingParams(min_p=0.1),
        SamplingParams(temperature=0.0),
        SamplingParams(),
    ]
    probs = processed_probs(logits, params)  # [5, 64]
    assert probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(5), atol=1e-6)
    order = logits.argsort(-1, descending=True)  # [5, 64]

    assert set((probs[0] > 0).nonzero().flatten().tolist()) == set(order[0, :5].tolist())

    kept = (probs[1] > 0).nonzero().flatten().tolist()
    full = torch.softmax(logits[1] / 0.8, -1)
    prefix = order[1, : len(kept)]
    assert set(kept) == set(prefix.tolist())
    assert full[prefix].sum() >= 0.6 > full[prefix[:-1]].sum()

    full = torch.softmax(logits[2], -1)
    assert torch.equal(probs[2] > 0, full >= 0.1 * full.max())

    assert probs[3].tolist() == torch.nn.functional.one_hot(logits[3].argmax(), vocab).tolist()
    assert (probs[4] > 0).all()


def test_sampling_frequencies_match_processed_distribution() -> None:
    # Raw probabilities; at temperature 0.8 with min_p 0.1 the last token is filtered out.
    logits = _logits_of([0.4, 0.25, 0.2, 0.1, 0.05])  # [1, 5]
    params = SamplingParams(temperature=0.8, min_p=0.1)
    expected = processed_probs(logits, [params])[0].double()  # [5]
    assert expected[4] == 0 and (expected[:4] > 0).all()

    draws = 20000
    generator = make_generator(1234, "cpu")  # one request's generator, advanced row after row
    tokens = sample(logits.expand(draws, 5), [params] * draws, [generator] * draws)
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[4] == 0
    want = expected[:4] * draws
    chi2 = float(((counts[:4] - want) ** 2 / want).sum())
    assert chi2 < 16.266, (counts.tolist(), want.tolist())  # chi-square, 3 dof, p = 0.001

    torch.manual_seed(99)  # rows without a generator draw from torch's default generator
    tokens = sample(logits.expand(draws, 5), [params] * draws, [None] * draws)
    counts = torch.bincount(tokens, minlength=5).double()
    chi2 = float(((counts[:4] - want) ** 2 / want).sum())
    assert counts[4] == 0 and chi2 < 16.266, (counts.tolist(), want.tolist())


def _run_steps(rows: list[tuple[torch.Tensor, SamplingParams, int | None]], steps: int) -> list[list[int]]:
    gens = [None if seed is None else make_generator(seed, "cpu") for _, _, seed in rows]
    logits = torch.stack([row_logits for row_logits, _, _ in rows])  # [B, V]
    params = [p for _, p, _ in rows]
    return [sample(logits, params, gens).tolist() for _ in range(steps)]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    rng = torch.Generator().manual_seed(6)
    a, b, c = (torch.randn(1000, generator=rng) for _ in range(3))  # [V] each
    request = SamplingParams(temperature=1.0, top_p=0.95, seed=123)
    alone = [step[0] for step in _run_steps([(a, request, 123)], 12)]
    first = _run_steps(
        [(b, SamplingParams(temperature=0.7), 5), (a, request, 123), (c, SamplingParams(), None)],
        12,
    )
    second = _run_steps(
        [
            (c, SamplingParams(temperature=0.0), None),
            (b, SamplingParams(top_k=3), 77),
            (c, SamplingParams(min_p=0.05), None),
            (a, request, 123),
        ],
        12,
    )
    assert [step[1] for step in first] == alone
    assert [step[3] for step in second] == alone
    other = [step[0] for step in _run_steps([(a, request, 124)], 12)]
    assert other != alone


def test_unseeded_generators_differ() -> None:
    first = torch.rand(8, generator=make_generator(None, "cpu"))
    second = torch.rand(8, generator=make_generator(None, "cpu"))
    assert not torch.equal(first, second)
    assert torch.equal(
        torch.rand(8, generator=make_generator(7, "cpu")),
        torch.rand(8, generator=make_generator(7, "cpu")),
    )


# ---------------------------------------------------------------- penalties


def test_penalties_match_hand_computation() -> None:
    row = [2.0, -1.0, 0.5, 3.0, -0.5, 1.0]
    logits = torch.tensor([row, row, row])  # [3, 6]
    before = logits.clone()
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
        SamplingParams(frequency_penalty=1.0, presence_penalty=-0.5),
    ]
    prompt = [[0, 1], [0, 1], [0, 1]]
    output = [[3, 3, 4], [3, 3, 4], [3, 3, 4]]
    out = apply_penalties(logits, prompt, output, params, [frozenset()] * 3)
    # Row 0: seen = {0, 1, 3, 4}; positives halved, negatives doubled; then counts and presence.
    expected0 = [1.0, -2.0, 0.5, 1.5 - 0.5 * 2 - 0.25, -1.0 - 0.5 * 1 - 0.25, 1.0]
    # Row 2: no repetition penalty, so prompt tokens are untouched.
    expected2 = [2.0, -1.0, 0.5, 3.0 - 2.0 + 0.5, -0.5 - 1.0 + 0.5, 1.0]
    assert torch.allclose(out[0], torch.tensor(expected0))
    assert torch.equal(out[1], logits[1])
    assert torch.allclose(out[2], torch.tensor(expected2))
    assert torch.equal(logits, before)


def test_neutral_penalties_return_input() -> None:
    logits = torch.randn(2, 10)  # [2, 10]
    out = apply_penalties(logits, [[1, 2], [3]], [[4], []], [SamplingParams(), SamplingParams()], [frozenset({0})] * 2)
    assert out is logits


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(3, 8)  # [3, 8]
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[2]),
        SamplingParams(min_tokens=3, stop_token_ids=[2]),
        SamplingParams(),
    ]
    eos = [frozenset({5, 100}), frozenset({5}), frozenset({5})]
    out = apply_penalties(logits, [[1], [1], [1]], [[0], [0, 1, 6], []], params, eos)
    assert torch.isinf(out[0, [2, 5]]).all() and (out[0, [2, 5]] < 0).all()
    assert torch.isfinite(out[0, [0, 1, 3, 4, 6, 7]]).all()
    assert torch.equal(out[1:], logits[1:])
    gens = [make_generator(i, "cpu") for i in range(3)]
    tokens = sample(out, [SamplingParams(temperature=1.0)] * 3, gens)
    assert tokens[0].item() not in (2, 5)


# ---------------------------------------------------------------- logprobs


def _reference_ranks(row: torch.Tensor) -> dict[int, int]:
    order = sorted(range(row.numel()), key=lambda t: (-row[t].item(), t))
    return {token: position + 1 for position, token in enumerate(order)}


def test_gather_logprobs_values_and_ranks() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(8))  # [4, 30]
    logits[0, [3, 7, 11]] = 5.0  # a three-way tie at the top
    logits[3, [2, 9, 20, 25]] = -1.25  # a tie in the middle
    chosen = torch.tensor([11, 0, 4, 20])
    result = gather_logprobs(logits, chosen, [2, None, 0, 30])
    reference = torch.log_softmax(logits, -1)
    assert result[1] is None

    row0 = result[0]
    assert row0 is not None and list(row0) == [11, 3, 7]
    assert row0[3].rank == 1 and row0[7].rank == 2 and row0[11].rank == 3
    assert list(result[2]) == [4]
    assert len(result[3]) == 30

    for i in (0, 2, 3):
        ranks = _reference_ranks(reference[i])
        entry = result[i]
        assert entry is not None
        for token, lp in entry.items():
            assert isinstance(lp, Logprob) and lp.decoded_token is None
            assert lp.rank == ranks[token]
            assert math.isclose(lp.logprob, reference[i, token].item(), abs_tol=1e-6)
    after_chosen = [lp.rank for lp in list(result[3].values())[1:]]
    assert after_chosen == [r for r in range(1, 31) if r != result[3][20].rank]


def test_gather_logprobs_float64_stays_float64() -> None:
    logits = torch.randn(2, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    chosen = torch.tensor([4, 40])
    result = gather_logprobs(logits, chosen, [5, 1])
    reference = torch.log_softmax(logits, -1)  # [2, 50] float64
    for i, entry in enumerate(result):
        assert entry is not None
        for token, lp in entry.items():
            assert abs(lp.logprob - reference[i, token].item()) < 1e-12

    half = logits.to(torch.bfloat16)
    result = gather_logprobs(half, chosen, [1, 1])
    reference = torch.log_softmax(half.float(), -1)
    assert result[0] is not None
    for token, lp in result[0].items():
        assert lp.logprob == reference[0, token].item()
