"""`ServerContext`: what every endpoint needs (engine, settings, metrics, request log, the compiles of output
constraints), tokenizing off the event loop, hiding the server's file paths from clients, and the bookkeeping
done when a request ends (Prometheus counters and histograms, deltaspec's and vLLM's names, one request-log line).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from deltaspec.config.server import ServerConfig
from deltaspec.engine.async_engine import AsyncEngine
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.model.weights import default_model_path
from deltaspec.server.constraints import ConstraintCompiles
from deltaspec.server.errors import APIError, shown
from deltaspec.server.metrics import RequestLog, ServerMetrics
from deltaspec.server.samples import Sample
from deltaspec.server.vllm_metrics import VllmMetrics


@dataclass
class ServerContext:
    engine: AsyncEngine
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics
    request_log: RequestLog | None
    private_paths: tuple[str, ...] = field(init=False)
    constraints: ConstraintCompiles = field(init=False)
    vllm_metrics: VllmMetrics = field(init=False)

    def __post_init__(self) -> None:
        engine = self.engine.engine
        config = self.config
        self.constraints = ConstraintCompiles(
            engine.structured,
            config.structured_outputs_workers,
            config.structured_outputs_timeout,
            config.max_constraint_bytes,
        )
        dirs = {engine.model_dir, engine.config.load.model, engine.config.speculation.draft_model, default_model_path()}
        paths = {str(p) for d in dirs if d is not None for p in (Path(d), Path(d).resolve()) if p.is_absolute()}
        self.private_paths = tuple(sorted(paths, key=len, reverse=True))
        self.vllm_metrics = VllmMetrics(
            self.metrics.registry, self.model_name, self.max_model_len, lambda: self.engine.usage, self.metrics.tally
        )

    def redact(self, text: str) -> str:
        """`text` with the model's (and the embedded tokenizer's) directories replaced by the served model name."""
        for path in self.private_paths:
            text = text.replace(path, self.model_name)
        return text

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.engine.tokenizer

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """The model's sampling defaults (`generation_config.json`) for the fields a request leaves unset."""
        return self.engine.engine.sampling_defaults

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.config.scheduler.max_model_len

    @property
    def trusts_request_templates(self) -> bool:
        """Whether a request may bring its own chat template (vLLM's `--trust-request-chat-template`)."""
        return self.config.trust_request_chat_template

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is this server's model name (a missing model field is accepted)."""
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model {shown(model)} does not exist; this server serves '{self.model_name}'.",
                param="model",
                code="model_not_found",
            )

    def require_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise APIError(400, f"The model has no tokenizer, so {what}; send token-id prompts to /v1/completions.")
        return self.tokenizer

    def encode_prompt(self, tokenizer: Tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
        """The prompt's token ids (on a worker thread), or a 400 before any tokenizing when the text is surely
        longer than the context: more than twice the bytes its tokens could cover (tokenizing megabytes takes
        seconds, and normalization may shorten a text, hence the margin)."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > 2 * self.max_model_len * tokenizer.max_token_bytes:
            raise APIError(
                400,
                f"The prompt is {size} bytes, far more than the context of {self.max_model_len} tokens holds; "
                "send a shorter prompt.",
            )
        return tokenizer.encode(text, add_special_tokens)

    def record(
        self,
        endpoint: str,
        request_id: str,
        arrival: float,
        samples: list[Sample],
        prompt_tokens: int,
        finish_reason: str,
        n: int,
    ) -> None:
        """Count a finished request in the metrics and write its request-log line."""
        metrics = self.metrics
        self.vllm_metrics.record(samples, n)
        generated = sum(len(s.token_ids) for s in samples)
        metrics.requests.labels(endpoint=endpoint, finish_reason=finish_reason).inc()
        metrics.prompt_tokens.inc(prompt_tokens)
        metrics.generation_tokens.inc(generated)
        ttfts = [s.metrics["time_to_first_token"] for s in samples if s.metrics.get("time_to_first_token") is not None]
        tpots = [
            s.metrics["time_per_output_token"] for s in samples if s.metrics.get("time_per_output_token") is not None
        ]
        for value in ttfts:
            metrics.ttft.observe(value)
        for value in tpots:
            metrics.tpot.observe(value)
        rounds = sum(s.metrics.get("spec_rounds", 0) for s in samples)
        accepted = sum(s.metrics.get("spec_accepted_tokens", 0) for s in samples)
        metrics.spec_rounds.inc(rounds)
        metrics.spec_accepted.inc(accepted)
        for sample in samples:
            for position, (hit, tried) in enumerate(
                zip(sample.metrics.get("accepted_at", []), sample.metrics.get("drafted_at", [])), start=1
            ):
                metrics.spec_accepted_at.labels(position=str(position)).inc(hit)
                metrics.spec_drafted_at.labels(position=str(position)).inc(tried)
        if self.request_log is not None:
            self.request_log.write(
                {
                    "arrival_time": arrival,
                    "request_id": request_id,
                    "endpoint": endpoint,
                    "ttft_s": min(ttfts) if ttfts else None,
                    "tpot_s": sum(tpots) / len(tpots) if tpots else None,
                    "prompt_tokens": prompt_tokens,
                    "cached_tokens": max((s.metrics.get("num_cached_tokens", 0) for s in samples), default=0),
                    "generated_tokens": generated,
                    "finish_reason": finish_reason,
                    "n": n,
                    "spec_rounds": rounds,
                    "spec_accepted_tokens": accepted,
                    "acceptance_length": accepted / rounds if rounds else None,
                }
            )
