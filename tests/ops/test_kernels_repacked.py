"""The repacked Q4_K and Q6_K layouts (`deltaspec.ops.quant.repacked`) and their CUDA products
(`deltaspec.ops.triton.quant_mma`): llama-quantize's blocks round-trip byte for byte and dequantize as gguf-py does;
every product (tensor cores, CUDA cores, the one-pass dequantization for prefill) matches the reference, through a
permuted input order and partly empty tiles; a model repacked in place generates what it generated before."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from deltaspec import LLM, SamplingParams
from deltaspec.model.gguf_raw import read_raw
from deltaspec.ops.quant import dequantize, repacked
from deltaspec.ops.quant.weight import QuantizedWeight
from tests.ops.test_kernels_quant import assert_near_the_reference, random_weight

LLAMA_MADE = Path(__file__).parents[1] / "data" / "gguf_llama" / "qwen3next-q4_k_m.gguf"


def llama_quantized_tensors():
    """(name, type, blocks [rows, row_bytes]) of the 2-D Q4_K and Q6_K tensors llama-quantize wrote."""
    for name, tensor in read_raw(LLAMA_MADE).tensors.items():
        if tensor.qtype in repacked.REPACKED and len(tensor.shape) == 2:
            yield name, tensor.qtype, torch.from_numpy(np.array(tensor.data)).reshape(tensor.shape[0], -1)


def test_llama_quantize_s_blocks_round_trip_and_dequantize_as_gguf_py_does():
    seen = set()
    for name, qtype, blocks in llama_quantized_tensors():
        packed = repacked.repack(blocks, qtype)
        layout = repacked.REPACKED[qtype]
        columns = blocks.shape[1] // repacked.format_bytes(qtype) * 256
        assert packed.shape == blocks.shape and not torch.equal(packed, blocks), name
        assert torch.equal(repacked.unpack(packed, layout, columns), blocks), name
        want = gguf_dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype]).reshape(blocks.shape[0], -1)
        assert np.array_equal(dequantize(packed, layout).numpy().view(np.int32), want.view(np.int32)), name
        seen.add(qtype)
    assert seen == {"Q4_K", "Q6_K"}


def test_repacking_in_passes_of_rows_gives_the_same_planes(monkeypatch):
    blocks = random_weight("Q6_K", 40, 512, seed=3)
    whole = repacked.repack(blocks, "Q6_K")
    monkeypatch.setattr(repacked, "PASS_BYTES", 8 * 420)  # passes of 8 rows of two Q6_K super-blocks
    assert torch.equal(repacked.repack(blocks, "Q6_K"), whole)


def test_a_repacked_weight_splits_and_looks_up_rows_as_its_blocks():
    blocks = random_weight("Q4_K", 24, 512, seed=4)
    weight = QuantizedWeight([("Q4_K", blocks)], 512)
    before = weight.dequantize()
    assert weight.repack_for_kernels() == 1 and weight.qtypes == ("Q4_K_R",)
    assert weight.repack_for_kernels() == 0  # already repacked
    assert torch.equal(weight.dequantize(), before)
    ids = torch.tensor([3, 0, 17])
    assert torch.equal(weight.rows(ids, torch.float32), before[ids])
    top, bottom = weight.split([10, 14])
    assert top.qtypes == ("Q4_K",) and torch.equal(bottom.dequantize(), before[10:])


def test_a_model_repacked_in_place_generates_the_same_tokens():
    llm = LLM(str(LLAMA_MADE), dtype="float64", device="cpu", max_num_seqs=1, max_model_len=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    before = llm.generate(["The planets of the solar system"], params)[0].outputs[0]
    model = llm.engine.model
    repacked_count = model.repack_for_kernels()
    types = {q for module in model.modules() if isinstance(module, QuantizedWeight) for q in module.qtypes}
    assert repacked_count > 0 and {"Q4_K_R", "Q6_K_R"} <= types and model.repack_seconds > 0
    after = llm.generate(["The planets of the solar system"], params)[0].outputs[0]
    assert after.token_ids == before.token_ids
    chosen = [[step[t].logprob for t in sorted(step)] for step in after.logprobs]
    assert chosen == [[step[t].logprob for t in sorted(step)] for step in before.logprobs]  # float64, same values


@pytest.fixture
def kernel(kernel_device):
    from deltaspec.ops.triton.quant_matmul import quantized_linear

    return quantized_linear


def repacked_weight(qtype: str, rows: int, columns: int, order=None, seed: int = 0) -> QuantizedWeight:
    weight = QuantizedWeight([(qtype, random_weight(qtype, rows, columns, seed))], columns, order)
    weight.repack_for_kernels()
    return weight


# (type, family, rows, shares): one row and two on CUDA cores; 1 to 16 rows on tensor cores, one share and several
# (3 shares of 3 super-blocks; 2 leaves the last share shorter)
GRID = [("Q4_K_R", "gemv", 1, 1), ("Q4_K_R", "gemv", 2, 2), ("Q4_K_R", "mma", 3, 3), ("Q4_K_R", "mma", 16, 2)]
GRID += [("Q6_K_R", "gemv", 1, 1), ("Q6_K_R", "gemv", 2, 2), ("Q6_K_R", "mma", 1, 1), ("Q6_K_R", "mma", 5, 2)]
GRID += [("Q6_K_R", "mma", 16, 3)]


@pytest.mark.gpu
@pytest.mark.kernel
@pytest.mark.parametrize(("layout", "family", "rows", "split_k"), GRID)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_repacked_product_matches_the_reference(kernel, kernel_device, layout, family, rows, split_k, dtype):
    from deltaspec.ops.triton.quant_matmul import Launch

    order = torch.randperm(768, generator=torch.Generator().manual_seed(2)) if split_k == 2 else None
    weight = repacked_weight(repacked.BASE[layout], 40, 768, order, seed=rows).to(kernel_device)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(1)).to(kernel_device, dtype)
    got = kernel(x, weight, Launch(family, 16, split_k))
    assert got.dtype == dtype and got.shape == (rows, 40)
    assert_near_the_reference(got, x, weight)


@pytest.mark.gpu
@pytest.mark.kernel
@pytest.mark.parametrize("layout", ["Q4_K_R", "Q6_K_R"])
def test_the_routed_products_and_the_prefill_dequantization_match_the_reference(kernel, kernel_device, layout):
    """The table's launch for 1, 2 and 7 rows; past 64 rows the one-pass dequantization (bit for bit the
    reference's values) and one GEMM."""
    from deltaspec.ops.triton import quant_mma

    weight = repacked_weight(repacked.BASE[layout], 72, 512).to(kernel_device)
    (_, data), *_ = weight.segments
    values = quant_mma.dequantize(data, layout, 512, torch.float32)
    assert torch.equal(values.cpu(), weight.to("cpu").dequantize())
    for rows in (1, 2, 7, 65):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(kernel_device, torch.float32)
        assert_near_the_reference(kernel(x, weight), x, weight)


@pytest.mark.gpu
def test_with_repack_a_llama_quantize_file_runs_on_cuda_as_on_the_cpu():
    """`--repack` on CUDA (float32): the Q4_K and Q6_K matrices are repacked, the scored log-probabilities are the CPU
    reference's within float32 rounding, and greedy decoding gives the CPU's tokens, through verify passes of several
    rows too (the n-gram drafter on a prompt that repeats itself)."""
    prompts = [{"prompt_token_ids": [1, 17, 230, 4, 99, 7] * 3}, {"prompt_token_ids": [5, 6, 7, 8]}]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    options = dict(dtype="float32", max_num_seqs=2, max_model_len=128)
    cpu = LLM(str(LLAMA_MADE), device="cpu", **options).generate(prompts, params)
    cuda = LLM(str(LLAMA_MADE), device="cuda", repack=True, **options)
    kept = {q for m in cuda.engine.model.modules() if isinstance(m, QuantizedWeight) for q in m.qtypes}
    assert {"Q4_K_R", "Q6_K_R"} <= kept
    for got, want in zip(cuda.generate(prompts, params), cpu):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        chosen = [[step[t].logprob for t in step] for step in got.outputs[0].logprobs]
        expected = [[step[t].logprob for t in step] for step in want.outputs[0].logprobs]
        torch.testing.assert_close(torch.tensor(chosen), torch.tensor(expected), rtol=0, atol=1e-3)
    spec = LLM(str(LLAMA_MADE), device="cuda", repack=True, speculative="ngram", draft_tokens=3, **options)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == [o.outputs[0].token_ids for o in cpu]


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_repacking_holds_no_more_than_its_transient_bound(qtype, monkeypatch):
    """What CUDA's allocator holds at its peak while a matrix is repacked in several passes stays within
    `repacked.transient_bytes`, the figure the memory planner counts for --repack."""
    monkeypatch.setattr(repacked, "PASS_BYTES", 4 << 20)
    blocks = random_weight(qtype, 3000, 5120, seed=5).cuda()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = repacked.repack(blocks, qtype)
    torch.cuda.synchronize()
    held = torch.cuda.max_memory_allocated() - before
    assert out.numel() < held <= repacked.transient_bytes(qtype, blocks.numel(), blocks.shape[1])
