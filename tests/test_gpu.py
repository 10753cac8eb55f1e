"""The model on CUDA (torch references through the dispatch table) agrees with the CPU run."""

import pytest
import torch

from deltaspec import LLM, SamplingParams
from tests.engine_helpers import forward_in_chunks

pytestmark = pytest.mark.gpu

PROMPT = [(7 * i + 3) % 500 + 3 for i in range(130)]


@pytest.mark.parametrize("name", ["qwen3_5_r2", "qwen3_next_r3_moe"])
def test_cuda_float32_logits_match_cpu_float64(checkpoints, name):
    cpu = forward_in_chunks(LLM(str(checkpoints[name]), dtype="float64", device="cpu").engine, PROMPT, [130])
    gpu_engine = LLM(str(checkpoints[name]), dtype="float32", device="cuda").engine
    gpu = forward_in_chunks(gpu_engine, PROMPT, [50, 1, 79])
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.double().cpu(), cpu, rtol=0, atol=2e-4)


def test_cuda_bfloat16_generation_runs_with_float32_state(checkpoints):
    llm = LLM(str(checkpoints["qwen3_5_moe_r2"]), dtype="bfloat16", device="cuda")
    assert llm.engine.cache.gdn.state[0].dtype == torch.float32
    outs = llm.generate([{"prompt_token_ids": PROMPT[:n]} for n in (1, 17, 130)],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
