"""`deltaspec quantize --random-weights --shape NAME --type TYPE OUT.gguf`: a shape's random weights as a GGUF file
that llama.cpp loads, so that both engines can be timed on the same file.

Owns turning the random model's parameters into the file's tensors. The parameters are drawn one at a time by
`random_init.random_parameters`, exactly as `--random-weights --shape NAME --quant TYPE` draws them in process
with the same seed on the same device (`--quant` for the quantized types; the float types draw float32 values
as `--random-weights` does), and each is written as soon as it is converted, so the file may be far larger than
memory. Each tensor gets the name, shape, order, type and metadata the converter and llama-quantize give a real
checkpoint of that shape (`gguf_write`): a quantized weight's blocks are llama-quantize's type for it
(`random_quant.tensor_types` and `gguf_write.tensor_types` make the same choice), moved as the converter moves
rows — Qwen3.5's value heads tiled in the rows of `attn_qkv`, `attn_gate`, `ssm_beta/alpha`, in whole blocks
between the columns of `ssm_out` where its blocks do not straddle value heads (else kept as drawn: a file of
other weights with the same distribution), Qwen3-Next's `in_proj_b` and `in_proj_a` interleaved into `ssm_ba`,
the experts' `gate_up_proj` split into `ffn_gate_exps` and `ffn_up_exps` — and a float parameter goes through
the converter's own code (`gguf_write_names.TensorConverter`: norms + 1, -exp(A_log), the same tiling).
The tokenizer is `gguf_write_vocab`'s, of the shape's vocabulary size. `deltaspec.random_weights.*` keys say the
weights are random, of which shape and seed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from deltaspec.config.model import ModelConfig
from deltaspec.model.checkpoint_names import checkpoint_name
from deltaspec.model.gguf_write import (
    CPU,
    FILE_TYPES,
    FLOAT_TYPES,
    add_tensor_infos,
    encode,
    file_plan,
    move_quantize_keys,
    tensor_types,
    write_file,
)
from deltaspec.model.gguf_write_meta import add_general, add_hyperparameters
from deltaspec.model.gguf_write_names import TensorConverter, layout_for, tile_v_heads
from deltaspec.model.gguf_write_source import ARCH_OF_MODEL_TYPE
from deltaspec.model.gguf_write_vocab import add_minimal_tokenizer
from deltaspec.model.hybrid import HybridModel
from deltaspec.model.random_init import parameter_shapes, random_parameters
from deltaspec.model.random_quant import gguf_name, quantized_config
from deltaspec.ops.quant.formats import format_of
from deltaspec.ops.quant.weight import QuantizedWeight

RANDOM_KEY = "deltaspec.random_weights"  # true; with .shape and .seed
Blocks = tuple[str, torch.Tensor]  # (GGUF type, uint8 [..., rows, row_bytes])
GATE_UP = "mlp.experts.gate_up_proj"
BETA_ALPHA = ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight")


def shape_hparams(config: ModelConfig) -> dict:
    """The config.json (text model) of a checkpoint of `config`, as the converter reads it."""
    hparams = {
        "num_hidden_layers": config.num_hidden_layers,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "rope_parameters": {"rope_theta": config.rope_theta, "partial_rotary_factor": config.partial_rotary_factor},
        "rms_norm_eps": config.rms_norm_eps,
        "head_dim": config.head_dim,
        "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "linear_value_head_dim": config.linear_value_head_dim,
        "layer_types": list(config.layer_types),
    }
    if config.intermediate_size:  # the MoE shapes without dense layers have none
        hparams["intermediate_size"] = config.intermediate_size
    if (moe := config.moe) is not None:
        hparams |= {
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.num_experts_per_tok,
            "moe_intermediate_size": moe.moe_intermediate_size,
            "shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
        }
    return hparams


class RandomConverter:
    """The random model's parameters, one at a time in drawing order, -> (GGUF name, float tensor or blocks); a
    Qwen3-Next layer's `in_proj_b` is held until its `in_proj_a` arrives."""

    def __init__(self, config: ModelConfig, arch: str):
        self.config = config
        self.layout = layout_for(config, arch)
        self.floats = TensorConverter(self.layout, config.moe.num_experts if config.moe else 0)
        self.held: dict[str, torch.Tensor | Blocks] = {}

    def convert(self, name: str, value: torch.Tensor | QuantizedWeight) -> list[tuple[str, torch.Tensor | Blocks]]:
        if isinstance(value, QuantizedWeight):
            ((qtype, data),) = value.segments
            value = (qtype, data)
        if self.layout.arch == "qwen3next" and name.endswith(BETA_ALPHA):
            return self._beta_alpha(name, value)
        if isinstance(value, torch.Tensor):
            return self.floats.convert(checkpoint_name(name), value)
        qtype, data = value
        file_name = gguf_name(name, self.config)
        if self.layout.v_heads_tiled and ".linear_attn." in name:
            data = self._tiled(name.rpartition(".linear_attn.")[2], qtype, data)
        if name.endswith(GATE_UP):
            gate, up = data.chunk(2, dim=-2)
            up_name = file_name.replace("ffn_gate_exps", "ffn_up_exps")
            return [(file_name, (qtype, gate.contiguous())), (up_name, (qtype, up.contiguous()))]
        return [(file_name, (qtype, data))]

    def _tiled(self, rest: str, qtype: str, data: torch.Tensor) -> torch.Tensor:
        """`TensorConverter._tile` on the blocks of one linear_attn weight: value heads grouped -> tiled."""
        lay = self.layout
        r = lay.hv // lay.hk
        if rest == "in_proj_qkv.weight":
            qk = 2 * lay.hk * lay.dk
            return torch.cat([data[:qk], tile_v_heads(data[qk:], 0, lay.hk, r, lay.dv)])
        if rest == "in_proj_z.weight":
            return tile_v_heads(data, 0, lay.hk, r, lay.dv)
        if rest in ("in_proj_b.weight", "in_proj_a.weight"):
            return tile_v_heads(data, 0, lay.hk, r, 1)
        fmt = format_of(qtype)
        if lay.dv % fmt.block_size:  # out_proj's blocks straddle value heads: kept as drawn
            return data
        blocks = data.view(data.shape[0], -1, fmt.type_size)  # [rows, column blocks, type_size]
        return tile_v_heads(blocks, 1, lay.hk, r, lay.dv // fmt.block_size).view(data.shape[0], -1)

    def _beta_alpha(self, name: str, value: torch.Tensor | Blocks) -> list[tuple[str, torch.Tensor | Blocks]]:
        """Qwen3-Next's `ssm_ba`: per key head, its value heads' b rows, then their a rows."""
        layer = name.rpartition(".linear_attn.")[0]
        if layer not in self.held:
            self.held[layer] = value
            return []
        first = self.held.pop(layer)
        pair = (first, value) if name.endswith(BETA_ALPHA[1]) else (value, first)
        merged_name = gguf_name(name, self.config).replace("ssm_alpha", "ssm_ba").replace("ssm_beta", "ssm_ba")
        lay = self.layout
        if isinstance(value, torch.Tensor):
            return [(merged_name, _interleave(*pair, lay.hk))]
        (qtype, b), (other, a) = pair
        assert qtype == other, f"{name}: b and a drawn as {qtype} and {other}, one file tensor"
        return [(merged_name, (qtype, _interleave(b, a, lay.hk)))]


def _interleave(b: torch.Tensor, a: torch.Tensor, groups: int) -> torch.Tensor:
    """[Hv, ...] b and a rows -> [2 Hv, ...]: each of `groups` key heads' b rows, then its a rows."""
    return torch.stack([b.view(groups, -1, *b.shape[1:]), a.view(groups, -1, *a.shape[1:])], 1).view(-1, *b.shape[1:])


def write_random_gguf(
    config: ModelConfig,
    shape: str,
    path: Path,
    kind: str,
    seed: int = 0,
    device: torch.device = CPU,
    progress: bool = True,
) -> Counter:
    """Write the random weights of `config` (shape `shape`, seeded `seed`, drawn on `device`) as the GGUF file
    `path` of --type `kind`; returns how many tensors got each type."""
    quantized = kind not in FLOAT_TYPES
    if quantized:
        config = quantized_config(config)  # Qwen3-Next's GDN projections drawn separately, as the file holds them
    arch = ARCH_OF_MODEL_TYPE[config.model_type]
    with torch.device("meta"):
        shapes = parameter_shapes(HybridModel(config, None, torch.float32, device, config.num_mtp_layers), config)
    converter = RandomConverter(config, arch)
    meta = ((n, torch.empty(s, device="meta")) for n, s in shapes)
    plan = file_plan(kind, [(n, tuple(t.shape)) for name, value in meta for n, t in converter.convert(name, value)])
    n_expert = config.moe.num_experts if config.moe else 0
    types = tensor_types(kind, plan, config.num_hidden_layers + config.num_mtp_layers, n_expert)
    writer = gguf.GGUFWriter(None, arch)
    add_tensor_infos(writer, [(name, dims, types[name]) for name, dims in plan])
    add_general(writer, None, f"{shape}-random")
    add_hyperparameters(writer, shape_hparams(config), config.num_mtp_layers, gguf.LlamaFileType[FILE_TYPES[kind]])
    add_minimal_tokenizer(writer, config.vocab_size)
    move_quantize_keys(writer, kind)
    writer.add_bool(RANDOM_KEY, True)
    writer.add_string(f"{RANDOM_KEY}.shape", shape)
    writer.add_uint32(f"{RANDOM_KEY}.seed", seed)
    drawn = random_parameters(config, shapes, torch.float32, device, seed, kind if quantized else None)
    write_file(writer, path, _encoded(converter, drawn, types), types, progress)
    return Counter(types.values())


def _encoded(
    converter: RandomConverter, drawn: Iterator[tuple[str, torch.Tensor | QuantizedWeight]], types: dict[str, str]
) -> Iterator[tuple[str, np.ndarray]]:
    """Each file tensor's bytes as soon as its parameters are drawn: blocks as drawn, floats encoded."""
    for name, value in drawn:
        for file_name, tensor in converter.convert(name, value):
            if isinstance(tensor, torch.Tensor):
                yield file_name, encode(tensor.cpu(), types[file_name], None, tensor.device)
                continue
            qtype, data = tensor
            assert qtype == types[file_name], f"{file_name} drawn as {qtype}, but the file holds {types[file_name]}"
            yield file_name, data.cpu().numpy()
