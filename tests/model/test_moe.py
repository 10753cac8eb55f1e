"""The mixture-of-experts references in float64 on the CPU: the router's choice, the grouping of (token, slot)
pairs by expert that the fused kernels read (its invariants, and a product computed block by block from it
equals the reference), and the reference expert products against a token-by-token definition."""

import pytest
import torch
import torch.nn.functional as F

from deltaspec.ops import moe


def random_experts(n: int, top_k: int, num_experts: int, seed: int) -> torch.Tensor:
    """[n, top_k] int32 distinct experts per token, skewed so that some experts get many pairs."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, num_experts, generator=gen, dtype=torch.float64) + torch.linspace(2, 0, num_experts)
    return moe.route(logits, top_k, True)[1]


def test_route_picks_the_most_probable_experts_and_renormalises():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 12, generator=gen, dtype=torch.float64)
    weights, experts = moe.route(logits, 3, True)
    probs = logits.softmax(-1)
    assert experts.dtype == torch.int32 and weights.dtype == torch.float64
    for row in range(5):
        assert set(experts[row].tolist()) == set(probs[row].argsort(descending=True)[:3].tolist())
        chosen = probs[row, experts[row].long()]
        torch.testing.assert_close(weights[row], chosen / chosen.sum(), rtol=0, atol=1e-15)
    raw, _ = moe.route(logits, 3, False)
    torch.testing.assert_close(raw, probs.gather(1, experts.long()), rtol=0, atol=1e-15)
    assert moe.route(logits.float(), 3, True)[0].dtype == torch.float32


@pytest.mark.parametrize(
    ("n", "top_k", "num_experts", "block_m"),
    [(1, 8, 64, 16), (3, 2, 8, 4), (37, 4, 16, 16), (300, 8, 64, 16), (50, 3, 5, 64)],
)
def test_grouping_puts_every_pair_once_in_its_experts_blocks(n, top_k, num_experts, block_m):
    experts = random_experts(n, top_k, num_experts, seed=n)
    reads = torch.zeros(1, dtype=torch.int64)
    grouping = moe.group_by_expert(experts, num_experts, block_m, reads)
    assert reads.item() == experts.unique().numel()
    num_pairs = n * top_k
    blocks = grouping.experts.numel()
    assert blocks == moe.max_blocks(num_pairs, num_experts, block_m)
    assert grouping.pairs.shape == (blocks * block_m,)
    rows = grouping.pairs.view(blocks, block_m)
    flat = experts.reshape(-1)
    seen = rows[rows < num_pairs]
    assert sorted(seen.tolist()) == list(range(num_pairs))  # every pair exactly once
    counts = torch.bincount(flat.long(), minlength=num_experts)
    used = grouping.experts[grouping.experts >= 0]
    assert torch.equal(grouping.experts[: used.numel()], used)  # unused blocks (-1) only at the end
    assert used.tolist() == sorted(used.tolist())  # experts in increasing order
    for expert in range(num_experts):
        its_blocks = rows[grouping.experts == expert]
        assert its_blocks.shape[0] == -(-counts[expert].item() // block_m)
        pairs = its_blocks[its_blocks < num_pairs]
        assert bool((flat[pairs.long()] == expert).all())
        assert pairs.tolist() == sorted(pairs.tolist())  # an expert's pairs keep their order
        assert bool((its_blocks.reshape(-1)[: pairs.numel()] == pairs).all())  # padding only after them


def expert_weights(num_experts: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen, dtype=torch.float64) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen, dtype=torch.float64) / inter**0.5
    return gate_up, down


def test_reference_products_follow_the_token_by_token_definition():
    gate_up, down = expert_weights(6, 16, 8, seed=1)
    x = torch.randn(9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    weights, experts = moe.route(torch.randn(9, 6, dtype=torch.float64), 3, True)
    shared_gate_up, shared_down = (w[0] for w in expert_weights(1, 16, 5, seed=5))
    shared_logit = torch.randn(9, dtype=torch.float64)
    reads = torch.zeros(1, dtype=torch.int64)
    shared = moe.SharedExpert(shared_gate_up, shared_down, shared_logit)
    got = moe.expert_products(x, gate_up, down, weights, experts, reads, shared)
    assert reads.item() == len(set(experts.reshape(-1).tolist()))
    for token in range(9):
        gate, up = (shared_gate_up @ x[token]).chunk(2)
        want = torch.sigmoid(shared_logit[token]) * (shared_down @ (F.silu(gate) * up))
        for slot in range(3):
            e = experts[token, slot].item()
            gate, up = (gate_up[e] @ x[token]).chunk(2)
            want += weights[token, slot] * (down[e] @ (F.silu(gate) * up))
        torch.testing.assert_close(got[token], want, rtol=0, atol=1e-13)


@pytest.mark.parametrize("block_m", [4, 16])
def test_a_product_computed_block_by_block_from_the_grouping_equals_the_reference(block_m):
    """What each program of the grouped kernels computes (one block of one expert's pairs), in float64."""
    num_experts, hidden, inter, top_k, n = 7, 24, 10, 3, 23
    gate_up, down = expert_weights(num_experts, hidden, inter, seed=3)
    x = torch.randn(n, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    weights, experts = moe.route(torch.randn(n, num_experts, dtype=torch.float64), top_k, True)
    grouping = moe.group_by_expert(experts, num_experts, block_m)
    per_pair = torch.zeros(n * top_k, hidden, dtype=torch.float64)
    for block, expert in enumerate(grouping.experts.tolist()):
        if expert < 0:
            continue
        pairs = grouping.pairs[block * block_m : (block + 1) * block_m].long()
        pairs = pairs[pairs < n * top_k]
        gate, up = F.linear(x[pairs // top_k], gate_up[expert]).chunk(2, dim=-1)
        per_pair[pairs] = F.linear(F.silu(gate) * up, down[expert]) * weights.reshape(-1)[pairs, None]
    want = moe.expert_products(x, gate_up, down, weights, experts, torch.zeros(1, dtype=torch.int64))
    torch.testing.assert_close(per_pair.view(n, top_k, hidden).sum(1), want, rtol=0, atol=1e-13)


def test_expert_parallel_ranks_route_to_their_experts_and_add_up_to_the_whole():
    """Two ranks of expert parallelism: each names the chosen experts it holds by their index among its own (-1 for
    the other rank's), its grouping leaves the others' pairs out, and the two ranks' products add up to the
    product over all the experts."""
    num_experts, hidden, inter, top_k, n = 8, 16, 6, 3, 11
    gate_up, down = expert_weights(num_experts, hidden, inter, seed=7)
    x = torch.randn(n, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    logits = torch.randn(n, num_experts, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    weights, experts = moe.route(logits, top_k, True)
    whole = moe.expert_products(x, gate_up, down, weights, experts, torch.zeros(1, dtype=torch.int64))
    total, held = torch.zeros_like(whole), num_experts // 2
    for rank in (0, 1):
        first = rank * held
        rank_weights, local = moe.route(logits, top_k, True, first, held)
        assert torch.equal(rank_weights, weights)  # renormalised over all top_k, wherever they are held
        mine = (experts >= first) & (experts < first + held)
        assert torch.equal(local, torch.where(mine, experts - first, -1))
        grouping = moe.group_by_expert(local, held, 4)
        grouped = grouping.pairs[grouping.pairs < n * top_k]
        assert sorted(grouped.tolist()) == torch.nonzero(mine.reshape(-1)).view(-1).tolist()
        reads = torch.zeros(1, dtype=torch.int64)
        stacks = gate_up[first : first + held], down[first : first + held]
        total += moe.expert_products(x, *stacks, weights, local, reads)
        assert reads.item() == local[local >= 0].unique().numel()
    torch.testing.assert_close(total, whole, rtol=0, atol=1e-13)
