"""Prefix checkpoints (DESIGN §4) on the CPU in float64: a resumed request gives exactly the outputs of a
full prefill, a prompt that diverges before a checkpoint does not use it, eviction never touches a
running sequence, and speculative decoding on a resumed sequence stays token-exact."""

import pytest

from deltaspec import LLM, SamplingParams

DOC = [(13 * i + 5) % 480 + 3 for i in range(300)]  # a "document" of 300 tokens
MIN_PROMPT = 128  # prompts this long leave a checkpoint 64 tokens before their end (300 - 512 < 0: no other)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


def engine(path, **options) -> LLM:
    return LLM(str(path), dtype="float64", device="cpu", prefix_checkpoint_min_prompt=MIN_PROMPT, **options)


def run(llm: LLM, prompts: list[list[int]], params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def assert_same_outputs(got, expected):
    for a, b in zip(got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            for token in lp_a:
                assert lp_a[token].logprob == pytest.approx(lp_b[token].logprob, abs=1e-9)


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints["qwen3_5_r2"]


def test_follow_ups_resume_from_checkpoints_and_match_a_full_prefill(path):
    cached, plain = engine(path), engine(path, enable_prefix_caching=False)
    first = run(cached, [DOC])[0]
    answer = first.outputs[0].token_ids
    assert first.num_cached_tokens == 0 and cached.engine.usage()["prefix_checkpoints"] == 2  # 236 and the end
    follow_ups = [DOC[:250] + [7, 8, 9], DOC + answer + [11, 12, 13, 14]]
    got = run(cached, follow_ups)
    assert [o.num_cached_tokens for o in got] == [236, len(DOC) + len(answer) - 1]
    expected = run(plain, follow_ups)
    assert [o.num_cached_tokens for o in expected] == [0, 0]
    assert_same_outputs(got, expected)


def test_a_prompt_diverging_before_a_checkpoint_does_not_use_it(path):
    cached, plain = engine(path), engine(path, enable_prefix_caching=False)
    run(cached, [DOC])
    changed = list(DOC)
    changed[100] += 1  # differs from the document before every checkpoint
    prompts = [changed + [1, 2, 3], DOC[:200] + [4, 5, 6]]
    got = run(cached, prompts)
    assert [o.num_cached_tokens for o in got] == [0, 0]
    assert_same_outputs(got, run(plain, prompts))


def test_the_whole_prompt_is_never_taken_from_a_checkpoint(path):
    """A prompt equal to a checkpoint's prefix still computes its last token (its logits start the answer)."""
    cached, plain = engine(path), engine(path, enable_prefix_caching=False)
    run(cached, [DOC])
    got = run(cached, [DOC[:236], DOC[:237]])
    assert [o.num_cached_tokens for o in got] == [0, 236]
    assert_same_outputs(got, run(plain, [DOC[:236], DOC[:237]]))


def test_eviction_under_memory_pressure_never_corrupts_a_running_sequence(path):
    """Three documents leave their checkpoints; then their follow-ups resume from them (sharing the
    checkpoints' pages) while three fresh long prompts need pages, so checkpoints are evicted under the
    running follow-ups. Every output equals the uncached one."""
    options = {"max_num_seqs": 3, "prefix_checkpoints": 3, "num_kv_blocks": 70, "block_size": 16, "max_model_len": 1120}
    cached, plain = engine(path, **options), engine(path, enable_prefix_caching=False, **options)
    docs = [DOC, DOC[150:] + DOC[:150], DOC[::-1]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    answers = [o.outputs[0].token_ids for o in run(cached, docs, params)]
    follow_ups = [d + a + [20 + i] for i, (d, a) in enumerate(zip(docs, answers))]
    fresh = [DOC[40 * i :] + DOC[: 40 * i + 30] for i in (2, 4, 5)]  # longer: admitted after the follow-ups
    got = run(cached, follow_ups + fresh, params)
    usage = cached.engine.usage()
    assert cached.engine.cache.prefix.evictions > 0 and sum(o.num_cached_tokens > 0 for o in got[:3]) >= 2
    expected = run(plain, follow_ups + fresh, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert usage["kv_blocks_used"] == 0 and usage["running"] == 0


@pytest.mark.parametrize("speculative", ["ngram", "mtp", "draft"])
def test_speculative_decoding_on_a_resumed_sequence_is_token_exact(speculative):
    """Every drafter of the embedded model (its greedy output repeats, so n-gram drafts get accepted too).
    A request that ends after a verify pass checkpoints where its state stands: before the rows still to
    fold, so the follow-up resumes at most there."""
    llm = LLM(
        dtype="float64", device="cpu", prefix_checkpoint_min_prompt=MIN_PROMPT, speculative=speculative, draft_tokens=3
    )
    plain = LLM(dtype="float64", device="cpu", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    first = run(llm, [DOC], params)[0]
    follow_up = DOC + first.outputs[0].token_ids + DOC[:40]
    got = run(llm, [follow_up], params)[0]
    assert len(DOC) <= got.num_cached_tokens <= len(DOC) + len(first.outputs[0].token_ids) - 1
    assert got.outputs[0].token_ids == run(plain, [follow_up], params)[0].outputs[0].token_ids
    assert got.metrics.get("spec_accepted_tokens", 0) > 0


def test_a_follow_up_resumes_even_when_the_pages_are_exactly_one_sequence(path):
    """No free page for a copy of the checkpoint's partial last page: the sequence takes that page over
    (only the checkpoint held it) and the checkpoint goes."""
    options = {"max_num_seqs": 1, "max_model_len": 320, "num_kv_blocks": 20, "block_size": 16}
    cached, plain = engine(path, **options), engine(path, enable_prefix_caching=False, **options)
    answer = run(cached, [DOC])[0].outputs[0].token_ids
    assert cached.engine.cache.kv.allocator.num_free == 0  # the checkpoints hold every page
    follow_up = DOC + answer + [11, 12, 13, 14]
    got = run(cached, [follow_up])
    assert got[0].num_cached_tokens == len(DOC) + len(answer) - 1
    assert_same_outputs(got, run(plain, [follow_up]))


def test_a_follow_up_is_scheduled_by_what_its_checkpoint_leaves_to_compute(path):
    """Shortest remaining work first: a follow-up with 5 tokens left after its checkpoint goes before a
    fresh 280-token prompt that arrived first."""
    cached = engine(path, max_num_seqs=1)
    answer = run(cached, [DOC])[0].outputs[0].token_ids
    eng, params = cached.engine, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    fresh = eng.add_request("fresh", None, DOC[::-1][:280], params)
    follow_up = eng.add_request("follow-up", None, DOC + answer + [11, 12, 13, 14], params)
    while eng.has_unfinished():
        eng.step()
    assert follow_up.cache.num_cached_tokens == len(DOC) + len(answer) - 1 and fresh.cache.num_cached_tokens == 0
    assert follow_up.stats.first_token_time < fresh.stats.first_token_time


@pytest.mark.parametrize("offload_gib", [0.0, 0.5])
def test_checkpoints_evicted_from_the_device_are_reused_from_host_memory(path, offload_gib):
    """One device checkpoint slot: a second document evicts the first one's checkpoints; with a host budget
    they are kept there, and the first document's follow-up resumes from host memory exactly."""
    options = {"prefix_checkpoints": 1, "prefix_offload_gib": offload_gib}
    cached, plain = engine(path, **options), engine(path, enable_prefix_caching=False)
    answer = run(cached, [DOC])[0].outputs[0].token_ids
    run(cached, [DOC[::-1]])
    follow_up = DOC + answer + [11, 12, 13, 14]
    got = run(cached, [follow_up])
    host = cached.engine.cache.prefix.host
    if offload_gib:
        assert got[0].num_cached_tokens == len(DOC) + len(answer) - 1 and host.hits == 1
    else:
        assert got[0].num_cached_tokens == 0 and not host.entries
    assert_same_outputs(got, run(plain, [follow_up]))


def test_the_default_pool_keeps_every_checkpoint_of_a_long_request_per_stream(path):
    """Two 600-token documents on two streams leave 3 checkpoints each (88, 536, the end): all are kept, so
    a follow-up diverging right after the first checkpoint still finds it."""
    docs = [[(7 * i + s) % 480 + 3 for i in range(600)] for s in (1, 2)]
    cached = engine(path, max_num_seqs=2, max_model_len=700)
    run(cached, docs)
    assert cached.engine.usage()["prefix_checkpoints"] == 6
    got = run(cached, [doc[:100] + [9, 9] for doc in docs])
    assert [o.num_cached_tokens for o in got] == [88, 88]


def test_hash_chains_reuse_a_hashed_prefix_and_give_the_full_computation():
    """Every chain `HashChains` returns equals `block_hashes` computed afresh: for lists that extend a hashed one, are
    a prefix of one, share only part of one, or are unrelated; at most `keep` lists are remembered."""
    import random

    from deltaspec.cache.prefix_cache import HashChains, block_hashes

    rng = random.Random(0)
    chains = HashChains(block_size=16, keep=2)
    document = [rng.randrange(1000) for _ in range(5000)]
    cases = [
        document,
        document + [1, 2, 3] * 30,  # a follow-up: extends it
        document[:1234],  # a prefix of it
        document[:2000] + [7] * 500,  # shares only part of it
        [rng.randrange(1000) for _ in range(100)],  # unrelated
        document + [1, 2, 3] * 30 + [4] * 64,  # extends an entry no longer kept (keep=2): hashed afresh
    ]
    for tokens in cases:
        assert chains(tokens) == block_hashes(tokens, 16)
    assert len(chains.recent) == 2 and chains.recent[0][0] == cases[-1]
