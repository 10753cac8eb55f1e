"""`CacheSpec`: the cache facts of a resolved configuration, decided once (`deltaspec.config.resolve.cache_spec`)
and handed to everything that sizes or allocates the caches: the memory planner, the `CacheManager` and its
caches, the CUDA graphs and every tensor-parallel rank's engine, as vLLM hands its `KVCacheConfig` to the
scheduler and the workers. Nothing re-derives these facts from the user's settings."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from deltaspec.config.graph_buckets import batch_sizes, captured_rows, row_sizes


@dataclass(frozen=True)
class CacheSpec:
    device: torch.device
    dtype: torch.dtype  # the model's: weights, activations, conv windows
    state_dtype: torch.dtype  # the GDN recurrent states'
    kv_dtype: torch.dtype  # the attention KV cache's storage (a quantized one keeps a scale per row)
    block_size: int  # tokens per KV page
    kv_blocks: int  # KV pages of the pool as configured; 0: one whole context per stream (`num_blocks`)
    streams: int  # sequences that run at once: one GDN state slot each
    max_model_len: int  # the longest sequence
    log_rows: int  # rows of each slot's speculative replay log; 0 without speculation
    checkpoint_slots: int  # prefix-checkpoint state slots (0 without prefix caching)
    offload_bytes: int  # host memory for prefix checkpoints evicted from the device
    cuda_graphs: bool  # decode and verify passes are captured as CUDA graphs (the model may still refuse them)

    @property
    def num_blocks(self) -> int:
        """KV pages to allocate: the configured pool, or every stream's whole context."""
        return self.kv_blocks or self.streams * -(-self.max_model_len // self.block_size)

    @property
    def graph_batch_sizes(self) -> list[int]:
        return batch_sizes(self.streams)

    @property
    def graph_row_sizes(self) -> list[int]:
        return row_sizes(self.log_rows)

    @property
    def captured_rows(self) -> int:
        """Rows over all captured CUDA-graph buckets, 0 when passes run eagerly."""
        return captured_rows(self.streams, self.log_rows) if self.cuda_graphs else 0

    def for_draft_model(self) -> CacheSpec:
        """The caches of a draft model running beside the target: a slot and a whole context per stream, its KV in
        the model's dtype, no replay log, prefix checkpoints or graphs."""
        return replace(
            self, kv_dtype=self.dtype, kv_blocks=0, log_rows=0, checkpoint_slots=0, offload_bytes=0, cuda_graphs=False
        )
