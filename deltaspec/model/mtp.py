"""The multi-token-prediction head shipped with Qwen3.5-class checkpoints (`mtp.*` weights).

For row i it reads the target's final hidden state h_i and the embedding of the next token
t_{i+1}: `h' = fc(cat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)])`, then full-attention
decoder layer(s) with their own paged KV cache (at the position of h_i), then `norm`. The shared
LM head turns h' into the draft distribution for t_{i+2}; feeding h' back chains k > 1 drafts.
"""

import torch
from torch import nn

from deltaspec.config.model import ModelConfig
from deltaspec.model.decoder import DecoderLayer, run_blocks
from deltaspec.model.forward_batch import ForwardBatch
from deltaspec.model.layers import Linear, RMSNorm, make_mlp
from deltaspec.ops.dispatch import OpTable
from deltaspec.parallel.group import SINGLE, TensorParallel


class MTPHead(nn.Module):
    def __init__(
        self, config: ModelConfig, num_layers: int, first_kv_index: int, ops: OpTable, tp: TensorParallel = SINGLE
    ):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = Linear(2 * hidden, hidden, ops)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, ops)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, ops)
        mlp = [make_mlp(config, config.moe is not None, ops, tp.rank) for _ in range(num_layers)]
        self.layers = nn.ModuleList(
            DecoderLayer(config, first_kv_index + i, ops, False, mlp[i], tp) for i in range(num_layers)
        )
        self.norm = RMSNorm(hidden, eps, ops)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, caches, cos, sin):
        """embeds, hidden [T, hidden] -> MTP hidden states [T, hidden]."""
        h = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1))
        return run_blocks(self.layers, h, self.norm, batch, caches, cos, sin)[0]
