"""The live-server harness the server tests share: a `deltaspec serve` app of the embedded default model on a free
port (`serving`), its `Live` handle with the real `openai` client and raw HTTP, a scripted stand-in for the
engine's output (`ScriptedOutput`), and the request constants the tests send."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai

from deltaspec.config.engine import EngineConfig
from deltaspec.config.server import ServerConfig
from deltaspec.engine.async_engine import AsyncEngine, RequestDelta, RequestStream
from deltaspec.engine.engine import Engine
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.server.app import bind_socket, build_app, make_server

KEY = "test-key"
MODEL = "tiny"
CTX = 2048
MAX_SEQS = 4
USER = [{"role": "user", "content": "Write a function that adds two numbers."}]
JSON_WITH_KEY = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
THINK = {"chat_template_kwargs": {"enable_thinking": True}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]


@dataclass
class Live:
    url: str
    port: int
    engine: Engine
    async_engine: AsyncEngine
    log: Path

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict | None = None,
        key: str | None = KEY,
        content_type: str | None = "application/json",
    ) -> tuple[int, dict | str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Content-Type": content_type} if content_type is not None else {}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read().decode()
        conn.close()
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw

    def metrics(self) -> dict[str, float]:
        status, text = self.request("GET", "/metrics")
        assert status == 200
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }

    def log_records(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@contextmanager
def serving(log: Path, engine_config: EngineConfig | None = None, **server_config) -> Iterator[Live]:
    """A live server on a free port: of the embedded model (CTX tokens, MAX_SEQS streams) unless `engine_config`
    says otherwise."""
    engine = Engine(
        engine_config
        or EngineConfig.from_flat(dtype="float32", device="cpu", max_num_seqs=MAX_SEQS, max_model_len=CTX),
        progress=False,
    )
    async_engine = AsyncEngine(engine)
    async_engine.start()
    app = build_app(async_engine, ServerConfig(request_log=str(log), **server_config))
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = make_server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield Live(f"http://127.0.0.1:{port}", port, engine, async_engine, log)
    server.should_exit = True
    thread.join(timeout=15)
    async_engine.shutdown()
    sock.close()
    assert not thread.is_alive()


def one_sentence(message: str) -> bool:
    return bool(re.fullmatch(r"[^\n]+\.", message)) and not re.search(r"[.;] +[A-Z][a-z]+ [a-z]", message)


class ScriptedOutput:
    """Stands in for `AsyncEngine.add_request`: every sample 'generates' the same scripted tokens."""

    def __init__(self, token_ids: list[int], finish_reason: str = "stop", error: str | None = None) -> None:
        self.token_ids, self.finish_reason, self.error = token_ids, finish_reason, error

    def __call__(
        self, request_id: str, prompt, prompt_ids: list[int], params, history_len: int = 0, images=None
    ) -> RequestStream:
        stream = RequestStream(request_id)
        pieces = [self.token_ids[i : i + 2] for i in range(0, len(self.token_ids), 2)] or [[]]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            stream.queue.put_nowait(
                RequestDelta(
                    request_id,
                    piece,
                    None,
                    len(prompt_ids),
                    last,
                    self.finish_reason if last else None,
                    error=self.error if last else None,
                )
            )
        return stream
