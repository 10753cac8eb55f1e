"""Verification of trees of drafts (DESIGN §5, trees): greedy, and lossless multi-candidate rejection sampling.

Sequence b ran 1 + n_b rows: row 0 the last sampled token, row j + 1 its tree's node j (`deltaspec.spec.tree`);
row r's target distribution predicts the token after the path to r. Each result is `(tokens, rows)`: the accepted
path's tokens followed by exactly one target token, and the path's rows from the root (row 0), one per token.

Greedy (`verify_tree_greedy`, from each row's argmax): from the root, move to the child whose token is the target's
argmax at the current row; stop at a row none of whose children has it and append that argmax. This equals plain
greedy decoding token for token.

Sampling (`verify_tree_sampling`; SpecInfer's and EAGLE's scheme for candidates that are fixed tokens): at the current
row, with the target's processed distribution p there, its children are tried most valuable first; child c with
token t is accepted when u_c * (1 - r) < p(t), r the probability of the children rejected so far at that row, i.e.
with probability p'(t) for p' = p without the rejected children, renormalised. The first accepted child becomes the
current row. When every child is rejected, the token is drawn from p' (from p at a row without children: the bonus
token after an accepted leaf), by the exponential race. Each step thus samples exactly from p, so the output is
distributed as plain sampling. Greedy requests (p one-hot at the argmax) take the argmax walk and draw nothing.

Randomness, per sequence in a fixed order: `torch.rand(n_b)` (one uniform per node, whether it is tried or not),
then one [V] Exp(1) vector; sequences without a generator share torch's default one, in batch order. Two
device-to-host transfers per call: the children's probabilities with the uniforms, then the final tokens.
"""

from __future__ import annotations

import torch

from deltaspec.sample.params import SamplingParams
from deltaspec.sample.sampler import processed_probs
from deltaspec.spec.tree import DraftTree


def verify_tree_greedy(argmax: list[int], tree: DraftTree) -> tuple[list[int], list[int]]:
    """Greedy verification from the argmax of each of the pass's 1 + len(tree) rows."""
    kids = tree.children()
    rows, tokens = [0], []
    while True:
        target = argmax[rows[-1]]
        tokens.append(target)
        child = next((c for c in kids[rows[-1]] if tree.tokens[c - 1] == target), None)
        if child is None:
            return tokens, rows
        rows.append(child)


def verify_tree_sampling(
    target_logits: list[torch.Tensor],
    trees: list[DraftTree],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[tuple[list[int], list[int]]]:
    """Lossless verification of each tree (`target_logits[b]` [1 + len(trees[b]), V], with the request's penalties
    and masks applied per row); see the module docstring."""
    if not trees:
        return []
    logits = torch.cat(target_logits)  # [R, V]
    device = logits.device
    sizes = [len(tree) + 1 for tree in trees]
    starts = [sum(sizes[:b]) for b in range(len(trees))]
    p = processed_probs(logits, [q for q, size in zip(params, sizes) for _ in range(size)])  # [R, V]
    dtype = p.dtype

    parent_rows = [start + parent for start, tree in zip(starts, trees) for parent in tree.parents]
    node_tokens = [token for tree in trees for token in tree.tokens]
    index = torch.tensor([parent_rows, node_tokens], dtype=torch.long, device=device)
    child_p = p[index[0], index[1]]  # [N] each node's token's probability at its parent's row
    uniform = torch.zeros(len(node_tokens), dtype=dtype, device=device)  # 0 for greedy requests
    noise = torch.ones(len(trees), p.shape[1], dtype=dtype, device=device)  # [B, V]
    first = 0
    for b, (tree, q, generator) in enumerate(zip(trees, params, generators)):
        if not q.greedy:
            uniform[first : first + len(tree)] = torch.rand(len(tree), generator=generator, dtype=dtype, device=device)
            noise[b].exponential_(generator=generator)
        first += len(tree)
    noise.clamp_min_(torch.finfo(dtype).tiny)  # a zero draw would make 0 / 0 = NaN, which argmax would pick
    probs, draws = torch.stack([child_p, uniform]).tolist()

    results, final_rows, rejected = [], [], []
    first = 0
    for b, tree in enumerate(trees):
        kids, path, refused = tree.children(), [0], []
        while True:
            taken, mass = None, 0.0
            for child in kids[path[-1]]:
                node = first + child - 1
                if draws[node] * (1.0 - mass) < probs[node]:
                    taken = child
                    break
                mass += probs[node]
                refused.append((b, tree.tokens[child - 1]))
            if taken is None:
                break
            path.append(taken)
            refused = []
        rejected += refused
        final_rows.append(starts[b] + path[-1])
        results.append(([tree.tokens[row - 1] for row in path[1:]], path))
        first += len(tree)

    rows = torch.tensor(final_rows, dtype=torch.long, device=device)
    residual = p[rows]  # [B, V] a copy
    if rejected:
        which = torch.tensor(rejected, dtype=torch.long, device=device)
        residual[which[:, 0], which[:, 1]] = 0.0
    mass = residual.sum(dim=-1, keepdim=True)
    dist = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(dtype).tiny), p[rows])
    drawn = (dist / noise).argmax(dim=-1)  # [B]
    is_greedy = torch.tensor([q.greedy for q in params], dtype=torch.bool, device=device)
    final = torch.where(is_greedy, logits[rows].argmax(dim=-1), drawn).tolist()
    return [(tokens + [token], path) for (tokens, path), token in zip(results, final)]
