"""Which passes run as CUDA graphs and the (batch, rows) buckets captured for them: read through the resolved
`CacheSpec` by the graph runner (execution/cuda_graphs.py) and the memory planner, which counts the captured
graphs' outputs."""

from __future__ import annotations

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
ROW_BUCKETS = (2, 4, 8, 16, 32, 64)


def sizes_up_to(limit: int, buckets: tuple[int, ...]) -> list[int]:
    """The buckets below `limit`, then `limit` itself."""
    return [b for b in buckets if b < limit] + [limit]


def batch_sizes(max_num_seqs: int) -> list[int]:
    return sizes_up_to(max_num_seqs, BATCH_BUCKETS)


def row_sizes(log_rows: int) -> list[int]:
    """Rows per sequence: 1 (decode) and, with speculation, the verify buckets up to the replay log's rows."""
    return [1] + (sizes_up_to(log_rows, ROW_BUCKETS) if log_rows > 1 else [])


def uses_cuda_graphs(device: str, enforce_eager: bool, kernels: str) -> bool:
    """On CUDA with the Triton kernels (the references sync with the host), unless eager execution is forced.
    The model may still refuse: `HybridModel.syncs_with_host` (MoE experts the kernels do not take)."""
    return device.split(":")[0] == "cuda" and not enforce_eager and kernels != "reference"


def captured_rows(max_num_seqs: int, log_rows: int) -> int:
    """Rows over all captured buckets: each keeps its hidden states and logits for its replays."""
    return sum(size * rows for size in batch_sizes(max_num_seqs) for rows in row_sizes(log_rows))
