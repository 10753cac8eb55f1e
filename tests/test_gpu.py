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


@pytest.mark.parametrize("speculative", ["ngram", "draft+ngram"])
def test_cuda_speculative_decoding_runs_and_mostly_agrees_with_plain(speculative):
    prompts = ['def is_prime(n):\n    """Return True if n is a prime number."""\n', "class Stack:\n"]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = LLM(dtype="float32", device="cuda").generate(prompts, params)
    spec = LLM(dtype="float32", device="cuda", speculative=speculative, draft_tokens=5).generate(prompts, params)
    assert sum(o.metrics["spec_accepted_tokens"] for o in spec) > 0
    for a, b in zip(plain, spec):
        same = next((i for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)) if x != y), 48)
        assert len(b.outputs[0].token_ids) == 48 and same >= 16  # float32: reductions differ, greedy may drift late


def test_triton_kernels_match_the_references_through_the_whole_model(checkpoints):
    path = str(checkpoints["qwen3_5_r2"])
    reference = forward_in_chunks(LLM(path, dtype="float32", device="cuda", kernels="reference").engine,
                                  PROMPT, [70, 1, 3, 56])
    kernels = forward_in_chunks(LLM(path, dtype="float32", device="cuda").engine, PROMPT, [70, 1, 3, 56])
    torch.testing.assert_close(kernels, reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_cuda_graph_decoding_gives_the_eager_tokens(checkpoints, num_prompts):
    path = str(checkpoints["qwen3_5_r2"])
    prompts = [{"prompt_token_ids": PROMPT[:n]} for n in (5, 40, 130)[:num_prompts]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    graphed = LLM(path, dtype="float32", device="cuda")
    assert graphed.engine.runner.graphs is not None
    eager = LLM(path, dtype="float32", device="cuda", enforce_eager=True).generate(prompts, params)
    got = graphed.generate(prompts, params)
    assert graphed.engine.runner.graphs.buckets  # the decode passes replayed a graph
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in eager]


def test_cuda_graph_verify_passes_keep_speculative_output_exact():
    """Verify buckets pad rows and sequences; greedy speculative output equals plain greedy output."""
    prompts = ['def is_prime(n):\n    """Return True if n is a prime number."""\n', "class Stack:\n", "import os\n"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(dtype="float32", device="cuda", enforce_eager=True).generate(prompts, params)
    llm = LLM(dtype="float32", device="cuda", speculative="ngram", draft_tokens=6)
    spec = llm.generate(prompts, params)
    assert any(rows > 1 for _, rows in llm.engine.runner.graphs.buckets)
    assert sum(o.metrics["spec_accepted_tokens"] for o in spec) > 0
    for a, b in zip(plain, spec):
        same = next((i for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)) if x != y), 40)
        assert same >= 16
