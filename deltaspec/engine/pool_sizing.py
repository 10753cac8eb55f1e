"""Sizing the pools of a configuration that leaves them automatic, and the planner's advice.

`--max-num-seqs 0` is 8 streams, or with `--gpu-memory-utilization` as many as fit (at most 256, vLLM's default);
`--max-model-len 0` is the model's `max_position_embeddings` if the streams fit in 90 % of the free memory (the rest
is left to the allocator and other processes), else shortened to what that holds (what all of it holds if that is
not even a page);
`--gpu-memory-utilization F` grows the KV page pool to fill the budget. The advice a plan prints (the most
streams at this context, the longest context for these streams, never past the model's positions unless
`--allow-long-max-model-len`) comes from the same place. Every answer is a search over the plan's own
arithmetic (`plan_at`), so what is proposed fits by construction, whatever scales with the streams (their
slots, their prefix checkpoints, the CUDA graphs captured for them).
"""

from __future__ import annotations

from collections.abc import Callable

from deltaspec.cache.memory_plan import MemoryPlan
from deltaspec.config.engine import EngineConfig

AUTO_STREAMS = 8
AUTO_CONTEXT_SHARE = 0.9  # an automatic context shortened to fit leaves this share of the free memory to the plan
MAX_AUTO_STREAMS = 256
SEARCH_LIMIT = 1 << 26

PlanAt = Callable[[int, int, int], MemoryPlan]  # (streams, ctx, kv_blocks; 0 = a context per stream) -> plan


def streams_of(count: int) -> str:
    return f"{count} stream" if count == 1 else f"{count} streams"


def largest(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with `fits(n)`, for a `fits` that holds up to some n and fails beyond it;
    lo - 1 when not even `lo` fits. Probes doubling steps, then bisects."""
    if lo > hi or not fits(lo):
        return lo - 1
    good, step = lo, 1
    while good + step <= hi and fits(good + step):
        good, step = good + step, step * 2
    bad = min(good + step, hi + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


class PoolSizing:
    """The automatic streams, context and KV pool of one resolved configuration, and the advice of its plan."""

    def __init__(self, config: EngineConfig, positions: int, plan_at: PlanAt):
        self.config, self.positions, self.plan_at = config, positions, plan_at
        self.block = config.cache.block_size

    @property
    def ctx_limit(self) -> int:
        return SEARCH_LIMIT if self.config.scheduler.allow_long_max_model_len else self.positions

    def most_streams(self, ctx: int, kv_blocks: int, hi: int = SEARCH_LIMIT) -> int:
        return max(largest(lambda streams: self.plan_at(streams, ctx, kv_blocks).fits, 1, hi), 0)

    def longest_ctx(self, streams: int, kv_blocks: int, share: float = 1.0) -> int:
        """The longest context (whole pages, within the model's positions and the pool) that fits in `share` of
        the memory available; 0 if none."""
        limit = min(self.ctx_limit, kv_blocks * self.block) if kv_blocks else self.ctx_limit

        def fits(pages: int) -> bool:
            plan = self.plan_at(streams, pages * self.block, kv_blocks)
            return plan.total <= share * plan.available and plan.at_load <= plan.available

        return max(largest(fits, 1, limit // self.block), 0) * self.block

    def largest_pool(self, streams: int, ctx: int) -> int:
        """The most KV pages that fit next to everything else; 0 if none."""
        return max(largest(lambda pages: self.plan_at(streams, ctx, pages).fits, 1, SEARCH_LIMIT), 0)

    def decide(self) -> tuple[int, int, int, list[str]]:
        """Streams, context, KV pages (0: one context per stream) and notes on what was chosen automatically."""
        cfg = self.config
        ctx = cfg.scheduler.max_model_len or self.positions
        if cfg.cache.num_kv_blocks and not cfg.scheduler.max_model_len:
            ctx = min(ctx, cfg.cache.num_kv_blocks * self.block)
        if not cfg.cache.gpu_memory_utilization:
            streams = cfg.scheduler.max_num_seqs or AUTO_STREAMS
            whole = self.plan_at(streams, ctx, 0)
            if (
                cfg.scheduler.max_model_len
                or cfg.cache.num_kv_blocks
                or whole.total <= AUTO_CONTEXT_SHARE * whole.available
            ):
                return streams, ctx, cfg.cache.num_kv_blocks, []
            shorter = self.longest_ctx(streams, 0, AUTO_CONTEXT_SHARE) or self.longest_ctx(streams, 0)
            if not shorter:
                return streams, ctx, 0, []
            note = (
                f"context: {shorter} tokens, the most that {streams} streams fit in {AUTO_CONTEXT_SHARE:.0%} of the "
                f"free memory (the model has {self.positions} positions; fewer --max-num-seqs leave room for longer "
                "ones, --max-model-len or --gpu-memory-utilization set it yourself)"
            )
            return streams, shorter, 0, [note]
        notes = []
        streams = cfg.scheduler.max_num_seqs
        if not streams:
            streams = self.most_streams(ctx, 0, MAX_AUTO_STREAMS)
            if not streams and not cfg.scheduler.max_model_len:
                ctx = self.longest_ctx(1, 0) or ctx
            streams = max(streams, 1)
            notes.append(f"streams: {streams}, as many as fit at {ctx} tokens each (at most {MAX_AUTO_STREAMS})")
        pages = self.largest_pool(streams, ctx)
        if pages * self.block < ctx and pages and not cfg.scheduler.max_model_len:
            ctx = pages * self.block
        if pages * self.block < ctx:
            return streams, ctx, 0, notes
        notes.append(f"KV pool: {pages} pages of {self.block} tokens fill the budget")
        return streams, ctx, pages, notes

    def alternatives(self, plan: MemoryPlan) -> tuple[str, ...]:
        """The largest configurations around `plan` that fit: more streams at its context, a longer context for
        its streams (its KV pool, if it has one, kept)."""
        kv_blocks = plan.kv_tokens // self.block
        found = []
        if streams := self.most_streams(plan.ctx, kv_blocks):
            found.append(f"{streams_of(streams)} at {plan.ctx} tokens")
        ctx = self.longest_ctx(plan.streams, kv_blocks)
        if ctx and (ctx, plan.streams) != (plan.ctx, streams):
            limit = " (the model's positions)" if ctx == self.positions else ""
            found.append(f"{streams_of(plan.streams)} at {ctx} tokens{limit}")
        return tuple(found)
