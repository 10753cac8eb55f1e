"""Prometheus metrics of one server app, and its JSON-lines request log.

`ServerMetrics` owns a private `CollectorRegistry` (so several apps in one process do not collide):
request, prompt-token and generated-token counters, TTFT and TPOT histograms, and gauges read
from `AsyncEngine.usage` at scrape time (running and waiting sequences, KV pages, GDN state
slots, preemptions, engine steps). `TokenTally` counts tokens as the engine's deltas arrive, for the
throughput lines of the log. `RequestLog` appends one JSON line per finished request; a write the disk refuses
costs the record and a warning, never the request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from deltaspec.engine.async_engine import RequestDelta
from deltaspec.errors import DeltaspecError

log = logging.getLogger("deltaspec.server")

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1.0, 2.5)

_GAUGES = {
    "running": ("deltaspec_num_requests_running", "Sequences running in the engine (holding caches)."),
    "waiting": ("deltaspec_num_requests_waiting", "Sequences waiting for caches."),
    "kv_blocks_used": ("deltaspec_kv_blocks_used", "Attention KV pages in use."),
    "kv_blocks_total": ("deltaspec_kv_blocks_total", "Attention KV pages allocated."),
    "state_slots_used": ("deltaspec_state_slots_used", "GDN state slots in use."),
    "state_slots_total": ("deltaspec_state_slots_total", "GDN state slots allocated."),
}
_COUNTERS = {
    "preemptions": ("deltaspec_preemptions", "Sequences preempted (recomputed later) since start."),
    "steps": ("deltaspec_engine_steps", "Engine forward passes since start."),
}


class _EngineCollector(Collector):
    """Engine usage as gauges (and cumulative counters), read when /metrics is scraped."""

    def __init__(self, usage: Callable[[], dict]) -> None:
        self._usage = usage

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        usage = self._usage()
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=usage[key])
        total = usage["kv_blocks_total"]
        yield GaugeMetricFamily(
            "deltaspec_kv_cache_usage_ratio",
            "Fraction of attention KV pages in use.",
            value=usage["kv_blocks_used"] / total if total else 0.0,
        )
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=usage[key])


@dataclass
class TokenTally:
    """Token totals since the server started, counted on the event loop from the deltas each sample receives:
    prompt tokens of samples whose prompt is done (their first token came), tokens generated, and of the samples
    that finished after their prompt was done, prompt tokens, the part resumed from prefix checkpoints, and
    speculative verify rounds, draft tokens verified and draft tokens accepted."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished_prompt_tokens: int = 0
    cached_tokens: int = 0
    spec_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, delta: RequestDelta, started: bool) -> None:
        """Count one delta of a sample; `started`: whether the sample had tokens before this delta."""
        if delta.new_token_ids and not started:
            self.prompt_tokens += delta.num_prompt_tokens
        self.generated_tokens += len(delta.new_token_ids)
        if delta.finished and (started or delta.new_token_ids):
            metrics = delta.metrics
            self.finished_prompt_tokens += delta.num_prompt_tokens
            self.cached_tokens += metrics.get("num_cached_tokens", 0)
            self.spec_rounds += metrics.get("spec_rounds", 0)
            self.drafted_tokens += sum(metrics.get("drafted_at", ()))
            self.accepted_tokens += metrics.get("spec_accepted_tokens", 0)

    def since(self, earlier: TokenTally) -> TokenTally:
        """What was counted after `earlier` (a copy of this tally)."""
        return TokenTally(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})


class ServerMetrics:
    def __init__(self, usage: Callable[[], dict]) -> None:
        self.tally = TokenTally()
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "deltaspec_requests",
            "Finished requests by endpoint and finish reason.",
            ["endpoint", "finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "deltaspec_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "deltaspec_generation_tokens", "Tokens generated, all samples.", registry=self.registry
        )
        self.ttft = Histogram(
            "deltaspec_time_to_first_token_seconds",
            "Time to first token per sample.",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "deltaspec_time_per_output_token_seconds",
            "Decode time per output token after the first, per sample.",
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.spec_rounds = Counter(
            "deltaspec_spec_verify_rounds", "Verify passes with draft tokens, all samples.", registry=self.registry
        )
        self.spec_accepted = Counter(
            "deltaspec_spec_accepted_tokens", "Draft tokens accepted, all samples.", registry=self.registry
        )
        self.spec_accepted_at = Counter(
            "deltaspec_spec_accepted_at_position",
            "Draft tokens accepted, by position in the draft (1 = first).",
            ["position"],
            registry=self.registry,
        )
        self.spec_drafted_at = Counter(
            "deltaspec_spec_drafted_at_position",
            "Draft tokens verified, by position in the draft (1 = first).",
            ["position"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(usage))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestLog:
    """Appends one JSON object per line to a file; safe to call from any thread.

    A path that cannot be written at start is refused there (a configuration mistake, fixed before serving, as
    Python's logging refuses a log file it cannot open when uvicorn or vLLM start). Once serving, the log never
    fails a request: a write that fails (a full disk, an I/O error, a removed directory) drops that record and
    is cut back off the file, so every line stays one whole record; one warning says so when writes start
    failing, and one line counts the dropped records when they work again."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._dropped = 0  # records dropped since writes last worked
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise DeltaspecError(f"Cannot write the request log {self.path} ({exc.strerror}).") from exc

    def write(self, record: dict) -> None:
        """Append `record` as one line, or drop it with a warning (the first of a run of failures only)."""
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        with self._lock:
            try:
                self._append(line)
            except OSError as exc:
                if not self._dropped:
                    log.warning(
                        "Cannot write the request log %s (%s); requests are served without it until writing works.",
                        self.path,
                        exc.strerror or exc,
                    )
                self._dropped += 1
                return
            if self._dropped:
                log.warning("The request log %s is written again; %d records were dropped.", self.path, self._dropped)
                self._dropped = 0

    def _append(self, line: bytes) -> None:
        """Append `line` whole or not at all: a write cut short (the disk filled) is truncated back off."""
        with open(self.path, "ab", buffering=0) as f:
            start = f.seek(0, os.SEEK_END)
            try:
                view = memoryview(line)
                while view:
                    view = view[f.write(view) :]
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(f.fileno(), start)
                raise
