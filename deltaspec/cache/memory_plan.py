"""Memory planner (DESIGN §4): what a configuration needs, and whether it fits, before anything is allocated.

A plan adds up the weights (read from the checkpoint's safetensors headers, in the dtype they will
be loaded in), the attention KV pages for `streams` sequences of `ctx` tokens, one GDN state slot
(recurrent state + conv window, and the replay log with speculation) per stream, the drafter's own
memory (an MTP head's weights and KV, a draft model's weights, KV and states), and a workspace for
one forward pass, and compares the sum with the free memory of the device. A configuration that does
not fit is refused with one sentence that says what would. `deltaspec.engine.planning` makes the
plan of an engine configuration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from deltaspec.config import ModelConfig
from deltaspec.errors import DeltaspecError

GIB = 1 << 30
RESERVE = {"cuda": 1 * GIB, "cpu": GIB // 2}  # runtime context, allocator slack, Python


@dataclass(frozen=True)
class DrafterMemory:
    """Device memory of a speculative drafter: fixed weights, KV per token and state per stream."""

    name: str = "none"
    weights: int = 0
    kv_per_token: int = 0
    state_per_stream: int = 0


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    streams: int
    ctx: int
    block_size: int
    weights: int
    kv_per_token: int
    state_per_stream: int
    workspace: int
    reserve: int
    available: int
    checkpoints: int = 0  # prefix-checkpoint slots, each one state
    drafter: DrafterMemory = DrafterMemory()

    @property
    def fixed_states(self) -> int:
        """State slots that do not scale with the streams: the checkpoints and the CUDA-graph scratch slot."""
        return (self.checkpoints + 1) * self.state_per_stream

    @property
    def padded_ctx(self) -> int:
        return math.ceil(self.ctx / self.block_size) * self.block_size

    @property
    def kv(self) -> int:
        return self.streams * self.padded_ctx * self.kv_per_token

    @property
    def states(self) -> int:
        return self.streams * self.state_per_stream + self.fixed_states

    @property
    def drafter_bytes(self) -> int:
        d = self.drafter
        return d.weights + self.streams * (self.padded_ctx * d.kv_per_token + d.state_per_stream)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.states + self.drafter_bytes + self.workspace + self.reserve

    def _room(self) -> int:
        """Memory left for what scales with the streams and the context."""
        return self.available - self.weights - self.drafter.weights - self.workspace - self.reserve - self.fixed_states

    @property
    def fits(self) -> bool:
        return self.total <= self.available

    def max_streams(self) -> int:
        """Most streams of `ctx` tokens that fit next to the weights and workspace."""
        d = self.drafter
        per_stream = self.padded_ctx * (self.kv_per_token + d.kv_per_token) + self.state_per_stream + d.state_per_stream
        return max(self._room() // per_stream, 0)

    def max_ctx(self) -> int:
        """Longest context (a multiple of the block size) that `streams` streams fit in."""
        room = self._room() // self.streams - self.state_per_stream - self.drafter.state_per_stream
        per_token = self.kv_per_token + self.drafter.kv_per_token
        if room <= 0 or per_token == 0:
            return 0
        return room // per_token // self.block_size * self.block_size

    def table(self) -> str:
        rows = [
            ("weights", self.weights),
            (f"attention KV ({self.streams} streams x {self.ctx} tokens)", self.kv),
            (f"GDN states ({self.streams} slots, {self.checkpoints} prefix checkpoints, scratch)", self.states),
            (f"drafter: {self.drafter.name} (weights, KV, states)", self.drafter_bytes),
            ("workspace (one forward pass)", self.workspace),
            ("reserve (runtime)", self.reserve),
            ("total needed", self.total),
            (f"free on {self.device}", self.available),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value / GIB:9.3f} GiB" for name, value in rows]
        limits = " or ".join(self.alternatives()) or "nothing: not even the weights fit"
        lines.append(f"{'fits' if self.fits else 'does NOT fit'}; the most that fits: {limits}")
        return "\n".join(lines)

    def alternatives(self) -> list[str]:
        """The largest configurations that fit: more streams at this context, a longer context for these streams."""
        found = []
        if self.max_streams() > 0:
            found.append(f"{self.max_streams()} streams at {self.ctx} tokens")
        if self.max_ctx() > 0:
            found.append(f"{self.streams} streams at {self.max_ctx()} tokens")
        return found

    def refusal(self) -> str:
        advice = " or ".join(self.alternatives()) or "a smaller model or dtype, since not even the weights fit"
        return (
            f"{self.streams} streams at {self.ctx} tokens need {self.total / GIB:.2f} GiB (weights "
            f"{self.weights / GIB:.2f}, KV {self.kv / GIB:.2f}, GDN states {self.states / GIB:.2f}, drafter "
            f"{self.drafter_bytes / GIB:.2f}, workspace {self.workspace / GIB:.2f}) but "
            f"{self.available / GIB:.2f} GiB is free on {self.device}; "
            f"{advice} would fit."
        )


def weight_bytes(files: dict[str, Path], dtype: torch.dtype, skip) -> int:
    """Bytes of all loaded tensors in `dtype`, from the safetensors headers (no tensor is read)."""
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        if not skip(name):
            by_file.setdefault(file, []).append(name)
    size = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            total += sum(math.prod(f.get_slice(n).get_shape()) for n in names) * size
    return total


def available_memory(device: torch.device) -> int:
    """Free bytes on `device` now: CUDA's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_memory(
    config: ModelConfig,
    num_kv_layers: int,
    weights: int,
    dtype: torch.dtype,
    state_dtype: torch.dtype,
    streams: int,
    ctx: int,
    block_size: int,
    batch_rows: int,
    prefill_chunk: int,
    device: torch.device,
    available: int | None = None,
    log_rows: int = 0,
    checkpoints: int = 0,
    graph_rows: int = 0,
    drafter: DrafterMemory = DrafterMemory(),
) -> MemoryPlan:
    """Needs of `streams` sequences of `ctx` tokens for this model on `device`; `log_rows` > 0 adds each
    slot's speculative replay log (one state plus the log, independent of how many drafts are accepted);
    `checkpoints` prefix-checkpoint slots are each one more state; `graph_rows` rows of captured CUDA graphs
    each keep their hidden state and logits; `drafter` is the speculative drafter's own memory."""
    size = torch.tensor([], dtype=dtype).element_size()
    state_size = torch.tensor([], dtype=state_dtype).element_size()
    kv_per_token = num_kv_layers * 2 * config.num_key_value_heads * config.head_dim * size
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
    graph_outputs = graph_rows * (config.vocab_size + config.hidden_size) * size
    attention_scores = min(prefill_chunk, batch_rows) * config.num_attention_heads * ctx * 4  # reference path
    return MemoryPlan(
        device=str(device),
        streams=streams,
        ctx=ctx,
        block_size=block_size,
        weights=weights,
        kv_per_token=kv_per_token,
        state_per_stream=state,
        workspace=activations + logits + attention_scores + graph_outputs,
        reserve=RESERVE.get(device.type, GIB // 2),
        available=available_memory(device) if available is None else available,
        checkpoints=checkpoints,
        drafter=drafter,
    )


def require_fit(plan: MemoryPlan) -> None:
    if not plan.fits:
        raise DeltaspecError(plan.refusal())
