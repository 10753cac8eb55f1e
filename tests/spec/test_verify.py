"""Tests for draft verification: greedy equals step-by-step argmax, and rejection sampling is lossless.

The statistical tests use fixed seeds, so they are deterministic; their thresholds are chi-square
critical values at alpha = 0.001, and each one is checked to reject a plausible buggy verifier.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from deltaspec.sample.params import SamplingParams
from deltaspec.sample.sampler import make_generator, processed_probs
from deltaspec.spec.verify import VerifyResult, verify_greedy, verify_greedy_tokens, verify_sampling

# Upper 0.1% points of the chi-square distribution by degrees of freedom (scipy is not installed;
# computed once with mpmath).
CHI2_999 = {
    1: 10.828,
    2: 13.816,
    3: 16.266,
    4: 18.467,
    5: 20.515,
    6: 22.458,
    7: 24.322,
    8: 26.124,
    9: 27.877,
    10: 29.588,
    11: 31.264,
    12: 32.909,
    13: 34.528,
    14: 36.123,
    15: 37.697,
    16: 39.252,
    17: 40.79,
    18: 42.312,
    19: 43.82,
    20: 45.315,
    21: 46.797,
    22: 48.268,
    23: 49.728,
    24: 51.179,
    25: 52.62,
    26: 54.052,
    27: 55.476,
    28: 56.892,
    29: 58.301,
    30: 59.703,
}

V = 5
START = V  # the "previous token" index of the first position in the toy tables
GREEDY = SamplingParams(temperature=0.0)
PLAIN = SamplingParams(temperature=1.0)


# ---------------------------------------------------------------- helpers


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom of `counts` [V] against `probs` [V].

    Cells with zero probability must have zero counts (checked); they add no degree of freedom.
    """
    counts = counts.double()
    probs = probs.double()
    support = probs > 0
    assert counts[~support].sum().item() == 0, (counts, probs)
    expected = counts.sum() * probs[support]
    assert expected.min().item() >= 5, "too few samples for a chi-square test"
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum().item()) - 1


def assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> float:
    stat, df = chi_square(counts, probs)
    assert stat < CHI2_999[df], f"chi2 {stat:.1f} >= {CHI2_999[df]} (df {df}): {counts} vs {probs}"
    return stat


def assert_differs(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """The test has power: the same counts reject a distribution a buggy verifier would give."""
    counts = counts.double()
    expected = counts.sum() * probs.double()
    stat = ((counts - expected) ** 2 / expected.clamp_min(1e-12)).sum().item()
    assert stat > CHI2_999[V - 1], (stat, counts, probs)


def counts_of(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=V)


def toy_tables(seed: int, params: SamplingParams, scale: float = 1.5):
    """Target logits and processed target / draft distributions indexed by the previous token.

    Row `START` is the first position. Returns (target logits [V+1, V], p [V+1, V], q [V+1, V]).
    """
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V + 1, V, generator=g, dtype=torch.float64) * scale
    drafter = target + torch.randn(V + 1, V, generator=g, dtype=torch.float64) * scale
    rows = [params] * (V + 1)
    return target, processed_probs(target, rows), processed_probs(drafter, rows)


def run_trials(
    target: torch.Tensor,
    q: torch.Tensor | None,
    params: SamplingParams,
    k: int,
    trials: int,
    seed: int,
    per_sequence_generators: bool,
    fixed_drafts: list[int] | None = None,
) -> VerifyResult:
    """One verify call over `trials` independent sequences of a toy Markov chain.

    The target's row for a position is `target[previous token]`; drafts are drawn from
    `q[previous draft]` (or are `fixed_drafts`, a deterministic drafter, when q is None).
    """
    g = torch.Generator().manual_seed(seed)
    if q is None:
        assert fixed_drafts is not None and len(fixed_drafts) == k
        drafts = torch.tensor(fixed_drafts, dtype=torch.long).expand(trials, k)
    else:
        columns = []
        previous = torch.full((trials,), START, dtype=torch.long)
        for _ in range(k):
            previous = torch.multinomial(q[previous], 1, generator=g).squeeze(1)
            columns.append(previous)
        drafts = torch.stack(columns, dim=1) if k else torch.empty(trials, 0, dtype=torch.long)
    contexts = torch.cat([torch.full((trials, 1), START, dtype=torch.long), drafts], dim=1)
    target_rows = target[contexts]  # [trials, k + 1, V]
    draft_rows = None if q is None else q[contexts[:, :k]]  # [trials, k, V]
    if per_sequence_generators:
        generators = [make_generator(seed * 100_003 + t, "cpu") for t in range(trials)]
    else:
        torch.manual_seed(seed)
        generators = [None] * trials
    return verify_sampling(
        list(target_rows),
        drafts.tolist(),
        [None] * trials if draft_rows is None else list(draft_rows),
        [params] * trials,
        generators,
    )


def check_lossless(result: VerifyResult, p: torch.Tensor) -> None:
    """First token ~ p[START]; second token given first x (same call) ~ p[x]; counters agree."""
    assert all(len(t) == a + 1 for t, a in zip(result.tokens, result.accepted))
    assert_matches(counts_of([t[0] for t in result.tokens]), p[START])
    stat, df, groups = 0.0, 0, 0
    for x in range(V):
        seconds = [t[1] for t in result.tokens if len(t) >= 2 and t[0] == x]
        if len(seconds) * p[x][p[x] > 0].min().item() >= 5:  # enough for a chi-square test
            s, d = chi_square(counts_of(seconds), p[x])
            stat, df, groups = stat + s, df + d, groups + 1
    assert groups >= 1
    assert stat < CHI2_999[df], (stat, df)


# ---------------------------------------------------------------- greedy


def logits_with_argmax(argmaxes: list[int], vocab: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(argmaxes), vocab, generator=g)
    x[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = x.abs().max() + 1.0
    return x


@pytest.mark.parametrize(
    ("argmaxes", "drafts", "tokens"),
    [
        ([3, 1, 4, 6], [3, 1, 4], [3, 1, 4, 6]),  # all accepted + bonus
        ([2, 1, 4, 6], [3, 1, 4], [2]),  # first rejected
        ([3, 5, 4, 6], [3, 1, 4], [3, 5]),  # middle rejected
        ([3, 1, 0, 6], [3, 1, 4], [3, 1, 0]),  # last rejected
        ([7], [], [7]),  # k = 0
    ],
)
def test_greedy_cases(argmaxes, drafts, tokens) -> None:
    result = verify_greedy([logits_with_argmax(argmaxes)], [drafts])
    assert result.tokens == [tokens]
    assert result.accepted == [len(tokens) - 1]


def test_greedy_ties_take_the_first_index() -> None:
    row = torch.tensor([0.0, 2.0, 1.0, 2.0, 2.0])
    logits = torch.stack([row, row])  # argmax of each row is 1 (first of the tied maxima)
    assert verify_greedy([logits], [[3]]).tokens == [[1]]  # tied but not first: rejected
    assert verify_greedy([logits], [[1]]).tokens == [[1, 1]]
    assert verify_greedy([logits[:1]], [[]]).tokens == [[1]]


def test_greedy_mixed_batch_equals_each_sequence_alone() -> None:
    cases = [
        ([3, 1, 4, 6], [3, 1, 4]),
        ([7], []),
        ([2, 1, 4, 6, 0], [3, 1, 4, 6]),
        ([5, 5], [5]),
        ([0, 2, 2], [0, 1]),
    ]
    logits = [logits_with_argmax(a, seed=i) for i, (a, _) in enumerate(cases)]
    drafts = [d for _, d in cases]
    batched = verify_greedy(logits, drafts)
    alone = [verify_greedy([rows], [d]) for rows, d in zip(logits, drafts)]
    assert batched.tokens == [r.tokens[0] for r in alone]
    assert batched.tokens == [[3, 1, 4, 6], [7], [2], [5, 5], [0, 2]]
    assert batched.accepted == [3, 0, 0, 1, 1]
    assert verify_greedy([], []) == VerifyResult(tokens=[], accepted=[])


class ToyModel:
    """A deterministic 'language model' over a small vocabulary with frequent argmax ties."""

    def __init__(self, vocab: int = 6, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        # Logits depend on the last two tokens; small integers make ties common.
        self.table = torch.randint(0, 3, (vocab, vocab, vocab), generator=g).double()
        self.vocab = vocab

    def logits(self, sequence: list[int]) -> torch.Tensor:
        return self.table[sequence[-2], sequence[-1]]


def test_greedy_speculation_equals_step_by_step_argmax() -> None:
    model = ToyModel()
    rng = random.Random(0)
    prompts = [[0, 1], [2, 2], [5, 3], [4, 0]]
    length = 60
    reference = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(length + 6):  # a round may overshoot `length` by up to k = 5 tokens
            seq.append(int(torch.argmax(model.logits(seq))))
        reference.append(seq[len(prompt) :])

    sequences = [list(p) for p in prompts]
    accepted_total = 0
    while True:
        active = [b for b in range(len(prompts)) if len(sequences[b]) - len(prompts[b]) < length]
        if not active:
            break
        drafts = []
        for b in active:
            # Drafts: the true continuation with random corruptions, of random length (0 allowed).
            done = len(sequences[b]) - len(prompts[b])
            truth = reference[b][done : done + rng.randint(0, 5)]
            drafts.append([t if rng.random() < 0.7 else rng.randrange(model.vocab) for t in truth])
        target_logits = [
            torch.stack([model.logits(sequences[b] + d[:i]) for i in range(len(d) + 1)]) for b, d in zip(active, drafts)
        ]
        result = verify_greedy(target_logits, drafts)
        for b, new in zip(active, result.tokens):
            sequences[b].extend(new)
        accepted_total += sum(result.accepted)
    for seq, prompt, ref in zip(sequences, prompts, reference):
        out = seq[len(prompt) :]
        assert len(out) >= length
        assert out == ref[: len(out)]
    assert accepted_total > 0


def test_sampling_with_greedy_params_equals_verify_greedy_and_draws_nothing() -> None:
    model = ToyModel(seed=3)
    rng = random.Random(1)
    target_logits, drafts, draft_probs = [], [], []
    for b in range(8):
        seq = [b % 6, (b * 5) % 6]
        k = b % 4
        d = [rng.randrange(6) for _ in range(k)]
        if b % 2:  # some drafts equal the argmax so that acceptances happen
            d = []
            for _ in range(k):
                d.append(int(torch.argmax(model.logits(seq + d))))
            if d:
                d[-1] = (d[-1] + b) % 6
        drafts.append(d)
        target_logits.append(torch.stack([model.logits(seq + d[:i]) for i in range(len(d) + 1)]))
        draft_probs.append(torch.softmax(torch.randn(k, 6, dtype=torch.float64), -1))
    generators = [make_generator(b, "cpu") for b in range(8)]
    states = [g.get_state() for g in generators]
    global_state = torch.get_rng_state()
    expected = verify_greedy(target_logits, drafts)
    assert sum(expected.accepted) > 0
    for gens, probs in [(generators, draft_probs), ([None] * 8, [None] * 8)]:
        result = verify_sampling(target_logits, drafts, probs, [GREEDY] * 8, gens)
        assert result == expected
    assert all(torch.equal(g.get_state(), s) for g, s in zip(generators, states))
    # An all-greedy call leaves torch's default generator alone.
    torch.set_rng_state(global_state)
    verify_sampling(target_logits, drafts, draft_probs, [GREEDY] * 8, [None] * 8)
    assert torch.equal(torch.get_rng_state(), global_state)
    # Greedy rows mixed with sampled rows give verify_greedy's tokens and draw nothing; the
    # sampled rows draw from their own generators only.
    params = [GREEDY if b % 2 == 0 else PLAIN for b in range(8)]
    mixed = verify_sampling(target_logits, drafts, draft_probs, params, generators)
    for b in range(8):
        unchanged = torch.equal(generators[b].get_state(), states[b])
        assert unchanged == params[b].greedy, b
        if params[b].greedy:
            assert mixed.tokens[b] == expected.tokens[b]
    assert torch.equal(torch.get_rng_state(), global_state)


# ---------------------------------------------------------------- lossless sampling


@pytest.mark.parametrize("per_sequence_generators", [False, True])
def test_rejection_sampling_is_lossless(per_sequence_generators: bool) -> None:
    target, p, q = toy_tables(seed=4, params=PLAIN)
    trials = 20_000
    result = run_trials(target, q, PLAIN, k=3, trials=trials, seed=7, per_sequence_generators=per_sequence_generators)
    rate = sum(a > 0 for a in result.accepted) / trials
    assert 0.2 < rate < 0.9, f"acceptance should be partial, got {rate}"
    check_lossless(result, p)
    first = counts_of([t[0] for t in result.tokens])
    # Power: a verifier that always accepted would emit q; one resampling from p on rejection
    # would emit min(p, q) + (1 - sum min(p, q)) * p.
    overlap = torch.minimum(p[START], q[START])
    assert_differs(first, q[START])
    assert_differs(first, overlap + (1 - overlap.sum()) * p[START])


def test_two_token_joint_distribution_matches_sequential_sampling() -> None:
    """Completing one-token rounds with a plain draw, (t0, t1) ~ p[START](t0) * p[t0](t1)."""
    target, p, q = toy_tables(seed=2, params=PLAIN)
    trials = 20_000
    result = run_trials(target, q, PLAIN, k=2, trials=trials, seed=11, per_sequence_generators=False)
    g = torch.Generator().manual_seed(5)
    joint = torch.zeros(V, V)
    for tokens in result.tokens:
        t0 = tokens[0]
        t1 = tokens[1] if len(tokens) > 1 else int(torch.multinomial(p[t0], 1, generator=g))
        joint[t0, t1] += 1
    expected = p[START][:, None] * p[:V]
    assert_matches(joint.flatten(), expected.flatten())
    independent = p[START][:, None] * p[START][None, :]  # a wrong conditional is detected
    stat = ((joint.flatten() - trials * independent.flatten()) ** 2 / (trials * independent.flatten())).sum().item()
    assert stat > CHI2_999[24]


def test_lossless_with_temperature_top_k_top_p() -> None:
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.95)
    target, p, q = toy_tables(seed=6, params=params, scale=1.0)
    assert ((p[START] > 0) != (q[START] > 0)).any(), "supports should differ to exercise residuals"
    assert (p[START] == 0).any()
    result = run_trials(target, q, params, k=3, trials=20_000, seed=13, per_sequence_generators=False)
    check_lossless(result, p)
    # The unfiltered target distribution is not what comes out.
    raw = torch.softmax(target[START], -1)
    assert_differs(counts_of([t[0] for t in result.tokens]), raw)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_acceptance_rate_is_the_overlap(seed: int) -> None:
    target, p, q = toy_tables(seed=seed, params=PLAIN)
    trials = 20_000
    result = run_trials(target, q, PLAIN, k=1, trials=trials, seed=seed, per_sequence_generators=False)
    beta = torch.minimum(p[START], q[START]).sum().item()
    rate = sum(result.accepted) / trials
    assert abs(rate - beta) < 4 * math.sqrt(beta * (1 - beta) / trials), (rate, beta)


def test_deterministic_drafter_accepts_with_p_of_the_draft_and_stays_lossless() -> None:
    target, p, _ = toy_tables(seed=6, params=PLAIN)
    d0 = int(torch.argsort(p[START], descending=True)[1])  # a likely but not the likeliest token
    d1 = int(torch.argmax(p[d0]))
    trials = 20_000
    result = run_trials(
        target, None, PLAIN, k=2, trials=trials, seed=17, per_sequence_generators=False, fixed_drafts=[d0, d1]
    )
    first_accept = sum(a >= 1 for a in result.accepted) / trials
    beta = p[START, d0].item()
    assert abs(first_accept - beta) < 4 * math.sqrt(beta * (1 - beta) / trials)
    both = sum(a == 2 for a in result.accepted) / trials
    beta2 = beta * p[d0, d1].item()
    assert abs(both - beta2) < 4 * math.sqrt(beta2 * (1 - beta2) / trials)
    check_lossless(result, p)
    # Rejected rounds never emit the rejected draft as the replacement.
    assert all(t[0] != d0 for t, a in zip(result.tokens, result.accepted) if a == 0)


def test_deterministic_drafter_with_certain_target_always_accepts() -> None:
    logits = torch.tensor([[0.0, 50.0, 0.0], [0.0, 0.0, 50.0], [60.0, 0.0, 0.0]], dtype=torch.float64)
    result = verify_sampling([logits], [[1, 2]], [None], [PLAIN], [make_generator(0, "cpu")])
    assert result.tokens == [[1, 2, 0]] and result.accepted == [2]


def test_residual_falls_back_to_p_when_it_is_all_zero() -> None:
    # q >= p everywhere (only possible when q does not sum to 1, e.g. by rounding): a rejection
    # leaves an all-zero residual, and the replacement must then come from p, not be token 0.
    logits = torch.log(torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64))
    q = torch.tensor([[0.6, 0.6, 0.0]], dtype=torch.float64)
    replacements = []
    for seed in range(300):
        result = verify_sampling([logits], [[1]], [q], [PLAIN], [make_generator(seed, "cpu")])
        if result.accepted == [0]:
            replacements.append(result.tokens[0][0])
    assert 20 < len(replacements) < 100  # rejected with probability 1 - 0.5 / 0.6
    assert set(replacements) == {0, 1}


def test_draft_outside_target_support_is_always_rejected() -> None:
    # p[d] = 0: always rejected, and the replacement is drawn from p (the residual is p here).
    logits = torch.tensor([[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    seen = set()
    for seed in range(200):
        result = verify_sampling([logits], [[2]], [q], [PLAIN], [make_generator(seed, "cpu")])
        assert result.accepted == [0]
        seen.add(result.tokens[0][0])
    assert seen == {0, 1}


# ---------------------------------------------------------------- determinism


def _sampled_batch(n: int = 6):
    g = torch.Generator().manual_seed(0)
    target_logits, drafts, draft_probs = [], [], []
    for b in range(n):
        k = b % 4
        target_logits.append(torch.randn(k + 1, 16, generator=g))
        q = torch.softmax(torch.randn(k, 16, generator=g), -1)
        drafts.append(torch.multinomial(q, 1, generator=g).squeeze(1).tolist() if k else [])
        draft_probs.append(q if b % 3 else None)
    return target_logits, drafts, draft_probs


def test_same_seed_same_tokens_in_any_batch_order() -> None:
    target_logits, drafts, draft_probs = _sampled_batch()
    n = len(drafts)
    params = [SamplingParams(temperature=1.3, seed=100 + b) for b in range(n)]

    def run(order: list[int], global_seed: int) -> list[list[int]]:
        torch.manual_seed(global_seed)  # must not matter: each row has its own generator
        result = verify_sampling(
            [target_logits[b] for b in order],
            [drafts[b] for b in order],
            [draft_probs[b] for b in order],
            [params[b] for b in order],
            [make_generator(params[b].seed, "cpu") for b in order],
        )
        return [result.tokens[order.index(b)] for b in range(n)]

    forward = run(list(range(n)), 1)
    assert run(list(reversed(range(n))), 2) == forward
    assert run([3, 0, 5, 1, 4, 2], 3) == forward
    # Alone in its own batch, a sequence gives the same tokens too.
    for b in range(n):
        alone = verify_sampling(
            [target_logits[b]], [drafts[b]], [draft_probs[b]], [params[b]], [make_generator(params[b].seed, "cpu")]
        )
        assert alone.tokens[0] == forward[b]


def test_generator_consumption_order_is_k_uniforms_then_v_exponentials() -> None:
    """Replaying the documented draws by hand predicts every decision and token."""
    g = torch.Generator().manual_seed(9)
    vocab, k = 6, 2
    logits = torch.randn(k + 1, vocab, generator=g)
    q = torch.softmax(torch.randn(k, vocab, generator=g), -1)
    p = processed_probs(logits, [PLAIN] * (k + 1))
    drafts = (q - p[:k]).argmax(-1).tolist()  # q > p there: acceptance is partial
    outcomes = set()
    for seed in range(64):
        replay = make_generator(seed, "cpu")
        uniform = torch.rand(k, generator=replay)
        noise = torch.empty(vocab).exponential_(generator=replay)
        n = 0
        while n < k and uniform[n] * q[n, drafts[n]] < p[n, drafts[n]]:
            n += 1
        if n < k:
            residual = (p[n] - q[n]).clamp_min(0)
            dist = residual / residual.sum()
        else:
            dist = p[k]
        expected = drafts[:n] + [int((dist / noise).argmax())]
        generator = make_generator(seed, "cpu")
        result = verify_sampling([logits], [drafts], [q], [PLAIN], [generator])
        assert result.tokens == [expected] and result.accepted == [n], seed
        assert torch.equal(generator.get_state(), replay.get_state())
        outcomes.add(n)
    assert outcomes == {0, 1, 2}


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, 1000)
    tokens = {
        verify_sampling([logits], [[]], [None], [PLAIN], [make_generator(s, "cpu")]).tokens[0][0] for s in range(10)
    }
    assert len(tokens) > 5


# ---------------------------------------------------------------- validation


def test_shape_mismatches_raise() -> None:
    with pytest.raises(ValueError, match="target_logits\\[0\\]"):
        verify_greedy([torch.zeros(2, 4)], [[1, 2]])
    with pytest.raises(ValueError, match="drafts"):
        verify_greedy([torch.zeros(1, 4)], [[], []])
    with pytest.raises(ValueError, match="outside"):
        verify_greedy([torch.zeros(2, 4)], [[4]])
    with pytest.raises(ValueError, match="draft_probs\\[0\\]"):
        verify_sampling([torch.zeros(2, 4)], [[1]], [torch.ones(2, 4) / 4], [PLAIN], [None])
    with pytest.raises(ValueError, match="params"):
        verify_sampling([torch.zeros(1, 4)], [[]], [None], [], [None])


def test_greedy_verification_from_device_argmax_equals_the_logits_path():
    torch.manual_seed(3)
    drafts = [[], [4, 1, 7], [2, 2], [5, 0, 3, 3]]
    logits = [torch.randn(1 + len(d), 8) for d in drafts]
    for d, rows in zip(drafts, logits):  # make some drafts right, so acceptance varies
        for i, token in enumerate(d[: len(d) // 2 + 1]):
            rows[i, token] += 10.0
    expected = verify_greedy(logits, drafts)
    got = verify_greedy_tokens([rows.argmax(-1).tolist() for rows in logits], drafts)
    assert (
        got == expected and any(expected.accepted) and not all(a == len(d) for a, d in zip(expected.accepted, drafts))
    )
