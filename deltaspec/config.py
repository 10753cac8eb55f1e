"""Frozen configuration dataclasses: the model's architecture and the engine's settings.

`ModelConfig` is the architecture as deltaspec understands it, whatever checkpoint format it came
from (`deltaspec.model.hf_config` parses Hugging Face `config.json` into it). `EngineConfig` holds
what the user chooses (dtype, device, cache sizes); its fields carry `help` metadata from which the
CLI generates its flags. "auto" values are resolved in `resolve_engine_config`, one pure function.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from deltaspec.errors import DeltaspecError

MAX_TREE_ROWS = 64  # nodes of one tree of drafts, its root included (the kernels' ancestor masks are int64)

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLP: softmax router, top-k experts, optional shared expert. With expert parallelism
    (`expert_parallel_size` ranks) the router still scores all `num_experts`; each rank holds `held_experts`."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    expert_parallel_size: int = 1

    @property
    def held_experts(self) -> int:
        """The routed experts one rank holds."""
        return self.num_experts // self.expert_parallel_size


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one hybrid GDN / gated-attention model (DESIGN §1)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    attention_bias: bool
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    gdn_layout: str  # "qwen3_5": in_proj_qkv/z/b/a; "qwen3_next": grouped in_proj_qkvz/ba
    # MLP: per layer, True where the layer's MLP is a mixture of experts
    moe: MoEConfig | None
    moe_layers: tuple[bool, ...]
    # multi-token-prediction head
    num_mtp_layers: int
    eos_token_ids: tuple[int, ...] = ()

    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the GDN causal conv: q | k | v."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )


DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_ALIASES = {
    "double": "float64",
    "float": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a dtype name ("bfloat16", "bf16", "float32", ...) to a torch dtype."""
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        name = str(name).removeprefix("torch.")
    key = DTYPE_ALIASES.get(name, name)
    if key not in DTYPES:
        raise DeltaspecError(f"Unknown dtype {name!r}; use one of {', '.join(DTYPES)}.")
    return DTYPES[key]


KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}


def parse_kv_dtype(name: str, dtype: str | torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype: a quantized one (`KV_CACHE_DTYPES`), or the model's `dtype` for "auto" (or
    that dtype's own name, as a resolved config spells it)."""
    if name in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[name]
    model_dtype = parse_dtype(dtype)
    if name != "auto" and (name not in DTYPES or DTYPES[name] != model_dtype):
        raise DeltaspecError(
            f"Unknown --kv-cache-dtype {name!r}; use auto (the model's dtype), fp8_e4m3 (or fp8) or int8."
        )
    return model_dtype


@dataclass(frozen=True)
class EngineConfig:
    """What the user chooses about running a model. "auto" fields are resolved on load."""

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
    device: str = field(default="auto", metadata={"help": "torch device: auto, cpu, cuda, cuda:N"})
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
    fp8_activations: str = field(
        default="none",
        metadata={
            "help": "FP8 weights' activations: none (kept in the model's dtype, W8A16) or dynamic (in products of "
            "more than 64 rows, e.g. prefill, quantized to e4m3 per token and 128 features as the checkpoints' "
            "activation_scheme dynamic, vLLM and transformers do, for Hopper's FP8 tensor cores)"
        },
    )
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
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "most rows in one forward pass (prompt chunks + decode rows)"}
    )
    prefill_chunk: int = field(
        default=512,
        metadata={"help": "most prompt rows of one sequence in one pass: a long prompt delays others by at most this"},
    )
    seed: int = field(default=0, metadata={"help": "seed for requests that give none"})
    threads: int | None = field(
        default=None,
        metadata={
            "help": "CPU threads for the engine (default: physical cores the process may use)",
            "type": int,
            "aliases": ("-t",),
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "Jinja chat template used instead of the model's: a file, or the template itself",
            "aliases": ("--chat-template-file",),
        },
    )
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
    kernels: str = field(
        default="auto",
        metadata={
            "help": "op implementations: auto (Triton kernels on CUDA, torch references elsewhere), reference "
            "(torch references everywhere)"
        },
    )
    enforce_eager: bool = field(default=False, metadata={"help": "run every pass eagerly, without CUDA graphs"})
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
    shape_overrides: tuple[tuple[str, int], ...] = field(
        default=(),
        metadata={
            "cli": False,
            "help": "(Python only) ModelConfig/MoEConfig fields replaced in the shape, for small tests",
        },
    )

    @property
    def log_rows(self) -> int:
        """Rows of each state slot's speculative replay log: the rows of a verify pass (the drafts plus the bonus row,
        or a tree's nodes), 0 without speculation."""
        return max(self.draft_tokens + 1, self.speculative_tree) if self.speculative != "none" else 0


MAX_PORT = 65535


@dataclass(frozen=True)
class ServerConfig:
    """How `deltaspec serve` listens and what it accepts."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    api_key: str | None = field(
        default=None,
        metadata={
            "help": "require 'Authorization: Bearer KEY' on /v1/* (default: $DELTASPEC_API_KEY, else no key); "
            "/health and /metrics stay open unless --metrics-key is given"
        },
    )
    metrics_key: str | None = field(
        default=None,
        metadata={"help": "require 'Authorization: Bearer KEY' on /metrics and /health (default: both open)"},
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name clients must use (default: the checkpoint directory's name)"}
    )
    trust_request_chat_template: bool = field(
        default=False,
        metadata={
            "help": "render a request's chat_template in place of the model's (off unless given, as in vLLM: a "
            "template is code the server runs)"
        },
    )
    max_n: int = field(default=16, metadata={"help": "largest n (samples per request) accepted"})
    max_sequences_per_request: int = field(
        default=64, metadata={"help": "most sequences one request may start: its prompts times n"}
    )
    max_request_bytes: int = field(
        default=8 << 20, metadata={"help": "largest request body in bytes; a larger one gets 413"}
    )
    shutdown_timeout: float = field(
        default=30.0,
        metadata={
            "help": "seconds the requests in flight get to finish after SIGTERM or Ctrl-C; the rest then end with "
            "an error"
        },
    )
    request_log: str | None = field(
        default=None, metadata={"help": "append one JSON line per finished request to this file"}
    )
    log_stats_interval: float = field(
        default=10.0,
        metadata={"help": "seconds between the throughput lines logged while requests run (vLLM's format)"},
    )
    disable_log_stats: bool = field(default=False, metadata={"help": "log no throughput lines"})
    access_log: bool = field(
        default=False,
        metadata={"help": "log one line per HTTP request: method, path, status, duration and request id"},
    )
    allowed_hosts: str | None = field(
        default=None,
        metadata={
            "help": "Host header names answered besides those of --host, e.g. a proxy's 'llm.example.com' "
            "(comma-separated or a JSON list; '*': any); default: loopback names when --host is a loopback "
            "address, --host itself when it is another address, any for 0.0.0.0 or :: (with this flag: its "
            "names and the loopback ones)"
        },
    )
    allowed_origins: str | None = field(
        default=None,
        metadata={
            "help": "origins whose web pages may call the server (CORS), as vLLM's JSON list or comma-separated; "
            "'*': any (default: none, no CORS headers)"
        },
    )
    allowed_methods: str = field(
        default="*", metadata={"help": "HTTP methods those pages may use (with --allowed-origins)"}
    )
    allowed_headers: str = field(
        default="*", metadata={"help": "request headers those pages may send (with --allowed-origins)"}
    )
    allow_credentials: bool = field(
        default=False, metadata={"help": "let those pages send cookies and credentials (with --allowed-origins)"}
    )
    structured_outputs_timeout: float = field(
        default=10.0,
        metadata={
            "help": "seconds a request waits for its output constraint (JSON schema, regex, grammar) to compile; "
            "past them it gets 400 (the compile goes on, and the same constraint is then answered at once)"
        },
    )
    structured_outputs_workers: int = field(
        default=2, metadata={"help": "threads that compile output constraints, apart from request handling"}
    )
    max_constraint_bytes: int = field(
        default=256 << 10, metadata={"help": "largest output constraint (schema, regex, choices, grammar) in bytes"}
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= MAX_PORT:
            raise DeltaspecError(f"--port must be 0 to {MAX_PORT} (0: any free port), got {self.port}.")
        for name in ("structured_outputs_timeout", "structured_outputs_workers", "max_constraint_bytes"):
            if not getattr(self, name) > 0:
                flag = "--" + name.replace("_", "-")
                raise DeltaspecError(f"{flag} must be more than 0, got {getattr(self, name)}.")
        if not self.log_stats_interval > 0:
            raise DeltaspecError(
                f"--log-stats-interval must be more than 0 seconds, got {self.log_stats_interval}; "
                "use --disable-log-stats to log no throughput lines."
            )
        for name in ("allowed_hosts", "allowed_origins", "allowed_methods", "allowed_headers"):
            if getattr(self, name) is not None:
                flag_list(getattr(self, name), "--" + name.replace("_", "-"))


def flag_list(value: str, flag: str) -> tuple[str, ...]:
    """The items of a list-valued flag, given as vLLM's JSON list (`'["a", "b"]'`) or comma-separated (`a,b`)."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise DeltaspecError(f"{flag} must be a JSON list of strings or comma-separated values, got {value!r}.")
    else:
        items = text.split(",")
    return tuple(item.strip() for item in items if item.strip())


CHECKPOINTS_PER_STREAM = 3  # a long request leaves up to three: 512 and 64 tokens before its prompt's end, its end


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_threads() -> int:
    """CPU threads when --threads is not given: OMP_NUM_THREADS when the environment sets it (as torch reads it),
    else the physical cores the process may use."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else physical_cores()


def physical_cores() -> int:
    """The physical cores among the CPUs this process may run on (its affinity mask): logical CPUs that share a
    core (hyper-threads) count once; every allowed CPU where the kernel does not say which core it is."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks (macOS, Windows)
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def resolve_engine_config(cfg: EngineConfig, checkpoint_dtype: str | None) -> EngineConfig:
    """Resolve the "auto" device and dtypes of `cfg` and check its values; the streams, context, KV pool and
    prefix checkpoints depend on the memory and are decided by the planner (`with_pools`).

    dtype auto: the checkpoint's own `torch_dtype` on CUDA, float32 on CPU (bfloat16 matmuls are
    slow there). state_dtype auto: float32, or float64 for a float64 model. kv_cache_dtype auto: the model's dtype
    (named as it, "fp8" as "fp8_e4m3").
    """
    device = default_device() if cfg.device == "auto" else cfg.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeltaspecError(f"Device {device!r} was asked for but CUDA is not available; use --device cpu.")
    if cfg.dtype == "auto":
        dtype = (checkpoint_dtype or "bfloat16") if device.startswith("cuda") else "float32"
    else:
        dtype = cfg.dtype
    dtype_name = str(parse_dtype(dtype)).removeprefix("torch.")
    if cfg.state_dtype == "auto":
        state_dtype = "float64" if dtype_name == "float64" else "float32"
    else:
        state_dtype = str(parse_dtype(cfg.state_dtype)).removeprefix("torch.")
    parse_kv_dtype(cfg.kv_cache_dtype, dtype_name)
    kv_cache_dtype = (
        dtype_name if cfg.kv_cache_dtype == "auto" else {"fp8": "fp8_e4m3"}.get(cfg.kv_cache_dtype, cfg.kv_cache_dtype)
    )
    if cfg.prefix_offload_gib < 0:
        raise DeltaspecError(f"prefix_offload_gib must be 0 (no offload) or more, got {cfg.prefix_offload_gib}.")
    if cfg.prefix_checkpoints < 0:
        raise DeltaspecError(f"prefix_checkpoints must be 0 (three per stream) or more, got {cfg.prefix_checkpoints}.")
    if cfg.fp8_activations not in ("none", "dynamic"):
        raise DeltaspecError(f"Unknown --fp8-activations {cfg.fp8_activations!r}; use none or dynamic.")
    if cfg.speculative_tree and not 2 <= cfg.speculative_tree <= MAX_TREE_ROWS:
        raise DeltaspecError(
            f"speculative_tree is the most nodes of a tree of drafts, 2 to {MAX_TREE_ROWS} (0: chains); got "
            f"{cfg.speculative_tree}."
        )
    if cfg.speculative_tree and cfg.draft_tokens >= MAX_TREE_ROWS:
        raise DeltaspecError(
            f"With speculative_tree a draft is at most {MAX_TREE_ROWS - 1} tokens deep; got draft_tokens "
            f"{cfg.draft_tokens}."
        )
    if cfg.speculative_tree_shape not in ("dynamic", "static"):
        raise DeltaspecError(f"Unknown speculative_tree_shape {cfg.speculative_tree_shape!r}; use dynamic or static.")
    if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
        raise DeltaspecError(
            "The n-gram drafter needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
            f"{cfg.prompt_lookup_min} and {cfg.prompt_lookup_max}."
        )
    if cfg.threads is not None and cfg.threads < 1:
        raise DeltaspecError(f"threads must be at least 1, got {cfg.threads}; leave it out for the physical cores.")
    if cfg.kernels not in ("auto", "reference"):
        raise DeltaspecError(f"Unknown kernels setting {cfg.kernels!r}; use auto or reference.")
    if not 0 <= cfg.gpu_memory_utilization <= 1:
        raise DeltaspecError(
            f"gpu_memory_utilization is a fraction of the device's memory in (0, 1], or 0 for pools of exactly "
            f"streams x context; got {cfg.gpu_memory_utilization}."
        )
    if cfg.gpu_memory_utilization and cfg.num_kv_blocks:
        raise DeltaspecError("--gpu-memory-utilization sizes the KV pool itself; give it or --num-kv-blocks, not both.")
    for name in ("max_num_seqs", "max_model_len", "num_kv_blocks"):
        if getattr(cfg, name) < 0:
            raise DeltaspecError(f"{name} must be 0 (automatic) or more, got {getattr(cfg, name)}.")
    for name in (
        "tensor_parallel_size",
        "block_size",
        "max_num_batched_tokens",
        "prefill_chunk",
        "draft_tokens",
    ):
        if getattr(cfg, name) < 1:
            raise DeltaspecError(f"{name} must be at least 1, got {getattr(cfg, name)}.")
    chat_template = None if cfg.chat_template is None else chat_template_text(cfg.chat_template)
    return replace(
        cfg,
        device=device,
        dtype=dtype_name,
        state_dtype=state_dtype,
        kv_cache_dtype=kv_cache_dtype,
        chat_template=chat_template,
        threads=cfg.threads or default_threads(),
    )


def chat_template_text(template: str) -> str:
    """The Jinja source `--chat-template` gives, read as vLLM reads it: text with a brace or a newline is the
    template itself, anything else names its file."""
    if any(char in template for char in "{}\n"):
        return template
    try:
        return Path(template).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DeltaspecError(
            f"--chat-template {template!r} is neither a file nor a Jinja template; give a template file or its text "
            "(deltaspec ships no named templates, and without the flag it uses the model's own)."
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DeltaspecError(f"Could not read the chat template file {template} ({exc}).") from None


def check_context(cfg: EngineConfig, positions: int) -> None:
    """Refuse a --max-model-len beyond the model's trained positions unless it is explicitly allowed."""
    if cfg.max_model_len > positions and not cfg.allow_long_max_model_len:
        raise DeltaspecError(
            f"--max-model-len {cfg.max_model_len} exceeds the model's max_position_embeddings ({positions}); use "
            f"{positions} or less, or add --allow-long-max-model-len to run past the positions it was trained on."
        )


def with_pools(cfg: EngineConfig, streams: int, ctx: int, kv_blocks: int) -> EngineConfig:
    """`cfg` with its streams, context and KV pool decided (by the planner) and its prefix checkpoints counted:
    0 means three per stream, none without prefix caching."""
    pool = kv_blocks * cfg.block_size
    if kv_blocks and pool < ctx:
        raise DeltaspecError(
            f"The KV pool of {kv_blocks} pages x {cfg.block_size} tokens ({pool} tokens) cannot hold one full "
            f"context of {ctx} tokens; use --num-kv-blocks {-(-ctx // cfg.block_size)} or more, or "
            f"--max-model-len {pool} or less."
        )
    checkpoints = (cfg.prefix_checkpoints or CHECKPOINTS_PER_STREAM * streams) if cfg.enable_prefix_caching else 0
    return replace(
        cfg, max_num_seqs=streams, max_model_len=ctx, num_kv_blocks=kv_blocks, prefix_checkpoints=checkpoints
    )
