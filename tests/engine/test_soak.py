"""A soak of the live server (loopback, embedded model, CPU): 32 streaming clients send several requests each,
with each drafter setting (the MTP one with a row budget smaller than the streams' drafts, which used to fail
every request in flight), and some clients hang up mid-stream. Nothing is lost, nothing gets a 5xx, and the KV
pages and state slots in /metrics are back to zero after the load."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest

from deltaspec.bench.local_server import local_server
from deltaspec.config.engine import EngineConfig

CLIENTS, REQUESTS_PER_CLIENT, MAX_TOKENS = 32, 2, 10
PROMPTS = ["def add(a, b):\n", "class Queue:\n", "import os\n\n\ndef main(", "# sort a list\n"]


def served_model(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/models")
    name = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()
    return name


def stream_completion(port: int, model: str, prompt: str, hang_up_after: int | None) -> dict:
    """One streaming completion over raw HTTP: its status, events, whether it ended with [DONE], and the
    finish reason; with `hang_up_after`, the client closes the connection after that many events."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.8, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    result = {"status": response.status, "events": 0, "done": False, "finish_reason": None, "error": None}
    if response.status != 200:
        result["error"] = response.read().decode()
        conn.close()
        return result
    for line in response:
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            result["done"] = True
            break
        event = json.loads(line[len("data: ") :])
        result["events"] += 1
        if "error" in event:
            result["error"] = event["error"]
        for choice in event.get("choices", []):
            result["finish_reason"] = choice.get("finish_reason") or result["finish_reason"]
        if hang_up_after is not None and result["events"] >= hang_up_after:
            break
    conn.close()
    return result


def gauges(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith(("deltaspec_kv_blocks_used", "deltaspec_state_slots_used", "deltaspec_num_requests"))
    }


@pytest.mark.parametrize(
    "speculative,options",
    [("none", {}), ("mtp", {"max_num_batched_tokens": 8, "draft_tokens": 3}), ("draft+ngram", {"draft_tokens": 4})],
)
def test_32_streaming_clients_lose_nothing_and_free_everything(tmp_path, speculative, options):
    config = EngineConfig.from_flat(
        dtype="float32", device="cpu", max_num_seqs=8, max_model_len=512, speculative=speculative, **options
    )
    with local_server(config, tmp_path / "requests.jsonl") as (url, _):
        port = urlparse(url).port
        model = served_model(port)

        def client(c: int) -> list[dict]:
            hang_up = 2 if c % 5 == 0 else None  # every fifth client hangs up mid-stream
            prompts = [PROMPTS[(c + r) % len(PROMPTS)] for r in range(REQUESTS_PER_CLIENT)]
            return [stream_completion(port, model, prompt, hang_up) for prompt in prompts]

        with ThreadPoolExecutor(CLIENTS) as pool:
            results = [(c, r) for c, rs in enumerate(pool.map(client, range(CLIENTS))) for r in rs]
        assert all(r["status"] == 200 and r["error"] is None for _, r in results), [r for _, r in results if r["error"]]
        finished = [r for c, r in results if c % 5]
        assert all(r["done"] and r["finish_reason"] in ("length", "stop") for r in finished)
        deadline = time.monotonic() + 20
        while (now := gauges(port)) and any(now.values()) and time.monotonic() < deadline:
            time.sleep(0.1)  # hung-up streams are aborted as their disconnects are noticed
        assert now == {key: 0.0 for key in now} and len(now) == 4
        logged = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
        assert len(logged) == CLIENTS * REQUESTS_PER_CLIENT
