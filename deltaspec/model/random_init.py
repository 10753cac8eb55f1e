"""`--random-weights --shape NAME`: a real-shaped model with random weights, built on the device (no file).

The model is built on the meta device, then every parameter is drawn on the target device, tensor by
tensor, from one seeded generator, and assigned; then the projections are fused as after a checkpoint
load. The scales keep a deep stack numerically sane in bf16 (no inf/nan, logits that depend on the
input): input projections N(0, 1/fan_in), output projections (o_proj, out_proj, down_proj) N(0,
1/(fan_in * 2 * layers)) so the residual stream stays O(1) over 64 layers, embeddings N(0, 0.02²), an
untied LM head N(0, 1/hidden) (logits ~ N(0, 1)), zero-centred norm weights 0, the GDN gated norm 1,
and `A_log = log(U(0, 16))`, `dt_bias = 1`, conv weights U(±1/sqrt(K)) as transformers initialises them.
A tensor-parallel rank draws every full tensor as one process would and keeps its part, so the sharded model
is the same model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from tqdm import tqdm

from deltaspec.config.model import ModelConfig
from deltaspec.errors import DeltaspecError
from deltaspec.model.hybrid import HybridModel, fused_once_loaded
from deltaspec.model.layers import QuantizedEmbedding, set_weight
from deltaspec.model.random_quant import quantized_config, random_blocks, tensor_types
from deltaspec.ops.dispatch import OpTable
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.parallel.group import SINGLE, TensorParallel
from deltaspec.parallel.pipeline import holds
from deltaspec.parallel.shard import Shard, shard_config

OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")
ZERO_CENTRED_NORMS = (
    "layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "norm.weight",
    "norm_embedding.weight",
    "norm_hidden.weight",
)


def matrix_std(name: str, shape: torch.Size, config: ModelConfig) -> float:
    """The standard deviation a weight matrix is drawn with (see the module docstring)."""
    if name.endswith("embed_tokens.weight"):
        return 0.02
    if name.endswith(OUTPUT_PROJECTIONS):
        return 1 / math.sqrt(shape[-1] * 2 * config.num_hidden_layers)
    return 1 / math.sqrt(shape[-1])  # input projections, LM head, router, MTP fc, experts' gate_up


def _draw(name: str, shape: torch.Size, config: ModelConfig, out: torch.Tensor, gen: torch.Generator) -> None:
    """Fill `out` (shape `shape`) with the random init of parameter `name` (see the module docstring)."""
    if name.endswith("linear_attn.A_log"):
        out.copy_(
            torch.empty(shape, dtype=torch.float32, device=out.device)
            .uniform_(0, 16, generator=gen)
            .clamp_min(1e-4)
            .log()
        )
    elif name.endswith(("linear_attn.dt_bias", "linear_attn.norm_weight")):
        out.fill_(1.0)
    elif name.endswith("conv1d_weight"):
        bound = 1 / math.sqrt(shape[-1])
        out.uniform_(-bound, bound, generator=gen)
    elif name.endswith(".bias") or name.endswith(ZERO_CENTRED_NORMS):
        out.zero_()
    elif len(shape) >= 2:
        out.normal_(0.0, matrix_std(name, shape, config), generator=gen)
    else:
        raise DeltaspecError(f"No random init is defined for parameter {name} {list(shape)}.")


def parameter_shapes(model: HybridModel, config: ModelConfig) -> list[tuple[str, torch.Size]]:
    """The parameters random weights are drawn for, in the order they are drawn: `model`'s (built on the meta
    device), the LM head left out when it is tied to the embeddings."""
    return [
        (name, param.shape)
        for name, param in model.named_parameters()
        if not (name == "lm_head.weight" and config.tie_word_embeddings)
    ]


def file_types(config: ModelConfig, quant: str) -> dict[str, str]:
    """{parameter: GGUF type} under `quant`, as in a file with the shape's MTP head, whether it is drawn or not:
    llama-quantize counts the head's tensors in its choices."""
    with torch.device("meta"):
        full = HybridModel(config, None, torch.float32, torch.device("meta"), config.num_mtp_layers)
    return tensor_types(config, dict(parameter_shapes(full, config)), quant)


def random_parameters(
    config: ModelConfig,
    shapes: list[tuple[str, torch.Size]],
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    quant: str | None = None,
) -> Iterator[tuple[str, QuantizedWeight | torch.Tensor]]:
    """Each parameter of `shapes` (`parameter_shapes`) drawn in turn on `device` from one generator seeded `seed`:
    with `quant`, a weight matrix as blocks of the type `random_quant.tensor_types` gives it (`random_blocks`),
    every other parameter as a `dtype` tensor (`_draw`). One parameter exists at a time unless the caller keeps
    it, so a GGUF file of any size is written from this as well as a model is built from it."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    types = file_types(config, quant) if quant else {}
    pools = {}  # quantized unit-normal blocks per type (`random_blocks`)
    for name, shape in shapes:
        if name in types:
            yield name, random_blocks(shape, types[name], matrix_std(name, shape, config), gen, pools)
        else:
            drawn = torch.empty(shape, dtype=dtype, device=device)
            _draw(name, shape, config, drawn, gen)
            yield name, drawn


@fused_once_loaded
def random_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    ops: OpTable,
    seed: int = 0,
    progress: bool = True,
    with_mtp: bool = True,
    quant: str | None = None,
    tp: TensorParallel = SINGLE,
    layers: range | None = None,
) -> HybridModel:
    """The model of `config` with seeded random weights drawn on `device` (`random_parameters`), fused like a
    loaded checkpoint (the shape's MTP head only `with_mtp`); with `quant`, each weight matrix becomes blocks of
    the type `random_quant.tensor_types` gives it, distributed like its normal init quantized
    (`random_quant.random_blocks`: blocks drawn from a pool of quantized unit-normal blocks, their scales
    multiplied by the matrix's std), so the float model never exists whole (and Qwen3-Next's GDN projections are
    separate, as a GGUF file's load). A rank of the tensor-parallel group `tp` keeps its part of each float
    weight (`--quant` runs on one device); a pipeline stage keeps its decoder `layers` only. Every weight is drawn
    either way, so every rank's share is that of the same model."""
    if quant and tp.sharded:
        raise DeltaspecError("--quant runs on one device; drop --tensor-parallel-size or --quant.")
    if quant:
        config = quantized_config(config)
    num_mtp_layers = config.num_mtp_layers if with_mtp else 0
    with torch.device("meta"):
        rank_config = shard_config(config, tp.size, tp.expert_parallel)
        model = HybridModel(rank_config, ops, dtype, device, num_mtp_layers, tp, layers)
        whole = not tp.sharded and len(model.layers) == config.num_hidden_layers
        full = model if whole else HybridModel(config, ops, dtype, device, num_mtp_layers)
    shard = Shard(config, tp.rank, tp.size, tp.expert_parallel)
    shapes = parameter_shapes(full, config)
    modules = dict(model.named_modules())
    weights = {}
    drawn = random_parameters(config, shapes, dtype, device, seed, quant)
    for name, value in tqdm(drawn, total=len(shapes), desc="Random weights", unit="tensor", disable=not progress):
        if not holds(model.layers, name):  # another pipeline stage's layer
            continue
        if isinstance(value, QuantizedWeight):
            module_name, _, attribute = name.rpartition(".")
            set_weight(modules[module_name], attribute, value)
        else:
            weights[name] = shard.take(name, value).contiguous() if tp.sharded else value
    if config.tie_word_embeddings and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    elif config.tie_word_embeddings:  # quantized embeddings, which the LM head shares
        set_weight(model.lm_head, "weight", model.model.embed_tokens.weight)
    model.load_state_dict(weights, assign=True, strict=False)
    if left := [n for n, p in model.named_parameters() if p.is_meta]:
        raise RuntimeError(f"random weights left {len(left)} parameters undrawn, e.g. {left[0]}")
    if isinstance(model.model.embed_tokens.weight, QuantizedWeight):
        model.model.embed_tokens = QuantizedEmbedding(model.model.embed_tokens.weight, dtype)
    return model
