"""vLLM's metric names on /metrics, beside deltaspec's own, so that dashboards and alerts built for vLLM work.

The names, label names (`model_name`, the served name, and `engine`, always "0": one engine) and histogram buckets
are vLLM v1's (`vllm/v1/metrics/loggers.py`); values count engine requests (one per sample), as vLLM's do. Read
from the engine at scrape time: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc` (a fraction, as vLLM's; also under its older name `vllm:gpu_cache_usage_perc`),
`vllm:num_preemptions_total`, and from the server's token tally `vllm:prefix_cache_queries_total` /
`vllm:prefix_cache_hits_total` (prompt tokens of finished samples / of them resumed from a prefix checkpoint).
Counted as samples finish: `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
`vllm:request_success_total{finished_reason}`, the histograms `vllm:time_to_first_token_seconds`,
`vllm:time_per_output_token_seconds`, `vllm:e2e_request_latency_seconds`, `vllm:request_decode_time_seconds`,
`vllm:request_prompt_tokens`, `vllm:request_generation_tokens`, `vllm:request_params_n`,
`vllm:request_params_max_tokens`, and the speculative counters `vllm:spec_decode_num_drafts_total`,
`vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total` and
`vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from deltaspec.server.metrics import TokenTally
from deltaspec.server.samples import Sample

LABELS = ("model_name", "engine")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
TTFT_BUCKETS += (40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
TPOT_BUCKETS += (40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
LATENCY_BUCKETS += (480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(largest: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `largest` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > largest:
                return out
            out.append(mantissa * scale)
        scale *= 10


class _EngineCollector(Collector):
    """vLLM's gauges and cumulative counters that the engine and the token tally already keep, read at scrape."""

    def __init__(self, labels: dict[str, str], usage: Callable[[], dict], tally: TokenTally) -> None:
        self.labels, self.usage, self.tally = labels, usage, tally

    def _family(self, kind: type, name: str, doc: str, value: float):
        family = kind(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        usage, tally = self.usage(), self.tally
        total = usage["kv_blocks_total"]
        kv_usage = usage["kv_blocks_used"] / total if total else 0.0
        yield self._family(GaugeMetricFamily, "vllm:num_requests_running", "Running requests.", usage["running"])
        yield self._family(GaugeMetricFamily, "vllm:num_requests_waiting", "Waiting requests.", usage["waiting"])
        yield self._family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage; 1 is 100%.", kv_usage)
        yield self._family(GaugeMetricFamily, "vllm:gpu_cache_usage_perc", "KV-cache usage (old name).", kv_usage)
        yield self._family(CounterMetricFamily, "vllm:num_preemptions", "Preemptions.", usage["preemptions"])
        queries = tally.finished_prompt_tokens
        yield self._family(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens queried.", queries)
        yield self._family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens cached.", tally.cached_tokens)


class VllmMetrics:
    """vLLM's metrics of one server app, in its registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        max_model_len: int,
        usage: Callable[[], dict],
        tally: TokenTally,
    ) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        registry.register(_EngineCollector(self.labels, usage, tally))

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*LABELS, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(**self.labels)

        tokens = buckets_1_2_5(max_model_len)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.").labels(**self.labels)
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.").labels(**self.labels)
        self.success = counter("vllm:request_success", "Finished requests.", ("finished_reason",))
        self.drafts = counter("vllm:spec_decode_num_drafts", "Verified drafts.").labels(**self.labels)
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.").labels(**self.labels)
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(**self.labels)
        self.accepted_at = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted by position.", ("position",)
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Time per output token.", TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency.", LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "Decode time per request.", LATENCY_BUCKETS)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.request_generation = histogram("vllm:request_generation_tokens", "Tokens generated per request.", tokens)
        self.params_n = histogram("vllm:request_params_n", "The n request parameter.", (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens parameter.", tokens)

    def record(self, samples: list[Sample], n: int) -> None:
        """Count one HTTP request's samples (engine requests), each as vLLM counts a request."""
        self.params_n.observe(n)
        for sample in samples:
            metrics = sample.metrics
            generated = len(sample.token_ids)
            self.success.labels(**self.labels, finished_reason=sample.finish_reason or "abort").inc()
            self.params_max_tokens.observe(sample.params.max_tokens)
            self.generation_tokens.inc(generated)
            if generated:
                self.prompt_tokens.inc(sample.num_prompt_tokens)
                self.request_prompt.observe(sample.num_prompt_tokens)
                self.request_generation.observe(generated)
            ttft, decode = metrics.get("time_to_first_token"), metrics.get("decode_time")
            if ttft is not None:
                self.ttft.observe(ttft)
            if metrics.get("time_per_output_token") is not None:
                self.tpot.observe(metrics["time_per_output_token"])
            if ttft is not None and decode is not None:
                self.e2e.observe(ttft + decode)
                self.decode.observe(decode)
            drafted_at, accepted_at = metrics.get("drafted_at", []), metrics.get("accepted_at", [])
            self.drafts.inc(metrics.get("spec_rounds", 0))
            self.draft_tokens.inc(sum(drafted_at))
            self.accepted.inc(metrics.get("spec_accepted_tokens", 0))
            for position, hit in enumerate(accepted_at):
                self.accepted_at.labels(**self.labels, position=str(position)).inc(hit)
