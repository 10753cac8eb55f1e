"""Scheduling across many streams: chunked prefill never holds others back by more than one chunk,
aging keeps long prompts from starving, and running out of KV pages preempts instead of failing."""

import pytest

from deltaspec import LLM, SamplingParams

PROMPT = [(29 * i + 3) % 500 + 3 for i in range(600)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def engine_for(checkpoints, **options):
    return LLM(str(checkpoints["qwen3_5_r2"]), dtype="float64", device="cpu", **options).engine


def test_long_prompt_delays_a_short_request_and_decoding_by_at_most_one_chunk(checkpoints):
    engine = engine_for(checkpoints, prefill_chunk=16, max_num_batched_tokens=64, max_model_len=1024)
    decoder = engine.add_request("decoding", None, PROMPT[:5], SamplingParams(max_tokens=40, temperature=0))
    engine.step()
    long = engine.add_request("long", None, PROMPT[:400], GREEDY)
    steps_with_long_prefilling = 0
    short = None
    while long.remaining_prompt > 0:
        before = (len(decoder.output_ids), long.cache.num_computed)
        engine.step()
        steps_with_long_prefilling += 1
        assert long.cache.num_computed - before[1] <= 16  # one chunk per pass
        assert len(decoder.output_ids) == before[0] + 1  # decoding went on every pass
        if steps_with_long_prefilling == 3:
            short = engine.add_request("short", None, PROMPT[:5], GREEDY)
            arrival = engine.scheduler.step_count
        if short is not None and short.output_ids and not hasattr(short, "first_step"):
            short.first_step = engine.scheduler.step_count
    assert short.first_step == arrival + 1  # admitted and prefilled in the very next pass
    assert steps_with_long_prefilling == 400 // 16


def test_aging_lets_a_long_prompt_through_a_stream_of_short_ones(checkpoints):
    engine = engine_for(checkpoints, prefill_chunk=10, max_num_batched_tokens=10, max_num_seqs=4)
    long = engine.add_request("long", None, PROMPT[:100], SamplingParams(max_tokens=1, temperature=0))
    shorts = []
    for step in range(200):
        shorts.append(
            engine.add_request(f"s{step}", None, PROMPT[step : step + 10], SamplingParams(max_tokens=1, temperature=0))
        )
        engine.step()
        if long.finished:
            break
    assert long.finished, "the long prompt starved"
    assert 16 * 3 < step < 100  # it waited while shorter work went first, then aged past it
    while engine.has_unfinished():
        engine.step()
    assert all(s.finished and len(s.output_ids) == 1 for s in shorts)


@pytest.mark.parametrize("num_blocks", [8, 12])
def test_running_out_of_kv_pages_preempts_and_recomputes_exactly(checkpoints, num_blocks):
    prompts = [PROMPT[i * 7 : i * 7 + 10] for i in range(3)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    roomy = LLM(str(checkpoints["qwen3_5_r2"]), dtype="float64", device="cpu")
    expected = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params)]
    tight = LLM(
        str(checkpoints["qwen3_5_r2"]),
        dtype="float64",
        device="cpu",
        num_kv_blocks=num_blocks,
        block_size=4,
        max_model_len=32,
    )
    got = [o.outputs[0].token_ids for o in tight.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == expected
    usage = tight.engine.usage()
    assert usage["preemptions"] > 0
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0 and usage["running"] == 0
