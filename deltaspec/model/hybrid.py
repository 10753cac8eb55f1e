"""The hybrid decoder: embeddings, GDN / attention blocks, final norm, LM head, optional MTP head.

`HybridModel.forward(batch, caches)` runs every sequence of a `ForwardBatch` in one pass and
returns the final (normed) hidden state of every row (`run` also returns the outputs of the layers
a block drafter reads, `feature_layers`); `compute_logits` applies the LM head to the rows the
caller needs. Parameter names follow the Hugging Face checkpoint names
(`model.layers.N...`, `lm_head.weight`, `mtp...`) so that loading is a name lookup. A tensor-parallel rank
builds it from its share of the architecture (`deltaspec.parallel.shard.shard_config`) with its `tp` group:
the embedding and the LM head then hold its slice of the vocabulary. A pipeline stage builds the decoder `layers` it
holds (the others are empty places) and runs them on the residual stream the stage before it sent (`run`); the
embedding, final norm, LM head and MTP head are on every stage, so that every stage turns the last stage's hidden
states into the same logits and drafts (`deltaspec.parallel.pipeline`).
"""

import functools
import time
from collections.abc import Callable

import torch
from torch import nn
from tqdm import tqdm

from deltaspec.cache.model_caches import ModelCaches
from deltaspec.config.model import LINEAR_ATTENTION, ModelConfig
from deltaspec.model.checkpoint_names import checkpoint_name
from deltaspec.model.decoder import DecoderLayer, OtherStageLayer, run_blocks
from deltaspec.model.forward_batch import ForwardBatch
from deltaspec.model.layers import FusedLinear, Linear, QuantizedEmbedding, RMSNorm, SparseMoE, make_mlp
from deltaspec.model.mtp import MTPHead
from deltaspec.ops.dispatch import OpTable
from deltaspec.ops.mrope import mrope_cos_sin
from deltaspec.ops.norms import compute_dtype
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.rope import cos_sin, inv_frequencies
from deltaspec.parallel.group import SINGLE, TensorParallel


class RotaryTable(nn.Module):
    """Inverse frequencies of the partial RoPE, computed once in the compute dtype."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.dtype = dtype
        self.register_buffer(
            "inv_freq",
            inv_frequencies(config.rotary_dim, config.rope_theta, compute_dtype(dtype), device),
            persistent=False,
        )

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim] of the batch's rows: from its positions, or its three position streams when it
        holds image tokens."""
        if batch.images is not None:
            return mrope_cos_sin(batch.images.positions, self.inv_freq, batch.images.sections, self.dtype)
        return cos_sin(batch.positions, self.inv_freq, self.dtype)


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of one rank's slice of the vocabulary [vocab / size, hidden] (floats, or GGUF blocks
    gathered in `dtype`): each rank looks up the ids in its slice (zeros for the others) and the all-reduce
    assembles every row."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size // tp.size, hidden))
        self.tp = tp
        self.dtype: torch.dtype | None = None  # set for a quantized slice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., hidden]"""
        rows = self.weight.shape[0]
        local = ids - self.tp.rank * rows
        here = (local >= 0) & (local < rows)
        local = local.clamp(0, rows - 1)
        if isinstance(self.weight, QuantizedWeight):
            found = self.weight.rows(local.reshape(-1), self.dtype).view(*ids.shape, self.weight.in_features)
        else:
            found = nn.functional.embedding(local, self.weight)
        return self.tp.all_reduce(found * here.unsqueeze(-1))


class TextModel(nn.Module):
    """The embedding, the decoder `layers` held (an `OtherStageLayer` in the place of each other one; their caches are
    indexed from the first held layer on) and the final norm."""

    def __init__(self, config: ModelConfig, ops: OpTable, tp: TensorParallel, layers: range):
        super().__init__()
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
            if tp.sharded
            else nn.Embedding(config.vocab_size, config.hidden_size)
        )
        gdn_index = attn_index = 0
        held = []
        for i, kind in enumerate(config.layer_types):
            if i not in layers:
                held.append(OtherStageLayer())
                continue
            is_gdn = kind == LINEAR_ATTENTION
            held.append(
                DecoderLayer(
                    config,
                    gdn_index if is_gdn else attn_index,
                    ops,
                    is_gdn,
                    make_mlp(config, config.moe_layers[i], ops, tp.rank),
                    tp,
                )
            )
            gdn_index, attn_index = gdn_index + is_gdn, attn_index + (not is_gdn)
        self.layers = nn.ModuleList(held)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class HybridModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        ops: OpTable,
        dtype: torch.dtype,
        device,
        num_mtp_layers: int,
        tp: TensorParallel = SINGLE,
        layers: range | None = None,
    ):
        super().__init__()
        self.config = config
        self.tp = tp
        self.layers = range(config.num_hidden_layers) if layers is None else layers  # the pipeline stage's
        self.model = TextModel(config, ops, tp, self.layers)
        self.lm_head = Linear(config.hidden_size, config.vocab_size // tp.size, ops)
        held_kv = self.held_attention_layers
        self.mtp = MTPHead(config, num_mtp_layers, held_kv, ops, tp) if num_mtp_layers else None
        self.rotary = RotaryTable(config, dtype, device)
        self.repack_seconds: float | None = None  # how long `repack_for_kernels` took; None: nothing repacked
        self.feature_layers: tuple[int, ...] = ()  # layers whose outputs `run` returns, for a block drafter

    @property
    def held_attention_layers(self) -> int:
        return sum(self.config.layer_types[i] != LINEAR_ATTENTION for i in self.layers)

    @property
    def num_kv_layers(self) -> int:
        """Attention layers with a KV cache: the model's (the stage's), then the MTP head's."""
        return self.held_attention_layers + (len(self.mtp.layers) if self.mtp else 0)

    def fuse_projections(self) -> None:
        """Fuse every group of projections that reads the same input into one weight (after loading)."""
        for module in [m for m in self.modules() if hasattr(m, "fuse")]:
            module.fuse()

    def use_ops(self, ops: OpTable) -> None:
        """Make every module call `ops` (e.g. once the device's GEMM routing is known)."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def syncs_with_host(self, dtype: torch.dtype) -> bool:
        """Whether a pass in `dtype` reads device values on the host (MoE experts the op table's kernels do not
        take), which rules out CUDA graphs."""
        return any(module.syncs_with_host(dtype) for module in self.modules() if isinstance(module, SparseMoE))

    def expected_expert_bytes(self, tokens: int) -> float:
        """The expert bytes the decoder's MoE layers read in a pass of `tokens` tokens, on average under uniform
        routing (0 for a dense model; the MTP head's pass is the drafter's)."""
        return sum(m.expected_expert_bytes(tokens) for m in self.model.layers.modules() if isinstance(m, SparseMoE))

    def linear_shapes(self) -> dict[tuple[int, int], int]:
        """(out, in) of every float weight a pass multiplies through the op table's `linear` -> how many of them
        (the MTP head included). A MoE layer's shared expert is not among them: `moe_experts` multiplies it."""
        shared = {
            id(linear)
            for moe in self.modules()
            if isinstance(moe, SparseMoE) and hasattr(moe, "shared_expert")
            for linear in moe.shared_expert.modules()
        }
        shapes: dict[tuple[int, int], int] = {}
        for module in self.modules():
            if isinstance(module, Linear) and isinstance(module.weight, torch.Tensor) and id(module) not in shared:
                shape = tuple(module.weight.shape)
                shapes[shape] = shapes.get(shape, 0) + 1
        return shapes

    def repack_for_kernels(self, progress: bool = False) -> int:
        """Repack the Q4_K and Q6_K matrices that the op table's `quantized_linear` multiplies into the layouts of
        the CUDA products (`QuantizedWeight.repack_for_kernels`); MoE layers' weights (the MoE kernels read blocks)
        and an embedding table's stay. Returns how many segments were repacked; `repack_seconds` says how long
        it took."""
        in_moe = {id(part) for layer in self.modules() if isinstance(layer, SparseMoE) for part in layer.modules()}
        tables = {id(module.weight) for module in self.modules() if isinstance(module, QuantizedEmbedding)}
        weights = [
            module.weight
            for module in self.modules()
            if isinstance(module, Linear)
            and id(module) not in in_moe
            and isinstance(module.weight, QuantizedWeight)
            and id(module.weight) not in tables
        ]
        start = time.perf_counter()
        done = sum(
            weight.repack_for_kernels() for weight in tqdm(weights, "Repacking", unit="matrix", disable=not progress)
        )
        if done:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.repack_seconds = time.perf_counter() - start
        return done

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight under its Hugging Face checkpoint name; fused projections come back as views."""
        out, fused = {}, []
        for name, module in self.named_modules():
            if isinstance(module, FusedLinear):
                out.update(module.hf_weights(name.rpartition(".")[0]))
                fused.append(name + ".")
        for name, param in self.named_parameters():
            if not name.startswith(tuple(fused)):
                out[checkpoint_name(name)] = param
        return out

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """All rows of `batch` through the stack -> final hidden states [T, hidden]."""
        return self.run(batch, caches)[0]

    def run(
        self, batch: ForwardBatch, caches: ModelCaches, stream: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All rows of `batch` through the stack -> (final hidden states [T, hidden], the outputs of the layers in
        `feature_layers` side by side [T, len(feature_layers) * hidden], or None when it is empty). A pipeline stage
        after the first starts from the residual `stream` [T, hidden] the stage before sent instead of the embeddings,
        and one before the last returns the residual stream after its last layer, un-normed, for the next."""
        cos, sin = self.rotary(batch)
        if stream is None:
            stream = self.model.embed_tokens(batch.token_ids)
            if batch.images is not None:  # the tower's embeddings in place of the image tokens'
                stream = stream.index_copy(0, batch.images.rows, batch.images.embeds.to(stream.dtype))
        last_stage = self.layers.stop == self.config.num_hidden_layers
        hidden, taps = run_blocks(
            self.model.layers[self.layers.start : self.layers.stop],
            stream,
            self.model.norm if last_stage else None,
            batch,
            caches,
            cos,
            sin,
            self.feature_layers,
        )
        return hidden, torch.cat(taps, dim=-1) if taps else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] (every rank's slice of the vocabulary)."""
        return self.tp.gather_vocab(self.lm_head(hidden))

    def mtp_forward(self, batch: ForwardBatch, hidden: torch.Tensor, caches: ModelCaches) -> torch.Tensor:
        """The MTP head on rows (token t_{i+1}, hidden h_i) -> its hidden states [T, hidden]."""
        cos, sin = self.rotary(batch)
        return self.mtp(self.model.embed_tokens(batch.token_ids), hidden, batch, caches, cos, sin)


def fused_once_loaded(load: Callable[..., HybridModel]) -> Callable[..., HybridModel]:
    """A loader (`load` builds and fills a model) whose model is fused (`fuse_projections`) and put in eval mode
    after `load` has returned: its own references to the parts (an index of modules, a dict of loaded tensors) are
    gone by then, so each group's parts are freed as it is fused and the peak is the weights plus one fused
    projection (a 27B model's parts held to the end cost 24 GB more, more than an 80 GB card has left)."""

    @functools.wraps(load)
    def loaded(*args, **kwargs) -> HybridModel:
        model = load(*args, **kwargs)
        model.fuse_projections()
        return model.eval()

    return loaded
