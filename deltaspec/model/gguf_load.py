"""Building the hybrid model from a GGUF checkpoint (`deltaspec.model.gguf_file.read_gguf`), weights kept quantized.

Every tensor comes in deltaspec's (Hugging Face) naming. Float tensors (F32, F16, BF16) become ordinary
parameters in the engine's dtype; quantized matrices stay as their GGUF blocks (`QuantizedWeight`), moved to
the device as they are, and the embedding table becomes a `QuantizedEmbedding` that dequantizes only the rows
it gathers. A routed-expert tensor stacks the experts ([E, rows, row_bytes]); gate and up are stacked per
expert into the model's `gate_up_proj`. A Qwen3-Next file's GDN input projections come as separate ones, so
its model is built with Qwen3.5's projection layout (`gguf_names`). Projections are fused afterwards as for any
checkpoint (a fused weight's parts keep their own types as segments). A tensor-parallel rank keeps its pieces of
each tensor (`shard_tensor`): rows as they are, input columns as whole blocks.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from tqdm import tqdm

from deltaspec.config.model import ModelConfig
from deltaspec.errors import DeltaspecError
from deltaspec.model.checkpoint_names import target_name
from deltaspec.model.gguf_raw import GGUFTensor, block_layout
from deltaspec.model.hybrid import HybridModel, VocabParallelEmbedding, fused_once_loaded
from deltaspec.model.layers import QuantizedEmbedding, set_weight
from deltaspec.ops.dispatch import OpTable
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.parallel.group import SINGLE, TensorParallel
from deltaspec.parallel.pipeline import holds
from deltaspec.parallel.shard import ROW_PARALLEL_BIAS, Shard, shard_config

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
EMBEDDING = "model.embed_tokens.weight"
EXPERT_PARTS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def float_tensor(tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A float GGUF tensor in `dtype` on `device` (BF16 arrives as its raw 16-bit patterns)."""
    data = np.array(tensor.data)  # a writable copy of the mapped file's bytes
    if tensor.qtype == "BF16":
        values = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    else:
        values = torch.from_numpy(data)
    return values.reshape(tensor.shape).to(device=device, dtype=dtype)


def quantized_tensor(tensor, device: torch.device) -> QuantizedWeight:
    """A quantized GGUF matrix (or expert stack) as a one-segment QuantizedWeight on `device`."""
    data = torch.from_numpy(np.array(tensor.data)).to(device)  # [..., rows, row_bytes], a writable copy
    order = None if tensor.input_order is None else torch.from_numpy(np.array(tensor.input_order)).to(device)
    return QuantizedWeight([(tensor.qtype, data.reshape(*tensor.shape[:-1], -1))], tensor.shape[-1], order)


@fused_once_loaded
def load_gguf_model(
    checkpoint,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    ops: OpTable,
    progress: bool = True,
    with_mtp: bool = True,
    tp: TensorParallel = SINGLE,
    layers: range | None = None,
) -> HybridModel:
    """The model of `checkpoint` (a `GGUFCheckpoint`) on `device`: quantized weights kept as blocks, float ones in
    `dtype`; the MTP head only `with_mtp`; a rank of the tensor-parallel group `tp` builds and reads its share, a
    pipeline stage its decoder `layers` only."""
    if not any(name.endswith("in_proj_qkvz.weight") for name in checkpoint.tensors):
        config = replace(config, gdn_layout="qwen3_5")  # a Qwen3-Next file's GDN projections read as separate ones
    shard = Shard(config, tp.rank, tp.size, tp.expert_parallel)
    with torch.device("meta"):
        num_mtp_layers = config.num_mtp_layers if with_mtp else 0
        rank_config = shard_config(config, tp.size, tp.expert_parallel)
        model = HybridModel(rank_config, ops, dtype, device, num_mtp_layers, tp, layers)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    experts: dict[str, dict[str, QuantizedWeight | torch.Tensor]] = {}
    filled: set[str] = set()
    for name, tensor in tqdm(checkpoint.tensors.items(), desc="Loading weights", unit="tensor", disable=not progress):
        target = target_name(name, with_mtp)
        if target is None or not holds(model.layers, target):
            continue
        module_name, _, attribute = target.rpartition(".")
        tensor = shard_tensor(name, target, tensor, shard)
        if module_name.endswith(".experts") and attribute in EXPERT_PARTS:
            experts.setdefault(module_name, {})[attribute] = _weight_of(tensor, dtype, device)
            continue
        if target not in params:
            raise DeltaspecError(f"The GGUF file has a tensor {name} that this model has no place for.")
        weight = _weight_of(tensor, dtype, device)
        if tp.sharded and target.endswith(ROW_PARALLEL_BIAS):
            weight = shard.take(target, weight)
        if tuple(weight.shape) != tuple(params[target].shape):
            raise DeltaspecError(
                f"The GGUF tensor {name} has shape {tuple(weight.shape)}; the model needs "
                f"{tuple(params[target].shape)}."
            )
        set_weight(modules[module_name], attribute, weight)
        filled.add(target)
    for module_name, parts in experts.items():
        _set_experts(modules[module_name], module_name, parts)
        filled.update(f"{module_name}.{fused}" for fused in set(EXPERT_PARTS.values()))
    if "lm_head.weight" not in filled and config.tie_word_embeddings and EMBEDDING in filled:
        set_weight(model.lm_head, "weight", model.model.embed_tokens.weight)
        filled.add("lm_head.weight")
    if missing := sorted(set(params) - filled):
        raise DeltaspecError(
            f"The GGUF file lacks {len(missing)} tensors the model needs, e.g. {', '.join(missing[:3])}."
        )
    if isinstance(model.model.embed_tokens, VocabParallelEmbedding):
        model.model.embed_tokens.dtype = dtype  # a quantized slice gathers its rows in the engine's dtype
    elif isinstance(model.model.embed_tokens.weight, QuantizedWeight):
        model.model.embed_tokens = QuantizedEmbedding(model.model.embed_tokens.weight, dtype)
    return model


def shard_tensor(name: str, target: str, tensor: GGUFTensor, shard: Shard) -> GGUFTensor:
    """`shard`'s pieces of the GGUF tensor `name` (parameter `target`): slices of its rows (or of an expert stack's
    rows), or of its input columns as whole blocks — a block that would straddle two ranks is refused. Columns kept
    in a stored order (`input_order`) are taken where they stand, and the slice keeps its own order."""
    pieces = shard.pieces(target, torch.Size(tensor.shape))
    if pieces is None:
        return tensor
    dim, spans = pieces
    columns = dim == len(tensor.shape) - 1
    if not columns:
        data = np.concatenate([tensor.data.take(range(start, stop), axis=dim) for start, stop in spans], axis=dim)
        shape = (*tensor.shape[:dim], sum(stop - start for start, stop in spans), *tensor.shape[dim + 1 :])
        return GGUFTensor(tensor.qtype, shape, data, tensor.input_order)
    order = np.arange(tensor.shape[-1]) if tensor.input_order is None else np.asarray(tensor.input_order)
    taken = np.zeros(len(order), dtype=bool)
    for start, stop in spans:
        taken |= (order >= start) & (order < stop)
    elementwise = tensor.qtype in ("F32", "F16", "F64")  # data of these is values, of the others bytes
    block_size, block_bytes = (1, 1) if elementwise else block_layout(tensor.qtype)
    per_block = taken.reshape(-1, block_size)
    if (per_block.any(axis=1) != per_block.all(axis=1)).any():
        raise DeltaspecError(
            f"The GGUF tensor {name} ({tensor.qtype}, blocks of {block_size} inputs) cannot be split among "
            f"{shard.size} ranks without cutting a block; run this file on fewer GPUs."
        )
    blocks = tensor.data.reshape(*tensor.shape[:-1], -1, block_bytes)
    kept = blocks[..., per_block.all(axis=1), :].reshape(*tensor.shape[:-1], -1)
    held = np.concatenate([np.arange(start, stop) for start, stop in spans])  # the rank's inputs, in its order
    new_order = np.searchsorted(held, order[taken])  # stored column j of the slice takes the rank's input new_order[j]
    in_order = (new_order == np.arange(len(new_order))).all()
    return GGUFTensor(tensor.qtype, (*tensor.shape[:-1], len(held)), kept, None if in_order else new_order)


def gguf_weight_bytes(
    checkpoint, dtype: torch.dtype, with_mtp: bool, shard: Shard | None = None, layers: range | None = None
) -> tuple[int, int]:
    """Bytes the loaded weights take (quantized ones as their blocks, float ones in `dtype`): the target model's
    and its MTP head's (0 unless `with_mtp`); with `shard`, one tensor-parallel rank's; with `layers`, a pipeline
    stage's."""
    target = mtp = 0
    for name, tensor in checkpoint.tensors.items():
        if (parameter := target_name(name, with_mtp=True)) is None:
            continue
        if layers is not None and not holds(layers, parameter):
            continue
        size = tensor.data.nbytes if tensor.qtype not in FLOAT_TYPES else int(np.prod(tensor.shape)) * dtype.itemsize
        size = int(size * shard.fraction(parameter, torch.Size(tensor.shape))) if shard is not None else size
        if name.startswith("mtp."):
            mtp += size if with_mtp else 0
        else:
            target += size
    return target, mtp


def _weight_of(tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor | QuantizedWeight:
    if tensor.qtype in FLOAT_TYPES:
        return float_tensor(tensor, dtype, device)
    return quantized_tensor(tensor, device)


def _set_experts(module, name: str, parts: dict[str, QuantizedWeight | torch.Tensor]) -> None:
    """The routed experts' gate | up stacked per expert into `gate_up_proj` [E, 2I, H], and `down_proj`."""
    if set(parts) != set(EXPERT_PARTS):
        raise DeltaspecError(f"The GGUF file lacks some of {name}'s expert tensors (it has {sorted(parts)}).")
    gate, up, down = parts["gate_proj"], parts["up_proj"], parts["down_proj"]
    if isinstance(gate, QuantizedWeight) or isinstance(up, QuantizedWeight):
        gate_up = QuantizedWeight.cat([_as_blocks(gate), _as_blocks(up)])
    else:
        gate_up = torch.cat([gate, up], dim=-2)
    set_weight(module, "gate_up_proj", gate_up)
    set_weight(module, "down_proj", down)


def _as_blocks(weight: QuantizedWeight | torch.Tensor) -> QuantizedWeight:
    return weight if isinstance(weight, QuantizedWeight) else QuantizedWeight.from_float(weight)
