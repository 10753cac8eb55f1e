"""A minimal streaming client for any OpenAI-compatible server (stdlib only), timing each token.

Benchmarks drive the server over HTTP exactly as users do; this client records when the request
was sent, when each content chunk arrived, and the server's usage numbers.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse


@dataclass
class Timing:
    """One streamed request as the client saw it (perf_counter seconds)."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    completion_tokens: int = 0
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (DESIGN §6), from the token count the server reported."""
        if len(self.chunk_times) < 2 or self.completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)


class Client:
    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600):
        url = urlparse(base_url)
        self.host, self.port = url.hostname, url.port or 80
        self.prefix = url.path.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.model = model
        self.timeout = timeout

    def stream(self, endpoint: str, body: dict) -> Timing:
        """POST `body` with stream=True to `/v1/{endpoint}` and time every chunk that carries text."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        timing = Timing(sent=time.perf_counter())
        try:
            conn.request("POST", f"{self.prefix}/v1/{endpoint}", json.dumps(body), self.headers)
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"{endpoint} returned {response.status}: {response.read()[:300]!r}")
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    timing.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    timing.completion_tokens = chunk["usage"]["completion_tokens"]
                    timing.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in chunk.get("choices", []):
                    piece = (
                        choice.get("text")
                        or (choice.get("delta") or {}).get("content")
                        or (choice.get("delta") or {}).get("reasoning_content")
                        or ""
                    )
                    if piece:
                        timing.chunk_times.append(time.perf_counter())
                        timing.text += piece
                    timing.finish_reason = choice.get("finish_reason") or timing.finish_reason
        finally:
            conn.close()
        return timing
