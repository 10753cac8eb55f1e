"""Trees of drafts (DESIGN §5, trees): growing one from a drafter's proposal, and what the rounds teach about them.

A tree's nodes are draft tokens in the order the verify pass runs them: node j is row j + 1, the root (row 0) the
last sampled token, and `parents[j]` is node j's parent row (parents come before their children). The material is a
`Draft`: the drafter's chain `tokens` (what it conditioned each position on), per position its top candidates with
their probabilities (`Draft.candidates`), and other whole continuations (`Draft.branches`, e.g. n-gram matches).
The children of any node at depth d may be the candidates the drafter gave for position d + 1, as with per-position
heads (Medusa); a branch adds its own path, merged where it meets a candidate path.

Growth by expected accepted length. A node's value is the chance that its whole path is accepted: the product of
its edges' acceptance estimates. Dynamic shape: a candidate edge is worth the drafter's probability for it as the
rounds calibrate it (the measured acceptance of candidates the drafter gave about that probability, pruned ones
included: a drafter's probabilities can be under- or overconfident, and the size below needs chances); static
shape: the acceptance measured for its depth and candidate rank (`TreeStats`), the same every round, so the shape
stays put while the rates do. A branch edge is worth the measured acceptance of branches at its depth; an edge both
proposed takes the larger estimate. A pass then yields 1 + sum of the nodes' values tokens in expectation, and
values only fall going down, so taking the most valuable frontier node first gives, for every size, the tree of most
expected tokens; the size is the one with the most expected tokens per verify cost (`VerifyCostTable`), within the
budget, and never a row count the table says is slower than a larger one.

Row order: depth first, each node's leaf children before its other children, so a recurrence that runs the rows in
order restarts only at a node's second child that has children of its own (`deltaspec.ops.layout`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from deltaspec.spec.drafter import Draft
from deltaspec.spec.policy import VerifyCostTable

BRANCH = -1  # the kind of a node only a branch proposed: BRANCH - i for branch i (the drafter's chain, when it gives
# no candidates, is branch 0)
TREE_WIDTH = 4  # candidates a drafter reports per position when it drafts for a tree


@dataclass
class DraftTree:
    """A tree of drafts in row order (see the module docstring)."""

    tokens: list[int]  # node j's token (row j + 1)
    parents: list[int]  # node j's parent row: 0 the root (the last sampled token), i > 0 node i - 1
    ranks: list[int]  # node j's kind: its candidate rank at its depth (0: the drafter's first choice), or BRANCH - i
    # when only branch i proposed it
    branch: list[int | None]  # the first branch that proposed node j, None: only a candidate
    values: list[float]  # the estimated chance that node j's whole path is accepted

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """Node j's depth: 1 for a child of the root."""
        depth = [0]
        for parent in self.parents:
            depth.append(depth[parent] + 1)
        return depth[1:]

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(len(self.parents)))

    def children(self) -> list[list[int]]:
        """Per row (the root's first), its children's rows, most valuable first (ties: row order)."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for j, parent in enumerate(self.parents):
            kids[parent].append(j + 1)
        for rows in kids:
            rows.sort(key=lambda row: -self.values[row - 1])
        return kids

    def path_tokens(self, row: int) -> list[int]:
        """The draft tokens on the way from the root to row `row` (its own last; none for the root)."""
        tokens = []
        while row > 0:
            tokens.append(self.tokens[row - 1])
            row = self.parents[row - 1]
        return tokens[::-1]

    def cut(self, keep: int) -> DraftTree:
        """The first `keep` nodes (their parents come before them)."""
        return DraftTree(
            self.tokens[:keep],
            self.parents[:keep],
            self.ranks[:keep],
            self.branch[:keep],
            self.values[:keep],
        )

    def without(self, rows: set[int]) -> DraftTree:
        """The tree without the nodes at `rows` and their descendants, rows renumbered."""
        kept, new_row = [], {0: 0}
        for j, parent in enumerate(self.parents):
            if j + 1 not in rows and parent in new_row:
                new_row[j + 1] = len(kept) + 1
                kept.append(j)
        return DraftTree(
            [self.tokens[j] for j in kept],
            [new_row[self.parents[j]] for j in kept],
            [self.ranks[j] for j in kept],
            [self.branch[j] for j in kept],
            [self.values[j] for j in kept],
        )


CALIBRATION_BINS = 10  # drafter probabilities are calibrated in bins of 0.1


@dataclass
class TreeStats:
    """Acceptance of tree edges by depth and kind (candidate rank r >= 0, or BRANCH - i for branch i), and of
    candidate edges by the drafter's probability (bins of 1 / CALIBRATION_BINS): of the times such an edge was
    offered below an accepted node, how often it was the one accepted — exponentially decayed counts over rounds,
    starting from a prior."""

    decay: float = 0.98
    prior_weight: float = 4.0
    offered: dict[tuple[int, int], float] = field(default_factory=dict)
    accepted: dict[tuple[int, int], float] = field(default_factory=dict)
    offered_at: dict[int, float] = field(default_factory=dict)  # by probability bin
    accepted_at: dict[int, float] = field(default_factory=dict)

    @staticmethod
    def prior(kind: int) -> float:
        """Acceptance assumed before any round: a first choice 0.6, rank r 0.15 / r, branch i 0.8 / (i + 1)."""
        return 0.8 / (BRANCH - kind + 1) if kind <= BRANCH else 0.6 if kind == 0 else 0.15 / kind

    def rate(self, depth: int, kind: int) -> float:
        key = (depth, kind)
        weight = self.prior_weight
        return (self.accepted.get(key, 0.0) + weight * self.prior(kind)) / (self.offered.get(key, 0.0) + weight)

    def calibrated(self, prob: float) -> float:
        """The measured acceptance of candidates the drafter gave about probability `prob` (itself as the prior)."""
        b = min(int(prob * CALIBRATION_BINS), CALIBRATION_BINS - 1)
        weight = self.prior_weight
        return (self.accepted_at.get(b, 0.0) + weight * prob) / (self.offered_at.get(b, 0.0) + weight)

    def update(self, tree: DraftTree, path: list[int]) -> None:
        """A round verified `tree` and accepted the rows `path` (the root first): the children of every node on it
        were offered, and the next row of the path (if any) accepted."""
        for counts in (self.offered, self.accepted):
            for key in counts:
                counts[key] *= self.decay
        kids, depths = tree.children(), tree.depths
        for step, row in enumerate(path):
            taken = path[step + 1] if step + 1 < len(path) else None
            for child in kids[row]:
                j = child - 1
                branch = tree.branch[j]
                for kind in {tree.ranks[j], BRANCH - branch} if branch is not None else {tree.ranks[j]}:
                    key = (depths[j], kind)
                    self.offered[key] = self.offered.get(key, 0.0) + 1.0
                    self.accepted[key] = self.accepted.get(key, 0.0) + (child == taken)

    def calibrate(self, candidates: list[list[tuple[int, float]]], committed: list[int]) -> None:
        """The step after a draft committed the tokens `committed` (a verified tree's accepted path and the target's
        own token, or the one token of a plain decode step when the tree was pruned to nothing): at each position
        they reach, every candidate the drafter gave there is counted by its probability's bin, accepted when it is
        the committed token — whether or not the tree held it, so pruned candidates are measured too."""
        for counts in (self.offered_at, self.accepted_at):
            for key in counts:
                counts[key] *= self.decay
        for offered, token in zip(candidates, committed):
            for candidate, prob in offered:
                b = min(int(prob * CALIBRATION_BINS), CALIBRATION_BINS - 1)
                self.offered_at[b] = self.offered_at.get(b, 0.0) + 1.0
                self.accepted_at[b] = self.accepted_at.get(b, 0.0) + (candidate == token)


@dataclass
class _Edge:
    value: float  # the edge's own acceptance estimate
    rank: int  # its kind
    branch: int | None  # the first branch that proposes it


def grow_tree(
    draft: Draft,
    max_nodes: int,
    stats: TreeStats,
    static: bool,
    costs: VerifyCostTable | None,
) -> DraftTree:
    """The tree of at most `max_nodes` nodes (rows - 1) grown from `draft` by expected accepted length, sized by
    `costs` (None: as large as the material and `max_nodes` allow). Its depth is that of the draft's chain or
    branches."""
    candidates = draft.candidates or []
    branches = [] if draft.candidates else [list(draft.tokens)]  # a chain without candidates is branch 0
    branches += [list(b.tokens) for b in draft.branches or ()]
    branch_next: dict[tuple[int, ...], dict[int, int]] = {}  # token path -> next token -> the first branch with it
    for i, tokens in enumerate(branches):
        for depth, token in enumerate(tokens):
            branch_next.setdefault(tuple(tokens[:depth]), {}).setdefault(token, i)

    def edges(path: tuple[int, ...]) -> dict[int, _Edge]:
        """The children a node with token path `path` may get, by token."""
        depth = len(path) + 1
        found: dict[int, _Edge] = {}
        if depth <= len(candidates):
            for rank, (token, prob) in enumerate(candidates[depth - 1]):
                found[token] = _Edge(stats.rate(depth, rank) if static else stats.calibrated(prob), rank, None)
        for token, branch in sorted(branch_next.get(path, {}).items(), key=lambda item: item[1]):
            value = stats.rate(depth, BRANCH - branch)
            edge = found.get(token)
            found[token] = (
                _Edge(max(edge.value, value), edge.rank, branch)
                if edge is not None
                else _Edge(value, BRANCH - branch, branch)
            )
        return found

    # Best first: (-value, order, parent node index (-1: the root), token path, edge).
    picked: list[tuple[int, tuple[int, ...], _Edge, float]] = []  # (parent index, path, edge, value)
    order = 0
    frontier: list = []
    for token, edge in edges(()).items():
        heapq.heappush(frontier, (-edge.value, order, -1, (token,), edge))
        order += 1
    while frontier and len(picked) < max_nodes:
        negative, _, parent, path, edge = heapq.heappop(frontier)
        value = -negative
        if value <= 0:
            break
        picked.append((parent, path, edge, value))
        for token, child in edges(path).items():
            heapq.heappush(frontier, (-value * child.value, order, len(picked) - 1, path + (token,), child))
            order += 1
    keep = _size(picked, costs, max_nodes)
    return _in_row_order(picked[:keep])


def _size(picked: list, costs: VerifyCostTable | None, max_nodes: int) -> int:
    """How many of the nodes (most valuable first) give the most expected tokens per verify cost."""
    if costs is None or not picked:
        return len(picked)
    allowed = set(costs.allowed(min(max_nodes, len(picked))))
    best, best_rate, expected = 0, 1.0 / costs.cost(1), 1.0
    for n, (*_, value) in enumerate(picked, 1):
        expected += value
        rate = expected / costs.cost(n + 1)
        if n in allowed and rate > best_rate:
            best, best_rate = n, rate
    return best


def _in_row_order(picked: list) -> DraftTree:
    """The picked nodes (each after its parent) depth first, leaf children before the others, the others most
    valuable first."""
    kids: dict[int, list[int]] = {}
    for i, (parent, *_rest) in enumerate(picked):
        kids.setdefault(parent, []).append(i)
    tree = DraftTree([], [], [], [], [])
    stack = [(-1, 0)]  # (picked index, its row)
    while stack:
        node, row = stack.pop()
        if node >= 0:
            _, path, edge, value = picked[node]
            tree.tokens.append(path[-1])
            tree.parents.append(row)
            tree.ranks.append(edge.rank)
            tree.branch.append(edge.branch)
            tree.values.append(value)
            row = len(tree.tokens)
        ordered = sorted(kids.get(node, []), key=lambda i: (i in kids, -picked[i][3], i))
        stack.extend((child, row) for child in reversed(ordered))
    return tree
