"""The Triton mixture-of-experts kernels against their references (`deltaspec.ops.moe`): the router's top-k,
the one-program grouping against the torch one, and the expert products for float and quantized (Q8_0, Q6_K,
Q4_K, Q4_K with Q6_K down products, FP8_B128, I4_G32 and I4_G128) experts, one token to a prefill's worth,
through the decode path (a GEMV per pair) and the grouped one with every tile height; under expert parallelism,
the router naming the held experts and every path skipping the pairs of another rank's."""

import pytest
import torch

from deltaspec.ops import moe
from deltaspec.ops.quant.weight import QuantizedWeight
from tests.conftest import compiled_only, skip_if_interpreted, triton_interpreted
from tests.ops.test_kernels_quant import random_weight

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]


@pytest.fixture
def kernels(kernel_device):
    from deltaspec.ops.triton import moe as triton_moe

    return triton_moe


def skewed_logits(n: int, num_experts: int, seed: int, device: str) -> torch.Tensor:
    """Router logits whose low experts win more often, so some experts get many pairs and some none."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, num_experts, generator=gen) + torch.linspace(3, 0, num_experts)).to(device)


@pytest.mark.parametrize(("n", "num_experts", "top_k"), [(1, 256, 8), (7, 512, 10), (33, 64, 4), (5, 6, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalize", [True, False])
def test_route(kernels, kernel_device, n, num_experts, top_k, dtype, normalize):
    logits = skewed_logits(n, num_experts, n, kernel_device).to(dtype)
    weights, experts = kernels.route(logits, top_k, normalize)
    want_weights, want_experts = moe.route(logits, top_k, normalize)
    assert experts.dtype == torch.int32 and weights.dtype == torch.float32
    probs = logits.cpu().double().softmax(-1)
    # bf16 logits tie often: then either of the tied experts is the same choice (same probability, same slot)
    torch.testing.assert_close(probs.gather(1, experts.cpu().long()), probs.gather(1, want_experts.cpu().long()))
    assert all(len(set(row)) == top_k for row in experts.tolist())
    torch.testing.assert_close(weights.cpu(), want_weights.cpu(), rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize(
    ("n", "num_experts", "shared", "top_k"), [(1, 256, 1, 8), (5, 512, 1, 10), (32, 6, 0, 2), (33, 64, 1, 4)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", [None, (4, 256, 2), (2, 512, 2)])
def test_router_product_and_top_k(kernels, kernel_device, n, num_experts, shared, top_k, dtype, tile):
    """One launch where `router_tile` (or the test) gives one, else the GEMM, then `route`; twice, as graph
    replays run it: the last program of each row to finish routes it and leaves the arrival count at 0 for the
    next pass."""
    if tile and dtype == torch.float32:
        skip_if_interpreted("the given tiles in bfloat16, float32 without a tile")
    hidden = 512
    gen = torch.Generator().manual_seed(n)
    weight = (torch.randn(num_experts + shared, hidden, generator=gen) / hidden**0.5).to(kernel_device, dtype)
    weight[: num_experts // 4] += 0.05  # the low experts win more often
    calls = []

    def product(x):
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, weight)

    for _pass in range(2):
        x = torch.randn(n, hidden, generator=gen).to(kernel_device, dtype)
        logits, weights, experts = kernels.router(x, weight, None, product, num_experts, top_k, True, tile=tile)
        want_logits = torch.nn.functional.linear(x.double(), weight.double())
        bound = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(logits.double(), want_logits, rtol=bound, atol=bound)
        want_weights, want_experts = moe.route(logits[:, :num_experts], top_k, True)
        probs = logits[:, :num_experts].cpu().double().softmax(-1)
        torch.testing.assert_close(probs.gather(1, experts.cpu().long()), probs.gather(1, want_experts.cpu().long()))
        torch.testing.assert_close(weights.cpu(), want_weights.cpu(), rtol=2e-6, atol=2e-7)
    assert calls == ([] if (tile or kernels.router_tile(n)) else [n, n])


@pytest.mark.parametrize(
    ("n", "top_k", "num_experts", "block_m"),
    [(1, 8, 256, 16), (13, 10, 512, 16), (64, 8, 32, 32), (200, 8, 256, 64), (3, 2, 5, 16)],
)
def test_one_program_grouping_equals_the_torch_grouping(kernels, kernel_device, n, top_k, num_experts, block_m):
    experts = moe.route(skewed_logits(n, num_experts, 7, kernel_device), top_k, True)[1]
    reads = torch.zeros(2, dtype=torch.int64, device=kernel_device)
    got = kernels.group_by_expert(experts, num_experts, block_m, reads[:1])
    want = moe.group_by_expert(experts, num_experts, block_m, reads[1:])
    assert torch.equal(got.experts.cpu(), want.experts.cpu())
    assert torch.equal(got.pairs.cpu(), want.pairs.cpu())
    assert reads.tolist() == [experts.unique().numel()] * 2
    below = num_experts // 2  # counting only the experts below an id (the shared expert's pairs are expert E's)
    reads.zero_()
    kernels.group_by_expert(experts, num_experts, block_m, reads[:1], counted=below)
    moe.group_by_expert(experts, num_experts, block_m, reads[1:], counted=below)
    assert reads.tolist() == [experts[experts < below].unique().numel()] * 2


def float_experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(5)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return gate_up.to(device, dtype), down.to(device, dtype)


def quantized_experts(qtype: str, num_experts: int, hidden: int, inter: int, device: str):
    gate_up = random_weight(qtype, num_experts * 2 * inter, hidden, seed=6).view(num_experts, 2 * inter, -1)
    down = random_weight(qtype, num_experts * hidden, inter, seed=7).view(num_experts, hidden, -1)
    return (
        QuantizedWeight([(qtype, gate_up.to(device))], hidden),
        QuantizedWeight([(qtype, down.to(device))], inter),
    )


def products(kernels, x, gate_up, down, weights, experts, shared=None, tile=None) -> torch.Tensor:
    """The kernels' product, checking that it counts the distinct experts it read."""
    reads = torch.zeros(1, dtype=torch.int64, device=x.device)
    got = kernels.expert_products(x, gate_up, down, weights, experts, reads, shared, tile=tile)
    assert reads.item() == experts[experts >= 0].unique().numel()  # another rank's experts (-1) are not read
    return got


def assert_products_match(got: torch.Tensor, x, gate_up, down, weights, experts, shared=None) -> None:
    """Against the float64 reference: float32 kernels within 1e-5 of the output's scale (float32 sums of a
    few hundred terms), bf16 within 2e-2 (bf16 rounds the weights, the intermediate and the outputs)."""

    def wide(w):
        return w.to("cpu") if isinstance(w, QuantizedWeight) else w.cpu().double()

    wide_shared = None
    if shared is not None:
        wide_shared = moe.SharedExpert(wide(shared.gate_up), wide(shared.down), shared.logit.cpu().double())
    reads = torch.zeros(1, dtype=torch.int64)
    args = (wide(gate_up), wide(down), weights.cpu().double(), experts.cpu(), reads, wide_shared)
    want = moe.expert_products(x.cpu().double(), *args)
    bound = 2e-2 if got.dtype == torch.bfloat16 else 1e-5
    scale = want.abs().max().item()
    torch.testing.assert_close(got.cpu().double(), want, rtol=bound, atol=bound * scale)


# ("grouped" or "ungrouped", block_m, block_n, block_k) or ("pair", gate_up_n, down_n, block_k); None: what
# `tile_for` picks
TILES = [
    None,
    ("grouped", 16, 32, 64),
    ("grouped", 32, 64, 64),
    ("grouped", 64, 32, 32),
    ("ungrouped", 16, 32, 64),
    ("pair", 16, 8, 32),
]


def launch_of(kernels, spec):
    if spec is None:
        return None
    kind, *sizes = spec
    if kind == "pair":
        return kernels.PairTile(*sizes)
    return kernels.Tile(*sizes, ungrouped=kind == "ungrouped")


def shared_expert(kernels, stacks, weights, n, kind, gen, dtype, top_k) -> moe.SharedExpert:
    """The shared expert of `weights` (gate|up, down) beside the routed `stacks`, its gate logit a column of the
    router's output, checking that it takes the launches `kind` says: "expert" (shaped and stored like the
    routed experts: the same launches) or "apart" (not: multiplied before them)."""
    logit = torch.randn(n, 9, generator=gen).to(stacks[0].device, dtype)[:, -1]
    shared = moe.SharedExpert(*weights, logit)
    assert kernels.runs_shared_as_expert(*stacks, shared, top_k) == (kind == "expert")
    return shared


def float_shared(kernels, gate_up, down, n, kind, gen, dtype, top_k, same_widths=None) -> moe.SharedExpert | None:
    """None, or a shared expert for float experts: one more expert of their widths (default: for "expert"), or
    of half their intermediate size."""
    if kind is None:
        return None
    same_widths = kind == "expert" if same_widths is None else same_widths
    inter = down.shape[-1] if same_widths else down.shape[-1] // 2
    weights = tuple(w[0] for w in float_experts(1, gate_up.shape[-1], inter, dtype, gate_up.device))
    return shared_expert(kernels, (gate_up, down), weights, n, kind, gen, dtype, top_k)


@pytest.mark.parametrize(
    ("n", "tile"), [(n, tile) for n in (1, 5, 40) for tile in TILES if n <= 5 or tile is None or tile[0] == "grouped"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_shared", [None, "expert", "apart"])
def test_float_expert_products(kernels, kernel_device, n, tile, dtype, with_shared):
    num_experts, hidden, inter, top_k = 12, 96, 80, 4  # widths that leave tiles partly empty
    gate_up, down = float_experts(num_experts, hidden, inter, dtype, kernel_device)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, hidden, generator=gen).to(kernel_device, dtype)
    weights, experts = moe.route(skewed_logits(n, num_experts, n, kernel_device), top_k, True)
    shared = float_shared(kernels, gate_up, down, n, with_shared, gen, dtype, top_k)
    assert kernels.fuses(dtype, gate_up, down)
    got = products(kernels, x, gate_up, down, weights, experts, shared, tile=launch_of(kernels, tile))
    assert_products_match(got, x, gate_up, down, weights, experts, shared)


def test_decode_passes_skip_the_grouping_and_longer_ones_group(kernels):
    assert kernels.tile_for(kernels.PAIR_MAX_TOKENS, 8, 256).ungrouped
    assert isinstance(kernels.tile_for(kernels.PAIR_MAX_TOKENS, 8, 256, quantized=True), kernels.PairTile)
    assert not kernels.tile_for(kernels.PAIR_MAX_TOKENS + 1, 8, 256).ungrouped


GROUPED_16 = ("grouped", 16, 32, 64)
PAIR_SHARED_ELSEWHERE = compiled_only("the Q6_K-Q4_K, FP8 and I4_G32 pair cases, the shared expert in I4_G32's")
# (gate|up type, down type, tokens, launch, with a shared expert, dtype): every type in every kernel; the decode
# GEMVs once per case, in one dtype and wide slabs, to keep the interpreter's share of CI short
QUANT_CASES = [
    *[
        (qtype, qtype, n, GROUPED_16, False, dtype)
        for qtype in ("Q8_0", "Q6_K", "Q4_K")
        for n in (1, 9)
        for dtype in (torch.float32, torch.bfloat16)
    ],
    *[("Q4_K", "Q6_K", 9, GROUPED_16, "expert", dtype) for dtype in (torch.float32, torch.bfloat16)],
    ("Q6_K", "Q6_K", 9, GROUPED_16, "apart", torch.bfloat16),
    ("Q8_0", "Q8_0", 1, None, False, torch.bfloat16),
    ("Q6_K", "Q4_K", 1, ("pair", 32, 16, 256), False, torch.float32),
    pytest.param("Q4_K", "Q6_K", 2, ("pair", 32, 16, 256), "expert", torch.bfloat16, marks=PAIR_SHARED_ELSEWHERE),
    ("Q4_K", "Q6_K", 1, ("pair", 32, 16, 256), "apart", torch.bfloat16),
    *[("FP8_B128", "FP8_B128", n, tile, "expert", torch.bfloat16) for n, tile in ((1, None), (9, GROUPED_16))],
    ("FP8_B128", "FP8_B128", 2, ("pair", 32, 16, 256), False, torch.float32),
    pytest.param("I4_G128", "I4_G32", 1, None, "expert", torch.bfloat16, marks=compiled_only("I4_G32-I4_G128 decode")),
    ("I4_G128", "I4_G32", 9, GROUPED_16, "expert", torch.bfloat16),
    *[("I4_G32", "I4_G128", n, tile, False, torch.float32) for n, tile in ((1, None), (9, GROUPED_16))],
    pytest.param("I4_G128", "I4_G128", 2, ("pair", 32, 16, 256), False, torch.float32, marks=PAIR_SHARED_ELSEWHERE),
    ("I4_G32", "I4_G32", 2, ("pair", 32, 16, 256), "expert", torch.bfloat16),
]


@pytest.mark.parametrize(("gate_up_type", "down_type", "n", "tile", "with_shared", "dtype"), QUANT_CASES)
def test_quantized_expert_products(kernels, kernel_device, gate_up_type, down_type, n, tile, dtype, with_shared):
    num_experts, hidden, inter, top_k = 6, 512, 256, 3
    gate_up = quantized_experts(gate_up_type, num_experts, hidden, inter, kernel_device)[0]
    down = quantized_experts(down_type, num_experts, hidden, inter, kernel_device)[1]
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, hidden, generator=gen).to(kernel_device, dtype)
    weights, experts = moe.route(skewed_logits(n, num_experts, n, kernel_device), top_k, True)
    shared = None
    if with_shared:  # one more expert of the routed types, or ("apart") its gate|up in Q8_0 instead
        shared_type = gate_up_type if with_shared == "expert" else "Q8_0"
        one_gate_up = quantized_experts(shared_type, 1, hidden, inter, kernel_device)[0][0]
        one_down = quantized_experts(down_type, 1, hidden, inter, kernel_device)[1][0]
        shared = shared_expert(kernels, (gate_up, down), (one_gate_up, one_down), n, with_shared, gen, dtype, top_k)
    assert kernels.fuses(dtype, gate_up, down)
    got = products(kernels, x, gate_up, down, weights, experts, shared, tile=launch_of(kernels, tile))
    assert_products_match(got, x, gate_up, down, weights, experts, shared)


def test_other_expert_types_take_the_reference_and_say_they_sync(kernels, kernel_device):
    gate_up = QuantizedWeight([("Q5_K", torch.zeros(2, 8, 176, dtype=torch.uint8, device=kernel_device))], 256)
    down = QuantizedWeight([("Q8_0", torch.zeros(2, 256, 34 * 4 // 4, dtype=torch.uint8, device=kernel_device))], 4 * 8)
    assert not kernels.fuses(torch.float32, gate_up, down) and kernels.experts_sync(torch.float32, gate_up, down)
    floats = float_experts(2, 32, 4, torch.float32, kernel_device)
    assert not kernels.experts_sync(torch.float32, *floats) and kernels.experts_sync(torch.float64, *floats)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_the_kernels_do_not_take_keep_the_shared_expert_on_the_dense_kernels(
    kernels, kernel_device, dtype, monkeypatch
):
    """Q5_K experts (a Q5_K_M file) take the reference loop; their Q8_0 shared expert still takes the dense GGUF
    GEMM rather than the reference's dequantize-then-multiply, with the reference's rounding."""
    num_experts, hidden, inter, top_k, n = 4, 256, 256, 2, 3
    gate_up, down = quantized_experts("Q5_K", num_experts, hidden, inter, kernel_device)
    one_gate_up = quantized_experts("Q8_0", 1, hidden, inter, kernel_device)[0][0]
    one_down = quantized_experts("Q8_0", 1, hidden, inter, kernel_device)[1][0]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n, hidden, generator=gen).to(kernel_device, dtype)
    logit = torch.randn(n, generator=gen).to(kernel_device, dtype)
    shared = moe.SharedExpert(one_gate_up, one_down, logit)
    weights, experts = moe.route(skewed_logits(n, num_experts, 4, kernel_device), top_k, True)
    assert not kernels.fuses(dtype, gate_up, down)
    from deltaspec.ops.triton import quant_matmul

    dense_calls = []
    dense = quant_matmul.quantized_linear
    monkeypatch.setattr(quant_matmul, "quantized_linear", lambda a, w: dense_calls.append(w) or dense(a, w))
    got = products(kernels, x, gate_up, down, weights, experts, shared)
    assert len(dense_calls) == 2 and dense_calls[0] is one_gate_up and dense_calls[1] is one_down
    assert_products_match(got, x, gate_up, down, weights, experts, shared)


@pytest.mark.skipif(triton_interpreted(), reason="a prefill's worth of pairs is too slow for the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_shared", [None, "apart"])
def test_prefill_sized_products_use_the_torch_grouping(kernels, kernel_device, dtype, with_shared):
    """Past the one-program grouping even a shared expert shaped like the routed ones is multiplied apart."""
    num_experts, hidden, inter, top_k, n = 64, 256, 128, 8, 1024  # 8192 pairs: past the one-program grouping
    assert n * top_k > kernels.ALIGN_MAX_PAIRS
    gate_up, down = float_experts(num_experts, hidden, inter, dtype, kernel_device)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(n, hidden, generator=gen).to(kernel_device, dtype)
    weights, experts = moe.route(skewed_logits(n, num_experts, 9, kernel_device), top_k, True)
    shared = float_shared(kernels, gate_up, down, n, with_shared, gen, dtype, top_k, same_widths=True)
    got = products(kernels, x, gate_up, down, weights, experts, shared)
    assert_products_match(got, x, gate_up, down, weights, experts, shared)


@pytest.mark.parametrize("tile", [None, (4, 256, 2)])
def test_the_router_names_the_held_experts_by_their_index_among_them(kernels, kernel_device, tile):
    """Expert parallelism: the fused router and `route` give the weights of one process and each chosen expert's
    index among the rank's held ones, -1 for another rank's."""
    n, num_experts, top_k, hidden = 3, 64, 8, 512
    gen = torch.Generator().manual_seed(12)
    weight = (torch.randn(num_experts, hidden, generator=gen) / hidden**0.5).to(kernel_device)
    x = torch.randn(n, hidden, generator=gen).to(kernel_device)

    def product(rows):
        return torch.nn.functional.linear(rows, weight)

    logits, weights, experts = kernels.router(x, weight, None, product, num_experts, top_k, True, tile=tile)
    for first, held in ((0, 16), (16, 16), (48, 16), (32, 32)):
        want = torch.where((experts >= first) & (experts < first + held), experts - first, -1)
        _, got_weights, local = kernels.router(
            x, weight, None, product, num_experts, top_k, True, first, held, tile=tile
        )
        assert torch.equal(local, want) and torch.equal(got_weights, weights)
        routed_weights, routed = kernels.route(logits, top_k, True, first, held)
        assert torch.equal(routed, want)  # (its launch may reduce in another order than the fused router's)
        torch.testing.assert_close(routed_weights, weights, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("with_shared", [None, "expert"])
@pytest.mark.parametrize("rank", [0, 1])
def test_expert_parallel_products_skip_another_ranks_experts(kernels, kernel_device, tile, with_shared, rank):
    """A rank holding half of 12 experts: the pairs routed to the other half (-1) add nothing on every path (a
    GEMV per pair, one block per pair, the grouping) and the rank's product is the reference's over its experts."""
    num_experts, held, hidden, inter, top_k, n = 12, 6, 96, 80, 4, 5
    gate_up, down = float_experts(held, hidden, inter, torch.float32, kernel_device)  # the rank's experts
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(n, hidden, generator=gen).to(kernel_device)
    weights, experts = moe.route(skewed_logits(n, num_experts, 3, kernel_device), top_k, True, rank * held, held)
    assert bool((experts < 0).any()) and bool((experts >= 0).any())
    shared = float_shared(kernels, gate_up, down, n, with_shared, gen, torch.float32, top_k)
    got = products(kernels, x, gate_up, down, weights, experts, shared, tile=launch_of(kernels, tile))
    assert_products_match(got, x, gate_up, down, weights, experts, shared)


@pytest.mark.parametrize(("n", "tile"), [(2, ("pair", 32, 16, 256)), (9, GROUPED_16)])
def test_expert_parallel_products_of_gguf_experts(kernels, kernel_device, n, tile):
    """The GGUF decode GEMVs (and the grouped kernels) skip another rank's pairs too, the shared expert kept."""
    num_experts, held, hidden, inter, top_k = 8, 4, 512, 256, 3
    gate_up, down = quantized_experts("Q4_K", held, hidden, inter, kernel_device)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, hidden, generator=gen).to(kernel_device, torch.bfloat16)
    weights, experts = moe.route(skewed_logits(n, num_experts, 5, kernel_device), top_k, True, held, held)
    assert bool((experts < 0).any()) and bool((experts >= 0).any())
    one_gate_up = quantized_experts("Q4_K", 1, hidden, inter, kernel_device)[0][0]
    one_down = quantized_experts("Q4_K", 1, hidden, inter, kernel_device)[1][0]
    shared = shared_expert(kernels, (gate_up, down), (one_gate_up, one_down), n, "expert", gen, torch.bfloat16, top_k)
    got = products(kernels, x, gate_up, down, weights, experts, shared, tile=launch_of(kernels, tile))
    assert_products_match(got, x, gate_up, down, weights, experts, shared)
