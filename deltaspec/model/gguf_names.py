"""GGUF tensors under deltaspec's (Hugging Face) names, with llama.cpp's conversion undone.

Owns the inverse of what llama.cpp's converter (conversion/qwen.py, classes `Qwen2MoeModel`, `_QwenMtpMixin`,
`Qwen3NextModel`, `_LinearAttentionVReorderBase`, and the base `ModelBase.modify_tensors` of conversion/base.py)
does to the names and values of Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints:

- names: `blk.N.*` -> `model.layers.N.*`, the NextN blocks after the last layer -> `mtp.layers.i.*`, their
  `nextn.eh_proj/enorm/hnorm/shared_head_norm` -> `mtp.fc/pre_fc_norm_embedding/pre_fc_norm_hidden/norm`;
- values (float tensors only): RMSNorm weights were stored +1 (undone), `A_log` as -exp(A_log) (undone), the
  conv weight [C, 1, K] squeezed to [C, K] (kept: it is deltaspec's parameter shape);
- Qwen3.5 value heads (when there are more value than key heads) were reordered from grouped by key head to
  tiled, in the rows of `in_proj_qkv` (V part), `in_proj_z`, `in_proj_a/b`, the conv channels (V part),
  `A_log`, `dt_bias`, and the columns of `out_proj`: rows are put back (a row gather, exact for any type);
  `out_proj`'s columns are put back for float tensors and for quantized ones whose blocks do not straddle value
  heads (whole blocks move within each row), else left as stored with `GGUFTensor.input_order` set;
- Qwen3-Next's `in_proj_qkvz` was split into `attn_qkv` ([all q | all k | all v]) and `attn_gate` (z). For
  the engine they load as Qwen3.5's separate projections (`in_proj_qkv`, `in_proj_z`, and `ssm_ba`'s per-group
  [b, a] rows as `in_proj_b` / `in_proj_a`; the GDN module computes the same), so each file tensor stays whole
  in its own type — llama-quantize's Q4_K_M gives `attn_qkv` more bits than `attn_gate` in a third of the
  layers. With `grouped_qkvz` (to write a GGUF file back, from float tensors) the rows are gathered back into
  Hugging Face's per-key-head groups [q, k, v, z];
- routed experts were stacked into `ffn_{gate,up,down}_exps` [E, rows, cols]: they stay stacked, as
  `mlp.experts.{gate,up,down}_proj`; optional fusions (`ffn_gate_up_exps`, an attention `attn_qkv`) are split
  back into row slices.

Shapes: ggml ignores trailing dimensions of size 1 (torch's leading ones), and llama-quantize (like every file
ggml's own gguf code writes) stores only the dimensions up to the last one above 1 — a single-row matrix such as
`ffn_gate_inp_shexp` [1, hidden] arrives as [hidden], an expert stack of one expert as a matrix. Each tensor gets
back the rank its Hugging Face parameter has (`rank_of`) before anything else reads it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from deltaspec.config.model import LINEAR_ATTENTION
from deltaspec.errors import DeltaspecError
from deltaspec.model.gguf_config import architecture_of
from deltaspec.model.gguf_raw import GGUFTensor, RawGGUF, block_layout

FLOAT_QTYPES = ("F32", "F16", "F64")  # numpy float arrays; BF16 stays raw bytes like the quantized types
BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")
NORM = "norm"  # stored as weight + 1
A_LOG = "a_log"  # stored as -exp(A_log)

GLOBAL_NAMES = {
    "token_embd.weight": ("model.embed_tokens.weight", None),
    "output.weight": ("lm_head.weight", None),
    "output_norm.weight": ("model.norm.weight", NORM),
}
NEXTN_NAMES = {  # only on the first NextN block, where conversion/qwen.py `_QwenMtpMixin.filter_tensors` puts them
    "nextn.eh_proj.weight": ("mtp.fc.weight", None),
    "nextn.enorm.weight": ("mtp.pre_fc_norm_embedding.weight", NORM),
    "nextn.hnorm.weight": ("mtp.pre_fc_norm_hidden.weight", NORM),
    "nextn.shared_head_norm.weight": ("mtp.norm.weight", NORM),
}
LAYER_NAMES = {
    "attn_norm.weight": ("input_layernorm.weight", NORM),
    "post_attention_norm.weight": ("post_attention_layernorm.weight", NORM),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", NORM),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", NORM),
    "attn_q.weight": ("self_attn.q_proj.weight", None),
    "attn_k.weight": ("self_attn.k_proj.weight", None),
    "attn_v.weight": ("self_attn.v_proj.weight", None),
    "attn_output.weight": ("self_attn.o_proj.weight", None),
    "attn_q.bias": ("self_attn.q_proj.bias", None),
    "attn_k.bias": ("self_attn.k_proj.bias", None),
    "attn_v.bias": ("self_attn.v_proj.bias", None),
    "attn_output.bias": ("self_attn.o_proj.bias", None),
    "ffn_gate.weight": ("mlp.gate_proj.weight", None),
    "ffn_up.weight": ("mlp.up_proj.weight", None),
    "ffn_down.weight": ("mlp.down_proj.weight", None),
    "ffn_gate_inp.weight": ("mlp.gate.weight", None),
    "ffn_gate_exps.weight": ("mlp.experts.gate_proj", None),
    "ffn_up_exps.weight": ("mlp.experts.up_proj", None),
    "ffn_down_exps.weight": ("mlp.experts.down_proj", None),
    "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", None),
    "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", None),
    "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", None),
    "ffn_gate_inp_shexp.weight": ("mlp.shared_expert_gate.weight", None),
    "ssm_a": ("linear_attn.A_log", A_LOG),
    "ssm_dt.bias": ("linear_attn.dt_bias", None),
    "ssm_conv1d.weight": ("linear_attn.conv1d.weight", None),
    "ssm_norm.weight": ("linear_attn.norm.weight", None),
    "ssm_out.weight": ("linear_attn.out_proj.weight", None),
    "ssm_beta.weight": ("linear_attn.in_proj_b.weight", None),
    "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", None),
    "ssm_ba.weight": ("linear_attn.in_proj_ba.weight", None),
    "attn_gate.weight": ("linear_attn.in_proj_z.weight", None),
}


@dataclass(frozen=True)
class Layout:
    """The shapes the conversion depended on."""

    arch: str
    num_layers: int
    linear_layers: frozenset[int]
    q_rows: int  # attention q_proj rows (query and gate)
    kv_rows: int
    hk: int
    hv: int
    dk: int
    dv: int

    @property
    def v_heads_tiled(self) -> bool:
        """Whether the converter reordered value heads (Qwen3.5 with more value than key heads)."""
        return self.arch in ("qwen35", "qwen35moe") and self.hv != self.hk


def layout_of(raw: RawGGUF, config: dict) -> Layout:
    return Layout(
        arch=architecture_of(raw),
        num_layers=config["num_hidden_layers"],
        linear_layers=frozenset(i for i, t in enumerate(config["layer_types"]) if t == LINEAR_ATTENTION),
        q_rows=2 * config["num_attention_heads"] * config["head_dim"],
        kv_rows=config["num_key_value_heads"] * config["head_dim"],
        hk=config["linear_num_key_heads"],
        hv=config["linear_num_value_heads"],
        dk=config["linear_key_head_dim"],
        dv=config["linear_value_head_dim"],
    )


def hf_tensors(raw: RawGGUF, config: dict, grouped_qkvz: bool = False) -> dict[str, GGUFTensor]:
    """Every tensor of `raw` under its Hugging Face name (see the module docstring); Qwen3-Next's GDN input
    projections grouped as its checkpoints keep them only with `grouped_qkvz`."""
    layout = layout_of(raw, config)
    out: dict[str, GGUFTensor] = {}
    for name, tensor in raw.tensors.items():
        for hf_name, hf_tensor in _convert(raw, layout, name, with_rank(tensor, rank_of(name)), grouped_qkvz):
            out[hf_name] = hf_tensor
    return out


def rank_of(name: str) -> int:
    """The number of dimensions of the Hugging Face tensor(s) the GGUF tensor `name` holds: 3 for a routed-expert
    stack, 1 for norms, biases and `ssm_a`, 2 for every other weight (matrices and the conv window)."""
    if name.endswith("_exps.weight"):
        return 3
    if not name.endswith(".weight") or name.endswith("norm.weight"):
        return 1
    return 2


def with_rank(tensor: GGUFTensor, rank: int) -> GGUFTensor:
    """`tensor` with the leading dimensions of size 1 that ggml's writer left out put back up to `rank`."""
    missing = rank - len(tensor.shape)
    if missing <= 0:
        return tensor
    return replace(
        tensor, shape=(1,) * missing + tensor.shape, data=tensor.data.reshape((1,) * missing + tensor.data.shape)
    )


def _convert(
    raw: RawGGUF, layout: Layout, name: str, tensor: GGUFTensor, grouped_qkvz: bool
) -> list[tuple[str, GGUFTensor]]:
    """The Hugging Face tensor(s) the GGUF tensor `name` holds (none: it is converted with another one)."""
    if name in GLOBAL_NAMES:
        hf_name, value = GLOBAL_NAMES[name]
        return [(hf_name, _undo_value(name, tensor, value))]
    match = BLOCK_NAME.match(name)
    if match is None:
        raise _unknown(raw, layout, name)
    block, rest = int(match[1]), match[2]
    if block >= layout.num_layers:  # a NextN (MTP) block
        prefix = f"mtp.layers.{block - layout.num_layers}."
        if rest in NEXTN_NAMES and block == layout.num_layers:
            hf_name, value = NEXTN_NAMES[rest]
            return [(hf_name, _undo_value(name, tensor, value))]
    else:
        prefix = f"model.layers.{block}."
    linear = block in layout.linear_layers
    if rest == "attn_qkv.weight":
        if not linear:
            return _split_rows(name, tensor, prefix + "self_attn.{}_proj.weight", layout)
        if layout.arch == "qwen3next" and grouped_qkvz:
            return [(prefix + "linear_attn.in_proj_qkvz.weight", _qkvz(raw, layout, block, tensor))]
        return [(prefix + "linear_attn.in_proj_qkv.weight", _qkv(name, tensor, layout))]
    if layout.arch == "qwen3next" and grouped_qkvz and rest == "attn_gate.weight":
        return []  # gathered into in_proj_qkvz with attn_qkv
    if layout.arch == "qwen3next" and not grouped_qkvz and rest == "ssm_ba.weight":
        r = layout.hv // layout.hk
        groups = np.arange(layout.hk)[:, None] * 2 * r + np.arange(r)[None, :]  # [Hk, r]: b rows of each group
        return [
            (prefix + "linear_attn.in_proj_b.weight", _take_rows(tensor, groups.reshape(-1))),
            (prefix + "linear_attn.in_proj_a.weight", _take_rows(tensor, (groups + r).reshape(-1))),
        ]
    if rest == "ffn_gate_up_exps.weight":
        half = tensor.shape[1] // 2
        return [
            (prefix + "mlp.experts.gate_proj", _slice(tensor, 1, 0, half)),
            (prefix + "mlp.experts.up_proj", _slice(tensor, 1, half, 2 * half)),
        ]
    if rest not in LAYER_NAMES:
        raise _unknown(raw, layout, name)
    hf_name, value = LAYER_NAMES[rest]
    tensor = _undo_value(name, tensor, value)
    if linear and layout.v_heads_tiled and rest in V_HEAD_FIXES:
        tensor = V_HEAD_FIXES[rest](name, tensor, layout)
    return [(prefix + hf_name, tensor)]


def _unknown(raw: RawGGUF, layout: Layout, name: str) -> DeltaspecError:
    return DeltaspecError(f"{raw.path} has a tensor {name} that deltaspec does not know in a {layout.arch} model.")


def _undo_value(name: str, tensor: GGUFTensor, value: str | None) -> GGUFTensor:
    """Undo the converter's value transform (`NORM`: +1, `A_LOG`: -exp) on a float tensor, as float32."""
    if value is None:
        return tensor
    values = _float32(name, tensor)
    values = values - np.float32(1) if value == NORM else np.log(-values)
    return GGUFTensor(qtype="F32", shape=tensor.shape, data=values)


def _float32(name: str, tensor: GGUFTensor) -> np.ndarray:
    """The values of a float tensor as float32 (BF16 from its raw bytes)."""
    if tensor.qtype in FLOAT_QTYPES:
        return tensor.data.astype(np.float32)
    if tensor.qtype == "BF16":
        bits = np.ascontiguousarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(tensor.shape)
    raise DeltaspecError(
        f"The GGUF tensor {name} is stored as {tensor.qtype}, but deltaspec can only undo the converter's change "
        "of its values on a float (F32, F16 or BF16) tensor."
    )


def _expect_rows(name: str, tensor: GGUFTensor, rows: int) -> None:
    if tensor.shape[0] != rows:
        raise DeltaspecError(
            f"The GGUF tensor {name} has {tensor.shape[0]} rows where the file's metadata implies {rows}; "
            "the file is inconsistent."
        )


def _slice(tensor: GGUFTensor, axis: int, start: int, stop: int) -> GGUFTensor:
    """Rows start:stop along `axis` (a view)."""
    index = (slice(None),) * axis + (slice(start, stop),)
    shape = tensor.shape[:axis] + (stop - start,) + tensor.shape[axis + 1 :]
    return replace(tensor, shape=shape, data=tensor.data[index])


def _take_rows(tensor: GGUFTensor, rows: np.ndarray) -> GGUFTensor:
    """The rows `rows` (axis 0), in that order (a copy)."""
    return replace(tensor, shape=(len(rows), *tensor.shape[1:]), data=np.take(tensor.data, rows, axis=0))


def _split_rows(name: str, tensor: GGUFTensor, pattern: str, layout: Layout) -> list[tuple[str, GGUFTensor]]:
    """A fused attention `attn_qkv` (converter option --fuse-qkv) back into q_proj, k_proj, v_proj."""
    _expect_rows(name, tensor, layout.q_rows + 2 * layout.kv_rows)
    bounds = np.cumsum([0, layout.q_rows, layout.kv_rows, layout.kv_rows])
    return [(pattern.format(p), _slice(tensor, 0, bounds[i], bounds[i + 1])) for i, p in enumerate("qkv")]


def grouped_from_tiled(hk: int, r: int, head_dim: int) -> np.ndarray:
    """Index that undoes `_LinearAttentionVReorderBase._reorder_v_heads`: Hugging Face value head g * r + i
    (grouped by key head g) sits at tiled position i * hk + g; `grouped = tiled[index]`."""
    return np.arange(hk * r * head_dim).reshape(r, hk, head_dim).transpose(1, 0, 2).reshape(-1)


def tiled_from_grouped(hk: int, r: int, head_dim: int) -> np.ndarray:
    """The converter's own reorder (the inverse of `grouped_from_tiled`): `tiled = grouped[index]`."""
    return np.arange(hk * r * head_dim).reshape(hk, r, head_dim).transpose(1, 0, 2).reshape(-1)


def _v_rows(name: str, tensor: GGUFTensor, layout: Layout, skip: int, head_dim: int) -> GGUFTensor:
    """Rows after the first `skip` hold value heads of `head_dim` rows in tiled order: put them back grouped."""
    _expect_rows(name, tensor, skip + layout.hv * head_dim)
    v_rows = grouped_from_tiled(layout.hk, layout.hv // layout.hk, head_dim)
    return _take_rows(tensor, np.concatenate([np.arange(skip), skip + v_rows]))


def _qkv(name: str, tensor: GGUFTensor, layout: Layout) -> GGUFTensor:
    """Qwen3.5 `in_proj_qkv`: [all q | all k | all v], value heads put back in grouped order."""
    if not layout.v_heads_tiled:
        return tensor
    return _v_rows(name, tensor, layout, 2 * layout.hk * layout.dk, layout.dv)


def _out_proj(name: str, tensor: GGUFTensor, layout: Layout) -> GGUFTensor:
    """Qwen3.5 `out_proj`, whose columns (value heads) the converter tiled: restored where that moves whole
    values or whole quantized blocks; otherwise kept, with `input_order` saying which input each column takes."""
    r = layout.hv // layout.hk
    if tensor.shape[-1] != layout.hv * layout.dv:
        raise DeltaspecError(
            f"The GGUF tensor {name} has {tensor.shape[-1]} columns where the file's metadata implies "
            f"{layout.hv * layout.dv}; the file is inconsistent."
        )
    if tensor.qtype in FLOAT_QTYPES:
        return replace(tensor, data=tensor.data[:, grouped_from_tiled(layout.hk, r, layout.dv)])
    block_size, block_bytes = block_layout(tensor.qtype)
    if layout.dv % block_size:
        return replace(tensor, input_order=tiled_from_grouped(layout.hk, r, layout.dv))
    blocks = tensor.data.reshape(tensor.shape[0], -1, block_bytes)
    head_blocks = grouped_from_tiled(layout.hk, r, layout.dv // block_size)
    return replace(tensor, data=blocks[:, head_blocks].reshape(tensor.shape[0], -1))


V_HEAD_FIXES: dict[str, Callable[[str, GGUFTensor, Layout], GGUFTensor]] = {
    "attn_gate.weight": lambda n, t, lay: _v_rows(n, t, lay, 0, lay.dv),
    "ssm_beta.weight": lambda n, t, lay: _v_rows(n, t, lay, 0, 1),
    "ssm_alpha.weight": lambda n, t, lay: _v_rows(n, t, lay, 0, 1),
    "ssm_a": lambda n, t, lay: _v_rows(n, t, lay, 0, 1),
    "ssm_dt.bias": lambda n, t, lay: _v_rows(n, t, lay, 0, 1),
    "ssm_conv1d.weight": lambda n, t, lay: _v_rows(n, t, lay, 2 * lay.hk * lay.dk, lay.dv),
    "ssm_out.weight": _out_proj,
}


def _qkvz(raw: RawGGUF, layout: Layout, block: int, qkv: GGUFTensor) -> GGUFTensor:
    """Qwen3-Next `in_proj_qkvz`: `attn_qkv` ([all q | all k | all v]) and `attn_gate` (z) gathered back into
    per-key-head groups [q, k, v, z] (the inverse of conversion/qwen.py `Qwen3NextModel.modify_tensors`)."""
    qkv_name, z_name = f"blk.{block}.attn_qkv.weight", f"blk.{block}.attn_gate.weight"
    z = raw.tensors.get(z_name)
    if z is None:
        raise DeltaspecError(f"{raw.path} has {qkv_name} but not {z_name}, so in_proj_qkvz cannot be rebuilt.")
    hk, dk, r, dv = layout.hk, layout.dk, layout.hv // layout.hk, layout.dv
    _expect_rows(qkv_name, qkv, 2 * hk * dk + layout.hv * dv)
    _expect_rows(z_name, z, layout.hv * dv)
    if qkv.qtype != z.qtype:
        if not {qkv.qtype, z.qtype} <= {*FLOAT_QTYPES, "BF16"}:
            raise DeltaspecError(
                f"{raw.path} stores {qkv_name} as {qkv.qtype} but {z_name} as {z.qtype}, so deltaspec cannot "
                "rebuild their rows into one in_proj_qkvz."
            )
        qkv = GGUFTensor("F32", qkv.shape, _float32(qkv_name, qkv))
        z = GGUFTensor("F32", z.shape, _float32(z_name, z))
    v0, z0 = 2 * hk * dk, 2 * hk * dk + layout.hv * dv
    rows = np.concatenate(
        [
            np.concatenate(
                [
                    np.arange(g * dk, (g + 1) * dk),
                    hk * dk + np.arange(g * dk, (g + 1) * dk),
                    v0 + np.arange(g * r * dv, (g + 1) * r * dv),
                    z0 + np.arange(g * r * dv, (g + 1) * r * dv),
                ]
            )
            for g in range(hk)
        ]
    )
    both = replace(qkv, shape=(z0 + layout.hv * dv, *qkv.shape[1:]), data=np.concatenate([qkv.data, z.data]))
    return _take_rows(both, rows)
