"""Which part of every weight a tensor-parallel rank holds, and the per-rank architecture those parts make.

Split across ranks (Megatron-style, as vLLM and SGLang shard these models): attention query heads (each with
its output gate) and KV heads (where the ranks outnumber the KV heads, each rank holds the one KV head its query
heads read, replicated as in vLLM); GDN key and value heads with their conv channels, gates (`A_log`,
`dt_bias`, b, a) and z; the intermediate size of dense MLPs, of every routed expert and of the shared
expert; the vocabulary of the embedding and the LM head. Column-parallel weights (those that read the
layer's input) keep a slice of their output rows, row-parallel ones (attention and GDN output projections,
down projections) a slice of their input columns, whose partial outputs the decoder all-reduces. Norms, the
router, the shared expert's gate and the MTP head's fc are whole on every rank. A weight whose rows are
several parts side by side (GDN's q | k | v, an expert's gate | up) takes its slice of each part.

With expert parallelism (`expert_parallel`, vLLM's `--enable-expert-parallel`) the routed experts are not cut:
rank r holds experts r * E / size .. (r + 1) * E / size - 1 whole (every router still scores all E), and adds
the products of the chosen ones it holds; everything else, the shared expert included, splits as above, and the
MoE output's all-reduce is the same one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from deltaspec.config.model import ModelConfig
from deltaspec.errors import DeltaspecError

Pieces = tuple[int, tuple[tuple[int, int], ...]]  # (dimension, (start, stop) of each piece along it, concatenated)


PER_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")  # a checkpoint's per-expert tensor: `...experts.N.gate_proj...`


def _sharded_counts(config: ModelConfig, expert_parallel: bool = False) -> dict[str, int]:
    """The model's counts a tensor-parallel size must divide, by name."""
    counts = {
        "vocab_size": config.vocab_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
    }
    if not all(config.moe_layers) or config.moe is None:
        counts["intermediate_size"] = config.intermediate_size
    if config.moe is not None:
        if expert_parallel:
            counts["num_experts"] = config.moe.num_experts
        else:
            counts["moe_intermediate_size"] = config.moe.moe_intermediate_size
        if config.moe.shared_expert_intermediate_size:
            counts["shared_expert_intermediate_size"] = config.moe.shared_expert_intermediate_size
    return counts


def _undivided(config: ModelConfig, size: int, expert_parallel: bool) -> list[str]:
    """The counts `size` ranks cannot split, as "name (count)": every split count must be a multiple of `size`,
    but KV heads may also be fewer than the ranks if they divide them (each is then replicated, as vLLM does)."""
    counts = _sharded_counts(config, expert_parallel)
    return [
        f"{name} ({count})"
        for name, count in counts.items()
        if count % size and not (name == "num_key_value_heads" and size % count == 0)
    ]


def valid_sizes(config: ModelConfig, limit: int = 8, expert_parallel: bool = False) -> list[int]:
    """Tensor-parallel sizes up to `limit` that split every count of `config` (`_undivided`)."""
    return [n for n in range(1, limit + 1) if not _undivided(config, n, expert_parallel)]


def shard_config(config: ModelConfig, size: int, expert_parallel: bool = False) -> ModelConfig:
    """The architecture one of `size` ranks holds: heads and intermediate sizes divided by `size` (the vocabulary
    stays whole: the embedding and the LM head divide it themselves); with `expert_parallel`, the routed experts
    divided instead of their intermediate size."""
    if expert_parallel and config.moe is None:
        raise DeltaspecError(
            "--enable-expert-parallel splits a mixture-of-experts model's experts, and this model has none; drop it."
        )
    if size == 1:
        return config
    if size < 1:
        raise DeltaspecError(f"--tensor-parallel-size must be at least 1, got {size}.")
    counts = _sharded_counts(config, expert_parallel)
    undivided = _undivided(config, size, expert_parallel)
    if undivided:
        sizes = ", ".join(map(str, valid_sizes(config, expert_parallel=expert_parallel)))
        raise DeltaspecError(
            f"Tensor parallel size {size} does not divide the model's {', '.join(undivided)}; sizes that divide "
            f"every head count and intermediate size of this model: {sizes}."
        )
    moe = config.moe
    if moe is not None:
        moe = replace(
            moe,
            moe_intermediate_size=moe.moe_intermediate_size if expert_parallel else moe.moe_intermediate_size // size,
            shared_expert_intermediate_size=moe.shared_expert_intermediate_size // size,
            expert_parallel_size=size if expert_parallel else 1,
        )
    return replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=max(config.num_key_value_heads // size, 1),  # fewer than the ranks: one, replicated
        linear_num_key_heads=config.linear_num_key_heads // size,
        linear_num_value_heads=config.linear_num_value_heads // size,
        intermediate_size=config.intermediate_size // size
        if "intermediate_size" in counts
        else config.intermediate_size,
        moe=moe,
    )


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`, for the full architecture `config`: which pieces of each weight it holds (with
    `expert_parallel`, whole routed experts)."""

    config: ModelConfig
    rank: int
    size: int
    expert_parallel: bool = False

    def _part(self, start: int, stop: int) -> tuple[int, int]:
        step = (stop - start) // self.size
        return start + self.rank * step, start + (self.rank + 1) * step

    def held_expert(self, expert: int) -> int | None:
        """The index among this rank's experts of routed expert `expert`, None where another rank holds it."""
        if not self.expert_parallel:
            return expert
        first, stop = self._part(0, self.config.moe.num_experts)
        return expert - first if first <= expert < stop else None

    def pieces(self, name: str, shape: torch.Size) -> Pieces | None:
        """The pieces of parameter `name` (its full `shape`) this rank holds; None where it holds all of it.
        Per-expert checkpoint tensors (`...experts.N.gate_proj.weight`) are named as in the checkpoint."""
        c = self.config
        if self.size == 1:
            return None
        key, value = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
        if name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d_weight")):
            return 0, (self._part(0, key), self._part(key, 2 * key), self._part(2 * key, 2 * key + value))
        if self.expert_parallel and name.endswith(("experts.gate_up_proj", "experts.down_proj", *GGUF_STACKS)):
            return 0, (self._part(0, shape[0]),)
        if self.expert_parallel and PER_EXPERT_RE.search(name):  # a held expert's tensor is whole
            return None
        if name.endswith(GGUF_STACKS):  # a GGUF file's expert stacks [E, I, H]
            return 1, (self._part(0, shape[1]),)
        if name.endswith("experts.gate_up_proj"):
            half = shape[1] // 2
            return 1, (self._part(0, half), self._part(half, 2 * half))
        if name.endswith("experts.down_proj"):
            return 2, (self._part(0, shape[2]),)
        if name.endswith(KV_PROJECTIONS) and self.size > c.num_key_value_heads:  # replicated: one whole KV head
            per_head = shape[0] // c.num_key_value_heads
            head = self.rank * c.num_key_value_heads // self.size  # the KV head of this rank's query heads
            return 0, ((head * per_head, (head + 1) * per_head),)
        if name.endswith(ROW_PARALLEL):
            return 1, (self._part(0, shape[1]),)
        if name.endswith(COLUMN_PARALLEL):
            return 0, (self._part(0, shape[0]),)
        return None

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full parameter `tensor` (a view when it is one piece); a row-parallel bias,
        which the all-reduce would add `size` times, is rank 0's alone (zeros elsewhere)."""
        if self.size > 1 and name.endswith(ROW_PARALLEL_BIAS):
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        pieces = self.pieces(name, tensor.shape)
        if pieces is None:
            return tensor
        dim, spans = pieces
        parts = [tensor.narrow(dim, start, stop - start) for start, stop in spans]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def fraction(self, name: str, shape: torch.Size) -> float:
        """The share of parameter `name` (its full `shape`) this rank holds."""
        pieces = self.pieces(name, shape)
        if pieces is None:
            return 1.0
        dim, spans = pieces
        return sum(stop - start for start, stop in spans) / shape[dim]


GGUF_STACKS = ("experts.gate_proj", "experts.up_proj")  # a GGUF file's gate and up expert stacks [E, I, H]
COLUMN_PARALLEL = (
    "embed_tokens.weight",
    "lm_head.weight",
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "linear_attn.in_proj_z.weight",
    "linear_attn.in_proj_b.weight",
    "linear_attn.in_proj_a.weight",
    "linear_attn.in_proj_qkvz.weight",
    "linear_attn.in_proj_ba.weight",
    "linear_attn.dt_bias",
    "linear_attn.A_log",
    "gate_proj.weight",
    "up_proj.weight",
)
KV_PROJECTIONS = (
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
)
ROW_PARALLEL = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "down_proj.weight")
ROW_PARALLEL_BIAS = ("self_attn.o_proj.bias",)
