"""The parts an engine is built from, as its plan says: the executor (the ranks it runs on), the model (a checkpoint
or random weights), the tokenizer of a random-weight model, the checkpoint's sampling defaults, the caches, the
measured GEMM routing (and the verify costs read from it), the drafter, and the CUDA graphs of decode and verify
passes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from deltaspec.cache.manager import CacheManager
from deltaspec.config.engine import EngineConfig
from deltaspec.config.model import ModelConfig
from deltaspec.engine.executor import Executor, SingleDevice
from deltaspec.engine.images import ImageInput, TextOnly, mrope_sections
from deltaspec.engine.planning import Planned, checked_tower
from deltaspec.engine.scheduler import Scheduler
from deltaspec.engine.workers import join_launched, launch, launched_rank
from deltaspec.errors import DeltaspecError
from deltaspec.execution.cuda_graphs import CudaGraphRunner
from deltaspec.execution.pipeline_pass import PipelinePass
from deltaspec.execution.sequence import Sequence
from deltaspec.model.block_drafter import load_block_drafter, random_block_drafter
from deltaspec.model.generation_config import FILE_NAME, sampling_defaults
from deltaspec.model.gguf_load import load_gguf_model
from deltaspec.model.hybrid import HybridModel
from deltaspec.model.random_init import random_model
from deltaspec.model.tokenizer import BorrowedTokenizer, Tokenizer
from deltaspec.model.weights import default_model_path, load_model
from deltaspec.ops.dispatch import OpTable
from deltaspec.parallel.group import SINGLE, TensorParallel
from deltaspec.parallel.pipeline import WHOLE, Pipeline, stage_config
from deltaspec.parallel.shard import shard_config
from deltaspec.sample.params import SamplingParams
from deltaspec.spec.block import BlockDrafter
from deltaspec.spec.drafter import Drafter
from deltaspec.spec.factory import make_drafter
from deltaspec.spec.mtp import MTPDrafter
from deltaspec.spec.policy import DraftLengthPolicy, VerifyCostTable
from deltaspec.spec.speculator import DraftLength, Speculator, TreeSettings

ROUTED_WEIGHT_ELEMENTS = 1 << 20  # weights of at least 1 M elements (2 MB in bf16) get a measured GEMM route

log = logging.getLogger("deltaspec.engine")


def engine_executor(config: EngineConfig, replica: Callable) -> Executor:
    """The ranks the engine runs on: its one device, or rank 0 of `config.parallel.world_size` ranks (pipeline stages
    x tensor-parallel ranks), whose followers each build their engine with `replica` (the engine's class;
    `deltaspec.engine.workers`): processes it starts itself, or, under an outside launcher (torchrun, Slurm), the
    launcher's other ranks."""
    if launched_rank() is not None:
        return join_launched(config, replica)
    return launch(config, replica) if config.parallel.world_size > 1 else SingleDevice()


def engine_model(
    planned: Planned, ops: OpTable, progress: bool, tp: TensorParallel = SINGLE, pipeline: Pipeline = WHOLE
) -> HybridModel:
    """The engine's model (a tensor-parallel rank's share of it, of its pipeline stage's layers): random weights of the
    shape, or the checkpoint; its MTP head only when it drafts; with --repack on CUDA, its Q4_K and Q6_K matrices
    repacked for the kernels. Sets the process's torch CPU threads to the engine's `threads` first."""
    cfg, device = planned.config, planned.cache.device
    torch.set_num_threads(cfg.host.threads)
    model = _loaded_model(planned, ops, progress, tp, pipeline.layers(planned.model_config.num_hidden_layers))
    if cfg.host.repack and device.type == "cuda" and cfg.host.kernels != "reference":
        # the Q4_K / Q6_K layouts the CUDA products read, in the same bytes; what a repack held goes back to the
        # device before the caches are allocated (the planner counted it as `load_transient`)
        if count := model.repack_for_kernels(progress):
            torch.cuda.empty_cache()
            log.info("repacked %d Q4_K / Q6_K matrices for the tensor cores in %.2f s", count, model.repack_seconds)
    return model


def _loaded_model(planned: Planned, ops: OpTable, progress: bool, tp: TensorParallel, layers: range) -> HybridModel:
    cfg, dtype, device = planned.config, planned.cache.dtype, planned.cache.device
    if cfg.load.random_weights:
        return random_model(
            planned.model_config,
            dtype,
            device,
            ops,
            cfg.scheduler.seed,
            progress,
            planned.with_mtp,
            quant=cfg.load.quant,
            tp=tp,
            layers=layers,
        )
    if planned.gguf is not None:
        gguf, config = planned.gguf, planned.model_config
        return load_gguf_model(gguf, config, dtype, device, ops, progress, planned.with_mtp, tp, layers)
    return load_model(
        planned.model_dir, planned.model_config, planned.raw, dtype, device, ops, progress, planned.with_mtp, tp, layers
    )


def engine_tokenizer(planned: Planned) -> Tokenizer | None:
    """The checkpoint's tokenizer (a GGUF file's from its metadata); a random-weight model's borrowed one; with
    --chat-template, rendering with that template instead of the checkpoint's."""
    if planned.gguf is not None:
        tokenizer = planned.gguf.tokenizer
    elif planned.model_dir is not None:
        tokenizer = Tokenizer.from_dir(planned.model_dir)
    else:
        tokenizer = borrowed_tokenizer(planned.model_config)
    if tokenizer is not None and planned.config.load.chat_template is not None:
        return tokenizer.with_chat_template(planned.config.load.chat_template)
    return tokenizer


def engine_images(planned: Planned) -> ImageInput | TextOnly:
    """A multimodal checkpoint's vision tower and image processing; `TextOnly` for a model that takes no images."""
    if not planned.images_per_prompt:
        return TextOnly(planned.model_dir)
    load, limit = planned.config.load, planned.images_per_prompt
    dtype, device = planned.cache.dtype, planned.cache.device
    if planned.gguf is not None:  # llama.cpp's projector file beside the GGUF model
        sections = mrope_sections(planned.raw)
        token_id = planned.gguf.tokenizer.token_to_id
        return ImageInput.from_mmproj(
            Path(load.mmproj), token_id, sections, dtype, device, limit, load.vision_tower_offload
        )
    offload = load.vision_tower_offload
    return checked_tower(lambda: ImageInput.from_checkpoint(planned.model_dir, dtype, device, limit, offload))


def engine_sampling_defaults(planned: Planned) -> dict[str, float | int]:
    """The checkpoint's sampling defaults (`generation_config.json`, or a GGUF file's `general.sampling.*`),
    checked as `SamplingParams` would check them; none for random weights."""
    if planned.gguf is not None:
        defaults, source = planned.gguf.sampling_defaults, "GGUF file's general.sampling metadata"
    else:
        defaults, source = sampling_defaults(planned.model_dir), FILE_NAME
    try:
        SamplingParams(**defaults)
    except DeltaspecError as exc:
        raise DeltaspecError(f"The checkpoint's {source} sets an invalid sampling default: {exc}") from None
    return defaults


def engine_cache(planned: Planned, model: HybridModel) -> CacheManager:
    """The caches the plan sized (KV pages, state slots, logs, checkpoints) for `model`'s layers (its MTP head's
    included); a tensor-parallel rank's hold its heads only, a pipeline stage's its layers only."""
    cfg = planned.config
    rank_config = shard_config(
        planned.model_config, cfg.parallel.tensor_parallel_size, cfg.parallel.enable_expert_parallel
    )
    return CacheManager(stage_config(rank_config, model.layers), model.num_kv_layers, planned.cache)


def engine_scheduler(config: EngineConfig, cache: CacheManager) -> Scheduler:
    return Scheduler(
        cache,
        config.scheduler.max_num_batched_tokens,
        config.scheduler.prefill_chunk,
        checkpoint_min_prompt=config.cache.prefix_checkpoint_min_prompt,
    )


def borrowed_tokenizer(model_config: ModelConfig) -> Tokenizer | None:
    """A random-weight model borrows the embedded model's tokenizer when its ids fit the shape's vocabulary
    (they fit every real shape), so the server and the text benchmarks run on it too; ids beyond the
    borrowed vocabulary decode as ids within it (`BorrowedTokenizer`)."""
    lent = Tokenizer.from_dir(default_model_path())
    if lent is None or lent.vocab_size > model_config.vocab_size:
        return None
    return BorrowedTokenizer.lend(lent)


def route_gemms(
    model: HybridModel,
    ops: OpTable,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool,
    share: Callable = lambda value: value,
) -> VerifyCostTable:
    """On CUDA in 16-bit precision with the Triton kernels, route every weight multiply of `model` by the device's
    measured skinny-GEMM table (DESIGN §6) and read the verify-cost table from the same measurements, a MoE
    model's expert reads (which grow with the rows) added at the bandwidth they imply; elsewhere keep torch's
    matmul and the default cost estimate. Weights too small to be bandwidth-bound stay on torch's matmul
    without measuring; a model with no large weight keeps the default estimate. Pipeline stages route by rank 0's
    table (`share`: rank 0's value on every rank), so the weights every stage holds multiply alike everywhere."""
    if device.type != "cuda" or config.host.kernels == "reference" or dtype not in (torch.bfloat16, torch.float16):
        return VerifyCostTable()
    from deltaspec.ops.gemm_routing import GemmRouter

    shapes = {
        shape: count for shape, count in model.linear_shapes().items() if shape[0] * shape[1] >= ROUTED_WEIGHT_ELEMENTS
    }
    if not shapes:
        return VerifyCostTable()
    router = GemmRouter(shapes, dtype, device, show_progress=progress)
    if config.parallel.pipeline_parallel_size > 1:
        router.adopt(share(router.table))
    model.use_ops(replace(ops, linear=router.linear))
    return VerifyCostTable(
        router.relative_costs(max(config.speculation.draft_tokens + 1, 2), model.expected_expert_bytes)
    )


def engine_drafter(
    planned: Planned, model: HybridModel, cache: CacheManager, running: Callable[[str], Sequence], ops: OpTable
) -> Drafter | None:
    """The drafter the plan's `speculative` asks for (None for none). The MTP head drafts from the engine's model,
    caches and running sequences (`running` finds one by id); a block drafter reads the engine's model's layer
    outputs, embeddings and LM head (a random-weight model without --draft-model gets a random one sized for it);
    a draft model keeps caches of its own, as the plan's cache spec gives them (`CacheSpec.for_draft_model`)."""
    config, model_config = planned.config, planned.model_config
    device, dtype = planned.cache.device, planned.cache.dtype

    def mtp() -> MTPDrafter:
        return MTPDrafter(model, cache, running, device, config.scheduler.seed)

    def block(path: Path | None) -> BlockDrafter:
        if path is None:
            net = random_block_drafter(model_config, ops, dtype, device, config.scheduler.seed)
        else:
            net = load_block_drafter(path, model_config, ops, dtype, device)
        return BlockDrafter(net, model, device, config.scheduler.seed)

    return make_drafter(config, planned.cache, planned.model_dir, model_config.vocab_size, mtp, block)


def graph_runner(model: HybridModel, cache: CacheManager, planned: Planned, progress: bool) -> CudaGraphRunner | None:
    """CUDA graphs for decode and verify passes, captured now, where the plan's cache spec allows them and the
    model's passes never read device values on the host."""
    if not planned.cache.cuda_graphs or model.syncs_with_host(planned.cache.dtype):
        return None
    trees = planned.config.speculation.speculative_tree > 0
    graphs = CudaGraphRunner(model, cache.caches, planned.cache, cache.gdn.scratch_slot, trees)
    graphs.capture_all(progress)
    return graphs


def pipeline_pass(pipeline: Pipeline, config: EngineConfig) -> PipelinePass | None:
    """How a pipeline stage runs its passes (its micro-batches); None on one stage."""
    return PipelinePass(pipeline, config.parallel.pipeline_micro_batches) if pipeline.staged else None


def engine_speculator(
    config: EngineConfig,
    model: HybridModel,
    cache: CacheManager,
    drafter: Drafter | None,
    policy: DraftLength | None,
    costs: VerifyCostTable,
) -> Speculator | None:
    """The speculator around `drafter` (None without one): the model returns the layer outputs the drafter reads,
    and the draft length adapts within `draft_tokens` by the verify costs unless `policy` replaces it."""
    if drafter is None:
        return None
    model.feature_layers = tuple(getattr(drafter, "target_layers", ()))
    trees = None
    if config.speculation.speculative_tree:  # sized by the verify costs, unless a given policy fixes the draft length
        sized = costs if policy is None or isinstance(policy, DraftLengthPolicy) else None
        trees = TreeSettings(
            config.speculation.speculative_tree - 1, config.speculation.speculative_tree_shape == "static", sized
        )
    policy = policy or DraftLengthPolicy(max_k=config.speculation.draft_tokens, table=costs)
    return Speculator(drafter, policy, cache, config.scheduler.max_model_len, model.config.vocab_size, trees)
