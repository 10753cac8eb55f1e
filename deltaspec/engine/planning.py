"""The memory plan of an engine configuration (DESIGN §4), in one place, before anything is allocated.

`plan_for` resolves the configuration against its checkpoint (or its `--random-weights` shape), counts the
weights the engine will load (from the safetensors headers, or the shape's parameter count), the
drafter's memory (`deltaspec.spec.factory.drafter_memory`; an injected drafter owns its memory), the
replay logs, the prefix checkpoints and the captured CUDA graphs, sizes what the configuration leaves
automatic (streams, context, KV pool; `pool_sizing.py`) within the free memory or the
`--gpu-memory-utilization` budget, and returns the `MemoryPlan`, with its advice, and what was resolved.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deltaspec.cache.memory_plan import (
    GIB,
    DrafterMemory,
    MemoryPlan,
    Workspace,
    available_memory,
    plan_memory,
    total_memory,
    weight_bytes,
)
from deltaspec.config.cache_spec import CacheSpec
from deltaspec.config.dtypes import parse_dtype
from deltaspec.config.engine import EngineConfig
from deltaspec.config.model import ModelConfig
from deltaspec.config.resolve import cache_spec, check_context, images_per_prompt, resolve_engine_config, with_pools
from deltaspec.engine.images import has_vision_tower, mrope_sections, tower_workspace
from deltaspec.engine.pool_sizing import PoolSizing
from deltaspec.errors import DeltaspecError
from deltaspec.model.checkpoint_names import target_name
from deltaspec.model.gguf_load import FLOAT_TYPES, gguf_weight_bytes
from deltaspec.model.gguf_raw import read_raw
from deltaspec.model.hf_config import checkpoint_dtype, parse_model_config, read_config_json
from deltaspec.model.hybrid import HybridModel
from deltaspec.model.random_quant import parse_quant, quantized_bytes, quantized_config, tensor_types
from deltaspec.model.safetensors_files import checkpoint_files
from deltaspec.model.shapes import parameter_counts, shape_config
from deltaspec.model.vision.config import parse_vision_config
from deltaspec.model.vision.load import TOWER_PREFIXES
from deltaspec.model.vision.mmproj import mmproj_config
from deltaspec.model.vision.preprocess import read_image_processing
from deltaspec.model.weights import count_mtp_layers, model_dir_for
from deltaspec.ops.dispatch import REFERENCE
from deltaspec.ops.quant import repacked
from deltaspec.ops.quant.formats import row_bytes
from deltaspec.parallel.group import TensorParallel
from deltaspec.parallel.pipeline import check_stages, holds, stage_config, stage_layers
from deltaspec.parallel.shard import Shard, shard_config
from deltaspec.spec.drafter import Drafter
from deltaspec.spec.factory import drafter_memory, uses

if TYPE_CHECKING:
    from deltaspec.model.gguf_file import GGUFCheckpoint


@dataclass(frozen=True)
class Planned:
    plan: MemoryPlan
    config: EngineConfig  # resolved: no "auto" left; `speculative` names the drafter that will run
    cache: CacheSpec  # the plan's: what the allocator, the graphs and the drafters build
    model_config: ModelConfig
    raw: dict  # the checkpoint's config.json ({} for random weights)
    model_dir: Path | None  # None for random weights; the file of a GGUF checkpoint
    with_mtp: bool  # whether the MTP head is loaded: only when it drafts
    gguf: GGUFCheckpoint | None = None  # the GGUF file's contents, read once
    images_per_prompt: int = 0  # the most images a prompt may carry; 0: the vision tower stays unloaded


def checked_tower(read):
    """`read()` of a checkpoint's vision tower, whose errors also say how to run its text model alone."""
    try:
        return read()
    except DeltaspecError as exc:
        raise DeltaspecError(f"{exc} To run the text model alone, give --limit-mm-per-prompt image=0.") from None


def mmproj_plan(resolved: EngineConfig, gguf, raw: dict, dtype: torch.dtype) -> tuple[int, int, int]:
    """The image limit, tower bytes and image workspace of the llama.cpp projector file beside a GGUF model."""
    if gguf is None:
        raise DeltaspecError(
            "--mmproj is llama.cpp's projector file for a GGUF model; a safetensors checkpoint brings its own tower."
        )
    path = Path(resolved.load.mmproj)
    if not path.is_file():
        raise DeltaspecError(f"The mmproj file {path} does not exist; give the projector file's path.")
    mmproj = read_raw(path)
    config, processing = mmproj_config(mmproj, gguf.tokenizer.token_to_id, mrope_sections(raw))
    elements = sum(math.prod(tensor.shape) for tensor in mmproj.tensors.values())
    images = images_per_prompt(resolved.load.limit_mm_per_prompt)
    return (
        images,
        elements * dtype.itemsize if images else 0,
        tower_workspace(config, processing, dtype) if images else 0,
    )


def plan_for(config: EngineConfig, drafter: Drafter | None = None) -> Planned:
    """The plan of `config`; with an injected `drafter`, speculation runs with it whatever `speculative` says."""
    if config.load.quant and not config.load.random_weights:
        raise DeltaspecError(
            "--quant quantizes --random-weights; a GGUF file carries its own types (deltaspec quantize makes one)."
        )
    if config.load.random_weights or config.load.shape is not None:
        model_config, raw, model_dir, gguf = _random_shape(config), {}, None, None
        resolved = resolve_engine_config(config, "bfloat16")
    else:
        model_dir = model_dir_for(config.load.model)
        gguf = _read_gguf(model_dir) if model_dir.suffix == ".gguf" else None
        raw = gguf.config if gguf else read_config_json(model_dir)
        names = gguf.tensors if gguf else (files := checkpoint_files(model_dir))
        model_config = replace(parse_model_config(raw), num_mtp_layers=count_mtp_layers(names))  # as loaded
        resolved = resolve_engine_config(config, checkpoint_dtype(raw))
    check_context(resolved, model_config.max_position_embeddings)
    if drafter is not None:
        resolved = resolved.with_settings(speculative=drafter.name)
    if resolved.speculation.speculative_tree and resolved.speculation.speculative == "none":
        raise DeltaspecError("speculative_tree grows trees of drafts; it needs a drafter, e.g. --speculative mtp.")
    dtype = parse_dtype(resolved.load.dtype)
    with_mtp = drafter is None and uses(resolved.speculation.speculative, "mtp")
    size, stages = resolved.parallel.tensor_parallel_size, resolved.parallel.pipeline_parallel_size
    experts_whole = resolved.parallel.enable_expert_parallel
    device = torch.device(resolved.host.device)
    repacks = resolved.host.repack and device.type == "cuda" and resolved.host.kernels != "reference"
    matrices: list[tuple[str, str, int, int]] = []  # with --repack, the quantized 2-D weights `repack_transient` reads
    check_stages(model_config.num_hidden_layers, stages)
    layers = planned_stage(model_config, stages)
    rank_config = shard_config(model_config, size, experts_whole)  # one rank's; refuses sizes that do not divide
    rank_config = stage_config(rank_config, layers)  # of the stage planned for: its layers' caches
    if resolved.parallel.world_size > 1:
        _check_parallel(resolved, drafter)
    if resolved.parallel.world_size > 1 and gguf is None:
        tp = TensorParallel(0, size, experts_whole)
        target, mtp = rank_weight_bytes(model_config, dtype, tp, with_mtp, layers)
    elif model_dir is None and resolved.load.quant:
        target, mtp = random_quantized_bytes(model_config, dtype, resolved.load.quant, with_mtp)
        matrices = random_quantized_matrices(model_config, resolved.load.quant, with_mtp) if repacks else []
    elif model_dir is None:
        counts = parameter_counts(model_config)
        target, mtp = (counts["total"] - counts["mtp"]) * dtype.itemsize, counts["mtp"] * dtype.itemsize
    elif gguf is not None:
        shard = Shard(model_config, 0, size, experts_whole)
        target, mtp = gguf_weight_bytes(gguf, dtype, with_mtp, shard, layers)
        matrices = gguf_matrices(gguf, with_mtp, shard, layers) if repacks else []
    else:
        target = weight_bytes(files, dtype, skip=lambda name: target_name(name, with_mtp=False) is None)
        mtp = weight_bytes(files, dtype, skip=lambda name: not name.startswith("mtp.")) if with_mtp else 0
    load_transient = repack_transient(matrices)
    images, image_workspace, tower = 0, 0, 0
    if resolved.load.mmproj:
        images, tower, image_workspace = mmproj_plan(resolved, gguf, raw, dtype)
    elif gguf is None and model_dir is not None and has_vision_tower(raw, files):
        images = images_per_prompt(resolved.load.limit_mm_per_prompt)
        if images:  # the tower's weights, and what it holds while it encodes the largest image
            tower = weight_bytes(files, dtype, skip=lambda name: not name.startswith(TOWER_PREFIXES))
            image_workspace = checked_tower(
                lambda: tower_workspace(parse_vision_config(raw), read_image_processing(model_dir), dtype)
            )
    if images:  # with the tower offloaded, its weights are lent per request: part of the image workspace
        if resolved.load.vision_tower_offload:
            image_workspace += tower
        else:
            target += tower
    memory = (
        DrafterMemory(drafter.name) if drafter is not None else drafter_memory(resolved, model_dir, model_config, mtp)
    )
    available, budget_note = _available(resolved, device)

    workspace = Workspace(
        resolved.scheduler.max_num_batched_tokens,
        resolved.scheduler.prefill_chunk,
        materialized_scores=device.type != "cuda" or resolved.host.kernels == "reference",
        images=image_workspace,
    )

    def plan_at(streams: int, ctx: int, kv_blocks: int) -> MemoryPlan:
        cache = cache_spec(resolved, streams, ctx, kv_blocks)
        plan = plan_memory(rank_config, cache, target, workspace, memory, available)
        return replace(plan, load_transient=load_transient)

    sizing = PoolSizing(resolved, model_config.max_position_embeddings, plan_at)
    streams, ctx, kv_blocks, notes = sizing.decide()
    layout = f"tensor parallel {size}" + (", experts split whole" if experts_whole else "")
    if stages > 1:
        stage = f"this stage: layers {layers.start}-{layers.stop - 1} of {model_config.num_hidden_layers}"
        layout = f"pipeline parallel {stages} ({stage}, the most any stage holds)" + (f", {layout}" if size > 1 else "")
    parallel_note = f"{layout}: the weights, caches and memory above are one rank's (one GPU's)"
    plan = replace(
        plan_at(streams, ctx, kv_blocks),
        notes=tuple(filter(None, (budget_note, parallel_note if size * stages > 1 else None, *notes))),
        available_label="budget" if budget_note else "free",
    )
    plan = replace(plan, alternatives=sizing.alternatives(plan))
    resolved = resolved.with_settings(
        prefix_checkpoint_min_prompt=resolved.cache.prefix_checkpoint_min_prompt or plan.state_in_tokens()
    )
    if plan.fits:
        resolved = with_pools(resolved, streams, ctx, kv_blocks)
    else:  # refused by whoever runs it; the plan and its advice are what matter
        resolved = resolved.with_settings(max_num_seqs=streams, max_model_len=ctx, prefix_checkpoints=plan.checkpoints)
    return Planned(plan, resolved, plan.cache, model_config, raw, model_dir, with_mtp, gguf, images)


def planned_stage(config: ModelConfig, stages: int) -> range:
    """The layers of the pipeline stage the plan sizes for, since every stage runs with the same pools: the stage with
    the most layers, and of those the one with the most attention layers (the most KV)."""
    held = [stage_layers(config.num_hidden_layers, stages, index) for index in range(stages)]
    return max(held, key=lambda layers: (len(layers), sum(i in config.attention_layer_ids for i in layers)))


def rank_weight_bytes(
    config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, with_mtp: bool, layers: range | None = None
) -> tuple[int, int]:
    """Bytes of rank `tp`'s weights in `dtype` (of the pipeline stage holding `layers`): the target's and (0 unless
    `with_mtp`) its MTP head's, as the sharded model holds them."""
    with torch.device("meta"):
        rank_config = shard_config(config, tp.size, tp.expert_parallel)
        model = HybridModel(rank_config, REFERENCE, dtype, "meta", config.num_mtp_layers, tp, layers)
    sizes = {name: p.numel() * dtype.itemsize for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        sizes.pop("lm_head.weight")
    mtp = sum(n for name, n in sizes.items() if name.startswith("mtp."))
    return sum(sizes.values()) - mtp, mtp if with_mtp else 0


def _check_parallel(config: EngineConfig, drafter: Drafter | None) -> None:
    """Refuse what tensor parallelism and pipeline stages do not run, saying what does."""
    size, stages = config.parallel.world_size, config.parallel.pipeline_parallel_size
    flags = "--tensor-parallel-size" if stages == 1 else "--pipeline-parallel-size"
    if config.load.quant:
        raise DeltaspecError(f"--quant runs on one device; drop {flags} or --quant.")
    if drafter is not None:
        raise DeltaspecError("An injected drafter runs on one device; drop the parallel sizes or the drafter.")
    if stages > 1 and uses(config.speculation.speculative, "block"):
        raise DeltaspecError(
            "The block drafter reads the outputs of layers on every pipeline stage, which the stages do not send; "
            "use --speculative mtp, draft or ngram with --pipeline-parallel-size, or drop it."
        )
    if config.host.device.startswith("cuda") and size > torch.cuda.device_count():
        raise DeltaspecError(
            f"{flags} {size if stages == 1 else stages} needs {size} GPUs, one per rank, but "
            f"{torch.cuda.device_count()} are visible; lower it or make more GPUs visible."
        )


def random_quantized_bytes(config: ModelConfig, dtype: torch.dtype, quant: str, with_mtp: bool) -> tuple[int, int]:
    """Bytes of a random-weight model quantized under `quant` (as `random_model` builds it): the target's and
    (0 unless `with_mtp`) its MTP head's; the weights it keeps in float count in `dtype`."""
    shapes, types = _random_quantized_weights(config, quant)
    sizes = {
        name: quantized_bytes(shape, types[name]) if name in types else shape.numel() * dtype.itemsize
        for name, shape in shapes.items()
    }
    mtp = sum(size for name, size in sizes.items() if name.startswith("mtp."))
    return sum(sizes.values()) - mtp, mtp if with_mtp else 0


def random_quantized_matrices(config: ModelConfig, quant: str, with_mtp: bool) -> list[tuple[str, str, int, int]]:
    """(parameter, block type, bytes, row bytes) of the 2-D weights a random-weight model quantized under `quant`
    keeps as blocks."""
    shapes, types = _random_quantized_weights(config, quant)
    return [
        (name, qtype, quantized_bytes(shapes[name], qtype), row_bytes(qtype, shapes[name][-1]))
        for name, qtype in types.items()
        if len(shapes[name]) == 2 and (with_mtp or not name.startswith("mtp."))
    ]


def _random_quantized_weights(config: ModelConfig, quant: str) -> tuple[dict[str, torch.Size], dict[str, str]]:
    """The shapes of a random-weight model's parameters (a tied LM head is the embedding's) and the block type of
    those `quant` keeps quantized."""
    with torch.device("meta"):
        model = HybridModel(
            quantized_config(config), REFERENCE, torch.bfloat16, "meta", num_mtp_layers=config.num_mtp_layers
        )
    shapes = {name: p.shape for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes, tensor_types(config, shapes, quant)


def gguf_matrices(checkpoint, with_mtp: bool, shard: Shard, layers: range) -> list[tuple[str, str, int, int]]:
    """(parameter, block type, bytes, row bytes) of a GGUF file's quantized 2-D weights as one rank of one stage
    loads them."""
    matrices = []
    for name, tensor in checkpoint.tensors.items():
        parameter = target_name(name, with_mtp=with_mtp)
        if parameter is None or not holds(layers, parameter) or len(tensor.shape) != 2 or tensor.qtype in FLOAT_TYPES:
            continue
        share = shard.fraction(parameter, torch.Size(tensor.shape))
        matrices.append((parameter, tensor.qtype, int(tensor.data.nbytes * share), int(tensor.data.shape[-1])))
    return matrices


KEPT_AS_BLOCKS = re.compile(r"embed_tokens|\.mlp\.(gate\.|experts\.|shared_expert)")  # embeddings, MoE layers


def repack_transient(matrices: list[tuple[str, str, int, int]]) -> int:
    """What `--repack` holds for a moment while the model loads: the most that repacking one of `matrices` takes
    (`repacked.transient_bytes`) over the Q4_K and Q6_K ones `HybridModel.repack_for_kernels` repacks (not an
    embedding table's, not a MoE layer's)."""
    return max(
        (
            repacked.transient_bytes(qtype, nbytes, row)
            for name, qtype, nbytes, row in matrices
            if qtype in repacked.REPACKED and not KEPT_AS_BLOCKS.search(name)
        ),
        default=0,
    )


def _read_gguf(path: Path) -> GGUFCheckpoint:
    from deltaspec.model.gguf_file import read_gguf  # the gguf package is imported only for GGUF files

    return read_gguf(path)


def _available(config: EngineConfig, device: torch.device) -> tuple[int, str | None]:
    """The memory this engine may use, and a note saying where that number comes from with
    --gpu-memory-utilization (the fraction of the whole device, which must be free now)."""
    free = available_memory(device)
    fraction = config.cache.gpu_memory_utilization
    if not fraction:
        return free, None
    total = total_memory(device)
    budget = int(fraction * total)
    if budget > free:
        raise DeltaspecError(
            f"--gpu-memory-utilization {fraction} asks for {budget / GIB:.2f} GiB of the {total / GIB:.2f} GiB on "
            f"{device}, but only {free / GIB:.2f} GiB is free; use {int(free / total * 100) / 100} or less, or free "
            "the memory other processes hold."
        )
    return budget, f"budget: --gpu-memory-utilization {fraction} of the {total / GIB:.2f} GiB of {device}"


def _random_shape(config: EngineConfig) -> ModelConfig:
    """The model config of a `--random-weights --shape` configuration, after checking the flags go together."""
    if not config.load.random_weights:
        raise DeltaspecError(
            "--shape only applies with --random-weights; add --random-weights, or drop --shape to load a checkpoint."
        )
    if config.load.shape is None:
        raise DeltaspecError(
            "--random-weights needs --shape NAME (qwen3.5-27b, qwen3.5-9b, qwen3.5-0.8b, "
            "qwen3.5-35b-a3b or qwen3-next-80b-a3b)."
        )
    if config.load.model is not None:
        raise DeltaspecError("--random-weights builds a model from --shape and loads no checkpoint; drop --model.")
    if config.load.quant:
        parse_quant(config.load.quant)
    if uses(config.speculation.speculative, "draft") and not config.speculation.draft_model:
        raise DeltaspecError(
            "speculative='draft' with --random-weights needs --draft-model PATH; or use mtp, block or ngram."
        )
    return replace(shape_config(config.load.shape, config.load.shape_overrides), eos_token_ids=())
