"""`ServerConfig`: how `deltaspec serve` listens and what it accepts, and `flag_list`, the reading of its
list-valued flags."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from deltaspec.errors import DeltaspecError

MAX_PORT = 65535
DATA_PARALLEL_BACKENDS = ("mp", "ray")  # vLLM's --data-parallel-backend names


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
    data_parallel_size: int = field(
        default=1,
        metadata={
            "help": "engine replicas behind this one address, each a whole copy of the model (on GPUs: "
            "--tensor-parallel-size GPUs of its own each); requests go to the replica that holds their prefix, else to "
            "the least-loaded one",
            "aliases": ("-dp",),
        },
    )
    data_parallel_backend: str = field(
        default="mp",
        metadata={
            "help": "who starts the replicas: mp (processes on this host) or ray (Ray Serve deployments on the Ray "
            "cluster's hosts; needs the ray extra)",
            "aliases": ("-dpb",),
        },
    )
    router_cache_threshold: float = field(
        default=0.3,
        metadata={
            "help": "with --data-parallel-size: the least share of a prompt a replica's earlier prompts must cover "
            "for the prompt to go there rather than to the least-loaded replica"
        },
    )
    router_balance_abs_threshold: int = field(
        default=64,
        metadata={
            "help": "with --data-parallel-size: route to the least-loaded replica, whatever the prefixes, while the "
            "busiest one has more than this many requests over it (and --router-balance-rel-threshold times as many)"
        },
    )
    router_balance_rel_threshold: float = field(
        default=1.5,
        metadata={"help": "with --data-parallel-size: see --router-balance-abs-threshold"},
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
        if self.data_parallel_size < 1:
            raise DeltaspecError(f"--data-parallel-size must be 1 or more, got {self.data_parallel_size}.")
        if self.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise DeltaspecError(f"--data-parallel-backend must be mp or ray, got {self.data_parallel_backend!r}.")
        if not 0 <= self.router_cache_threshold <= 1:
            raise DeltaspecError(f"--router-cache-threshold must be 0 to 1, got {self.router_cache_threshold}.")
        if self.router_balance_abs_threshold < 0 or self.router_balance_rel_threshold < 1:
            raise DeltaspecError(
                "--router-balance-abs-threshold must be 0 or more and --router-balance-rel-threshold 1 or more, got "
                f"{self.router_balance_abs_threshold} and {self.router_balance_rel_threshold}."
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
