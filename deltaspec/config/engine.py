"""`EngineConfig`: what the user chooses about running a model, composed of frozen groups (as vLLM's `VllmConfig`):
`LoadConfig` (the model and its weights), `HostConfig` (device, threads, kernels), `SchedulerConfig` (streams, context,
pass sizes), `CacheConfig` (cache dtypes, KV pages, prefix checkpoints), `SpeculativeConfig` (drafter, draft length,
trees) and `ParallelConfig` (tensor, expert and pipeline parallelism). Each setting's field carries `help` metadata
from which the CLI generates its flag; a setting keeps one flat name (`block_size`, `--block-size`) whatever group holds
it, and `EngineConfig.from_flat` is the way in from flat names (the `LLM` keywords, the flags). "auto" values are
resolved in `deltaspec.config.resolve`, which also derives the resolved `CacheSpec` every cache reader takes."""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields, replace

from deltaspec.config.host import default_device

DEFAULT_IMAGES_PER_PROMPT = 8  # a multimodal checkpoint's limit when limit_mm_per_prompt leaves it out
MAX_TREE_ROWS = 64  # nodes of one tree of drafts, its root included (the kernels' ancestor masks are int64)


@dataclass(frozen=True)
class LoadConfig:
    """What model is run and how its weights are built: the checkpoint (or a random-weight shape), the dtype,
    the chat template."""

    model: str | None = field(
        default=None,
        metadata={
            "help": "checkpoint directory or Hugging Face hub id (default: the embedded model)",
            "aliases": ("-m",),
        },
    )
    dtype: str = field(
        default="auto", metadata={"help": "weight and activation dtype: auto, float64, float32, bfloat16, float16"}
    )
    fp8_activations: str = field(
        default="none",
        metadata={
            "help": "FP8 weights' activations: none (kept in the model's dtype, W8A16) or dynamic (in products of "
            "more than 64 rows, e.g. prefill, quantized to e4m3 per token and 128 features as the checkpoints' "
            "activation_scheme dynamic, vLLM and transformers do, for Hopper's FP8 tensor cores)"
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "Jinja chat template used instead of the model's: a file, or the template itself",
            "aliases": ("--chat-template-file",),
        },
    )
    random_weights: bool = field(
        default=False,
        metadata={
            "help": "build the model of --shape with random weights on the device (no checkpoint; the embedded "
            "model's tokenizer); for benchmarks"
        },
    )
    shape: str | None = field(
        default=None,
        metadata={
            "help": "model shape for --random-weights: qwen3.5-0.8b, qwen3.5-9b, qwen3.5-27b, qwen3.5-35b-a3b, "
            "qwen3-next-80b-a3b"
        },
    )
    quant: str | None = field(
        default=None,
        metadata={
            "help": "with --random-weights: keep the weights quantized as a llama.cpp preset (q4_k_m, q5_k_m, q6_k, "
            "q8_0), one GGUF block type (q4_k, iq4_xs, ...), as a GGUF file would, fp8 (an FP8 block-scaled "
            "checkpoint's weights) or int4 / i4_g32 / i4_g128 (a W4A16 checkpoint's groups); for benchmarks"
        },
    )
    mmproj: str | None = field(
        default=None,
        metadata={
            "help": "llama.cpp's multimodal projector file (mmproj-*.gguf) beside a GGUF model: its vision tower, "
            "for images",
            "aliases": ("-mm",),
        },
    )
    limit_mm_per_prompt: str | None = field(
        default=None,
        metadata={
            "help": 'the most images one prompt may carry, as vLLM spells it: {"image": N} or image=N (default: '
            f"{DEFAULT_IMAGES_PER_PROMPT}; 0 leaves a multimodal checkpoint's vision tower unloaded)"
        },
    )
    vision_tower_offload: bool = field(
        default=False,
        metadata={
            "help": "keep a multimodal checkpoint's vision tower in host memory and lend it device memory only while "
            "it encodes a request's images (its weights leave the device between images; each request with images "
            "copies them over)"
        },
    )
    allowed_local_media_path: str | None = field(
        default=None,
        metadata={
            "help": "a directory whose image files requests may name (file:// URLs or paths); without it images come "
            "only inline, as data: URLs (never fetched from the network)"
        },
    )
    shape_overrides: tuple[tuple[str, int], ...] = field(
        default=(),
        metadata={
            "cli": False,
            "help": "(Python only) ModelConfig/MoEConfig fields replaced in the shape, for small tests",
        },
    )


@dataclass(frozen=True)
class HostConfig:
    """Where the engine runs: the device, the CPU threads, the op implementations and whether passes may be
    CUDA graphs."""

    device: str = field(default="auto", metadata={"help": "torch device: auto, cpu, cuda, cuda:N"})
    threads: int | None = field(
        default=None,
        metadata={
            "help": "CPU threads for the engine (default: physical cores the process may use)",
            "type": int,
            "aliases": ("-t",),
        },
    )
    kernels: str = field(
        default="auto",
        metadata={
            "help": "op implementations: auto (Triton kernels on CUDA, torch references elsewhere), reference "
            "(torch references everywhere)"
        },
    )
    repack: bool = field(
        default=False,
        metadata={
            "help": "on CUDA, repack Q4_K and Q6_K weights in place (same memory) into the layout of the tensor-core "
            "products, which verify 2-64 rows at 1.1-1.4x the cost of one (kernel timings, docs/performance.md); "
            "opt-in until its whole-model effect is measured"
        },
    )
    enforce_eager: bool = field(default=False, metadata={"help": "run every pass eagerly, without CUDA graphs"})

    def device_name(self) -> str:
        """The torch device this config runs on: `device`, with auto resolved to this machine's default."""
        return default_device() if self.device == "auto" else self.device


@dataclass(frozen=True)
class SchedulerConfig:
    """How many sequences run, how long they may be and how a pass is filled."""

    max_num_seqs: int = field(
        default=0,
        metadata={
            "help": "most sequences that run at once (GDN state slots); 0: 8, or with --gpu-memory-utilization as "
            "many as fit (at most 256)",
            "aliases": ("--max-streams", "-np", "--parallel"),
        },
    )
    max_model_len: int = field(
        default=0,
        metadata={
            "help": "longest sequence, prompt + output; 0: the model's max_position_embeddings, or as much as "
            "90 percent of the free memory holds for the streams",
            "aliases": ("--ctx", "-c", "--ctx-size"),
        },
    )
    allow_long_max_model_len: bool = field(
        default=False,
        metadata={
            "help": "accept a --max-model-len beyond the model's max_position_embeddings (positions it was not "
            "trained on)"
        },
    )
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "most rows in one forward pass (prompt chunks + decode rows)"}
    )
    prefill_chunk: int = field(
        default=512,
        metadata={"help": "most prompt rows of one sequence in one pass: a long prompt delays others by at most this"},
    )
    seed: int = field(default=0, metadata={"help": "seed for requests that give none"})


@dataclass(frozen=True)
class CacheConfig:
    """The caches' storage: state and KV dtypes, KV pages, the memory budget, prefix checkpoints."""

    state_dtype: str = field(
        default="auto",
        metadata={
            "help": "GDN recurrent state dtype: auto (float32, float64 for float64 models), float32, bfloat16, float16"
        },
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "attention KV cache dtype: auto (the model's dtype), fp8_e4m3 (fp8) or int8, each row with its "
            "own scale computed when it is written"
        },
    )
    gpu_memory_utilization: float = field(
        default=0.0,
        metadata={
            "help": "fraction of the device's memory this engine may use, in (0, 1]: the KV page pool (and, without "
            "--max-num-seqs, the streams) grow to fill it, as in vLLM; 0: pools of exactly streams x context"
        },
    )
    block_size: int = field(default=16, metadata={"help": "tokens per attention KV page"})
    num_kv_blocks: int = field(
        default=0, metadata={"help": "attention KV pages to allocate (0: enough for max_num_seqs x max_model_len)"}
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={
            "help": "resume requests from checkpoints of earlier ones that share their prefix (GDN state + KV pages)",
            "aliases": ("--prefix-caching",),
        },
    )
    prefix_checkpoints: int = field(
        default=0,
        metadata={
            "help": "prefix checkpoints kept on the device, least recently used evicted first (0: three per stream)"
        },
    )
    prefix_offload_gib: float = field(
        default=0.0,
        metadata={"help": "host memory (GiB) that keeps prefix checkpoints evicted from the device, for later reuse"},
    )
    prefix_checkpoint_min_prompt: int = field(
        default=0,
        metadata={
            "help": "prompts at least this long leave checkpoints 512 and 64 tokens before their end and may evict "
            "older ones for them (a chat prompt's checkpoint where its next turn parts may evict whatever its "
            "length) (0: the length whose KV takes the memory of one checkpoint's state)"
        },
    )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: the drafter, its draft length, the n-gram matches, trees of drafts."""

    speculative: str = field(
        default="none",
        metadata={
            "help": "drafter for speculative decoding: none, ngram (prompt lookup over the sequence's own tokens), "
            "mtp (the checkpoint's MTP head), draft (a small model, --draft-model), block (a DFlash-style block "
            "drafter, --draft-model), mtp+ngram, draft+ngram, block+ngram"
        },
    )
    draft_tokens: int = field(
        default=4,
        metadata={
            "help": "most draft tokens per sequence per pass; each sequence's length adapts to its acceptance below it"
        },
    )
    prompt_lookup_min: int = field(
        default=2,
        metadata={
            "help": "the n-gram drafter's shortest match: it drafts what followed the longest suffix of at least this "
            "many tokens that occurred before",
            "aliases": ("--ngram-prompt-lookup-min",),
        },
    )
    prompt_lookup_max: int = field(
        default=5,
        metadata={
            "help": "the n-gram drafter's longest match (at least --prompt-lookup-min)",
            "aliases": ("--ngram-prompt-lookup-max",),
        },
    )
    speculative_tree: int = field(
        default=0,
        metadata={
            "help": "verify a tree of drafts of at most this many nodes per sequence, the last sampled token its root "
            "(so as many verify rows; at most 64): the drafter's top candidates where it is unsure, n-gram "
            "continuations as branches, grown by expected accepted length; 0 keeps chains"
        },
    )
    speculative_tree_shape: str = field(
        default="dynamic",
        metadata={
            "help": "how a tree is grown: dynamic (each round from the drafter's probabilities, as the rounds "
            "calibrate them) or static (from the measured acceptance of each depth and candidate rank, the same shape "
            "every round)"
        },
    )
    draft_model: str | None = field(
        default=None,
        metadata={
            "help": "draft model directory or hub id for speculative=draft (default: the embedded model's own), or the "
            "block drafter's (DFlash layout) for speculative=block"
        },
    )


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split across GPUs: tensor (and expert) parallelism inside a pipeline stage, pipeline stages
    of consecutive layers."""

    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "processes (one per GPU) the model is split across: attention and GDN heads, MLP and expert "
            "intermediate sizes and the vocabulary divided among them",
            "aliases": ("-tp",),
        },
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata={
            "help": "with --tensor-parallel-size, split a mixture-of-experts model's routed experts whole among the "
            "ranks (each computes the chosen experts it holds) instead of cutting every expert's intermediate size",
            "aliases": ("-ep",),
        },
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata={
            "help": "pipeline stages the model's layers are split across, consecutive layers per stage (each stage "
            "--tensor-parallel-size processes: pipeline x tensor processes in all)",
            "aliases": ("-pp",),
        },
    )
    pipeline_micro_batches: int = field(
        default=0,
        metadata={
            "help": "with --pipeline-parallel-size, the micro-batches a step's sequences are cut into so that the "
            "stages overlap (0: automatic, one per stage where each gets at least 64 rows, else none; 1: none)"
        },
    )

    @property
    def world_size(self) -> int:
        """Processes in all: the pipeline stages times the tensor-parallel ranks of each."""
        return self.pipeline_parallel_size * self.tensor_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    """What the user chooses about running a model, by group. "auto" fields are resolved on load."""

    load: LoadConfig = LoadConfig()
    host: HostConfig = HostConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    speculation: SpeculativeConfig = SpeculativeConfig()
    parallel: ParallelConfig = ParallelConfig()

    @classmethod
    def from_flat(cls, **settings) -> EngineConfig:
        """The configuration of settings given by their flat names (`EngineConfig.from_flat(max_num_seqs=4)`), the
        rest at their defaults."""
        return cls().with_settings(**settings)

    def with_settings(self, **settings) -> EngineConfig:
        """This configuration with the settings named (by their flat names) replaced."""
        unknown = set(settings) - set(SETTING_GROUP)
        if unknown:
            raise TypeError(f"EngineConfig has no setting {', '.join(sorted(unknown))}")
        changes = {}
        for name, value in settings.items():
            changes.setdefault(SETTING_GROUP[name], {})[name] = value
        return replace(self, **{group: replace(getattr(self, group), **c) for group, c in changes.items()})

    def flat(self) -> dict:
        """Every setting by its flat name, as `from_flat` takes them."""
        return {name: getattr(getattr(self, group), name) for name, group in SETTING_GROUP.items()}


def engine_fields() -> tuple[Field, ...]:
    """The fields of every setting, group by group: the flags and the `LLM` keywords."""
    return tuple(f for group in fields(EngineConfig) for f in fields(group.default))


SETTING_GROUP = {  # flat setting name -> the EngineConfig field of the group that holds it
    f.name: group.name for group in fields(EngineConfig) for f in fields(group.default)
}
