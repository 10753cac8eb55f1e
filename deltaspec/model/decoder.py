"""Decoder blocks (`h += mixer(norm1(h)); h += mlp(norm2(h))`) and the caches they read.

The residual stream runs with each add fused into the norm that follows it: a block takes its
normed input and the residual, and returns the next block's normed input and the residual. Under tensor
parallelism the mixer's and the MLP's outputs are each rank's partial sums, all-reduced before the add. A pipeline stage
before the last ends on its last layer's residual stream, which the next stage's first layer norms; another stage's
layers are `OtherStageLayer`s.
"""

import torch
from torch import nn

from deltaspec.cache.model_caches import ModelCaches
from deltaspec.config.model import ModelConfig
from deltaspec.model.attention import GatedAttention
from deltaspec.model.forward_batch import ForwardBatch
from deltaspec.model.gdn import GatedDeltaNet
from deltaspec.model.layers import RMSNorm
from deltaspec.ops.dispatch import OpTable
from deltaspec.parallel.group import SINGLE, TensorParallel


class DecoderLayer(nn.Module):
    """`h += mixer(norm1(h)); h += mlp(norm2(h))`."""

    def __init__(
        self,
        config: ModelConfig,
        mixer_index: int,
        ops: OpTable,
        is_gdn: bool,
        mlp: nn.Module,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.is_gdn = is_gdn
        self.tp = tp
        if is_gdn:
            self.linear_attn = GatedDeltaNet(config, mixer_index, ops)
        else:
            self.self_attn = GatedAttention(config, mixer_index, ops)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        batch: ForwardBatch,
        caches: ModelCaches,
        cos,
        sin,
        next_norm: RMSNorm | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """x = input_layernorm(residual) [T, hidden] -> (next_norm(new residual), new residual); without `next_norm`
        (the last layer of a pipeline stage before the last) (None, new residual)."""
        if self.is_gdn:
            mixed = self.linear_attn(x, batch, caches)
        else:
            mixed = self.self_attn(x, batch, caches, cos, sin)
        x, residual = self.post_attention_layernorm.add(self.tp.all_reduce(mixed), residual)
        mlp = self.tp.all_reduce(self.mlp(x))
        if next_norm is None:
            return None, residual + mlp  # what `add` sums: the next stage's first norm reads it
        return next_norm.add(mlp, residual)


class OtherStageLayer(nn.Module):
    """The place of a decoder layer another pipeline stage holds: no weights, never run (the layer indices, and so
    the checkpoint names, stay those of the whole model)."""


def run_blocks(
    layers: nn.ModuleList,
    h: torch.Tensor,
    final_norm: RMSNorm | None,
    batch: ForwardBatch,
    caches: ModelCaches,
    cos,
    sin,
    taps: tuple[int, ...] = (),
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """h [T, hidden] through `layers`, then `final_norm` -> ([T, hidden], the output of each layer in `taps`
    as transformers' `hidden_states[i + 1]` gives it: the residual stream after the layer, un-normed, except after
    the last layer, where it is normed; [T, hidden] each, in the order of `taps`). Without `final_norm` (a pipeline
    stage before the last) the first result is the residual stream after the last layer, un-normed."""
    x, residual = layers[0].input_layernorm(h), h
    tapped = {}
    for i, layer in enumerate(layers):
        last = i + 1 == len(layers)
        next_norm = final_norm if last else layers[i + 1].input_layernorm
        x, residual = layer(x, residual, batch, caches, cos, sin, next_norm)
        if i in taps:
            tapped[i] = x if last else residual
    return residual if final_norm is None else x, [tapped[i] for i in taps]
