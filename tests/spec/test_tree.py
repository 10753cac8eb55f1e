"""Trees of drafts, the parts without a model: growing a tree by expected accepted length, its row order, cutting and
pruning it, the statistics, and verification (greedy walks; lossless multi-candidate sampling, in distribution)."""

from __future__ import annotations

import itertools

import pytest
import torch

from deltaspec.ops.layout import TREE_RESTART, recurrence_flags
from deltaspec.sample.params import SamplingParams
from deltaspec.spec.drafter import Draft
from deltaspec.spec.policy import VerifyCostTable
from deltaspec.spec.tree import BRANCH, DraftTree, TreeStats, grow_tree
from deltaspec.spec.tree_verify import verify_tree_greedy, verify_tree_sampling


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.path_tokens(row)) for row in range(1, len(tree) + 1)}


def test_best_first_takes_the_most_likely_paths():
    # position 1: 10 (0.6) or 11 (0.3); position 2: 20 (0.5) or 21 (0.4); children of either first token use them
    draft = Draft([10, 20], candidates=[[(10, 0.6), (11, 0.3)], [(20, 0.5), (21, 0.4)]])
    tree = grow_tree(draft, 4, TreeStats(), static=False, costs=None)
    # values: 10: .6, 10-20: .3, 10-21: .24, 11: .3, 11-20: .15, 11-21: .12 -> the four best
    assert paths(tree) == {(10,), (10, 20), (10, 21), (11,)}
    assert sorted(tree.values, reverse=True) == pytest.approx([0.6, 0.3, 0.3, 0.24])
    for row in range(1, len(tree) + 1):  # parents come first, and a node's value is its path's product
        assert tree.parents[row - 1] < row


def test_rows_are_depth_first_with_leaves_first():
    draft = Draft([1, 2, 3], candidates=[[(1, 0.9), (4, 0.5)], [(2, 0.9), (5, 0.5)], [(3, 0.9), (6, 0.2)]])
    tree = grow_tree(draft, 9, TreeStats(), static=False, costs=None)
    parents = [-1, *tree.parents]
    kids = tree.children()
    for row in range(len(tree) + 1):  # a node's leaf children come right after it
        leaves = [c for c in sorted(kids[row]) if not kids[c]]
        inner = [c for c in sorted(kids[row]) if kids[c]]
        assert all(leaf < other for leaf in leaves for other in inner)
    restarts = sum(bool(f & TREE_RESTART) for f in recurrence_flags(parents))
    branching = sum(max(0, len([c for c in kids[r] if kids[c]]) - 1) for r in range(len(tree) + 1))
    assert restarts == branching  # only a second child with children of its own restarts the recurrence


def test_size_follows_the_verify_costs():
    draft = Draft([1, 2, 3, 4], candidates=[[(t, 0.9)] for t in (1, 2, 3, 4)])
    cheap = VerifyCostTable((1.0, 1.01, 1.02, 1.03, 1.04))
    dear = VerifyCostTable((1.0, 2.0, 3.0, 4.0, 5.0))
    assert len(grow_tree(draft, 4, TreeStats(), False, cheap)) == 4
    assert len(grow_tree(draft, 4, TreeStats(), False, dear)) == 0
    # a row count slower than a longer one is never chosen: 3 rows cost more than 4
    odd = VerifyCostTable((1.0, 1.05, 1.5, 1.1, 1.2))
    assert len(grow_tree(draft, 4, TreeStats(), False, odd)) in (3, 4)
    assert len(grow_tree(draft, 4, TreeStats(), False, odd)) != 2


def test_branches_merge_with_candidates_and_keep_their_own_paths():
    draft = Draft(
        [1, 2],
        candidates=[[(1, 0.7), (3, 0.2)], [(2, 0.6), (4, 0.1)]],
        branches=[Draft([1, 2, 9]), Draft([5, 6])],
    )
    tree = grow_tree(draft, 12, TreeStats(), static=False, costs=None)
    assert {(1, 2, 9), (5, 6), (1, 2), (1,)} <= paths(tree)
    by_path = {tuple(tree.path_tokens(r)): r - 1 for r in range(1, len(tree) + 1)}
    assert tree.ranks[by_path[(1,)]] == 0 and tree.branch[by_path[(1,)]] == 0  # both proposed it
    assert tree.ranks[by_path[(5,)]] == BRANCH - 1 and tree.branch[by_path[(5,)]] == 1
    # a chain without candidates is branch 0, valued by the measured branch rates
    plain = grow_tree(Draft([7, 8]), 4, TreeStats(), static=False, costs=None)
    assert plain.tokens == [7, 8] and plain.is_chain and plain.ranks == [BRANCH, BRANCH]


def test_static_shape_ignores_this_rounds_probabilities():
    stats = TreeStats()
    a = Draft([1, 2], candidates=[[(1, 0.99), (3, 0.01)], [(2, 0.99), (4, 0.01)]])
    b = Draft([5, 6], candidates=[[(5, 0.2), (7, 0.8)], [(6, 0.1), (8, 0.9)]])
    ta, tb = (grow_tree(d, 3, stats, static=True, costs=None) for d in (a, b))
    assert ta.parents == tb.parents and ta.ranks == tb.ranks


def test_cut_and_without_keep_a_tree():
    tree = grow_tree(
        Draft([1, 2, 3], candidates=[[(1, 0.8), (4, 0.5)], [(2, 0.8), (5, 0.5)], [(3, 0.8)]]),
        8,
        TreeStats(),
        False,
        None,
    )
    for keep in range(len(tree) + 1):
        cut = tree.cut(keep)
        assert all(p <= j for j, p in enumerate(cut.parents))
    row_of_1 = next(r for r in range(1, len(tree) + 1) if tree.path_tokens(r) == [1])
    pruned = tree.without({row_of_1})
    assert all(path[0] != 1 for path in paths(pruned)) and (4,) in paths(pruned)


def test_statistics_count_offers_below_accepted_nodes():
    tree = grow_tree(
        Draft([1, 2], candidates=[[(1, 0.8), (3, 0.1)], [(2, 0.8), (4, 0.1)]]), 6, TreeStats(), False, None
    )
    stats = TreeStats(decay=1.0, prior_weight=0.0)
    row = {tuple(tree.path_tokens(r)): r for r in range(1, len(tree) + 1)}
    stats.update(tree, [0, row[(3,)]])  # the second choice was accepted at depth 1, nothing below it
    assert stats.rate(1, 1) == 1.0 and stats.rate(1, 0) == 0.0
    assert (2, 0) in stats.offered  # the children of node 3 were offered and none taken


def test_greedy_walk_follows_the_argmax():
    tree = DraftTree([5, 6, 7, 8], [0, 1, 0, 3], [0, 0, 1, 0], [None] * 4, [0.9, 0.8, 0.1, 0.05])
    # rows: 0 root, 1 '5', 2 '5 6', 3 '7', 4 '7 8'
    assert verify_tree_greedy([7, 0, 0, 8, 3], tree) == ([7, 8, 3], [0, 3, 4])
    assert verify_tree_greedy([5, 9, 0, 0, 0], tree) == ([5, 9], [0, 1])
    assert verify_tree_greedy([2, 0, 0, 0, 0], tree) == ([2], [0])


def test_greedy_sampling_params_take_the_argmax_walk():
    tree = DraftTree([5, 6, 7], [0, 1, 0], [0, 0, 1], [None] * 3, [0.9, 0.8, 0.1])
    logits = torch.randn(4, 10, dtype=torch.float64)
    logits[0, 7] = logits[3, 2] = 10.0
    ((tokens, rows),) = verify_tree_sampling([logits], [tree], [SamplingParams(temperature=0.0)], [None])
    assert (tokens, rows) == ([7, 2], [0, 3])


def test_tree_sampling_matches_the_target_distribution():
    """Each row's target distribution is a function of its path (a fixed random Markov model); the emitted tokens
    must be distributed as sampling that model directly: exactly, checked against the exact probabilities."""
    vocab, n = 5, 20_000
    gen = torch.Generator().manual_seed(3)
    table = torch.softmax(torch.randn(vocab + 1, vocab, generator=gen, dtype=torch.float64) * 1.5, dim=-1)

    def dist(path: list[int]) -> torch.Tensor:  # the target's next-token distribution after `path`
        return table[path[-1] if path else vocab]

    tree = DraftTree([0, 1, 2, 4, 3], [0, 1, 0, 0, 4], [0, 0, 1, 2, 0], [None] * 5, [0.5, 0.3, 0.2, 0.1, 0.05])
    logits = torch.stack([dist(tree.path_tokens(r)).log() for r in range(len(tree) + 1)])
    params = SamplingParams(temperature=1.0)
    generators = [torch.Generator().manual_seed(s) for s in range(n)]
    results = verify_tree_sampling([logits] * n, [tree] * n, [params] * n, generators)
    first = torch.bincount(torch.tensor([tokens[0] for tokens, _ in results]), minlength=vocab).double()
    expected = dist([]) * n
    assert float(((first - expected) ** 2 / expected).sum()) < 18.5  # 4 degrees of freedom, p = 0.001
    # the second token, given the first was one of the root's children that have children of their own
    for t1 in (0, 4):
        seconds = [tokens[1] for tokens, _ in results if tokens[0] == t1 and len(tokens) > 1]
        counts = torch.bincount(torch.tensor(seconds), minlength=vocab).double()
        expected = dist([t1]) * len(seconds)
        assert float(((counts - expected) ** 2 / expected).sum()) < 18.5
    assert all(len(tokens) == len(rows) for tokens, rows in results)


def test_tree_sampling_is_deterministic_per_generator():
    tree = DraftTree([1, 2, 3], [0, 1, 0], [0, 0, 1], [None] * 3, [0.5, 0.4, 0.3])
    logits = torch.randn(4, 6, dtype=torch.float64)
    params = SamplingParams(temperature=0.8)
    runs = [verify_tree_sampling([logits], [tree], [params], [torch.Generator().manual_seed(9)]) for _ in range(3)]
    assert all(r == runs[0] for r in runs)


@pytest.mark.parametrize("width", [1, 2, 3])
def test_every_candidate_path_is_reachable(width):
    candidates = [[(10 * d + r, 0.5 / (r + 1)) for r in range(width)] for d in range(3)]
    tree = grow_tree(Draft([c[0][0] for c in candidates], candidates=candidates), 100, TreeStats(), False, None)
    expected = {p for depth in (1, 2, 3) for p in itertools.product(*[[t for t, _ in c] for c in candidates[:depth]])}
    assert paths(tree) == expected
