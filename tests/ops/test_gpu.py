"""The model on CUDA agrees with the CPU run; CUDA graphs replay for decode and verify passes (chains and trees of
drafts); speculative output on CUDA is a greedy decode of the model (every token the argmax given its prefix, up to
float32 near-ties)."""

import logging

import pytest
import torch

from deltaspec import LLM, SamplingParams
from tests.engine_helpers import forward_in_chunks
from tests.tree_helpers import BranchingDrafter

pytestmark = pytest.mark.gpu

PROMPT = [(7 * i + 3) % 500 + 3 for i in range(130)]
CODE_PROMPTS = ['def is_prime(n):\n    """Return True if n is a prime number."""\n', "class Stack:\n", "import os\n"]
NEAR_TIE = 1e-3  # float32 logits of one prefix differ by less than this between pass shapes


def assert_greedy_continuations(engine, outputs) -> None:
    """Each generated token is the argmax of `engine`'s logits given the prompt and the tokens before it (within
    NEAR_TIE of the maximum: a verify pass reduces in another order than the eager pass that checks it)."""
    for out in outputs:
        prompt, generated = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        ids = prompt + generated
        rows = forward_in_chunks(engine, ids[:-1], [len(ids) - 1])[len(prompt) - 1 :]  # row j predicts token j
        chosen = rows.gather(1, torch.tensor(generated, device=rows.device)[:, None]).squeeze(1)
        gap = rows.max(dim=-1).values - chosen
        assert gap.max().item() <= NEAR_TIE, f"token {gap.argmax().item()} is {gap.max().item():.3g} below the argmax"


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
    outs = llm.generate(
        [{"prompt_token_ids": PROMPT[:n]} for n in (1, 17, 130)],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    )
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)


@pytest.mark.parametrize("speculative", ["ngram", "draft+ngram", "mtp"])
def test_cuda_speculative_greedy_output_is_a_greedy_decode(speculative):
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    llm = LLM(dtype="float32", device="cuda", speculative=speculative, draft_tokens=5)
    spec = llm.generate(CODE_PROMPTS, params)
    assert sum(o.metrics["spec_accepted_tokens"] for o in spec) > 0
    assert all(len(o.outputs[0].token_ids) == 48 for o in spec)
    assert_greedy_continuations(LLM(dtype="float32", device="cuda", enforce_eager=True).engine, spec)


def test_triton_kernels_match_the_references_through_the_whole_model(checkpoints):
    path = str(checkpoints["qwen3_5_r2"])
    reference = forward_in_chunks(
        LLM(path, dtype="float32", device="cuda", kernels="reference").engine, PROMPT, [70, 1, 3, 56]
    )
    kernels = forward_in_chunks(LLM(path, dtype="float32", device="cuda").engine, PROMPT, [70, 1, 3, 56])
    torch.testing.assert_close(kernels, reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_triton_kernels_match_the_references_over_quantized_kv_and_a_bf16_state(checkpoints, kv_cache_dtype):
    """The kernels write the reference's KV bytes and read them as it does; a bf16 state is rounded after every
    row of the recurrent kernel's passes (the 1- and 3-row chunks), once per chunk by the reference's, so the
    logits agree within that rounding."""
    path, chunks = str(checkpoints["qwen3_5_r2"]), [70, 1, 3, 56]
    options = dict(dtype="float32", device="cuda", kv_cache_dtype=kv_cache_dtype)
    reference = forward_in_chunks(LLM(path, kernels="reference", **options).engine, PROMPT, chunks)
    kernels = forward_in_chunks(LLM(path, **options).engine, PROMPT, chunks)
    torch.testing.assert_close(kernels, reference, rtol=0, atol=1e-4)
    narrow = forward_in_chunks(LLM(path, state_dtype="bfloat16", **options).engine, PROMPT, chunks)
    torch.testing.assert_close(narrow, reference, rtol=0, atol=5e-2)


def test_cuda_graph_speculation_over_an_fp8_kv_cache_is_a_greedy_decode():
    """Verify passes write and read fp8 rows inside CUDA graphs: every token is the eager model's argmax."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    options = dict(dtype="float32", device="cuda", kv_cache_dtype="fp8_e4m3")
    spec = LLM(speculative="ngram", draft_tokens=4, **options).generate(CODE_PROMPTS, params)
    assert sum(o.metrics["spec_accepted_tokens"] for o in spec) > 0
    assert_greedy_continuations(LLM(enforce_eager=True, **options).engine, spec)


@pytest.mark.parametrize("name", ["qwen3_5_r2", "qwen3_5_moe_r2"])
@pytest.mark.parametrize("num_prompts", [1, 3])
def test_cuda_graph_decoding_gives_the_eager_tokens(checkpoints, name, num_prompts):
    """Dense and MoE models: the MoE routing and grouped expert products never read the host, so they replay."""
    path = str(checkpoints[name])
    prompts = [{"prompt_token_ids": PROMPT[:n]} for n in (5, 40, 130)[:num_prompts]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    graphed = LLM(path, dtype="float32", device="cuda")
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and not graphs.replays
    eager = LLM(path, dtype="float32", device="cuda", enforce_eager=True)
    assert eager.engine.runner.graphs is None
    want = eager.generate(prompts, params)
    got = graphed.generate(prompts, params)
    decode_bucket = next(b for b in graphs.batch_sizes if b >= num_prompts)
    assert graphs.replays[(decode_bucket, 1)] >= 20  # the decode passes replayed the graph of their bucket
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_cuda_graph_verify_passes_keep_speculative_output_a_greedy_decode():
    """Verify buckets pad rows and sequences; every token of the greedy speculative output is the model's argmax."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = LLM(dtype="float32", device="cuda", speculative="ngram", draft_tokens=6)
    spec = llm.generate(CODE_PROMPTS, params)
    replays = llm.engine.runner.graphs.replays
    assert sum(count for (_, rows), count in replays.items() if rows > 1) > 0  # verify passes ran as graphs
    assert sum(o.metrics["spec_accepted_tokens"] for o in spec) > 0
    assert_greedy_continuations(LLM(dtype="float32", device="cuda", enforce_eager=True).engine, spec)


@pytest.mark.parametrize("as_candidates", [False, True])
def test_cuda_graph_tree_passes_keep_speculative_output_a_greedy_decode(as_candidates):
    """Trees of drafts in graph-replayed verify passes (tree attention masks, the recurrence restarting along a row's
    ancestors, conv taps along parents, folds of an accepted path, KV moved down): the drafter's chain is wrong
    after two tokens and the truth sits on another branch, so accepted paths leave the chain; every token is the
    eager model's argmax."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eager = LLM(dtype="float32", device="cuda", enforce_eager=True)
    prompts = [eager.tokenizer.encode(p) for p in CODE_PROMPTS]
    plain = eager.generate([{"prompt_token_ids": p} for p in prompts], params)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}
    drafter = BranchingDrafter(truth, 2, eager.engine.model_config.vocab_size, as_candidates)
    llm = LLM(dtype="float32", device="cuda", drafter=drafter, draft_tokens=6, speculative_tree=12)
    spec = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    replays = llm.engine.runner.graphs.replays
    assert sum(count for (_, rows), count in replays.items() if rows > 1) > 0
    assert llm.engine.speculator.tree_rounds > 0
    assert sum(o.metrics["spec_accepted_tokens"] for o in spec) > 3 * len(prompts)  # past the chain's two
    assert_greedy_continuations(eager.engine, spec)


def test_cuda_graph_trees_from_real_drafters_batch_with_chains_and_decode_rows():
    """MTP with n-gram branches grows trees for some sequences while others verify chains or decode, in shared
    graph-replayed passes; the output stays the model's argmax."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = LLM(dtype="float32", device="cuda", speculative="mtp+ngram", draft_tokens=7, speculative_tree=16)
    spec = llm.generate(CODE_PROMPTS * 2, params)
    assert llm.engine.speculator.tree_rounds > 0
    assert sum(o.metrics["spec_accepted_tokens"] for o in spec) > 0
    assert_greedy_continuations(LLM(dtype="float32", device="cuda", enforce_eager=True).engine, spec)


@pytest.mark.parametrize("name", ["qwen3_5_moe_r2", "qwen3_next_r3_moe"])
def test_cuda_moe_speculative_output_is_a_greedy_decode_with_graphs(checkpoints, name):
    """MoE verify passes run as graphs with the grouped expert kernels; the output stays the model's argmax."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in (PROMPT, PROMPT[:40], [1, 2, 3, 4] * 3)]
    llm = LLM(str(checkpoints[name]), dtype="float32", device="cuda", speculative="ngram", draft_tokens=5)
    spec = llm.generate(prompts, params)
    replays = llm.engine.runner.graphs.replays
    assert sum(count for (_, rows), count in replays.items() if rows > 1) > 0
    assert sum(o.metrics.get("spec_accepted_tokens", 0) for o in spec) > 0  # 17 and 7 on the CPU
    eager = LLM(str(checkpoints[name]), dtype="float32", device="cuda", enforce_eager=True, kernels="reference")
    assert_greedy_continuations(eager.engine, spec)


def test_cuda_reference_path_speculative_output_is_token_identical_in_float64():
    """On CUDA with the torch references, float64 speculative output equals plain greedy output exactly."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = LLM(dtype="float64", device="cuda", kernels="reference").generate(CODE_PROMPTS, params)
    spec = LLM(dtype="float64", device="cuda", kernels="reference", speculative="mtp+ngram", draft_tokens=4).generate(
        CODE_PROMPTS, params
    )
    assert sum(o.metrics["spec_accepted_tokens"] for o in spec) > 0
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


def test_cuda_block_drafter_reads_the_same_features_from_graph_replays_as_eagerly(tmp_path):
    """The layer outputs a block drafter reads come from the pass itself, captured in the CUDA graphs too: per
    position they equal an eager engine's, and the speculative output stays a greedy decode."""
    from tests.tiny_models import write_block_drafter, write_checkpoint

    target = write_checkpoint(tmp_path / "t", "qwen3_5", seed=11, vocab_size=6)
    drafter = write_block_drafter(
        tmp_path / "b", target, seed=3, block_size=8, target_layer_ids=(0, 1), mask_token_id=5
    )
    prompts = [{"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}, {"prompt_token_ids": [4, 0, 4, 2]}]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    seen = {}
    for eager in (True, False):
        llm = LLM(
            str(target),
            dtype="float32",
            device="cuda",
            enforce_eager=eager,
            speculative="block",
            draft_tokens=7,
            draft_model=str(drafter),
        )
        block, observed, order = llm.engine.speculator.drafter, {}, {}
        observe = block.observe

        def record(seq_id, first, features, observe=observe, observed=observed, order=order):
            request = order.setdefault(seq_id, len(order))  # requests are first seen in prompt order
            for j in range(features.shape[0]):
                observed[(request, first + j)] = features[j].float().cpu()
            observe(seq_id, first, features)

        block.observe = record
        outs = llm.generate(prompts, params)
        seen[eager] = observed
        if not eager:
            replays = llm.engine.runner.graphs.replays
            assert sum(count for (_, rows), count in replays.items() if rows > 1) > 0
            assert sum(o.metrics["spec_accepted_tokens"] for o in outs) > 0
            assert_greedy_continuations(LLM(str(target), dtype="float32", device="cuda").engine, outs)
    common = set(seen[True]) & set(seen[False])
    assert len(common) > 40
    for key in common:
        torch.testing.assert_close(seen[False][key], seen[True][key], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("speculative", "tree"), [("none", 0), ("draft+ngram", 0), ("mtp", 0), ("mtp+ngram", 12)])
def test_cuda_structured_output_validates_with_graphs_and_drafters(speculative, tree):
    """Masks go to the logits' device; constrained rows of graph-replayed decode and verify passes stay valid."""
    import json

    from deltaspec import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer", "minimum": 0}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    llm = LLM(dtype="bfloat16", device="cuda", speculative=speculative, draft_tokens=4, speculative_tree=tree)
    for temperature in (0.0, 0.8):
        params = SamplingParams(
            max_tokens=120, temperature=temperature, seed=1, structured_outputs=StructuredOutputsParams(json=schema)
        )
        for out in llm.generate(CODE_PROMPTS, params):
            value = json.loads(out.outputs[0].text)
            assert set(value) == {"name", "n"} and isinstance(value["n"], int) and value["n"] >= 0


def test_a_gemm_routing_cache_that_cannot_be_written_costs_a_warning_not_the_start(tmp_path, monkeypatch, caplog):
    """The embedded model's LM head is routed in bf16: its table is measured, the save fails (the cache's parent is
    a file, as a read-only cache fails even for root), and the engine starts and generates all the same."""
    from deltaspec.ops import gemm_routing

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("DELTASPEC_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    monkeypatch.setattr(gemm_routing, "SHIPPED_TABLES", tmp_path / "no-shipped-tables")  # measured, then saved
    with caplog.at_level(logging.WARNING, logger="deltaspec.ops"):
        llm = LLM(dtype="bfloat16", device="cuda")
    warnings = [r.getMessage() for r in caplog.records if r.name == "deltaspec.ops"]
    assert len(warnings) == 1 and warnings[0].startswith("Cannot save the GEMM routing table to "), warnings
    [out] = llm.generate(CODE_PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 8
