"""Memory planner (DESIGN §4): what a configuration needs, and whether it fits, before anything is allocated.

A plan adds up the weights (read from the checkpoint's safetensors headers, in the dtype they will
be loaded in), the attention KV pages (a pool of `kv_tokens`, or `streams` sequences of `ctx` tokens),
one GDN state slot (recurrent state + conv window, and the replay log with speculation) per stream and
per prefix checkpoint, the drafter's own memory (an MTP head's weights and KV, a draft model's weights,
KV and states), and a workspace for one forward pass, and compares the sum with the memory available
on the device. A configuration that does not fit is refused with one sentence that says what would.
`deltaspec.engine.planning` sizes an engine configuration's automatic values and finds those
alternatives by searching over this same arithmetic, so the advice always fits.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from deltaspec.config.cache_spec import CacheSpec
from deltaspec.config.model import ModelConfig
from deltaspec.errors import DeltaspecError
from deltaspec.ops.attention import kv_row_width
from deltaspec.ops.quant.checkpoint_layout import main_tensor, stored_bytes

GIB = 1 << 30
RESERVE = {"cuda": 1 * GIB, "cpu": GIB // 2}  # runtime context, allocator slack, Python


@dataclass(frozen=True)
class DrafterMemory:
    """Device memory of a speculative drafter: fixed weights, KV per token and state per stream. An MTP head keeps
    its KV in the engine's page pool (`shares_pool`); a draft model has pages for each stream's whole context; a
    block drafter also makes every pass return the outputs of the target layers it reads (`features_per_row`)."""

    name: str = "none"
    weights: int = 0
    kv_per_token: int = 0
    state_per_stream: int = 0
    shares_pool: bool = False
    features_per_row: int = 0  # bytes of tapped target-layer outputs a pass returns per row


@dataclass(frozen=True)
class Workspace:
    """What one forward pass holds besides the caches: at most `batch_rows` rows, a prompt chunk of at most
    `prefill_chunk` rows, and with `materialized_scores` the attention scores of that chunk over the whole context
    (the torch reference holds them; the kernels hold none). `images`: the bytes a vision tower holds while it
    encodes one image, between passes (0 without one)."""

    batch_rows: int
    prefill_chunk: int
    materialized_scores: bool = True
    images: int = 0


@dataclass(frozen=True)
class MemoryPlan:
    cache: CacheSpec  # the streams, context, pages and slots planned
    weights: int
    kv_per_token: int
    state_per_stream: int
    workspace: int
    reserve: int
    available: int
    drafter: DrafterMemory = DrafterMemory()
    alternatives: tuple[str, ...] = ()  # the largest configurations that fit, as flags would give them
    available_label: str = "free"  # what `available` is: the free memory, or a --gpu-memory-utilization budget
    notes: tuple[str, ...] = ()  # how automatic values were chosen
    load_transient: int = 0  # held only while the model loads, before the caches: --repack's copy and temporaries

    @property
    def device(self) -> str:
        return str(self.cache.device)

    @property
    def streams(self) -> int:
        return self.cache.streams

    @property
    def ctx(self) -> int:
        return self.cache.max_model_len

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def checkpoints(self) -> int:
        """Prefix-checkpoint slots, each one state."""
        return self.cache.checkpoint_slots

    @property
    def kv_tokens(self) -> int:
        """Tokens of the configured KV page pool; 0: one whole context per stream."""
        return self.cache.kv_blocks * self.cache.block_size

    @property
    def padded_ctx(self) -> int:
        return math.ceil(self.ctx / self.block_size) * self.block_size

    @property
    def pool_tokens(self) -> int:
        return self.cache.num_blocks * self.block_size

    @property
    def kv(self) -> int:
        return self.pool_tokens * self.kv_per_token

    @property
    def states(self) -> int:
        """Each stream's slot, the prefix checkpoints and the CUDA-graph scratch slot."""
        return (self.streams + self.checkpoints + 1) * self.state_per_stream

    @property
    def drafter_bytes(self) -> int:
        d = self.drafter
        kv_tokens = self.pool_tokens if d.shares_pool else self.streams * self.padded_ctx
        return d.weights + kv_tokens * d.kv_per_token + self.streams * d.state_per_stream

    @property
    def fixed(self) -> int:
        """What any configuration of this model needs: weights, the drafter's weights, workspace and reserve."""
        return self.weights + self.drafter.weights + self.workspace + self.reserve

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.states + self.drafter_bytes + self.workspace + self.reserve

    @property
    def at_load(self) -> int:
        """The peak while the model loads: its weights, what repacking them holds for a moment, the reserve."""
        return self.weights + self.drafter.weights + self.load_transient + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.available and self.at_load <= self.available

    def state_in_tokens(self) -> int:
        """The tokens (whole pages) whose KV takes as much memory as one state slot: the prompt length from which
        a prefix checkpoint costs less than the KV it saves recomputing."""
        page = self.kv_per_token * self.block_size
        return max(-(-self.state_per_stream // page) if page else 1, 1) * self.block_size

    def table(self) -> str:
        kv_label = f"attention KV ({self.streams} streams x {self.ctx} tokens)"
        if self.kv_tokens:
            kv_label = f"attention KV pool ({self.kv_tokens} tokens; {self.streams} streams x {self.ctx} tokens)"
        rows = [
            ("weights", self.weights),
            (kv_label, self.kv),
            (f"GDN states ({self.streams} slots, {self.checkpoints} prefix checkpoints, scratch)", self.states),
            (f"drafter: {self.drafter.name} (weights, KV, states)", self.drafter_bytes),
            ("workspace (one forward pass)", self.workspace),
            *([("repacking at load (freed before the caches)", self.load_transient)] if self.load_transient else []),
            ("reserve (runtime)", self.reserve),
            ("total needed", self.total),
            (f"{self.available_label} on {self.device}", self.available),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value / GIB:9.3f} GiB" for name, value in rows]
        lines += self.notes
        lines.append(f"{'fits' if self.fits else 'does NOT fit'}; {self.advice()}")
        return "\n".join(lines)

    def advice(self) -> str:
        if self.alternatives:
            return "the most that fits: " + " or ".join(self.alternatives)
        if self.fixed > self.available:
            return (
                f"not even the weights, workspace and runtime reserve ({self.fixed / GIB:.2f} GiB) fit; use a smaller "
                "dtype or model, or a device with more memory"
            )
        if self.at_load > self.available:
            return (
                f"loading needs {self.at_load / GIB:.2f} GiB, {self.load_transient / GIB:.2f} of them to repack the "
                "largest Q4_K / Q6_K matrix for the tensor cores; drop --repack, or use a device with more memory"
            )
        return f"not even one stream of {self.block_size} tokens fits next to the weights"

    def refusal(self) -> str:
        needs = (
            f"{self.streams} streams at {self.ctx} tokens need {self.total / GIB:.2f} GiB (weights "
            f"{self.weights / GIB:.2f}, KV {self.kv / GIB:.2f}, GDN states {self.states / GIB:.2f}, drafter "
            f"{self.drafter_bytes / GIB:.2f}, workspace {self.workspace / GIB:.2f}) but "
            f"{self.available / GIB:.2f} GiB is {self.available_label} on {self.device}"
        )
        if self.alternatives:
            return f"{needs}; {' or '.join(self.alternatives)} would fit."
        return f"{needs}: {self.advice()}."


def weight_bytes(files: dict[str, Path], dtype: torch.dtype, skip) -> int:
    """Bytes of all loaded tensors, from the safetensors headers (no tensor is read): float ones in `dtype`, a
    quantized checkpoint's matrices as their blocks (`deltaspec.ops.quant.checkpoint_layout.stored_bytes`; their
    scales and zero points are in those bytes)."""
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        if not skip(name) and main_tensor(name, files) is None:
            by_file.setdefault(file, []).append(name)
    size = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                tensor = f.get_slice(name)
                shape, stored = tensor.get_shape(), tensor.get_dtype()
                blocks = stored_bytes(name, shape, stored, files)
                total += blocks if blocks is not None else math.prod(shape) * size
    return total


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory(device: torch.device) -> int:
    """Free bytes on `device` now: CUDA's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    free = _meminfo("MemAvailable")
    return free if free is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def total_memory(device: torch.device) -> int:
    """All the memory of `device`: the CUDA device's, or the host's MemTotal."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    total = _meminfo("MemTotal")
    return total if total is not None else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_memory(
    config: ModelConfig,
    cache: CacheSpec,
    weights: int,
    workspace: Workspace,
    drafter: DrafterMemory = DrafterMemory(),
    available: int | None = None,
) -> MemoryPlan:
    """Needs of `cache` for this model (its streams of its context, or its KV pool; a state slot per stream and per
    prefix checkpoint, each with the speculative replay log of `log_rows` rows, however many drafts are accepted;
    the hidden states and logits, and a block drafter's features, that each row of its captured CUDA graphs keeps)
    with `weights` bytes of weights and one pass's `workspace`; `drafter` is the speculative drafter's own memory;
    `available` defaults to the device's free memory. A quantized KV dtype adds each row's 16-byte tail holding
    its scale."""
    dtype, state_dtype, kv_dtype = cache.dtype, cache.state_dtype, cache.kv_dtype
    num_kv_layers, log_rows = len(config.attention_layer_ids), cache.log_rows
    batch_rows, ctx, streams = workspace.batch_rows, cache.max_model_len, cache.streams
    size = torch.tensor([], dtype=dtype).element_size()
    state_size = torch.tensor([], dtype=state_dtype).element_size()
    row_bytes = kv_row_width(config.head_dim, kv_dtype) * kv_dtype.itemsize
    kv_per_token = num_kv_layers * 2 * config.num_key_value_heads * row_bytes
    state = len(config.gdn_layer_ids) * (
        config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * state_size
        + (config.linear_conv_kernel_dim - 1) * config.gdn_conv_dim * size
    )
    log_size = 8 if torch.float64 in (dtype, state_dtype) else 4
    state += (
        len(config.gdn_layer_ids)
        * log_rows
        * (
            (
                config.linear_num_key_heads * config.linear_key_head_dim
                + config.linear_num_value_heads * (config.linear_value_head_dim + 2)
            )
            * log_size
            + config.gdn_conv_dim * size
        )
    )
    mlp_width = config.intermediate_size
    if config.moe is not None:
        mlp_width = max(
            mlp_width,
            config.moe.moe_intermediate_size * config.moe.num_experts_per_tok,
            config.moe.shared_expert_intermediate_size,
        )
    widest_projection = max(2 * config.num_attention_heads * config.head_dim, config.gdn_conv_dim, 2 * mlp_width)
    activations = batch_rows * (4 * config.hidden_size + widest_projection) * 4  # fp32 worst case
    logits = streams * config.vocab_size * 4
    graph_outputs = cache.captured_rows * ((config.vocab_size + config.hidden_size) * size + drafter.features_per_row)
    activations += batch_rows * drafter.features_per_row
    scores_rows = min(workspace.prefill_chunk, batch_rows) * workspace.materialized_scores
    attention_scores = scores_rows * config.num_attention_heads * ctx * 4
    return MemoryPlan(
        cache=cache,
        weights=weights,
        kv_per_token=kv_per_token,
        state_per_stream=state,
        workspace=max(activations + logits + attention_scores, workspace.images) + graph_outputs,
        reserve=RESERVE.get(cache.device.type, GIB // 2),
        available=available_memory(cache.device) if available is None else available,
        drafter=drafter,
    )


def require_fit(plan: MemoryPlan) -> None:
    if not plan.fits:
        raise DeltaspecError(plan.refusal())
