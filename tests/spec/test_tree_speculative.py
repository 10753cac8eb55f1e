"""Trees of drafts through the engine are exact: greedy output token-identical to plain greedy in float64 with every
drafter and tree shape, the GDN states and attention KV after a tree's accepted path equal plain decoding's, trees
batched with chains, decode rows and prompt chunks, with prefix caching, sampling that matches plain sampling in
distribution, and clear errors for trees that cannot be."""

from __future__ import annotations

import pytest
import torch

from deltaspec import LLM, DeltaspecError, SamplingParams
from deltaspec.spec.policy import FixedDraftLength
from tests.tiny_models import add_mtp_weights, write_block_drafter
from tests.tree_helpers import BranchingDrafter

PATTERN = [5, 9, 14, 22, 31, 40, 57]
PROMPTS = [PATTERN * 3, [3, 4] + PATTERN * 2 + [8], PATTERN[:4] * 5, [11, 12, 13] * 4 + PATTERN]
CODE = [
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    "import os\n\n\ndef main(",
    "class Stack:\n",
]


def run(path, prompts, params, **options):
    llm = LLM(str(path), dtype="float64", device="cpu", **options)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain_code():
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    return tokens(LLM(dtype="float64", device="cpu").generate(CODE, params))


@pytest.mark.parametrize(
    ("speculative", "k", "tree", "shape"),
    [
        ("ngram", 7, 8, "dynamic"),
        ("ngram", 15, 16, "static"),
        ("draft", 7, 16, "dynamic"),
        ("mtp", 7, 8, "static"),
        ("mtp", 15, 16, "dynamic"),
        ("mtp+ngram", 7, 16, "dynamic"),
        ("draft+ngram", 4, 4, "static"),
    ],
)
def test_default_model_tree_greedy_is_identical_with_every_drafter(plain_code, speculative, k, tree, shape):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = LLM(
        dtype="float64",
        device="cpu",
        speculative=speculative,
        draft_tokens=k,
        speculative_tree=tree,
        speculative_tree_shape=shape,
    )
    spec = llm.generate(CODE, params)
    assert tokens(spec) == plain_code
    assert sum(o.metrics.get("spec_accepted_tokens", 0) for o in spec) > 0
    assert llm.engine.speculator.grown == {}  # finished sequences leave no tree behind


def test_block_drafter_trees_are_token_identical(checkpoints, tmp_path):
    target = checkpoints["qwen3_5_r2"]
    drafter = write_block_drafter(tmp_path / "block", target, seed=7, target_layer_ids=(0, 2, 3))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    _, plain = run(target, PROMPTS, params)
    for speculative in ("block", "block+ngram"):
        llm, spec = run(
            target,
            PROMPTS,
            params,
            speculative=speculative,
            draft_model=str(drafter),
            draft_tokens=7,
            speculative_tree=16,
        )
        assert tokens(spec) == tokens(plain), speculative
        again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)  # resumed from checkpoints
        assert tokens(again) == tokens(plain), speculative


@pytest.mark.parametrize(("right", "as_candidates"), [(0, False), (2, False), (3, True), (1, True)])
def test_state_and_kv_after_a_tree_equal_plain_decodings(checkpoints, right, as_candidates):
    """Step by step: wherever the tree engine's state has consumed n tokens (its accepted rows fold at its next pass),
    every GDN layer's state and conv window and every attention layer's KV of those tokens equal the plain engine's
    at n tokens."""
    path = checkpoints["qwen3_5_r2"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = PROMPTS[1]
    plain_llm, plain = run(path, [prompt], params)
    truth = {tuple(prompt): plain[0].outputs[0].token_ids}
    drafter = BranchingDrafter(truth, right, plain_llm.engine.model_config.vocab_size, as_candidates)
    tree_llm = LLM(
        str(path),
        dtype="float64",
        device="cpu",
        draft_tokens=5,
        speculative_tree=12,
        drafter=drafter,
        draft_policy=FixedDraftLength(5),
    )

    def snapshots(engine, record):
        seq = engine.add_request("s", None, list(prompt), params)
        while not seq.finished:
            engine.step()
            consumed = seq.cache.num_computed - seq.cache.replay.unfolded
            if seq.finished or consumed in record:
                continue
            gdn, kv = engine.cache.gdn, engine.cache.kv
            record[consumed] = (
                [s[seq.cache.state_slot].clone() for s in gdn.state]
                + [c[seq.cache.state_slot].clone() for c in gdn.conv],
                [
                    cache.view(-1, *cache.shape[2:])[
                        seq.cache.kv_slots(range(consumed), engine.cache.block_size)
                    ].clone()
                    for cache in (*kv.k, *kv.v)
                ],
            )
        return seq

    plain_states, tree_states = {}, {}
    snapshots(plain_llm.engine, plain_states)
    seq = snapshots(tree_llm.engine, tree_states)
    assert seq.output_ids == plain[0].outputs[0].token_ids
    assert seq.stats.acceptance.accepted > 0
    common = sorted(set(plain_states) & set(tree_states))
    assert len(common) >= 3
    for n in common:
        for a, b in zip(plain_states[n][0] + plain_states[n][1], tree_states[n][0] + tree_states[n][1]):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


def test_trees_batch_with_chains_decode_rows_and_prompt_chunks(checkpoints):
    """Four requests of different lengths arrive together, with small passes: prompt chunks, decode rows, chains
    (trees that grew into one) and trees share passes."""
    path = checkpoints["qwen3_next_r3_moe"]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [p * 3 for p in PROMPTS]
    _, plain = run(path, prompts, params)
    llm, spec = run(
        path,
        prompts,
        params,
        speculative="ngram",
        draft_tokens=7,
        speculative_tree=16,
        max_num_batched_tokens=40,
        prefill_chunk=16,
    )
    assert tokens(spec) == tokens(plain)
    assert sum(o.metrics.get("spec_rounds", 0) for o in spec) > 0


def test_mtp_trees_with_prefix_caching_and_logprobs(checkpoints, tmp_path):
    import shutil

    path = tmp_path / "with_mtp"
    shutil.copytree(checkpoints["qwen3_5_r2"], path)
    add_mtp_weights(path)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)
    _, plain = run(path, PROMPTS, params)
    llm, spec = run(path, PROMPTS, params, speculative="mtp+ngram", draft_tokens=5, speculative_tree=10)
    follow_ups = [p + o.outputs[0].token_ids + [7] for p, o in zip(PROMPTS, spec)]  # resume where each one ended
    again = llm.generate([{"prompt_token_ids": p} for p in follow_ups], params)
    _, plain_again = run(path, follow_ups, params)
    assert tokens(spec) == tokens(plain) and tokens(again) == tokens(plain_again)
    assert sum(o.num_cached_tokens for o in again) > 0
    for a, b in zip(plain, spec):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: p.logprob for t, p in x.items()} == pytest.approx({t: p.logprob for t, p in y.items()}, abs=1e-9)


def test_penalties_and_sampled_requests_verify_trees(checkpoints):
    """Penalised greedy requests verify a tree row by row with the counts of each row's own path; seeded sampled
    requests are deterministic per seed, in any batch order."""
    path = checkpoints["qwen3_5_r2"]
    penalised = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    _, plain = run(path, PROMPTS, penalised)
    _, spec = run(path, PROMPTS, penalised, speculative="ngram", draft_tokens=5, speculative_tree=12)
    assert tokens(spec) == tokens(plain)
    sampled = [SamplingParams(max_tokens=16, temperature=0.9, seed=s, ignore_eos=True) for s in range(4)]
    llm, first = run(path, PROMPTS, sampled, speculative="ngram", draft_tokens=5, speculative_tree=12)
    second = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[::-1]], sampled[::-1])
    assert tokens(first) == tokens(second)[::-1]


def test_tree_settings_are_checked():
    with pytest.raises(DeltaspecError, match="speculative_tree is the most nodes"):
        LLM(device="cpu", speculative="ngram", speculative_tree=65)
    with pytest.raises(DeltaspecError, match="needs a drafter"):
        LLM(device="cpu", speculative_tree=8)
    with pytest.raises(DeltaspecError, match="speculative_tree_shape"):
        LLM(device="cpu", speculative="ngram", speculative_tree=8, speculative_tree_shape="wide")
    llm = LLM(device="cpu", speculative="ngram", draft_tokens=4, speculative_tree=12)
    assert llm.engine.plan.cache.log_rows == 12  # a verify pass has as many rows as the tree has nodes
