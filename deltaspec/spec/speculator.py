"""Speculator (DESIGN §3, §5): everything speculative about a step, on behalf of the engine.

It owns the drafter (one drafter, or a neural one with n-gram behind `CombinedDrafter`), the draft-length
policy, verification (greedy from the pass's argmax, lossless rejection sampling from logits, penalties,
min_tokens and the structured-output mask applied per verify row; a constrained sequence's draft is cut at its
first token the constraint refuses, after it for a sampled draft), the rollback of rejected rows (through the
cache manager, which alone moves the replay-log cursor), acceptance statistics, and the drafter's notices
(hidden states, commits, finishes).

With trees (`TreeSettings`), each draft becomes a tree of drafts grown from the drafter's candidates and branches
(`deltaspec.spec.tree`), pruned to what a constraint allows, and verified by `deltaspec.spec.tree_verify`; the
accepted path's rows stand (the cache manager moves their KV down to their positions), and the rounds teach the
trees' statistics.

Per step the engine calls `propose(running)` before scheduling; after the pass, `verify(outputs)` for the
sequences that verified drafts (it changes nothing: the tokens to append and the accepted count of each),
`commit(out, verdict, append)` for each of them (roll back, record, append through `append`, tell the
drafter), then `observe(outputs)` with every output; `finish(seq)` when a sequence ends.

A drafter that raises costs its sequences their drafts, not their requests: a failed batch proposal is
retried one sequence at a time, a sequence whose own proposal fails (or is no valid draft: too long, or
token ids outside the vocabulary) decodes without a draft that step, and a failed notice makes the drafter
forget the sequence (it starts over from its next proposal).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from deltaspec.cache.manager import CacheManager
from deltaspec.errors import DeltaspecError
from deltaspec.execution.runner import SeqOutput
from deltaspec.execution.sequence import Sequence
from deltaspec.sample.logprobs import gather_logprobs
from deltaspec.sample.sampler import apply_penalties
from deltaspec.sample.structured import apply_bitmask
from deltaspec.spec.drafter import Draft, Drafter, DraftRequest
from deltaspec.spec.policy import VerifyCostTable
from deltaspec.spec.tree import TREE_WIDTH, DraftTree, TreeStats, grow_tree
from deltaspec.spec.tree_verify import verify_tree_greedy, verify_tree_sampling
from deltaspec.spec.verify import verify_greedy_tokens, verify_sampling

log = logging.getLogger("deltaspec.spec")

Append = Callable[[Sequence, list[int], list], None]  # (sequence, tokens, logprobs per token)


class DraftLength(Protocol):
    """How many tokens to draft for a sequence (`deltaspec.spec.policy`)."""

    def choose(self, seq_id: str, budget: int) -> int: ...

    def update(self, seq_id: str, drafted: int, accepted: int) -> None: ...

    def forget(self, seq_id: str) -> None: ...


@dataclass
class Verdict:
    """What verification decided for one sequence: the accepted drafts and the target's own token after them, and
    for a tree the rows of the accepted path (the root's first; one per token)."""

    tokens: list[int]
    accepted: int
    logprobs: list  # per token: its logprobs, or None when the request asked for none
    rows: list[int] | None = None  # a tree's accepted path; None: a chain's first 1 + accepted rows


@dataclass
class TreeSettings:
    """Trees of drafts: at most `max_nodes` nodes (the verify pass's rows less the root), grown as the `static` shape
    or the dynamic one, sized by `costs` (None: always as large as they grow)."""

    max_nodes: int
    static: bool = False
    costs: VerifyCostTable | None = None


def row_logits(out: SeqOutput, tree: DraftTree | None = None) -> torch.Tensor:
    """The verify rows' logits [1 + k, V] with the request's penalties, min_tokens mask and structured-output mask
    applied per row: row i continues the output with the drafts on its way (a chain's first i, a tree's path to
    row i), so its counts include them, and its mask is the constraint's after them."""
    seq, rows = out.seq, out.logits.shape[0]
    paths = (
        [tree.path_tokens(i) for i in range(rows)]
        if tree is not None
        else [seq.proposal.tokens[:i] for i in range(rows)]
    )
    outputs = [seq.output_ids + path for path in paths]
    logits = apply_penalties(
        out.logits, [seq.request.prompt_ids] * rows, outputs, [seq.request.params] * rows, [seq.request.eos_ids] * rows
    )
    if seq.request.grammar is not None:
        masks = (
            seq.request.grammar.path_masks(paths)
            if tree is not None
            else seq.request.grammar.draft_masks(seq.proposal.tokens[: rows - 1])
        )
        logits = apply_bitmask(logits, masks)
    return logits


class Speculator:
    def __init__(
        self,
        drafter: Drafter,
        policy: DraftLength,
        cache: CacheManager,
        max_model_len: int,
        vocab_size: int,
        trees: TreeSettings | None = None,
    ):
        if not isinstance(drafter, Drafter):
            raise DeltaspecError(
                f"{type(drafter).__name__} is not a Drafter: it needs name, needs_hidden, propose, "
                "observe, on_commit, on_finish and state_bytes (deltaspec.spec.drafter)."
            )
        self.drafter, self.policy, self.cache, self.max_model_len = drafter, policy, cache, max_model_len
        self.vocab_size, self.trees = vocab_size, trees
        self.tree_stats = TreeStats()
        self.grown: dict[str, tuple[DraftTree, list[int]]] = {}  # a sequence's tree, and the drafter's own chain
        self.calibrating: dict[str, tuple[list, int]] = {}  # a sequence's last candidates, and its output length then
        self.tree_rounds = 0  # verify rounds whose drafts branched, since start

    @property
    def name(self) -> str:
        return self.drafter.name

    def propose(self, running: list[Sequence]) -> None:
        """Drafts for every decoding sequence, within its policy's length and its budget."""
        requests, seqs = [], []
        for seq in running:
            self._calibrate(seq)
            if not seq.decoding:
                continue
            budget = min(
                seq.request.params.max_tokens - len(seq.output_ids) - 1, self.max_model_len - seq.num_tokens - 1
            )
            k = self.policy.choose(seq.request.request_id, budget)
            if k > 0:
                width = TREE_WIDTH if self.trees is not None else 0
                requests.append(
                    DraftRequest(seq.request.request_id, seq.all_ids, k, seq.request.params, seq.request.grammar, width)
                )
                seqs.append(seq)
        if not requests:
            return
        try:
            drafts = self.drafter.propose(requests)
        except Exception:  # noqa: BLE001 - one sequence's drafter failure must not cost the others their drafts
            log.exception("the %s drafter failed on a batch of %d; proposing one at a time", self.name, len(requests))
            self._end_drafts(seqs)
            drafts = [self._propose_alone(request) for request in requests]
        self._end_drafts(seqs)
        for seq, request, draft in zip(seqs, requests, drafts):
            if not self._valid(draft, request.max_tokens):
                log.error("the %s drafter proposed an invalid draft for %s; dropped", self.name, seq.request.request_id)
                continue
            if self.trees is not None:
                self._plant(seq, draft)
            else:
                seq.proposal.tokens, seq.proposal.probs = self._within_constraint(seq, list(draft.tokens), draft.probs)

    def _valid(self, draft: Draft, max_tokens: int) -> bool:
        """Whether a draft (its candidates and branches too) stays within its length and the vocabulary."""
        tokens = list(draft.tokens)
        tokens += [t for position in draft.candidates or () for t, _ in position]
        for branch in draft.branches or ():
            tokens += branch.tokens
        lengths = [len(draft.tokens)] + [len(branch.tokens) for branch in draft.branches or ()]
        return max(lengths) <= max_tokens and all(0 <= t < self.vocab_size for t in tokens)

    def _plant(self, seq: Sequence, draft: Draft) -> None:
        """The tree grown from `draft`, without the nodes its constraint refuses, as the sequence's draft (a tree
        that is a chain verifies as one)."""
        settings = self.trees
        tree = grow_tree(draft, settings.max_nodes, self.tree_stats, settings.static, settings.costs)
        if seq.request.grammar is not None:
            depths = tree.depths
            refused = {
                row
                for row in range(1, len(tree) + 1)
                if seq.request.grammar.valid_prefix(tree.path_tokens(row)) < depths[row - 1]
            }
            tree = tree.without(refused)
        seq.proposal.tokens, seq.proposal.probs = list(tree.tokens), None
        seq.proposal.parents = None if tree.is_chain else list(tree.parents)
        self.grown[seq.request.request_id] = (tree, list(draft.tokens))
        if not tree.tokens:  # nothing was worth verifying: the drafting was wasted, as if its first token failed
            self.policy.update(seq.request.request_id, len(draft.tokens), 0)
        if draft.candidates:
            self.calibrating[seq.request.request_id] = (draft.candidates, len(seq.output_ids))

    def _calibrate(self, seq: Sequence) -> None:
        """Teach the trees' calibration what the step after `seq`'s last candidates committed (`TreeStats`)."""
        pending = self.calibrating.get(seq.request.request_id)
        if pending is not None and len(seq.output_ids) > pending[1]:
            del self.calibrating[seq.request.request_id]
            self.tree_stats.calibrate(pending[0], seq.output_ids[pending[1] :])

    @staticmethod
    def _end_drafts(seqs: list[Sequence]) -> None:
        """Undo the steps a drafter took along its drafts in the sequences' constraints."""
        for seq in seqs:
            if seq.request.grammar is not None:
                seq.request.grammar.end_draft()

    @staticmethod
    def _within_constraint(seq: Sequence, tokens: list[int], probs: torch.Tensor | None):
        """The draft cut at its first token the sequence's constraint refuses (or its first end-of-sequence token).
        A sampled draft keeps that token: verification always rejects it and draws the replacement from
        norm(max(0, p - q)), as losslessness needs (drawing from p there would favour what q under-proposes)."""
        if seq.request.grammar is None:
            return tokens, probs
        keep = seq.request.grammar.valid_prefix(tokens)
        if probs is not None and keep < len(tokens):
            keep += 1
        return tokens[:keep], None if probs is None else probs[:keep]

    def _propose_alone(self, request: DraftRequest) -> Draft:
        try:
            return self.drafter.propose([request])[0]
        except Exception:  # noqa: BLE001 - this sequence decodes without a draft this step
            log.exception("the %s drafter failed on request %s; it decodes without a draft", self.name, request.seq_id)
            self._notify(self.drafter.on_finish, request.seq_id)
            return Draft([])
        finally:
            if request.constraint is not None:
                request.constraint.end_draft()

    def verify(self, outputs: list[SeqOutput]) -> list[Verdict]:
        """Verdicts for `outputs` (sequences that verified drafts), in order: greedy verification from the argmax
        for plain-greedy sequences, rejection sampling (greedy for greedy requests) from the per-row processed
        logits for the others; a tree's by `deltaspec.spec.tree_verify`. Changes nothing but the sampling
        generators."""
        trees = {id(out): tree for out in outputs if (tree := self._tree_of(out.seq)) is not None}
        found = self._verify_trees([out for out in outputs if id(out) in trees], trees)
        outputs_of_chains = [out for out in outputs if id(out) not in trees]
        greedy = [out for out in outputs_of_chains if out.logits is None]
        sampled = [out for out in outputs_of_chains if out.logits is not None]
        by_argmax = verify_greedy_tokens([out.argmax for out in greedy], [out.seq.proposal.tokens for out in greedy])
        by_sampling = verify_sampling(
            [row_logits(out) for out in sampled],
            [out.seq.proposal.tokens for out in sampled],
            [
                None if out.seq.proposal.probs is None else out.seq.proposal.probs[: len(out.seq.proposal.tokens)]
                for out in sampled
            ],
            [out.seq.request.params for out in sampled],
            [out.seq.request.generator for out in sampled],
        )
        for group, result in ((greedy, by_argmax), (sampled, by_sampling)):
            for out, tokens, accepted in zip(group, result.tokens, result.accepted):
                found[id(out)] = Verdict(tokens, accepted, self._logprobs(out, tokens))
        return [found[id(out)] for out in outputs]

    def _tree_of(self, seq: Sequence) -> DraftTree | None:
        """The tree `seq` verifies (cut as far as the scheduler cut its draft), None for a chain."""
        if seq.proposal.parents is None or seq.request.request_id not in self.grown:
            return None
        return self.grown[seq.request.request_id][0].cut(len(seq.proposal.tokens))

    def _verify_trees(self, outputs: list[SeqOutput], trees: dict[int, DraftTree]) -> dict[int, Verdict]:
        greedy = [out for out in outputs if out.logits is None]
        sampled = [out for out in outputs if out.logits is not None]
        results = [verify_tree_greedy(out.argmax, trees[id(out)]) for out in greedy]
        results += verify_tree_sampling(
            [row_logits(out, trees[id(out)]) for out in sampled],
            [trees[id(out)] for out in sampled],
            [out.seq.request.params for out in sampled],
            [out.seq.request.generator for out in sampled],
        )
        return {
            id(out): Verdict(tokens, len(tokens) - 1, self._logprobs(out, tokens, rows), rows)
            for out, (tokens, rows) in zip(greedy + sampled, results)
        }

    @staticmethod
    def _logprobs(out: SeqOutput, tokens: list[int], rows: list[int] | None = None) -> list:
        wanted = out.seq.request.params.logprobs
        if wanted is None:
            return [None] * len(tokens)
        chosen = torch.tensor(tokens, device=out.logits.device)
        logits = out.logits[: len(tokens)] if rows is None else out.logits[torch.tensor(rows, device=chosen.device)]
        return gather_logprobs(logits, chosen, [wanted] * len(tokens))

    def commit(self, out: SeqOutput, verdict: Verdict, append: Append) -> None:
        """Keep the accepted rows of `out`'s sequence, record the round, append the tokens, tell the drafter."""
        seq, drafted, accepted = out.seq, len(out.seq.proposal.tokens), verdict.accepted
        tree = self._tree_of(seq)
        # the last sampled token's row and the accepted drafts: a chain's first rows, a tree's path
        self.cache.keep_verified(seq.cache, 1 + accepted if verdict.rows is None else verdict.rows)
        grown = self.grown.pop(seq.request.request_id, None)
        if tree is not None:
            drafted = max(tree.depths)
            self.tree_rounds += 1
            self.tree_stats.update(tree, verdict.rows)
        if grown is not None:  # of the drafter's own chain, the tokens that were committed
            accepted = next((i for i, (d, t) in enumerate(zip(grown[1], verdict.tokens)) if d != t), len(grown[1]))
            accepted = min(accepted, len(verdict.tokens) - 1)
        seq.proposal.cut(0)
        seq.stats.acceptance.record(drafted, verdict.accepted)
        # the policy picks how deep the drafter drafts: with trees, its chain's depth, however much the tree kept
        self.policy.update(seq.request.request_id, drafted if grown is None else len(grown[1]), verdict.accepted)
        append(seq, verdict.tokens, verdict.logprobs)
        if not seq.finished:
            self._notify(self.drafter.on_commit, seq.request.request_id, accepted, seq.num_tokens)

    def observe(self, outputs: list[SeqOutput]) -> None:
        """Hand a drafter that reads the target's hidden states those of every committed row: the outputs of its
        `target_layers` when it names some (the pass returned them as `features`), else the final ones."""
        if not self.drafter.needs_hidden:
            return
        for out in outputs:
            committed = out.seq.cache.num_computed - out.first_position
            states = out.hidden if out.features is None else out.features
            path = out.seq.cache.replay.fold_rows if out.verifying else None  # a tree's accepted path
            if path is not None:
                states = states[torch.tensor(path, device=states.device)]
            if not out.seq.finished and committed > 0:
                self._notify(self.drafter.observe, out.seq.request.request_id, out.first_position, states[:committed])

    def _notify(self, notice: Callable, seq_id: str, *args) -> None:
        """Give the drafter a notice; if it raises, it forgets the sequence and drafts for it from scratch."""
        try:
            notice(seq_id, *args)
        except Exception:  # noqa: BLE001 - a drafter's failure must not fail the request
            log.exception("the %s drafter failed on a notice for %s; it forgets that sequence", self.name, seq_id)
            if notice != self.drafter.on_finish:
                self._notify(self.drafter.on_finish, seq_id)

    def finish(self, seq: Sequence) -> None:
        self._notify(self.drafter.on_finish, seq.request.request_id)
        self.policy.forget(seq.request.request_id)
        self.grown.pop(seq.request.request_id, None)
        self.calibrating.pop(seq.request.request_id, None)

    def state_bytes(self) -> int:
        return self.drafter.state_bytes()
