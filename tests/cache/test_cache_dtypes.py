"""Narrower caches in float64 arithmetic: a GDN state stored in bfloat16 or float16 (`--state-dtype`) and an
attention KV cache in fp8 e4m3 or int8 with per-row scales (`--kv-cache-dtype`). Each is really stored so; greedy
speculative decoding (drafts accepted and rejected, the replay log folding accepted rows) gives plain decoding's
tokens and logprobs exactly, also on a sequence resumed from a prefix checkpoint (device or host memory); the
planner counts the narrower bytes."""

from __future__ import annotations

import pytest
import torch

from deltaspec import LLM, SamplingParams
from tests.spec.test_speculative import PROMPTS

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
DOC = [(13 * i + 5) % 480 + 3 for i in range(300)]


def assert_same(got, want) -> None:
    """Tokens equal, logprobs within float64 noise (a state rounded differently moves them by ~1e-3)."""
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert {t: p.logprob for t, p in x.items()} == pytest.approx({t: p.logprob for t, p in y.items()}, abs=1e-9)


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], outs


CODE = [
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    "import os\n\n\ndef main(",
    "class Stack:\n",
]


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["default", "qwen3_next_r3_moe"])
def test_greedy_speculation_over_a_narrow_state_is_exact(checkpoints, name, state_dtype):
    """The embedded model (its greedy code repeats: n-gram drafts accepted) and a tiny random MoE one (drafts
    mostly rejected)."""
    model = None if name == "default" else str(checkpoints[name])
    prompts = CODE if name == "default" else [{"prompt_token_ids": p} for p in PROMPTS]
    options = dict(model=model, dtype="float64", device="cpu", state_dtype=state_dtype)
    plain = LLM(**options)
    assert all(s.dtype == getattr(torch, state_dtype) for s in plain.engine.cache.gdn.state)
    want = plain.generate(prompts, GREEDY)
    spec = LLM(speculative="ngram", draft_tokens=3, **options).generate(prompts, GREEDY)
    assert_same(spec, want)
    rounds = sum(o.metrics.get("spec_rounds", 0) for o in spec)
    accepted = sum(o.metrics.get("spec_accepted_tokens", 0) for o in spec)
    assert rounds > 0 and accepted < 3 * rounds  # drafts verified, some rejected and rolled back
    assert accepted > 0 or name != "default"


def test_a_resumed_sequence_over_a_bfloat16_state_speculates_exactly():
    """Both engines resume the follow-up from the same stored (bf16) checkpoint: with drafts, the tokens of
    plain decoding."""
    options = dict(dtype="float64", device="cpu", state_dtype="bfloat16", prefix_checkpoint_min_prompt=128)
    spec = LLM(speculative="ngram", draft_tokens=3, **options)
    plain = LLM(**options)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    (first,), _ = tokens(plain, [DOC], params)
    assert tokens(spec, [DOC], params)[0] == [first]
    follow_up = DOC + first + DOC[:40]
    _, (out,) = tokens(spec, [follow_up], params)
    _, (plain_out,) = tokens(plain, [follow_up], params)
    assert out.num_cached_tokens >= len(DOC) and plain_out.num_cached_tokens >= len(DOC)
    assert_same([out], [plain_out])


def test_the_plan_counts_the_state_in_its_dtype(checkpoints):
    """Each GDN layer's [Hv, Dk, Dv] state takes 2 bytes a value instead of 4."""
    path = str(checkpoints["qwen3_5_r2"])
    wide = LLM(path, dtype="float32", device="cpu", state_dtype="float32").engine
    narrow = LLM(path, dtype="float32", device="cpu", state_dtype="bfloat16").engine
    config = wide.model.config
    values = len(config.gdn_layer_ids) * config.linear_num_value_heads
    values *= config.linear_key_head_dim * config.linear_value_head_dim
    assert wide.plan.state_per_stream - narrow.plan.state_per_stream == 2 * values


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_greedy_speculation_over_a_quantized_kv_cache_is_exact(kv_cache_dtype):
    options = dict(dtype="float64", device="cpu", kv_cache_dtype=kv_cache_dtype)
    plain = LLM(**options)
    assert all(
        c.dtype == {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}[kv_cache_dtype]
        for c in plain.engine.cache.kv.k
    )
    want = plain.generate(CODE, GREEDY)
    spec = LLM(speculative="ngram", draft_tokens=3, **options).generate(CODE, GREEDY)
    assert_same(spec, want)
    assert sum(o.metrics.get("spec_accepted_tokens", 0) for o in spec) > 0
    wide = LLM(dtype="float64", device="cpu").generate(CODE, GREEDY)
    first = [next(iter(o.outputs[0].logprobs[0].values())).logprob for o in (want[0], wide[0])]
    assert first[0] != first[1]  # the cache really holds quantized rows


@pytest.mark.parametrize("offload_gib", [0.0, 0.5])
def test_follow_ups_resume_exactly_over_a_quantized_kv_cache(offload_gib):
    """A row's quantized bytes depend on that row alone: a follow-up resumed from a checkpoint (its pages shared
    on the device, or copied back from host memory) gives a full prefill's outputs exactly."""
    options = dict(dtype="float64", device="cpu", kv_cache_dtype="fp8_e4m3", prefix_checkpoint_min_prompt=128)
    cached = LLM(prefix_checkpoints=1, prefix_offload_gib=offload_gib, **options)
    plain = LLM(enable_prefix_caching=False, **options)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    (answer,), _ = tokens(cached, [DOC], params)
    if offload_gib:
        tokens(cached, [DOC[::-1]], params)  # evicts DOC's checkpoint to host memory
    follow_up = DOC + answer + [11, 12, 13, 14]
    _, got = tokens(cached, [follow_up], params)
    assert got[0].num_cached_tokens >= len(DOC)
    assert cached.engine.cache.prefix.host.hits == (1 if offload_gib else 0)
    assert_same(got, tokens(plain, [follow_up], params)[1])


def test_the_plan_counts_quantized_kv_rows(checkpoints):
    """A token's K and V take 1 byte a value and a 16-byte tail (the scale) per KV head instead of 4 bytes a value."""
    path = str(checkpoints["qwen3_5_r2"])
    wide = LLM(path, dtype="float32", device="cpu").engine
    narrow = LLM(path, dtype="float32", device="cpu", kv_cache_dtype="int8").engine
    config = wide.model.config
    rows = wide.model.num_kv_layers * 2 * config.num_key_value_heads
    assert wide.plan.kv_per_token == rows * config.head_dim * 4
    assert narrow.plan.kv_per_token == rows * (config.head_dim + 16)
    assert narrow.cache.kv.bytes() == narrow.plan.kv_per_token * narrow.plan.pool_tokens
