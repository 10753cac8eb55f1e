"""deltaspec against the transformers reference on tiny random checkpoints of every family."""

import pytest
import torch

from deltaspec import LLM, SamplingParams
from tests.conftest import VARIANTS
from tests.engine_helpers import forward_in_chunks
from tests.hf_reference import load_reference, reference_greedy, reference_logits

PROMPT = [(17 * i + 5) % 500 + 3 for i in range(150)]  # longer than one 64-row GDN chunk


@pytest.mark.parametrize("name", VARIANTS)
def test_prompt_logits_match_transformers_float64(checkpoints, name):
    llm = LLM(str(checkpoints[name]), dtype="float64", device="cpu")
    ours = forward_in_chunks(llm.engine, PROMPT, [len(PROMPT)])
    reference = reference_logits(load_reference(checkpoints[name], torch.float64), PROMPT)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", VARIANTS)
def test_prompt_logits_match_transformers_float32(checkpoints, name):
    llm = LLM(str(checkpoints[name]), dtype="float32", device="cpu")
    ours = forward_in_chunks(llm.engine, PROMPT, [len(PROMPT)])
    reference = reference_logits(load_reference(checkpoints[name], torch.float32), PROMPT)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_generation_matches_transformers(checkpoints, name):
    prompt = PROMPT[:40]
    llm = LLM(str(checkpoints[name]), dtype="float64", device="cpu")
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=32, temperature=0.0))[0]
    expected = reference_greedy(load_reference(checkpoints[name], torch.float64), prompt, 32)
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].finish_reason == "length"
