"""A minimal streaming client for any OpenAI-compatible server (stdlib only), timing each token.

Benchmarks drive the server over HTTP exactly as users do; this client records when the request
was sent, when each content chunk arrived, and the server's usage numbers. It owns the server's
address as the user gives it (`--url`, with or without the trailing `/v1` that `deltaspec serve`
prints), the check that a server answers there before a benchmark starts (`Client.check`, one
GET /v1/models), reading the server's own /metrics where it publishes them (`Client.metrics`, for the benchmark's
sanity checks), and turning every way that can fail into one `DeltaspecError` sentence.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from deltaspec.errors import DeltaspecError

EXAMPLE = "give the address `deltaspec serve` prints, such as http://127.0.0.1:8000/v1"
CHECK_TIMEOUT_S = 10.0


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


def split_server_url(text: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path prefix) of a server's URL, given with or without its trailing `/v1` and slash:
    http://h:8000, http://h:8000/ and http://h:8000/v1/ all give prefix ''."""
    try:
        url = urlsplit(text.strip())
        port = url.port
    except ValueError as exc:
        raise DeltaspecError(f"The URL {text!r} is not valid ({exc}); {EXAMPLE}.") from None
    if url.scheme not in ("http", "https"):
        raise DeltaspecError(f"The URL {text!r} does not start with http:// or https://; {EXAMPLE}.")
    if not url.hostname:
        raise DeltaspecError(f"The URL {text!r} names no host; {EXAMPLE}.")
    if url.query or url.fragment:
        raise DeltaspecError(f"The URL {text!r} has a query or fragment, which a server's address has not; {EXAMPLE}.")
    prefix = url.path.rstrip("/").removesuffix("/v1")
    return url.scheme, url.hostname, port or (443 if url.scheme == "https" else 80), prefix


def server_says(raw: bytes) -> str:
    """The error message in an OpenAI error body (else the body's start), without its final full stop."""
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode(errors="replace")
    return " ".join(str(message).split())[:200].rstrip(".") or "an empty body"


def reason(exc: BaseException) -> str:
    """A connection failure in a few words: 'Connection refused', 'timed out', 'Name or service not known'."""
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def served_identity(card: dict) -> dict:
    """What the server runs, from its /v1/models card: the served model name, the shape of a random-weight model,
    the drafter and its draft length (None where the server does not say, as a non-deltaspec server won't)."""
    return {
        "model": card["id"],
        "shape": card.get("shape"),
        "speculative": card.get("speculative"),
        "draft_tokens": card.get("draft_tokens"),
        "max_model_len": card.get("max_model_len"),
    }


class Client:
    """Requests to one server at `base_url`, sent as `model` (default: the served one, once `check` ran)."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600):
        self.scheme, self.host, self.port, self.prefix = split_server_url(base_url)
        self.address = urlsplit(base_url.strip()).netloc.rpartition("@")[2]
        self.base_url = f"{self.scheme}://{self.address}{self.prefix}/v1"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.api_key = api_key
        self.model = model
        self.timeout = timeout
        self.card: dict | None = None

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=timeout)

    def check(self) -> dict:
        """The card of the model to benchmark, from one GET /v1/models (later calls reuse it); without a model
        name the client sends the served one from then on. Raises `DeltaspecError` when nothing answers, the
        server refuses, or it does not serve the model asked for."""
        if self.card is not None:
            return self.card
        conn = self.connection(min(self.timeout, CHECK_TIMEOUT_S))
        try:
            conn.request("GET", f"{self.prefix}/v1/models", headers=self.headers)
            response = conn.getresponse()
            status, raw = response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise DeltaspecError(
                f"Nothing answers at {self.base_url} ({reason(exc)}); start the server first or {EXAMPLE}."
            ) from None
        finally:
            conn.close()
        if status in (401, 403):
            fix = "pass the key the server was started with" if self.api_key else "pass its key with --api-key"
            raise DeltaspecError(f"The server at {self.base_url} refused the request (HTTP {status}); {fix}.")
        if status == 404:
            raise DeltaspecError(
                f"The server at {self.address} has no {self.prefix}/v1/models (HTTP 404), so no "
                f"OpenAI-compatible API is at {self.base_url}; {EXAMPLE}."
            )
        if status != 200:
            raise DeltaspecError(
                f"The server at {self.base_url} answered GET /v1/models with HTTP {status} ({server_says(raw)}); "
                "check that it is up and OpenAI-compatible."
            )
        try:
            cards = json.loads(raw)["data"]
            names = [card["id"] for card in cards]
        except (ValueError, KeyError, TypeError):
            raise DeltaspecError(
                f"The server at {self.base_url} did not answer GET /v1/models with a model list; {EXAMPLE}."
            ) from None
        if not names:
            raise DeltaspecError(f"The server at {self.base_url} serves no model (its /v1/models list is empty).")
        if self.model is not None and self.model not in names:
            raise DeltaspecError(
                f"The server at {self.base_url} serves {', '.join(map(repr, names))}, not {self.model!r}; "
                "pass a name it serves as --served-model-name or leave it out."
            )
        self.card = cards[names.index(self.model)] if self.model is not None else cards[0]
        self.model = self.card["id"]
        return self.card

    def metrics(self) -> str | None:
        """The server's /metrics text, or None where it publishes none (or needs another key, or is unreachable)."""
        conn = self.connection(min(self.timeout, CHECK_TIMEOUT_S))
        try:
            conn.request("GET", f"{self.prefix}/metrics", headers=self.headers)
            response = conn.getresponse()
            status, raw = response.status, response.read()
        except (OSError, http.client.HTTPException):
            return None
        finally:
            conn.close()
        return raw.decode(errors="replace") if status == 200 else None

    def stream(self, endpoint: str, body: dict) -> Timing:
        """POST `body` with stream=True to `/v1/{endpoint}` and time every chunk that carries text."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        conn = self.connection(self.timeout)
        timing = Timing(sent=time.perf_counter())
        try:
            conn.request("POST", f"{self.prefix}/v1/{endpoint}", json.dumps(body), self.headers)
            response = conn.getresponse()
            if response.status != 200:
                raise DeltaspecError(
                    f"The server at {self.base_url} answered POST /v1/{endpoint} with HTTP {response.status} "
                    f"({server_says(response.read())}); the benchmark stops at a failed request."
                )
            for raw in response:
                self.read_chunk(raw, endpoint, timing)
        except (OSError, http.client.HTTPException) as exc:
            raise DeltaspecError(
                f"The server at {self.base_url} stopped answering during the benchmark ({reason(exc)}); "
                "check that it is still running."
            ) from None
        finally:
            conn.close()
        return timing

    def read_chunk(self, raw: bytes, endpoint: str, timing: Timing) -> None:
        """Add one server-sent-events line to `timing`: usage, and the time and text of a chunk carrying text.
        An error event (a server ending the stream early) raises `DeltaspecError`."""
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if chunk.get("error"):
            raise DeltaspecError(
                f"The server at {self.base_url} ended a stream from /v1/{endpoint} with an error "
                f"({server_says(line[6:].encode())}); the benchmark stops at a failed request."
            )
        if chunk.get("usage"):
            timing.prompt_tokens = chunk["usage"]["prompt_tokens"]
            timing.completion_tokens = chunk["usage"]["completion_tokens"]
            timing.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            piece = choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
            if piece:
                timing.chunk_times.append(time.perf_counter())
                timing.text += piece
            timing.finish_reason = choice.get("finish_reason") or timing.finish_reason
