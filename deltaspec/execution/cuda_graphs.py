"""CUDA graphs for decode and verify passes, captured per (batch, rows) bucket (DESIGN §6).

A pass where every sequence decodes (one row each, no drafts) or verifies drafts (every sequence
then runs as a verify pass, with or without drafts of its own) is padded to a bucket: B sequences
of R rows. Padding sequences use the state cache's scratch slot; padding rows write no KV
(slot -1), log into replay-log rows that are never folded, and come after every real row, so they
change nothing a real row reads. Every bucket's graph is captured when the engine starts
(`capture_all`, as vLLM does: a capture inside a timed step would cost that step hundreds of
milliseconds) and replayed afterwards with new contents in its static input tensors; between
replays the host only writes those inputs and reads the outputs. Passes with prompt rows, prompt
logprobs, or models whose ops sync with the host (MoE experts the kernels do not take) run eagerly.

With trees of drafts (`trees`), every bucket is captured with the layout's `TreeRows` among its inputs: a chain is
the tree whose rows each follow the previous one, so chains, trees and decode rows share the buckets, and a tree
of R rows takes the verify bucket of R rows like a chain of R rows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from tqdm import tqdm

from deltaspec.cache.model_caches import ModelCaches
from deltaspec.config.cache_spec import CacheSpec
from deltaspec.execution.batch import Scheduled, device_index
from deltaspec.model.forward_batch import ForwardBatch
from deltaspec.model.hybrid import HybridModel
from deltaspec.ops.layout import SeqLayout, ancestor_masks, chain_parents, recurrence_flags


@dataclass
class StaticInputs:
    """A bucket's inputs, as views into one int64 and one int32 device buffer so that a pass's inputs
    travel in two host-to-device copies (from pinned host buffers of the same layout)."""

    batch: ForwardBatch
    longs: torch.Tensor  # device int64: token_ids | positions | slot_mapping | slots [| tree ancestors]
    ints: torch.Tensor  # device int32: context_lens | fold [| tree parents | flags | fold rows] | block_tables
    host_longs: torch.Tensor  # pinned host copies of the two
    host_ints: torch.Tensor


@dataclass
class Bucket:
    """One captured graph: its static inputs and outputs."""

    graph: torch.cuda.CUDAGraph
    inputs: StaticInputs
    hidden: torch.Tensor  # [B * R, hidden]
    features: torch.Tensor | None  # [B * R, taps * hidden] the model's `feature_layers` outputs, if it taps any
    logits: torch.Tensor  # [B * R, vocab]
    greedy: torch.Tensor  # [B * R] argmax of each row's logits


@dataclass
class GraphPass:
    """What one replay gives the runner. The real rows (each sequence's rows, back to back) lie at `rows` of
    the bucket's outputs; `hidden` and `features` are copies of them, `logits` and `greedy` are the graph's own
    buffers, which the next replay overwrites (copy what must outlive it)."""

    hidden: torch.Tensor  # [real rows, hidden], a copy
    features: torch.Tensor | None  # [real rows, taps * hidden], a copy; None when the model taps no layers
    logits: torch.Tensor  # [B * R, vocab], the graph's buffer
    greedy: torch.Tensor  # [B * R] argmax of each bucket row, the graph's buffer
    rows: torch.Tensor  # [real rows] long: the bucket row of each real row


class CudaGraphRunner:
    def __init__(
        self,
        model: HybridModel,
        caches: ModelCaches,
        spec: CacheSpec,
        scratch_slot: int,
        trees: bool = False,
    ):
        """Graphs of `model` over `caches` for the buckets of `spec`; padding sequences use state slot
        `scratch_slot`; with `trees`, verify buckets take trees of drafts."""
        self.model = model
        self.caches = caches
        self.block_size = block_size = spec.block_size
        self.device = spec.device
        self.batch_sizes = spec.graph_batch_sizes
        self.row_sizes = spec.graph_row_sizes
        self.table_width = -(-(spec.max_model_len + max(self.row_sizes)) // block_size)
        self.scratch_slot = scratch_slot
        self.log_rows, self.trees = spec.log_rows, trees
        self.pool = torch.cuda.graph_pool_handle()
        self.buckets: dict[tuple[int, int], Bucket] = {}
        self.replays: Counter[tuple[int, int]] = Counter()  # replays per bucket since start

    def capture_all(self, progress: bool = True) -> None:
        """Capture the graph of every (batch, rows) bucket, largest batches first (their memory is
        allocated first, and the smaller graphs reuse it from the shared pool)."""
        keys = [(size, rows) for size in reversed(self.batch_sizes) for rows in self.row_sizes]
        for size, rows in tqdm(keys, desc="Capturing CUDA graphs", unit="graph", disable=not progress):
            self._capture(size, rows)

    def bucket_for(self, schedule: list[Scheduled]) -> tuple[int, int] | None:
        """(B, R) for a pass of decode or verify rows only, None for anything else."""
        if not schedule or len(schedule) > self.batch_sizes[-1]:
            return None
        rows = 1
        for item in schedule:
            seq = item.seq
            if (
                item.num_rows != 1 + len(seq.proposal.tokens)
                or seq.cache.num_computed < len(seq.request.prompt_ids)
                or seq.request.params.prompt_logprobs is not None
            ):
                return None
            rows = max(rows, item.num_rows)
        if any(item.seq.proposal.tokens for item in schedule):
            fitting = [r for r in self.row_sizes if r >= rows and r > 1]
            if not fitting:
                return None
            rows = fitting[0]
        return next(b for b in self.batch_sizes if b >= len(schedule)), rows

    def run(self, schedule: list[Scheduled], key: tuple[int, int]) -> GraphPass:
        bucket = self.buckets[key]
        num_rows = self._fill(bucket.inputs, schedule, key[1])
        bucket.graph.replay()
        self.replays[key] += 1
        rows = device_index(tuple(b * key[1] + i for b, n in enumerate(num_rows) for i in range(n)), self.device)
        features = None if bucket.features is None else bucket.features.index_select(0, rows)
        return GraphPass(bucket.hidden.index_select(0, rows), features, bucket.logits, bucket.greedy, rows)

    def _fill(self, inputs: StaticInputs, schedule: list[Scheduled], rows: int) -> list[int]:
        """Write the pass's inputs into the bucket's static tensors; returns each sequence's real rows. Only the
        block-table columns some sequence of the pass uses are written (the attention reads no further than a
        sequence's context), and only as far as the last of them is copied: a table is as wide as the longest
        context allowed, a step's sequences mostly use a few columns of it."""
        size, width = inputs.batch.layout.num_seqs, self.table_width
        token_ids, positions, slot_mapping = [0] * (size * rows), list(range(rows)) * size, [-1] * (size * rows)
        context, slots, fold = [rows] * size, [self.scratch_slot] * size, [0] * size
        parents, fold_rows = [chain_parents(rows)] * size, [[]] * size
        used = max(len(item.seq.cache.blocks) for item in schedule)
        tables = [[0] * used for _ in range(size)]
        real_rows = []
        for b, item in enumerate(schedule):
            seq, start, n = item.seq, item.seq.cache.num_computed, item.num_rows
            real = seq.rope_positions(n)
            positions[b * rows : (b + 1) * rows] = real + list(range(start + n, start + rows))
            token_ids[b * rows : b * rows + n] = seq.row_ids[start : start + n]
            slot_mapping[b * rows : b * rows + n] = seq.cache.kv_slots(range(start, start + n), self.block_size)
            context[b], slots[b], fold[b] = start + rows, seq.cache.state_slot, seq.cache.replay.pending_fold
            tables[b][: len(seq.cache.blocks)] = seq.cache.blocks
            tree = seq.proposal.row_parents(n)
            if tree is not None:  # padding rows follow the last real row
                parents[b] = tree + list(range(n - 1, rows - 1))
            if seq.cache.replay.fold_rows is not None:
                fold_rows[b] = seq.cache.replay.fold_rows
            real_rows.append(n)
        longs, ints = token_ids + positions + slot_mapping + slots, context + fold
        if self.trees:
            longs += [m for rows_of in parents for m in ancestor_masks(rows_of)]
            ints += [p for rows_of in parents for p in rows_of]
            ints += [f for rows_of in parents for f in recurrence_flags(rows_of)]
            for b in range(size):
                ints += (list(fold_rows[b] or range(fold[b])) + [0] * self.log_rows)[: self.log_rows]
        inputs.host_longs.copy_(torch.tensor(longs, dtype=torch.long))
        inputs.host_ints[: len(ints)].copy_(torch.tensor(ints, dtype=torch.int32))
        inputs.host_ints[len(ints) :].view(size, width)[:, :used].copy_(torch.tensor(tables, dtype=torch.int32))
        end = len(ints) + (size - 1) * width + used  # [size, width] tables: the last used column of the last row
        inputs.longs.copy_(inputs.host_longs, non_blocking=True)
        inputs.ints[:end].copy_(inputs.host_ints[:end], non_blocking=True)
        return real_rows

    def _static_inputs(self, size: int, rows: int) -> StaticInputs:
        total, width = size * rows, self.table_width
        tree_rows, fold_width = (total, size * self.log_rows) if self.trees else (0, 0)
        longs = torch.zeros(3 * total + size + tree_rows, dtype=torch.long, device=self.device)
        ints = torch.zeros(2 * size + 2 * tree_rows + fold_width + size * width, dtype=torch.int32, device=self.device)
        token_ids, positions, slot_mapping, slots, ancestors = longs.split([total, total, total, size, tree_rows])
        context, fold, parents, flags, fold_rows, tables = ints.split(
            [size, size, tree_rows, tree_rows, fold_width, size * width]
        )
        layout = SeqLayout.build(
            [rows] * size,
            [rows] * size,
            [self.scratch_slot] * size,
            self.device,
            speculative=[rows > 1] * size,
            parents=[chain_parents(rows)] * size if self.trees else None,
            log_rows=self.log_rows,
        )
        layout.context_lens_t, layout.slots_t, layout.fold_t = context, slots, fold
        layout.block_tables = tables.view(size, width)
        if self.trees:
            tree = layout.tree
            tree.ancestors_t, tree.parent_t, tree.flags_t = ancestors, parents, flags
            tree.fold_rows_t = fold_rows.view(size, self.log_rows)
        inputs = StaticInputs(
            ForwardBatch(token_ids, positions, slot_mapping, layout),
            longs,
            ints,
            torch.zeros_like(longs, device="cpu").pin_memory(),
            torch.zeros_like(ints, device="cpu").pin_memory(),  # table columns a pass leaves keep valid ids
        )
        self._pad(inputs, rows)
        return inputs

    def _pad(self, inputs: StaticInputs, rows: int) -> None:
        """Make every sequence of the bucket padding: the scratch state slot, no KV writes, nothing folded."""
        batch, layout = inputs.batch, inputs.batch.layout
        batch.token_ids.zero_()
        batch.positions.copy_(torch.arange(rows, device=self.device).repeat(layout.num_seqs))
        batch.slot_mapping.fill_(-1)
        layout.context_lens_t.fill_(rows)
        layout.slots_t.fill_(self.scratch_slot)
        layout.fold_t.zero_()
        layout.block_tables.zero_()
        if self.trees:
            chain = chain_parents(rows) * layout.num_seqs
            tree = layout.tree
            tree.parent_t.copy_(torch.tensor(chain, dtype=torch.int32))
            tree.ancestors_t.copy_(torch.tensor(ancestor_masks(chain_parents(rows)) * layout.num_seqs))
            tree.flags_t.copy_(torch.tensor(recurrence_flags(chain_parents(rows)) * layout.num_seqs, dtype=torch.int32))
            tree.fold_rows_t.zero_()

    def time_replays(self, size: int, rows: int, repeats: int = 20) -> float:
        """Milliseconds per replay of bucket (size, rows), replays back to back with padding inputs: a pass's
        device time without the host's work between passes."""
        bucket = self.buckets[(size, rows)]
        self._pad(bucket.inputs, rows)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        bucket.graph.replay()
        begin.record()
        for _ in range(repeats):
            bucket.graph.replay()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / repeats

    def _capture(self, size: int, rows: int) -> Bucket:
        inputs = self._static_inputs(size, rows)
        batch = inputs.batch
        with torch.inference_mode():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                    self.model.compute_logits(self.model.run(batch, self.caches)[0]).argmax(-1)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden, features = self.model.run(batch, self.caches)
                logits = self.model.compute_logits(hidden)
                greedy = logits.argmax(-1)
        bucket = Bucket(graph, inputs, hidden, features, logits, greedy)
        self.buckets[(size, rows)] = bucket
        return bucket
