"""Chunked prefill and batching are exact: the cache contracts hold across pieces and sequences."""

import pytest
import torch

from deltaspec import LLM, SamplingParams
from tests.engine_helpers import forward_in_chunks, new_sequence, run_rows

PROMPT = [(31 * i + 11) % 500 + 3 for i in range(97)]


@pytest.fixture(scope="module", params=["qwen3_5_r2", "qwen3_next_r3_moe"])
def engine(request, checkpoints):
    return LLM(str(checkpoints[request.param]), dtype="float64", device="cpu", block_size=4).engine


def test_uneven_chunks_and_token_by_token_match_one_piece(engine):
    whole = forward_in_chunks(engine, PROMPT, [len(PROMPT)])
    uneven = forward_in_chunks(engine, PROMPT, [5, 1, 13, 64, 2, 12])
    stepwise = forward_in_chunks(engine, PROMPT, [1] * len(PROMPT))
    torch.testing.assert_close(uneven, whole, rtol=0, atol=1e-10)
    torch.testing.assert_close(stepwise, whole, rtol=0, atol=1e-10)


def test_sequences_in_one_forward_match_each_alone(engine):
    prompts = [PROMPT[:7], PROMPT[3:70], PROMPT[:1], PROMPT[10:43]]
    alone = [forward_in_chunks(engine, p, [len(p)]) for p in prompts]
    seqs = [new_sequence(engine, p) for p in prompts]
    try:
        # first pass: all four prefill together (a decode-sized one among them)
        first = run_rows(engine, [(s, len(p)) for s, p in zip(seqs, prompts)])
        for got, want in zip(first, alone):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        # second pass: mixed rows per sequence continue each one's own state
        extra = [[5, 6], [7], [8, 9, 10], [11]]
        for seq, ids in zip(seqs, extra):
            seq.request.prompt_ids.extend(ids)
        mixed = run_rows(engine, [(s, len(ids)) for s, ids in zip(seqs, extra)])
        for got, p, ids in zip(mixed, prompts, extra):
            want = forward_in_chunks(engine, p + ids, [len(p) + len(ids)])[-len(ids) :]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    finally:
        for seq in seqs:
            engine.cache.release(seq.cache)


def test_state_slots_are_isolated_and_reset_on_reuse(engine):
    """A freed slot handed to a new sequence starts from the empty state, not its last owner's."""
    first = forward_in_chunks(engine, PROMPT[:20], [20])
    forward_in_chunks(engine, PROMPT[40:90], [50])
    again = forward_in_chunks(engine, PROMPT[:20], [20])
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_small_token_budget_gives_the_same_generations(checkpoints):
    path = str(checkpoints["qwen3_5_moe_r2"])
    prompts = [{"prompt_token_ids": PROMPT[:n]} for n in (3, 50, 97, 20)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    roomy = LLM(path, dtype="float64", device="cpu", max_num_batched_tokens=4096).generate(prompts, params)
    tight = LLM(path, dtype="float64", device="cpu", max_num_batched_tokens=7, max_num_seqs=2, block_size=8).generate(
        prompts, params
    )
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


def test_batched_generation_matches_each_alone(checkpoints):
    llm = LLM(str(checkpoints["qwen3_5_r1_tied"]), dtype="float64", device="cpu")
    prompts = [{"prompt_token_ids": PROMPT[:n]} for n in (1, 9, 64, 33)]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    together = llm.generate(prompts, params)
    for prompt, out in zip(prompts, together):
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == out.outputs[0].token_ids
