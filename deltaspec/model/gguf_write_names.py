"""Hugging Face tensors -> GGUF tensors, as llama.cpp's converter names and changes them (the forward direction
of `deltaspec.model.gguf_names`, whose name tables it inverts).

Owns what conversion/qwen.py (`_LinearAttentionVReorderBase`, `Qwen3NextModel`, `_QwenMtpMixin`,
`Qwen2MoeModel`) and conversion/base.py (`filter_tensors`, `prepare_tensors`) do to each checkpoint tensor of
Qwen3.5, Qwen3.5-MoE and Qwen3-Next, in the same float arithmetic:

- names: `model.layers.N.*` -> `blk.N.*`; the MTP head after the last layer as NextN blocks (`mtp.fc` ->
  `blk.L.nextn.eh_proj`, its norms -> `nextn.enorm/hnorm/shared_head_norm`, `mtp.layers.i.*` -> `blk.{L+i}.*`);
  the multimodal prefix `model.language_model.` dropped and the vision tower skipped;
- values: RMSNorm weights + 1 (not the GDN gated norm), A_log -> -exp(A_log), the conv weight [C, 1, K] -> [C, K];
  float16 tensors keep float16 for this arithmetic, every other dtype becomes float32 first;
- Qwen3.5 with more value than key heads: value heads from grouped (by key head) to tiled order in the rows of
  in_proj_qkv's V part, in_proj_z, in_proj_a/b, the conv channels' V part, A_log, dt_bias, and the columns of
  out_proj (importance vectors of out_proj follow the columns);
- Qwen3-Next: in_proj_qkvz (per-key-head groups [q, k, v, z]) split into attn_qkv [all q | all k | all v] and
  attn_gate (z);
- routed experts: per-expert tensors stacked into [E, rows, cols] once a layer's 3 x E have arrived (down, gate,
  up), a fused gate_up_proj [E, 2I, H] split into gate and up.

`TensorConverter` is stateful only for the expert stacking; it works as well on meta tensors (shapes only).
"""

from __future__ import annotations

import re

import torch

from deltaspec.config.model import LINEAR_ATTENTION, ModelConfig
from deltaspec.errors import DeltaspecError
from deltaspec.model.checkpoint_names import SKIPPED_PREFIXES
from deltaspec.model.gguf_names import GLOBAL_NAMES, LAYER_NAMES, NEXTN_NAMES, NORM, Layout

HF_GLOBAL = {hf: (name, value) for name, (hf, value) in GLOBAL_NAMES.items()}
HF_NEXTN = {hf: (name, value) for name, (hf, value) in NEXTN_NAMES.items()}
HF_LAYER = {hf: (name, value) for name, (hf, value) in LAYER_NAMES.items()}
HF_LAYER["linear_attn.in_proj_qkv.weight"] = ("attn_qkv.weight", None)
QKVZ = "linear_attn.in_proj_qkvz.weight"
LAYER = re.compile(r"^(model|mtp)\.layers\.(\d+)\.(.+)$")
EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
STACK_ORDER = ("down_proj", "gate_proj", "up_proj")  # the order Qwen2MoeModel writes a layer's stacked experts
V_HEADS = {  # linear_attn tensor -> (axis holding the value heads, values per head: 1 or Dv)
    "in_proj_z.weight": (0, "dv"),
    "in_proj_b.weight": (0, 1),
    "in_proj_a.weight": (0, 1),
    "A_log": (0, 1),
    "dt_bias": (0, 1),
    "out_proj.weight": (1, "dv"),
}


def hf_name(name: str) -> str | None:
    """The checkpoint name as the converter sees it: the multimodal prefix dropped; None for the vision tower."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    return name.replace("model.language_model.", "model.", 1)


def tile_v_heads(tensor: torch.Tensor, dim: int, hk: int, r: int, head_dim: int) -> torch.Tensor:
    """`_LinearAttentionVReorderBase._reorder_v_heads`: value heads along `dim` from grouped (hk groups of r) to
    tiled (r groups of hk)."""
    shape = list(tensor.shape)
    dim %= len(shape)
    grouped = tensor.reshape(*shape[:dim], hk, r, head_dim, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).contiguous().reshape(shape)


class TensorConverter:
    """Turns checkpoint tensors, one at a time in the converter's order, into (GGUF name, tensor) pairs."""

    def __init__(self, layout: Layout, num_experts: int):
        self.layout = layout
        self.num_experts = num_experts
        self.experts: dict[int, dict[tuple[int, str], torch.Tensor]] = {}

    def convert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The GGUF tensors checkpoint tensor `name` becomes (none yet for a layer's experts until all arrived)."""
        if tensor.dtype not in (torch.float16, torch.float32):
            tensor = tensor.float()
        if name in HF_GLOBAL:
            gguf_name, value = HF_GLOBAL[name]
            return [(gguf_name, _value(tensor, value))]
        if name in HF_NEXTN:
            gguf_suffix, value = HF_NEXTN[name]
            return [(f"blk.{self.layout.num_layers}.{gguf_suffix}", _value(tensor, value))]
        match = LAYER.match(name)
        if match is None:
            raise _unknown(name, self.layout)
        block = int(match[2]) + (self.layout.num_layers if match[1] == "mtp" else 0)
        rest = match[3]
        if expert := EXPERT.match(rest):
            return self._stack_expert(block, int(expert[1]), expert[2], tensor)
        if rest == "mlp.experts.gate_up_proj":
            gate, up = self._fused_experts(name, tensor).chunk(2, dim=-2)
            return [(f"blk.{block}.ffn_gate_exps.weight", gate), (f"blk.{block}.ffn_up_exps.weight", up)]
        if rest == QKVZ:
            return self._split_qkvz(block, tensor)
        if rest not in HF_LAYER:
            raise _unknown(name, self.layout)
        gguf_suffix, value = HF_LAYER[rest]
        if rest == "linear_attn.conv1d.weight" and tensor.dim() == 3:
            tensor = tensor.squeeze(1)
        if self.layout.v_heads_tiled and rest.startswith("linear_attn."):
            tensor = self._tile(rest.removeprefix("linear_attn."), tensor)
        return [(f"blk.{block}.{gguf_suffix}", _value(tensor, value))]

    def finish(self) -> None:
        """Refuse a checkpoint whose expert tensors were left incomplete."""
        if left := [block for block, parts in self.experts.items() if parts]:
            raise DeltaspecError(
                f"The checkpoint lacks some expert tensors of layer {left[0]}; all {self.num_experts} experts' "
                "gate, up and down projections are needed."
            )

    def _tile(self, rest: str, tensor: torch.Tensor) -> torch.Tensor:
        """The Qwen3.5 value-head reorder of one linear_attn tensor (`rest` without the prefix)."""
        lay = self.layout
        r = lay.hv // lay.hk
        if rest in ("in_proj_qkv.weight", "conv1d.weight"):
            qk = 2 * lay.hk * lay.dk
            return torch.cat([tensor[:qk], tile_v_heads(tensor[qk:], 0, lay.hk, r, lay.dv)])
        if rest not in V_HEADS:
            return tensor
        axis, head_dim = V_HEADS[rest]
        return tile_v_heads(tensor, axis, lay.hk, r, lay.dv if head_dim == "dv" else head_dim)

    @staticmethod
    def _fused_experts(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A fused gate_up_proj, which the converter takes as [E, 2I, H]."""
        if tensor.dim() != 3 or tensor.shape[1] % 2:
            raise DeltaspecError(f"The checkpoint tensor {name} has shape {list(tensor.shape)}, not [E, 2I, H].")
        return tensor

    def _stack_expert(self, block: int, expert: int, proj: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        parts = self.experts.setdefault(block, {})
        parts[expert, proj] = tensor
        if len(parts) < 3 * self.num_experts:
            return []
        try:
            stacked = {p: torch.stack([parts[e, p] for e in range(self.num_experts)]) for p in STACK_ORDER}
        except KeyError as exc:
            raise DeltaspecError(f"Layer {block} has an expert tensor beyond its {self.num_experts} experts.") from exc
        parts.clear()
        names = {"down_proj": "ffn_down_exps", "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps"}
        return [(f"blk.{block}.{names[p]}.weight", stacked[p]) for p in STACK_ORDER]

    def _split_qkvz(self, block: int, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """`Qwen3NextModel.modify_tensors`: [q, k, v, z] per key head -> attn_qkv [all q | all k | all v], z."""
        lay = self.layout
        r = lay.hv // lay.hk
        sizes = [lay.dk, lay.dk, r * lay.dv, r * lay.dv]
        hidden = tensor.shape[1]
        grouped = tensor.permute(1, 0).contiguous().view(-1, lay.hk, sum(sizes))  # [hidden, hk, q+k+v+z]
        q, k, v, z = (part.contiguous().view(hidden, -1) for part in torch.split(grouped, sizes, dim=-1))
        qkv = torch.cat([q, k, v], dim=-1).permute(1, 0).contiguous()
        return [(f"blk.{block}.attn_qkv.weight", qkv), (f"blk.{block}.attn_gate.weight", z.permute(1, 0).contiguous())]


def _value(tensor: torch.Tensor, value: str | None) -> torch.Tensor:
    """The converter's value change: NORM -> weight + 1, A_LOG -> -exp(A_log)."""
    if value is None:
        return tensor
    return tensor + 1 if value == NORM else -torch.exp(tensor)


def _unknown(name: str, layout: Layout) -> DeltaspecError:
    return DeltaspecError(
        f"The checkpoint has a tensor {name} that llama.cpp's {layout.arch} models have no place for."
    )


def gguf_importance(name: str, importance: torch.Tensor, layout: Layout) -> list[tuple[str, torch.Tensor]]:
    """The GGUF tensor(s) that a projection's importance (`name`: its weight's checkpoint name; importance [cols],
    or [E, cols] for `...mlp.experts.{gate,up,down}_proj`) belongs to, its columns in the file's order."""
    match = LAYER.match(name)
    if match is None or match[1] == "mtp":
        raise DeltaspecError(f"No importance is collected for {name}, which is not a layer's projection.")
    block, rest = int(match[2]), match[3]
    if rest == QKVZ:
        return [(f"blk.{block}.attn_qkv.weight", importance), (f"blk.{block}.attn_gate.weight", importance)]
    if rest not in HF_LAYER:
        raise _unknown(name, layout)
    if layout.v_heads_tiled and rest == "linear_attn.out_proj.weight":
        importance = tile_v_heads(importance, -1, layout.hk, layout.hv // layout.hk, layout.dv)
    return [(f"blk.{block}.{HF_LAYER[rest][0]}", importance)]


def layout_for(config: ModelConfig, arch: str) -> Layout:
    """The shapes the conversion depends on, from the checkpoint's config."""
    return Layout(
        arch=arch,
        num_layers=config.num_hidden_layers,
        linear_layers=frozenset(i for i, t in enumerate(config.layer_types) if t == LINEAR_ATTENTION),
        q_rows=2 * config.num_attention_heads * config.head_dim,
        kv_rows=config.num_key_value_heads * config.head_dim,
        hk=config.linear_num_key_heads,
        hv=config.linear_num_value_heads,
        dk=config.linear_key_head_dim,
        dv=config.linear_value_head_dim,
    )
