"""Triton `write_kv` and `paged_attention` against their torch references (`deltaspec.ops.attention`), on fresh
random inputs: scattered pages, several sequences of different row counts and contexts in one call, both regimes
(decode/verify and prefill), with and without split-KV, and tree passes (rows that see only their ancestors)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltaspec.ops import attention as reference
from deltaspec.ops.layout import SeqLayout
from tests.conftest import triton_interpreted
from tests.tree_helpers import TREE, random_parents, root_path

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]

triton_attention = pytest.importorskip("deltaspec.ops.triton.attention")

TOLERANCES = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
# (Hq, Hkv, head_dim): the 27B model's heads (GQA group 6), and group 8 at head_dim 128
REAL_SHAPES = [(24, 4, 256), (16, 2, 128)]
# the same groups and head dims with fewer KV heads, where the interpreter would otherwise take minutes
GROUP_SHAPES = [(6, 1, 256), (8, 1, 128)]


@pytest.fixture(autouse=True)
def interpreter_fixes(monkeypatch):
    """Two bugs of Triton's interpreter (the CPU development aid; compiled kernels are unaffected), patched for
    these tests: in 3.6, a scalar used as a loop bound goes through int() of a 1-element array, which numpy >= 2.4
    refuses (triton-lang/triton#9171, fixed in 3.7 by squeezing first); and in 3.6 to 3.9, tl.dot multiplies
    bfloat16 operands as their raw uint16 storage, so they are widened to float32 first."""
    if not triton_interpreted():
        return
    import triton.language as tl
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_squeezed_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    create_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot_widening_bfloat16(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_tensor_with_squeezed_index)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot_widening_bfloat16)


def _paged_inputs(
    query_lens,
    context_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    device,
    seed=0,
    table_width=None,
    speculative=None,
    parents=None,
):
    """q [T, Hq, D], caches [num_blocks, block_size, Hkv, D] filled with random values everywhere (so reading a
    position a row may not see changes the result), and a layout whose pages are a random scatter of the pool
    (`speculative` and `parents` as `SeqLayout.build` takes them)."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-ctx // block_size) for ctx in context_lens]
    num_blocks = sum(pages_per_seq) + 5
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for count in pages_per_seq:
        tables.append(pool[used : used + count])
        used += count
    if table_width is not None:
        tables[0] = tables[0] + [0] * (table_width - len(tables[0]))
    layout = SeqLayout.build(
        query_lens,
        context_lens,
        list(range(len(query_lens))),
        device,
        speculative=speculative,
        block_tables=tables,
        parents=parents,
    )

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(device)

    q = rand(sum(query_lens), num_heads, head_dim)
    k_cache = rand(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = rand(num_blocks, block_size, num_kv_heads, head_dim)
    return q, k_cache, v_cache, layout


def _check_attention(q, k_cache, v_cache, layout):
    scale = q.shape[-1] ** -0.5
    expected = reference.paged_attention(q, k_cache, v_cache, layout, scale)
    actual = triton_attention.paged_attention(q, k_cache, v_cache, layout, scale)
    assert actual.dtype == q.dtype and actual.shape == q.shape
    torch.testing.assert_close(actual, expected, **TOLERANCES[q.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", GROUP_SHAPES)
def test_prefill_regime_mixed_batch(kernel_device, num_heads, num_kv_heads, head_dim, dtype):
    # a decode row, a verify pass, a first prefill chunk (context starts at 0), a chunk continuing a context,
    # and a 16-row verify: max_query_len 100 picks the prefill regime for all of them
    query_lens = [1, 5, 100, 70, 16]
    context_lens = [37, 130, 100, 160, 40]
    inputs = _paged_inputs(query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, dtype, kernel_device)
    assert inputs[3].max_query_len > triton_attention.VERIFY_MAX_ROWS
    _check_attention(*inputs)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,dtype",
    [
        (*REAL_SHAPES[0], 16, torch.float32),
        (*REAL_SHAPES[0], 64, torch.bfloat16),
        (*REAL_SHAPES[1], 32, torch.float32),
        (*REAL_SHAPES[1], 16, torch.bfloat16),
        (*GROUP_SHAPES[0], 32, torch.bfloat16),
        (*GROUP_SHAPES[1], 64, torch.float32),
    ],
)
def test_verify_regime_mixed_rows(kernel_device, num_heads, num_kv_heads, head_dim, block_size, dtype):
    query_lens = [1, 2, 16, 7, 1]
    context_lens = [1, 40, 150, 64, 129]
    inputs = _paged_inputs(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, kernel_device, seed=block_size
    )
    assert inputs[3].max_query_len <= triton_attention.VERIFY_MAX_ROWS
    _check_attention(*inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1], [1000]),  # one long decode
        ([1, 9], [1000, 45]),  # a long and a short sequence: most splits of the short one are empty
        ([16], [400]),  # a verify pass whose causal limits fall inside the last split
    ],
)
def test_split_kv_decode(kernel_device, query_lens, context_lens, dtype):
    inputs = _paged_inputs(query_lens, context_lens, *GROUP_SHAPES[0], 16, dtype, kernel_device, seed=3, table_width=64)
    assert triton_attention.kv_splits(inputs[0], inputs[1], inputs[3]) > 1
    _check_attention(*inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_prefill(kernel_device, dtype):
    inputs = _paged_inputs([90, 1], [600, 300], 4, 2, 64, 32, dtype, kernel_device, seed=4, table_width=40)
    assert inputs[3].max_query_len > triton_attention.VERIFY_MAX_ROWS
    assert triton_attention.kv_splits(inputs[0], inputs[1], inputs[3]) > 1
    _check_attention(*inputs)


def test_unsplit_when_tables_are_short(kernel_device):
    inputs = _paged_inputs([3, 1], [50, 20], 24, 4, 256, 16, torch.float32, kernel_device, seed=5)
    assert triton_attention.kv_splits(inputs[0], inputs[1], inputs[3]) == 1
    _check_attention(*inputs)


def test_large_scores_do_not_underflow(kernel_device):
    # every score far below zero: the online softmax must still normalise over what a row sees
    q, k_cache, v_cache, layout = _paged_inputs([4, 1], [40, 33], 8, 2, 128, 16, torch.float32, kernel_device, seed=6)
    q = q.abs() * 30
    k_cache = -k_cache.abs() * 30
    _check_attention(q, k_cache, v_cache, layout)


def test_reads_per_sequence_values_from_device_tensors(kernel_device):
    # a replayed CUDA graph keeps the host values of its capture: only num_seqs and max_query_len may be used
    q, k_cache, v_cache, layout = _paged_inputs(
        [1, 4, 2], [90, 50, 7], 24, 4, 256, 16, torch.float32, kernel_device, seed=7, table_width=16
    )
    scale = q.shape[-1] ** -0.5
    expected = reference.paged_attention(q, k_cache, v_cache, layout, scale)
    stale = dataclasses.replace(layout, query_lens=[2, 2, 3], context_lens=[5, 5, 5], max_query_len=8)
    actual = triton_attention.paged_attention(q, k_cache, v_cache, stale, scale)
    torch.testing.assert_close(actual, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 4, 256), (32, 2, 128), (64, 3, 80)])
def test_write_kv(kernel_device, block_size, num_kv_heads, head_dim, dtype, cache_dtype):
    generator = torch.Generator().manual_seed(block_size)
    num_blocks, num_tokens = 6, 23
    # k and v as strided views into one projection output, like a fused qkv split
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=generator).to(dtype).to(kernel_device)
    k, v = kv[:, 0], kv[:, 1]
    slot_mapping = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens].to(kernel_device)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(cache_dtype)
    k_cache = k_cache.to(kernel_device)
    v_cache = torch.randn_like(k_cache)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(k, v, expected_k, expected_v, slot_mapping)
    triton_attention.write_kv(k, v, k_cache, v_cache, slot_mapping)
    # a copy is exact; narrowing float32 may differ by one rounding step (the interpreter truncates)
    tolerance = {"atol": 0, "rtol": 0 if dtype == cache_dtype else 2**-7}
    torch.testing.assert_close(k_cache, expected_k, **tolerance)
    torch.testing.assert_close(v_cache, expected_v, **tolerance)


def test_write_kv_skips_negative_slots(kernel_device):
    generator = torch.Generator().manual_seed(11)
    k = torch.randn(3, 4, 256, generator=generator).to(torch.bfloat16).to(kernel_device)
    v = torch.randn(3, 4, 256, generator=generator).to(torch.bfloat16).to(kernel_device)
    k_cache = torch.randn(2, 16, 4, 256, generator=generator).to(torch.bfloat16).to(kernel_device)
    v_cache = torch.randn_like(k_cache)
    slot_mapping = torch.tensor([5, -1, 17], dtype=torch.long, device=kernel_device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(k[[0, 2]], v[[0, 2]], expected_k, expected_v, slot_mapping[[0, 2]])
    triton_attention.write_kv(k, v, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0)


QUANTIZED_CACHES = [torch.float8_e4m3fn, torch.int8]


def _interpreter_rounds_e4m3_wrongly(cache_dtype: torch.dtype) -> bool:
    """Triton's interpreter converts float32 to e4m3 wrongly (-126.57 became -64); compiled kernels round to
    nearest even as torch does."""
    return cache_dtype == torch.float8_e4m3fn and triton_interpreted()


@pytest.mark.parametrize("cache_dtype", QUANTIZED_CACHES)
@pytest.mark.parametrize(("dtype", "num_kv_heads", "head_dim"), [(torch.float32, 4, 256), (torch.bfloat16, 2, 80)])
def test_write_kv_quantizes_rows_as_the_reference(kernel_device, cache_dtype, dtype, num_kv_heads, head_dim):
    """Each row's values, float32 scale and zero padding, byte for byte (an all-zero row takes scale 1); other rows
    untouched."""
    if _interpreter_rounds_e4m3_wrongly(cache_dtype):
        pytest.skip("Triton's interpreter converts float32 to e4m3 wrongly")
    generator = torch.Generator().manual_seed(head_dim)
    block_size, num_blocks, num_tokens = 16, 5, 21
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    k[3] = 0
    full = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    k_cache = reference.quantize_kv_rows(full, cache_dtype).to(kernel_device)
    v_cache = reference.quantize_kv_rows(-full, cache_dtype).to(kernel_device)
    for cache in (k_cache, v_cache):  # stale tails: a written row's scale and zero padding must replace them
        cache.view(torch.uint8)[..., head_dim:] = 0xAB
    slot_mapping = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens].to(kernel_device)
    expected_k, expected_v = k_cache.cpu().clone(), v_cache.cpu().clone()
    reference.write_kv(k, v, expected_k, expected_v, slot_mapping.cpu())
    triton_attention.write_kv(k.to(kernel_device), v.to(kernel_device), k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache.cpu().view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.cpu().view(torch.uint8), expected_v.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", QUANTIZED_CACHES)
@pytest.mark.parametrize(("query_lens", "context_lens"), [([1, 2, 16, 7], [1, 40, 150, 64]), ([1, 100], [37, 160])])
def test_attention_reads_quantized_rows(kernel_device, cache_dtype, query_lens, context_lens):
    """Both regimes over fp8 / int8 caches: the reference's dequantized rows (values times their scales)."""
    num_heads, num_kv_heads, head_dim = GROUP_SHAPES[1]
    q, k_cache, v_cache, layout = _paged_inputs(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, kernel_device
    )
    k_cache, v_cache = (reference.quantize_kv_rows(c.cpu(), cache_dtype).to(kernel_device) for c in (k_cache, v_cache))
    _check_attention(q, k_cache, v_cache, layout)


# Tree passes (query_lens, context_lens, speculative, parents, table_width): a tree, a 40-row random tree whose
# second row block (32 rows a block at group 2) would see unmasked tiles past its context, a speculative chain,
# a decode row and a plain 5-row chunk (verify regime); a tree and a long context split over the KV (verify); and
# trees beside a 100-row chunk, split (prefill regime).
TREE_PASSES = {
    "verify": (
        [8, 40, 3, 1, 5],
        [200, 80, 50, 37, 129],
        [True, True, True, False, False],
        [TREE, random_parents(40, seed=1), None, None, None],
        None,
    ),
    "verify_split": ([8, 5], [1000, 300], [True, True], [TREE, random_parents(5, seed=2)], 64),
    "prefill_split": (
        [100, 8, 20],
        [600, 300, 90],
        [False, True, True],
        [None, TREE, random_parents(20, seed=3)],
        40,
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), GROUP_SHAPES[0]])
@pytest.mark.parametrize("regime", list(TREE_PASSES))
def test_tree_pass(kernel_device, regime, num_heads, num_kv_heads, head_dim, dtype):
    query_lens, context_lens, speculative, parents, table_width = TREE_PASSES[regime]
    inputs = _paged_inputs(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, dtype, kernel_device, 8, table_width,
        speculative, parents,
    )  # fmt: skip
    layout = inputs[3]
    assert (layout.max_query_len > triton_attention.VERIFY_MAX_ROWS) == (regime == "prefill_split")
    assert (triton_attention.kv_splits(inputs[0], inputs[1], layout) > 1) == regime.endswith("split")
    _check_attention(*inputs)


@pytest.mark.parametrize("cache_dtype", QUANTIZED_CACHES)
def test_tree_pass_reads_quantized_rows(kernel_device, cache_dtype):
    query_lens, context_lens, speculative, parents, _ = TREE_PASSES["verify"]
    q, k_cache, v_cache, layout = _paged_inputs(
        query_lens, context_lens, 4, 2, 64, 16, torch.bfloat16, kernel_device, 9, None, speculative, parents
    )
    k_cache, v_cache = (reference.quantize_kv_rows(c.cpu(), cache_dtype).to(kernel_device) for c in (k_cache, v_cache))
    _check_attention(q, k_cache, v_cache, layout)


@pytest.mark.parametrize("implementation", ["reference", "kernel"])
def test_tree_rows_are_their_paths_as_chains(kernel_device, implementation):
    """Row i of a tree after `base` cached tokens gives what the last row of its root-to-i path gives as a chain:
    the same context, then the path's rows' K and V at the next positions."""
    attention = reference.paged_attention if implementation == "reference" else triton_attention.paged_attention
    generator = torch.Generator().manual_seed(10)
    num_heads, num_kv_heads, head_dim, block_size, base = 4, 2, 64, 16, 70

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(kernel_device)

    q = rand(len(TREE), num_heads, head_dim)  # [L, Hq, D]
    context_k, context_v = rand(base, num_kv_heads, head_dim), rand(base, num_kv_heads, head_dim)  # [base, Hkv, D]
    new_k, new_v = rand(len(TREE), num_kv_heads, head_dim), rand(len(TREE), num_kv_heads, head_dim)  # [L, Hkv, D]
    paths = [root_path(TREE, row) for row in range(len(TREE))]
    sequences = [list(range(len(TREE)))] + paths  # the tree's rows, then each path's
    pages_per_seq = [-(-(base + len(rows)) // block_size) for rows in sequences]
    k_cache = rand(sum(pages_per_seq), block_size, num_kv_heads, head_dim)  # stale values wherever nothing is written
    v_cache = rand(sum(pages_per_seq), block_size, num_kv_heads, head_dim)
    tables, first_page = [], 0
    for count, rows in zip(pages_per_seq, sequences):
        table = list(range(first_page, first_page + count))
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(base + len(rows))])
        keys, values = torch.cat([context_k, new_k[rows]]), torch.cat([context_v, new_v[rows]])
        reference.write_kv(keys, values, k_cache, v_cache, slots.to(kernel_device))
        tables.append(table)
        first_page += count
    lens = [len(rows) for rows in sequences]
    layout = SeqLayout.build(
        lens, [base + n for n in lens], list(range(len(lens))), kernel_device, speculative=[True] * len(lens),
        block_tables=tables, parents=[TREE] + [None] * len(paths),
    )  # fmt: skip
    rows = torch.tensor([row for rows in sequences for row in rows], device=kernel_device)
    out = attention(q[rows], k_cache, v_cache, layout, head_dim**-0.5)  # [T, Hq, D]
    last_rows = layout.query_start[2:].long() - 1
    torch.testing.assert_close(out[: len(TREE)], out[last_rows], **TOLERANCES[torch.float32])
