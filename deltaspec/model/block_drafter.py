"""The block drafter network (DFlash's layout): one forward drafts a block of tokens from the target's features.

A checkpoint is a directory with `config.json` and safetensors in the layout of z-lab's DFlash drafters
(`architectures: ["DFlashDraftModel"]`): top-level tensors `fc`, `hidden_norm`, `layers.N.*` (Qwen3 decoder
layers: q/k/v/o projections with per-head `q_norm` / `k_norm`, SwiGLU MLP, plain-weight RMSNorms) and `norm`;
no embedding and no LM head, which are the target's. The config names the target layers it reads
(`dflash_config.target_layer_ids`), the mask token (`dflash_config.mask_token_id`) and the block size.

The math, for a sequence whose committed context is positions 0..n-1 and whose last sampled token t_n is
not yet computed by the target:
- context: the outputs of the target layers `target_layer_ids` at positions p < n, side by side, give
  `c_p = hidden_norm(fc(features_p))` [H]; every draft layer projects them to keys and values (k_norm and
  RoPE at position p on the keys) — they never become queries, so they are computed once per position;
- block: the embeddings of [t_n, mask, ..., mask] (B tokens, the target's embedding table) at positions
  n..n+B-1 go through the layers; in each, the block's queries attend to the context's keys and values and
  to the block's own (all of them, or only earlier ones in causal / sliding-window layers);
- output: `norm` then the target's LM head; block position i >= 1 predicts the token at position n + i,
  so one forward drafts B - 1 tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from deltaspec.config.model import ModelConfig
from deltaspec.errors import DeltaspecError
from deltaspec.model.layers import Linear
from deltaspec.ops.dispatch import OpTable
from deltaspec.ops.norms import compute_dtype
from deltaspec.ops.rope import YarnScaling, cos_sin, inv_frequencies

ARCHITECTURE = "DFlashDraftModel"


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default taps: the middle layer for a one-layer drafter, else `num_draft_layers` layers evenly
    spaced from layer 1 to layer L - 3 of the target."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(frozen=True)
class BlockDrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int  # B: the block holds the last sampled token and B - 1 masks, so it drafts B - 1 tokens
    target_layer_ids: tuple[int, ...]  # target layers whose outputs are the context features, in this order
    mask_token_id: int
    target_hidden_size: int
    causal: tuple[bool, ...]  # per layer: block queries see only earlier block keys
    sliding_window: tuple[int | None, ...]  # per layer: keys at most this far back (None: all)
    yarn: YarnScaling | None = None  # RoPE scaling (None: plain RoPE)

    @classmethod
    def from_json(cls, raw: dict, where: str) -> BlockDrafterConfig:
        """Parse a DFlash `config.json` (top-level keys or `dflash_config` ones, as z-lab's revisions write them)."""
        dflash = raw.get("dflash_config") or {}

        def need(key: str):
            if key not in raw:
                raise DeltaspecError(f"The block drafter config at {where} has no {key!r}; is it a DFlash drafter?")
            return raw[key]

        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling") or rope
        rope_kind = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_kind not in ("default", "yarn"):
            raise DeltaspecError(
                f"The block drafter at {where} uses {rope_kind!r} RoPE scaling; deltaspec reads drafters with plain or "
                "YaRN RoPE."
            )
        max_positions = int(raw.get("max_position_embeddings", 4096))
        hidden, layers = int(need("hidden_size")), int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        if ids is None:
            ids = default_target_layers(int(need("num_target_layers")), layers)
        mask = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if mask is None:
            raise DeltaspecError(f"The block drafter config at {where} names no mask_token_id (dflash_config).")
        kinds = raw.get("layer_types") or ["full_attention"] * layers
        causal_all = bool(raw.get("is_causal", dflash.get("causal", False)))
        window = raw.get("sliding_window")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            block_size=int(dflash.get("block_size", raw.get("block_size", 16))),
            target_layer_ids=tuple(int(i) for i in ids),
            mask_token_id=int(mask),
            target_hidden_size=int(raw.get("target_hidden_size", hidden)),
            causal=tuple(causal_all or kind == "sliding_attention" for kind in kinds),
            sliding_window=tuple(int(window) if kind == "sliding_attention" and window else None for kind in kinds),
            yarn=YarnScaling.from_config(scaling, max_positions) if rope_kind == "yarn" else None,
        )

    def to_json(self, num_target_layers: int) -> dict:
        """The DFlash `config.json` of this drafter (what `from_json` reads back)."""
        sliding = [w is not None for w in self.sliding_window]
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "num_target_layers": num_target_layers,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.yarn is None else {"rope_type": "yarn", **asdict(self.yarn)},
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "sliding_window": next((w for w in self.sliding_window if w is not None), None),
            "is_causal": all(self.causal) and not any(sliding),
            "attention_bias": False,
            "tie_word_embeddings": False,
        }

    def check_target(self, target: ModelConfig, where: str) -> None:
        """One sentence when the drafter cannot run on `target`."""
        if self.hidden_size != target.hidden_size or self.target_hidden_size != target.hidden_size:
            raise DeltaspecError(
                f"The block drafter at {where} has hidden size {self.hidden_size} (reading features of size "
                f"{self.target_hidden_size}), but the target's is {target.hidden_size}; it shares the target's "
                "embeddings and LM head, so they must be equal."
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise DeltaspecError(
                f"The block drafter at {where} reads target layers {bad}, but the target has "
                f"{target.num_hidden_layers} layers."
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise DeltaspecError(
                f"The block drafter at {where} uses mask token {self.mask_token_id}, outside the target's "
                f"vocabulary of {target.vocab_size}."
            )
        if self.block_size < 2:
            raise DeltaspecError(f"The block drafter at {where} has block_size {self.block_size}; it needs >= 2.")

    @classmethod
    def sized_for(cls, target: ModelConfig, block_size: int = 16, num_layers: int = 5) -> BlockDrafterConfig:
        """A drafter shaped like z-lab's public DFlash drafters for a target of this shape: five layers of the
        target's width, attention heads and MLP width, reading five evenly spaced target layers, blocks of 16
        (theirs for Qwen3.6-27B make four of the five layers sliding-window; these attend to the whole context)."""
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_layers=num_layers,
            num_heads=target.num_attention_heads,
            num_kv_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            block_size=block_size,
            target_layer_ids=default_target_layers(target.num_hidden_layers, num_layers),
            mask_token_id=target.vocab_size - 1,
            target_hidden_size=target.hidden_size,
            causal=(False,) * num_layers,
            sliding_window=(None,) * num_layers,
        )

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * d
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        return len(self.target_layer_ids) * self.target_hidden_size * h + 2 * h + self.num_layers * layer

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Context keys and values one committed position holds in the layers that keep the whole context."""
        full = sum(window is None for window in self.sliding_window)
        return full * 2 * self.num_kv_heads * self.head_dim * torch.empty(0, dtype=dtype).element_size()

    def window_bytes_per_stream(self, dtype: torch.dtype) -> int:
        """Context keys and values a stream holds in its sliding-window layers (at most twice each window)."""
        rows = sum(2 * window for window in self.sliding_window if window is not None)
        return rows * 2 * self.num_kv_heads * self.head_dim * torch.empty(0, dtype=dtype).element_size()


def rope_frequencies(config: BlockDrafterConfig, dtype: torch.dtype, device) -> torch.Tensor:
    """The drafter's RoPE inverse frequencies in the compute dtype (YaRN-scaled when its config says so)."""
    if config.yarn is None:
        return inv_frequencies(config.head_dim, config.rope_theta, compute_dtype(dtype), device)
    return config.yarn.inv_frequencies(config.head_dim, config.rope_theta, compute_dtype(dtype), device)


class PlainRMSNorm(nn.Module):
    """Qwen3's RMSNorm, `norm(x) * weight`, through the op table's zero-centred norm (weight - 1 in float32)."""

    def __init__(self, dim: int, eps: float, ops: OpTable):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.ops = eps, ops

    def centred(self) -> torch.Tensor:
        """The weight as the zero-centred norm reads it, exactly (1 + (w - 1) = w in the compute dtype)."""
        return self.weight.to(compute_dtype(self.weight.dtype)) - 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.centred(), self.eps)


class DraftAttention(nn.Module):
    def __init__(self, config: BlockDrafterConfig, ops: OpTable):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = Linear(h, config.num_heads * d, ops)
        self.k_proj = Linear(h, config.num_kv_heads * d, ops)
        self.v_proj = Linear(h, config.num_kv_heads * d, ops)
        self.o_proj = Linear(config.num_heads * d, h, ops)
        self.q_norm = PlainRMSNorm(d, config.rms_norm_eps, ops)
        self.k_norm = PlainRMSNorm(d, config.rms_norm_eps, ops)
        self.eps, self.ops = config.rms_norm_eps, ops

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> keys (k_norm, RoPE) and values, [T, kv_heads, head_dim] each."""
        k = self.k_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        return self.ops.norm_rope(k, self.k_norm.centred(), cos, sin, self.eps), v

    def forward_shared(
        self, x: torch.Tensor, cos, sin, context: tuple[torch.Tensor, torch.Tensor], mask
    ) -> torch.Tensor:
        """x [b, R, H]: each of b sequences' rows (several blocks side by side); context = its keys and values
        [b, C, kv_heads, d]; mask [b, R, C + R] bool (True = may attend: the context's keys, then the rows') ->
        [b, R, H]. `forward` with one attention call for all sequences."""
        batch, rows = x.shape[:2]
        flat = x.reshape(batch * rows, -1)
        q = self.q_proj(flat).view(batch * rows, self.num_heads, self.head_dim)
        q = self.ops.norm_rope(q, self.q_norm.centred(), cos, sin, self.eps).view(batch, rows, self.num_heads, -1)
        k, v = (t.view(batch, rows, self.num_kv_heads, -1) for t in self.keys_values(flat, cos, sin))
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # [b, heads, R, d]
            torch.cat((context[0], k), dim=1).transpose(1, 2),  # [b, kv_heads, C + R, d]
            torch.cat((context[1], v), dim=1).transpose(1, 2),
            attn_mask=mask[:, None],
            scale=1.0 / math.sqrt(self.head_dim),
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(attended.transpose(1, 2).reshape(batch * rows, -1)).view(batch, rows, -1)


class DraftMLP(nn.Module):
    def __init__(self, config: BlockDrafterConfig, ops: OpTable):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, ops)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, ops)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, ops)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)))


class DraftLayer(nn.Module):
    def __init__(self, config: BlockDrafterConfig, ops: OpTable):
        super().__init__()
        self.self_attn = DraftAttention(config, ops)
        self.mlp = DraftMLP(config, ops)
        self.input_layernorm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class BlockDrafterModel(nn.Module):
    """The drafter's own weights; the caller brings the target's embeddings and LM head."""

    def __init__(self, config: BlockDrafterConfig, ops: OpTable, dtype: torch.dtype, device):
        super().__init__()
        self.config = config
        self.fc = Linear(len(config.target_layer_ids) * config.target_hidden_size, config.hidden_size, ops)
        self.hidden_norm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.layers = nn.ModuleList(DraftLayer(config, ops) for _ in range(config.num_layers))
        self.norm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.dtype = dtype
        self.rope_scale = 1.0 if config.yarn is None else config.yarn.scale()
        self.register_buffer("inv_freq", rope_frequencies(config, dtype, device), persistent=False)

    def rope(self, positions: torch.Tensor):
        """cos, sin [T, head_dim] for positions [T] (full-width RoPE)."""
        return cos_sin(positions, self.inv_freq, self.dtype, self.rope_scale)

    def context_keys_values(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features [T, taps * target_hidden] at positions [T] -> per layer, keys and values [T, kv_heads, d]."""
        context = self.hidden_norm(self.fc(features))  # [T, H]
        cos, sin = self.rope(positions)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        context: list[list[tuple[torch.Tensor, torch.Tensor]]],
        context_positions: list[list[torch.Tensor]],
    ) -> torch.Tensor:
        """embeds [S * B, H] of S blocks at positions [S * B]; context[l][s] = sequence s's keys and values in
        layer l [C_ls, kv_heads, d] at context_positions[l][s] [C_ls] (a sliding-window layer may hold fewer)
        -> final normed hidden states [S * B, H]. One attention call per layer for all S blocks: each layer's
        contexts padded to the longest, the padding masked out (`padded_context`)."""
        cfg = self.config
        width = cfg.block_size
        blocks = positions.shape[0] // width
        block_positions = positions.view(blocks, width)  # [S, B]
        cos, sin = self.rope(positions)
        x = embeds.view(blocks, width, -1)
        for i, layer in enumerate(self.layers):
            keys, values, mask = padded_context(
                context[i], context_positions[i], block_positions, cfg.causal[i], cfg.sliding_window[i]
            )
            x = x + layer.self_attn.forward_shared(layer.input_layernorm(x), cos, sin, (keys, values), mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).view(blocks * width, -1)

    def forward_anchored(
        self, embeds: torch.Tensor, context: list[tuple[torch.Tensor, torch.Tensor]], anchors: torch.Tensor
    ) -> torch.Tensor:
        """Training's form of `forward`, one attention call per layer: b sequences whose context keys and values
        cover positions 0..C-1 (context[l] = layer l's [b, C, kv_heads, d], `context_keys_values`), each with A
        blocks; block s of sequence r sits at positions anchors[r, s]..anchors[r, s]+B-1 and sees the context before
        anchors[r, s], exactly as `forward` with that sequence's context cut there. embeds [b, A * B, H], anchors
        [b, A] -> final normed hidden states [b, A * B, H]."""
        cfg = self.config
        batch, blocks = anchors.shape
        width = cfg.block_size
        positions = (anchors[:, :, None] + torch.arange(width, device=anchors.device)).view(batch, -1)  # [b, R]
        cos, sin = self.rope(positions.reshape(-1))
        context_len = context[0][0].shape[1]
        keys = torch.cat((torch.arange(context_len, device=anchors.device).expand(batch, -1), positions), dim=1)
        block_of_key = torch.cat(
            (
                torch.full((context_len,), -1, device=anchors.device),
                torch.arange(blocks * width, device=anchors.device) // width,
            )
        )
        block_of_query = torch.arange(blocks * width, device=anchors.device) // width  # [R]
        anchor_of_query = anchors.repeat_interleave(width, dim=1)  # [b, R]
        in_context = (keys[:, None, :] < anchor_of_query[:, :, None]) & (block_of_key < 0)  # [b, R, C + R]
        own_block = (block_of_key[None, :] == block_of_query[:, None])[None]  # [1, R, C + R]
        earlier = keys[:, None, :] <= positions[:, :, None]
        x = embeds
        for i, layer in enumerate(self.layers):
            allowed = in_context | (own_block & earlier if cfg.causal[i] else own_block)
            if cfg.sliding_window[i] is not None:
                allowed = allowed & (keys[:, None, :] > positions[:, :, None] - cfg.sliding_window[i])
            x = x + layer.self_attn.forward_shared(layer.input_layernorm(x), cos, sin, context[i], allowed)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def padded_context(
    context: list[tuple[torch.Tensor, torch.Tensor]],
    context_positions: list[torch.Tensor],
    block_positions: torch.Tensor,
    causal: bool,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """S sequences' keys and values (context[s]: [C_s, kv_heads, d] at context_positions[s]) padded to the longest
    C -> keys, values [S, C, kv_heads, d] and the mask [S, B, C + B] (True = may attend) of each block query
    (block_positions [S, B]) over its context, then its block: every context row it holds (all earlier than the
    block), its block's rows (only earlier ones in a causal layer), within `window` positions in a windowed one."""
    blocks, width = block_positions.shape
    keys = pad_sequence([k for k, _ in context], batch_first=True)
    values = pad_sequence([v for _, v in context], batch_first=True)
    key_positions = pad_sequence(context_positions, batch_first=True, padding_value=-1)  # [S, C]
    held = key_positions >= 0
    queries = block_positions[:, :, None]  # [S, B, 1]
    own = block_positions[:, None, :]  # [S, 1, B]
    in_context = held[:, None, :].expand(blocks, width, held.shape[1])
    in_block = own <= queries if causal else torch.ones(blocks, width, width, dtype=torch.bool, device=own.device)
    if window is not None:
        in_context = in_context & (key_positions[:, None, :] > queries - window)
        in_block = in_block & (own > queries - window)
    return keys, values, torch.cat((in_context, in_block), dim=-1)


def random_block_drafter(
    target: ModelConfig, ops: OpTable, dtype: torch.dtype, device: torch.device, seed: int
) -> BlockDrafterModel:
    """A drafter of `BlockDrafterConfig.sized_for(target)` with random weights, for benchmarks of its cost."""
    config = BlockDrafterConfig.sized_for(target)
    with torch.device(device):
        model = BlockDrafterModel(config, ops, dtype, device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.inv_freq = rope_frequencies(config, dtype, device)
    return model.requires_grad_(False)


def block_drafter_config(path: Path) -> BlockDrafterConfig:
    """The config of the DFlash-layout drafter in directory `path`; one sentence when it is not one."""
    from deltaspec.model.hf_config import read_config_json

    raw = read_config_json(path)
    if ARCHITECTURE not in (raw.get("architectures") or []) and "dflash_config" not in raw:
        raise DeltaspecError(
            f"{path} is not a block drafter (its config.json names no {ARCHITECTURE} and has no dflash_config); "
            "--speculative block needs a DFlash-layout drafter directory."
        )
    return BlockDrafterConfig.from_json(raw, str(path))


def load_block_drafter(
    path: Path, target: ModelConfig, ops: OpTable, dtype: torch.dtype, device: torch.device
) -> BlockDrafterModel:
    """The DFlash-layout drafter in directory `path`, checked against the target, in `dtype` on `device`."""
    from deltaspec.model.safetensors_files import checkpoint_files, open_safetensors

    config = block_drafter_config(path)
    config.check_target(target, str(path))
    with torch.device("meta"):
        model = BlockDrafterModel(config, ops, dtype, "cpu")
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    files = checkpoint_files(path)
    missing = sorted(set(expected) - set(files))
    if missing:
        raise DeltaspecError(f"The block drafter at {path} lacks {len(missing)} tensors, e.g. {missing[0]!r}.")
    loaded = {}
    for name, shape in expected.items():
        with open_safetensors(files[name]) as f:
            tensor = f.get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise DeltaspecError(
                f"The block drafter at {path} has {name} of shape {tuple(tensor.shape)}; its config implies {shape}."
            )
        loaded[name] = tensor.to(device=device, dtype=dtype)
    model.load_state_dict(loaded, strict=False, assign=True)
    model.inv_freq = rope_frequencies(config, dtype, device)
    return model.requires_grad_(False)
