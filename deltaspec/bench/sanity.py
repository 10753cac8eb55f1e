"""Checks that a serving benchmark's run measured tokens the server generated as it streamed them, so that a rate
the server did not earn is refused (a `DeltaspecError` sentence) instead of reported.

A run is refused when a request reported no generated tokens (no usage in its stream: its TPOT cannot be computed),
when more text chunks arrived than the server says it generated, and, judged on the requests of 16 tokens or more
(shorter ones may honestly spend most of their time before their first token), when their streams arrived in
bursts (their tokens came within 2% of the requests' time: the rate would be the network's, not the model's) or,
where the server publishes its own time per output token on /metrics (vLLM's `vllm:inter_token_latency_seconds`
or `vllm:time_per_output_token_seconds`, or deltaspec's), when their mean TPOT is less than half the server's.
"""

from __future__ import annotations

from deltaspec.bench.client import Timing
from deltaspec.errors import DeltaspecError

MIN_TOKENS = 16  # requests shorter than this are not checked for bursts or against the server's TPOT
BURST_SPAN = 0.02  # a stream whose tokens took less than this fraction of the request's time came in a burst
SERVER_TPOT_FACTOR = 0.5  # the client's TPOT may not be below this fraction of the server's own
# The histograms of a server's own time per output token, in the order they are looked for.
SERVER_TPOT = (
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "deltaspec_time_per_output_token_seconds",
)


def histogram_totals(text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each `SERVER_TPOT` histogram in a Prometheus text exposition, over all its label sets."""
    totals: dict[str, list[float]] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        metric = name.partition("{")[0]
        for base in SERVER_TPOT:
            for i, suffix in enumerate(("_sum", "_count")):
                if metric == base + suffix:
                    totals.setdefault(base, [0.0, 0.0])[i] += float(value.split()[0])
    return {name: (total[0], total[1]) for name, total in totals.items()}


def server_tpot(before: str | None, after: str | None) -> float | None:
    """The server's own mean TPOT (seconds) between two scrapes of its /metrics, or None when it publishes none."""
    if before is None or after is None:
        return None
    first, last = histogram_totals(before), histogram_totals(after)
    for name in SERVER_TPOT:
        if name in first and name in last and last[name][1] > first[name][1]:
            return (last[name][0] - first[name][0]) / (last[name][1] - first[name][1])
    return None


def check_run(timings: list[Timing], concurrency: int, server_tpot_s: float | None) -> None:
    """Refuse a run whose numbers the server's own counts or times contradict (see the module docstring)."""
    at = f"At C={concurrency}"
    for timing in timings:
        if timing.completion_tokens < 1:
            raise DeltaspecError(
                f"{at} the server reported no generated tokens for a request (no usage in its stream), so no rate can "
                "be computed; benchmark a server that sends usage with stream_options.include_usage."
            )
        if len(timing.chunk_times) > timing.completion_tokens:
            raise DeltaspecError(
                f"{at} a request streamed {len(timing.chunk_times)} text chunks but the server counted "
                f"{timing.completion_tokens} generated tokens, so its usage is wrong and the rate is refused."
            )
    long = [t for t in timings if t.completion_tokens >= MIN_TOKENS and len(t.chunk_times) >= 2]
    if not long:
        return
    span = sum(t.chunk_times[-1] - t.chunk_times[0] for t in long)
    total = sum(t.chunk_times[-1] - t.sent for t in long)
    if span < BURST_SPAN * total:
        raise DeltaspecError(
            f"{at} the tokens arrived within {100 * span / total:.1f}% of the requests' time, in bursts rather than "
            "as they were generated, so the rate would be the network's and is refused; check that nothing between "
            "the benchmark and the server buffers the stream."
        )
    client_tpot_s = sum(t.tpot for t in long) / len(long)
    if server_tpot_s is not None and client_tpot_s < SERVER_TPOT_FACTOR * server_tpot_s:
        raise DeltaspecError(
            f"{at} the client timed {1000 * client_tpot_s:.2f} ms per output token but the server's own metrics say "
            f"{1000 * server_tpot_s:.2f} ms, so the stream arrived faster than it was generated and the rate is "
            "refused; check that nothing between the benchmark and the server buffers the stream."
        )
