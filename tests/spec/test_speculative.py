"""Speculative decoding is exact: token-identical greedy output in float64 for any drafts, lossless
sampling, replay-log rollback equal to never having drafted, and determinism per configuration."""

from __future__ import annotations

import pytest
import torch

from deltaspec import LLM, SamplingParams
from deltaspec.spec.drafter import Draft
from deltaspec.spec.policy import FixedDraftLength
from tests.tiny_models import write_checkpoint

PATTERN = [5, 9, 14, 22, 31, 40, 57]
PROMPTS = [PATTERN * 3, [3, 4] + PATTERN * 2 + [8], PATTERN[:4] * 5, [11, 12, 13] * 4 + PATTERN]


class ScriptedDrafter:
    """Drafts from a known continuation: `right` leading tokens correct, then wrong ones."""

    name = "scripted"
    needs_hidden = False

    def __init__(self, continuations: dict[tuple, list[int]], right: int, vocab: int):
        self.continuations, self.right, self.vocab = continuations, right, vocab
        self.commits: list[tuple[str, int, int]] = []

    def propose(self, requests):
        drafts = []
        for req in requests:
            prompt = next(p for p in self.continuations if tuple(req.token_ids[: len(p)]) == p)
            done = len(req.token_ids) - len(prompt)
            truth = self.continuations[prompt][done : done + req.max_tokens]
            tokens = [t if i < self.right else (t + 1) % self.vocab for i, t in enumerate(truth)]
            drafts.append(Draft(tokens=tokens))
        return drafts

    def observe(self, seq_id, first_position, hidden):
        pass

    def on_commit(self, seq_id, accepted, num_tokens):
        self.commits.append((seq_id, accepted, num_tokens))

    def on_finish(self, seq_id):
        pass

    def state_bytes(self):
        return 0


def run(path, prompts, params, **options):
    llm = LLM(str(path), dtype="float64", device="cpu", **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, outs


@pytest.mark.parametrize(
    ("name", "k"),
    [(name, k) for name in ("qwen3_5_r2", "qwen3_next_r3_moe") for k in (1, 3, 7, 15)] + [("qwen3_5_moe_r2", 7)],
)
def test_ngram_greedy_is_token_identical_in_float64(checkpoints, name, k):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    _, plain = run(checkpoints[name], PROMPTS, params)
    _, spec = run(checkpoints[name], PROMPTS, params, speculative="ngram", draft_tokens=k)
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: p.logprob for t, p in x.items()} == pytest.approx({t: p.logprob for t, p in y.items()}, abs=1e-9)
    assert sum(o.metrics.get("spec_rounds", 0) for o in spec) > 0  # drafts were really verified


@pytest.mark.parametrize("right", [0, 2, 100])  # accept none, some, all
def test_rollback_equals_never_having_drafted(checkpoints, right):
    path = checkpoints["qwen3_5_r2"]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1)
    plain_llm, plain = run(path, PROMPTS, params)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, plain)}
    drafter = ScriptedDrafter(truth, right, plain_llm.engine.model_config.vocab_size)
    llm = LLM(str(path), dtype="float64", device="cpu", draft_tokens=5, drafter=drafter)
    assert llm.engine.config.speculation.speculative == "scripted" and llm.engine.plan.cache.log_rows == 6
    spec = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            (tx, px), (ty, py) = next(iter(x.items())), next(iter(y.items()))
            assert tx == ty and px.logprob == pytest.approx(py.logprob, abs=1e-9)
        rounds, accepted = b.metrics["spec_rounds"], b.metrics["spec_accepted_tokens"]
        # greedy verification accepts a draft exactly where it and every draft before it are right: the first
        # `right` positions of every round, none after
        accepted_at = [drafted if i < right else 0 for i, drafted in enumerate(b.metrics["drafted_at"])]
        assert b.metrics["accepted_at"] == accepted_at and accepted == sum(accepted_at) and rounds >= 1
        assert (accepted > 0) == (right > 0)
        if right == 0:  # every draft of every sequence rejected, round after round
            assert accepted == 0 and rounds >= 2
        if right >= 5:
            assert b.metrics["acceptance_length"] >= 4
    assert llm.engine.usage()["state_slots_used"] == 0 and llm.engine.usage()["kv_blocks_used"] == 0
    assert all(0 <= a <= 5 for _, a, _ in drafter.commits)


def test_sequence_finishing_mid_draft_keeps_only_what_it_may(checkpoints):
    path = checkpoints["qwen3_5_r2"]
    plain_llm, plain = run(path, PROMPTS, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, plain)}
    stop_token = plain[0].outputs[0].token_ids[6]
    llm = LLM(
        str(path),
        dtype="float64",
        device="cpu",
        draft_tokens=7,
        drafter=ScriptedDrafter(truth, 100, plain_llm.engine.model_config.vocab_size),
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        [
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_token]),
            SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=11, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        ],
    )
    first = plain[0].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == first[: first.index(stop_token) + 1]
    assert outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].token_ids == plain[1].outputs[0].token_ids[:3]
    assert outs[2].outputs[0].token_ids == plain[2].outputs[0].token_ids[:11]
    assert outs[3].outputs[0].token_ids == plain[3].outputs[0].token_ids
    assert llm.engine.usage()["state_slots_used"] == 0


@pytest.mark.parametrize(
    "speculative,k",
    [
        ("ngram", 7),
        ("draft", 1),
        ("draft", 3),
        ("draft", 7),
        ("draft", 15),
        ("draft+ngram", 5),
        ("mtp", 1),
        ("mtp", 3),
        ("mtp", 7),
        ("mtp", 15),
        ("mtp+ngram", 5),
    ],
)
def test_default_model_greedy_is_identical_with_every_drafter(speculative, k):
    prompts = [
        'def is_prime(n):\n    """Return True if n is a prime number."""\n',
        "import os\n\n\ndef main(",
        "class Stack:\n",
    ]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(dtype="float64", device="cpu").generate(prompts, params)
    spec = LLM(dtype="float64", device="cpu", speculative=speculative, draft_tokens=k).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics["spec_accepted_tokens"] for o in spec) > 0


@pytest.mark.parametrize("speculative", ["draft", "draft+ngram"])
@pytest.mark.parametrize("k", [1, 3, 7, 15])
def test_draft_model_greedy_is_token_identical_on_random_models(checkpoints, tmp_path, k, speculative):
    draft = write_checkpoint(
        tmp_path / "draft", "qwen3_5", seed=5, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]
    )
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    _, plain = run(checkpoints["qwen3_next_r3_moe"], PROMPTS, params)
    _, spec = run(
        checkpoints["qwen3_next_r3_moe"],
        PROMPTS,
        params,
        speculative=speculative,
        draft_tokens=k,
        draft_model=str(draft),
    )
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.get("spec_rounds", 0) for o in spec) > 0


def test_draft_model_errors_are_clear(checkpoints, tmp_path):
    from deltaspec import DeltaspecError

    with pytest.raises(DeltaspecError, match="needs --draft-model"):
        LLM(str(checkpoints["qwen3_5_r2"]), device="cpu", speculative="draft")
    small_vocab = write_checkpoint(tmp_path / "v6", "qwen3_5", seed=1, vocab_size=6)
    with pytest.raises(DeltaspecError, match="must share its tokenizer"):
        LLM(str(checkpoints["qwen3_5_r2"]), device="cpu", speculative="draft", draft_model=str(small_vocab))
    with pytest.raises(DeltaspecError, match="Unknown speculative setting"):
        LLM(str(checkpoints["qwen3_5_r2"]), device="cpu", speculative="eagle")


def test_same_configuration_and_seed_give_identical_output(checkpoints):
    params = [SamplingParams(max_tokens=16, temperature=0.9, seed=s, ignore_eos=True) for s in range(4)]
    first = run(checkpoints["qwen3_5_r2"], PROMPTS, params, speculative="ngram", draft_tokens=4)[1]
    second = run(checkpoints["qwen3_5_r2"], PROMPTS[::-1], params[::-1], speculative="ngram", draft_tokens=4)[1]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second[::-1]]


@pytest.mark.parametrize("speculative", ["mtp+ngram", "draft+ngram"])
def test_neural_drafters_sample_deterministically_per_seed(speculative):
    prompts = ['def is_prime(n):\n    """Return True if n is a prime number."""\n', "class Stack:\n"]
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2)]
    llm = LLM(dtype="float64", device="cpu", speculative=speculative, draft_tokens=4)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params[::-1])][::-1]
    assert first == again


def chi_square(counts_a: torch.Tensor, counts_b: torch.Tensor) -> float:
    """Two-sample chi-square statistic over the categories either sample hit."""
    keep = (counts_a + counts_b) > 0
    a, b = counts_a[keep].double(), counts_b[keep].double()
    na, nb = a.sum(), b.sum()
    k1, k2 = (nb / na).sqrt(), (na / nb).sqrt()
    return float(((k1 * a - k2 * b) ** 2 / (a + b)).sum())


DISTRIBUTION_PROMPT, DISTRIBUTION_SAMPLES = [1, 2, 3, 1, 2, 3, 1, 2], 3000
DISTRIBUTION_OPTIONS = dict(max_num_seqs=256, max_model_len=32)


@pytest.fixture(scope="module")
def six_token_models(tmp_path_factory):
    """(a six-token-vocabulary target with MTP weights, a small draft model of its vocabulary, the target's plain
    samples: 3000 seeded runs of six tokens), shared by the drafters' distribution tests."""
    from tests.tiny_models import add_mtp_weights

    root = tmp_path_factory.mktemp("six-token-vocabulary")
    path = write_checkpoint(root / "tiny_vocab", "qwen3_5", seed=11, vocab_size=6)
    add_mtp_weights(path, seed=13)
    draft = write_checkpoint(
        root / "tiny_vocab_draft",
        "qwen3_5",
        seed=12,
        vocab_size=6,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
    )
    n = DISTRIBUTION_SAMPLES
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    _, plain = run(path, [DISTRIBUTION_PROMPT] * n, params, **DISTRIBUTION_OPTIONS)
    return path, draft, plain


@pytest.mark.parametrize(
    ("speculative", "tree"), [("ngram", 0), ("draft", 0), ("mtp", 0), ("ngram", 6), ("mtp", 6)]
)  # tree > 0: trees of drafts, verified by multi-candidate rejection sampling
def test_speculative_sampling_matches_plain_sampling_in_distribution(six_token_models, speculative, tree):
    path, draft, plain = six_token_models
    n = DISTRIBUTION_SAMPLES
    llm, spec = run(
        path,
        [DISTRIBUTION_PROMPT] * n,
        [SamplingParams(max_tokens=6, temperature=1.0, seed=10_000 + s, ignore_eos=True) for s in range(n)],
        speculative=speculative,
        draft_tokens=3,
        speculative_tree=tree,
        draft_model=str(draft),
        draft_policy=FixedDraftLength(3) if tree else None,  # trees as large as they grow, not sized by cost
        **DISTRIBUTION_OPTIONS,
    )
    rounds = sum(o.metrics.get("spec_rounds", 0) for o in spec)
    accepted = sum(o.metrics.get("spec_accepted_tokens", 0) for o in spec)
    assert rounds > n // 3 and accepted > n // 20  # speculation shaped a good share of the samples
    assert (llm.engine.speculator.tree_rounds > n // 10) == (tree > 0)  # branching trees, for a tree
    for position in range(6):
        a = torch.bincount(torch.tensor([o.outputs[0].token_ids[position] for o in plain]), minlength=6)
        b = torch.bincount(torch.tensor([o.outputs[0].token_ids[position] for o in spec]), minlength=6)
        assert chi_square(a, b) < 20.5  # 5 degrees of freedom, p = 0.001
    pairs_a = torch.bincount(
        torch.tensor([o.outputs[0].token_ids[4] * 6 + o.outputs[0].token_ids[5] for o in plain]), minlength=36
    )
    pairs_b = torch.bincount(
        torch.tensor([o.outputs[0].token_ids[4] * 6 + o.outputs[0].token_ids[5] for o in spec]), minlength=36
    )
    assert chi_square(pairs_a, pairs_b) < 66.6  # joint law of two tokens, 35 degrees of freedom, p = 0.001


def test_drafts_cut_by_a_small_token_budget_stay_exact():
    """When a pass has no room for a sequence's drafts they are dropped unverified; the drafters must forget them."""
    prompts = ["def f(x):\n", "import sys\n", "class A:\n", "x = [1, 2, 3]\n"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(dtype="float64", device="cpu").generate(prompts, params)
    for speculative in ("draft", "draft+ngram", "ngram"):
        spec = LLM(
            dtype="float64", device="cpu", speculative=speculative, draft_tokens=7, max_num_batched_tokens=6
        ).generate(prompts, params)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain], speculative


@pytest.mark.parametrize("speculative", ["mtp", "mtp+ngram"])
@pytest.mark.parametrize("k", [1, 3, 7, 15])
def test_mtp_greedy_is_token_identical_on_a_random_model(checkpoints, tmp_path, k, speculative):
    import shutil

    from tests.tiny_models import add_mtp_weights

    path = tmp_path / "with_mtp"
    shutil.copytree(checkpoints["qwen3_5_r2"], path)
    add_mtp_weights(path)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    _, plain = run(path, PROMPTS, params)
    _, spec = run(path, PROMPTS, params, speculative=speculative, draft_tokens=k, max_num_batched_tokens=40)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.get("spec_rounds", 0) for o in spec) > 0


def test_mtp_without_an_mtp_head_is_a_clear_error(checkpoints):
    from deltaspec import DeltaspecError

    with pytest.raises(DeltaspecError, match="has no MTP head"):
        LLM(str(checkpoints["qwen3_5_r2"]), device="cpu", speculative="mtp")


def test_an_injected_drafter_must_implement_the_whole_protocol(checkpoints):
    from deltaspec import DeltaspecError

    class ProposesOnly:
        name, needs_hidden = "partial", False

        def propose(self, requests):
            return [Draft(tokens=[]) for _ in requests]

    with pytest.raises(DeltaspecError, match="is not a Drafter: it needs name, needs_hidden, propose, observe"):
        LLM(str(checkpoints["qwen3_5_r2"]), device="cpu", drafter=ProposesOnly())


def test_acceptance_statistics_and_the_policy_forget_finished_sequences(checkpoints):
    """The Speculator records every round per position and drops a finished sequence's policy state."""
    llm = LLM(str(checkpoints["qwen3_5_r2"]), dtype="float64", device="cpu", speculative="ngram", draft_tokens=4)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    )
    drafted = [out.metrics for out in outs if out.metrics.get("spec_rounds")]
    assert drafted
    for m in drafted:
        assert m["drafted_at"][0] == m["spec_rounds"] and sum(m["accepted_at"]) == m["spec_accepted_tokens"]
    assert llm.engine.speculator.policy.ema == {}
    assert llm.engine.speculator.state_bytes() == 0


@pytest.mark.parametrize("speculative", ["ngram", "draft", "mtp+ngram"])
def test_penalties_and_min_tokens_draft_and_stay_exact(speculative):
    """Requests with repetition / presence / frequency penalties or an unmet min_tokens draft too: each verify row
    is penalised with the counts of the output and the earlier draft rows of its pass, so greedy output equals
    plain decoding's in float64."""
    prompts = ['def is_prime(n):\n    """Return True if n is a prime number."""\n', "class Stack:\n"]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.15),
        SamplingParams(max_tokens=40, temperature=0.0, presence_penalty=0.4, frequency_penalty=0.3, min_tokens=30),
    ]
    plain = LLM(dtype="float64", device="cpu").generate(prompts, params)
    spec = LLM(dtype="float64", device="cpu", speculative=speculative, draft_tokens=5).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert all(o.metrics.get("spec_rounds", 0) > 0 for o in spec)
