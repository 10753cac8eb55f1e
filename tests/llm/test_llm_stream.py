"""`LLM.stream`: one prompt's new tokens step by step, the same completion `generate` gives, and an abort when the
consumer stops early."""

from __future__ import annotations

import pytest

from deltaspec import LLM, SamplingParams
from deltaspec.errors import DeltaspecError

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):"


@pytest.fixture(scope="module")
def llm(text_checkpoint) -> LLM:
    return LLM(str(text_checkpoint), dtype="float32", device="cpu", speculative="ngram", draft_tokens=3)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=5),
    ],
)
def test_stream_yields_what_generate_returns(llm, params):
    expected = llm.generate(PROMPT, params)[0]
    steps = list(llm.stream(PROMPT, params))
    assert [step.output is None for step in steps] == [True] * (len(steps) - 1) + [False]
    assert all(step.token_ids for step in steps[:-1])
    assert [t for step in steps for t in step.token_ids] == expected.outputs[0].token_ids
    final = steps[-1].output
    assert final.outputs[0].text == expected.outputs[0].text
    assert final.outputs[0].finish_reason == expected.outputs[0].finish_reason
    assert final.metrics["num_generated_tokens"] == len(expected.outputs[0].token_ids)
    assert not llm.engine.has_unfinished()


def test_stream_cuts_at_a_stop_string(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    stop = greedy[5:8]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    final = list(llm.stream(PROMPT, params))[-1].output
    assert final.outputs[0].text == llm.generate(PROMPT, params)[0].outputs[0].text == greedy[: greedy.index(stop)]
    assert final.outputs[0].stop_reason == stop


def test_stopping_early_aborts_the_request(llm):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    steps = llm.stream(PROMPT, params)
    first = next(steps)
    assert first.token_ids and first.output is None and llm.engine.has_unfinished()
    steps.close()
    assert not llm.engine.has_unfinished()
    assert len(llm.generate(PROMPT, params)[0].outputs[0].token_ids) == 24  # the engine carries on as before


def test_stream_refuses_what_it_cannot_follow(llm):
    with pytest.raises(DeltaspecError, match="n=2"):
        next(llm.stream(PROMPT, SamplingParams(n=2)))
    with pytest.raises(DeltaspecError, match="exceeds the context"):
        next(llm.stream(PROMPT, SamplingParams(max_tokens=10**6)))
    assert not llm.engine.has_unfinished()
