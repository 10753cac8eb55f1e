"""Running `deltaspec serve` the way a vLLM or llama-server user expects: the start-up summary, the periodic
throughput line, request ids on error lines and in the access log, which key guards which endpoint, token-id
completions from a model without a tokenizer (and vLLM's `return_token_ids`), and the default completion length.
Live servers on free ports, driven by the real `openai` client and raw HTTP; one real `deltaspec serve` process."""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest

from deltaspec.config.engine import EngineConfig
from deltaspec.config.server import ServerConfig
from deltaspec.engine.async_engine import RequestDelta
from deltaspec.engine.engine import Engine
from deltaspec.errors import DeltaspecError
from deltaspec.server.auth import API_KEY_ENV
from deltaspec.server.logs import StatsSnapshot, memory, startup_summary, stats_line
from deltaspec.server.metrics import TokenTally
from tests.server.live import KEY, USER, Live, ScriptedOutput, serving
from tests.tiny_models import write_checkpoint

MODEL = "tiny"
NAME = "deltaspec-default"  # the embedded model's served name
STATS_S = 0.2
THROUGHPUT = re.compile(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s")


def send(
    port: int, method: str, path: str, body: dict | None = None, headers: dict | None = None
) -> tuple[int, dict[str, str], dict | str]:
    """One raw HTTP request: status, response headers (lower-case names) and the JSON (or text) body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json", **(headers or {})} if body is not None else headers or {}
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    response = conn.getresponse()
    raw = response.read().decode()
    conn.close()
    found = {name.lower(): value for name, value in response.getheaders()}
    try:
        return response.status, found, json.loads(raw)
    except ValueError:
        return response.status, found, raw


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def summary_rows(lines: list[str]) -> dict[str, str]:
    return {name: value.strip() for name, value in (line.split(":", 1) for line in lines)}


def messages(caplog, fragment: str = "") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "deltaspec.server" and fragment in r.getMessage()]


def wait_for(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return found


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    log = tmp_path_factory.mktemp("ops") / "requests.jsonl"
    with serving(log, api_key=KEY, served_model_name=MODEL, access_log=True, log_stats_interval=STATS_S) as server:
        yield server


# ---- start-up summary ----


def test_startup_summary_describes_the_engine_that_was_built():
    engine = Engine(
        EngineConfig.from_flat(dtype="float32", device="cpu", max_num_seqs=2, max_model_len=512), progress=False
    )
    rows = summary_rows(startup_summary(engine, "served-name"))
    pages = engine.cache.kv.allocator.num_blocks
    assert pages == 2 * 512 // 16
    assert rows == {
        "model": "'served-name' (embedded default model)",
        "format": "safetensors bfloat16",
        "device": "cpu, dtype float32, GDN state dtype float32, KV cache dtype float32",
        "weights": memory(engine.plan.weights),
        "KV cache": f"{memory(engine.cache.kv.bytes())}, {pages * 16} tokens ({pages} pages x 16)",
        "GDN states": f"{memory(engine.cache.gdn.bytes())}, 9 slots (2 streams, 6 prefix checkpoints, 1 scratch)",
        "streams": "2 x 512 tokens",
        "drafter": "none",
    }
    assert engine.plan.weights > 0 and engine.cache.kv.bytes() > 0


def test_startup_summary_of_random_weights_with_a_drafter():
    shape = (("num_hidden_layers", 4), ("hidden_size", 64), ("intermediate_size", 128), ("vocab_size", 8192))
    config = EngineConfig.from_flat(
        random_weights=True,
        shape="qwen3.5-27b",
        shape_overrides=shape,
        speculative="ngram",
        draft_tokens=2,
        dtype="float32",
        device="cpu",
        max_model_len=256,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    rows = summary_rows(startup_summary(Engine(config, progress=False), "m"))
    assert rows["model"] == "'m' (random weights, shape qwen3.5-27b)"
    assert rows["format"] == "random weights"
    assert rows["GDN states"].endswith("2 slots (1 streams, 0 prefix checkpoints, 1 scratch)")
    assert rows["streams"] == "1 x 256 tokens"
    assert rows["drafter"].startswith("ngram, up to 2 draft tokens, ")


# ---- the throughput line ----


def usage(steps: int, running: int = 0, waiting: int = 0, kv_used: int = 0, kv_total: int = 100) -> dict:
    return {
        "steps": steps,
        "running": running,
        "waiting": waiting,
        "kv_blocks_used": kv_used,
        "kv_blocks_total": kv_total,
    }


def test_stats_line_is_vllms_line_over_the_interval():
    before = StatsSnapshot(100.0, TokenTally(prompt_tokens=1000, generated_tokens=7), usage(steps=5))
    tally = TokenTally(
        prompt_tokens=1300,
        generated_tokens=57,
        finished_prompt_tokens=200,
        cached_tokens=50,
        spec_rounds=10,
        drafted_tokens=40,
        accepted_tokens=20,
    )
    after = StatsSnapshot(102.0, tally, usage(steps=9, running=2, waiting=1, kv_used=25))
    assert stats_line(before, after, prefix_caching=True) == (
        "Avg prompt throughput: 150.0 tokens/s, Avg generation throughput: 25.0 tokens/s, Running: 2 seqs, "
        "Waiting: 1 seqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%, "
        "Draft acceptance rate: 50.0% (mean acceptance length 3.00)"
    )
    assert "Prefix cache" not in stats_line(before, after, prefix_caching=False)
    plain = StatsSnapshot(102.0, replace(tally, drafted_tokens=0, finished_prompt_tokens=0), after.usage)
    assert stats_line(before, plain, prefix_caching=True).endswith("KV cache usage: 25.0%")
    assert stats_line(after, replace(after, time=112.0), prefix_caching=True) is None  # nothing happened
    busy = replace(after, time=112.0, usage=usage(steps=10, running=1))
    assert stats_line(after, busy, prefix_caching=True).startswith("Avg prompt throughput: 0.0 tokens/s")


def test_token_tally_counts_each_samples_deltas():
    tally = TokenTally()

    def delta(tokens: list[int], finished: bool = False, metrics: dict | None = None) -> RequestDelta:
        return RequestDelta("r-0", tokens, None, 30, finished, "length" if finished else None, metrics=metrics or {})

    tally.add(delta([5, 6]), started=False)  # the prompt is done: its first tokens came
    tally.add(delta([7]), started=True)
    final = {"num_cached_tokens": 16, "spec_rounds": 2, "spec_accepted_tokens": 3, "drafted_at": [2, 2, 1]}
    tally.add(delta([8], finished=True, metrics=final), started=True)
    tally.add(delta([], finished=True, metrics={"num_cached_tokens": 0}), started=False)  # aborted while waiting
    assert tally == TokenTally(
        prompt_tokens=30,
        generated_tokens=4,
        finished_prompt_tokens=30,
        cached_tokens=16,
        spec_rounds=2,
        drafted_tokens=5,
        accepted_tokens=3,
    )


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan")])
def test_the_throughput_interval_must_be_positive(interval):
    with pytest.raises(DeltaspecError, match=r"^--log-stats-interval must be more than 0 seconds, got .+; use --dis"):
        ServerConfig(log_stats_interval=interval)


def test_the_throughput_line_is_logged_while_a_request_runs_and_not_when_idle(live, caplog):
    caplog.set_level(logging.INFO, logger="deltaspec.server")
    client = live.client()
    stream = client.completions.create(
        model=MODEL, prompt="def f(x):", max_tokens=1500, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    lines, rates = [], []  # the throughput lines while the request runs, and their (prompt, generation) tokens/s
    for _ in stream:
        lines = [m for m in messages(caplog, "Running: 1 seqs") if THROUGHPUT.search(m)]
        rates = [tuple(map(float, THROUGHPUT.search(m).groups())) for m in lines]
        if sum(generation > 0 for _, generation in rates) >= 2:
            break
    stream.close()
    assert sum(generation > 0 for _, generation in rates) >= 2, messages(caplog)
    # the prompt's tokens are counted with its first generated ones: the line that first reports generated tokens
    # reports the prompt's, and no other line does
    first = next(i for i, (_, generation) in enumerate(rates) if generation > 0)
    assert rates[first][0] > 0 and all(prompt == 0 for i, (prompt, _) in enumerate(rates) if i != first), lines
    running = lines[first]
    assert re.search(r"Waiting: 0 seqs, KV cache usage: [\d.]+%", running)
    assert float(re.search(r"KV cache usage: ([\d.]+)%", running).group(1)) > 0
    wait_for(lambda: live.async_engine.usage["running"] == 0)
    time.sleep(3 * STATS_S)  # the line after the abort
    quiet = len(messages(caplog, "Avg prompt throughput"))
    time.sleep(3 * STATS_S)
    assert len(messages(caplog, "Avg prompt throughput")) == quiet  # idle: no lines


# ---- request ids, error lines and the access log ----


def test_error_responses_are_logged_with_the_request_id_they_answer(live, caplog):
    caplog.set_level(logging.INFO, logger="deltaspec.server")
    body = {"prompt": "x", "echo": True}
    status, headers, reply = send(live.port, "POST", "/v1/completions", body, {**bearer(KEY), "X-Request-Id": "abc-7"})
    assert status == 400 and headers["x-request-id"] == "abc-7"
    assert f"request abc-7: 400 {reply['error']['message']}" in messages(caplog)
    status, headers, _ = send(live.port, "GET", "/v1/nowhere", headers={"X-Request-Id": "not a token"})
    generated = headers["x-request-id"]
    assert status == 404 and re.fullmatch(r"[0-9a-f]{32}", generated)
    assert any(m.startswith(f"request {generated}: 404 ") for m in messages(caplog))
    status, headers, _ = send(live.port, "GET", "/v1/models", headers={"X-Request-Id": "no-key"})
    assert status == 401 and any(m.startswith("request no-key: 401 The API key is missing") for m in messages(caplog))
    ok = send(live.port, "GET", "/v1/models", headers={**bearer(KEY), "X-Request-Id": "x" * 129})
    assert ok[0] == 200 and re.fullmatch(r"[0-9a-f]{32}", ok[1]["x-request-id"])  # too long: a new id
    assert not any(m.startswith(f"request {ok[1]['x-request-id']}:") for m in messages(caplog))  # no error, no line


def test_engine_failures_and_unexpected_errors_are_logged_with_the_request_id(live, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="deltaspec.server")
    failing = ScriptedOutput(live.tokenizer.encode("abc"), finish_reason="error", error="RuntimeError: boom")
    monkeypatch.setattr(live.async_engine, "add_request", failing)
    headers = {**bearer(KEY), "X-Request-Id": "streamed-1"}
    status, _, events = send(live.port, "POST", "/v1/completions", {"prompt": "x", "stream": True}, headers)
    assert status == 200 and "RuntimeError: boom" in events
    failed = wait_for(  # logged when the stream has ended
        lambda: [r for r in caplog.records if r.getMessage().startswith("request streamed-1: sample cmpl-")]
    )
    assert [r.levelno for r in failed] == [logging.ERROR]
    assert failed[0].getMessage().endswith("failed in the engine: RuntimeError: boom")
    headers["X-Request-Id"] = "whole-1"
    status, _, reply = send(live.port, "POST", "/v1/chat/completions", {"messages": USER}, headers)
    assert status == 500
    assert any(m.startswith("request whole-1: sample chatcmpl-") for m in messages(caplog, "RuntimeError: boom"))
    assert f"request whole-1: 500 {reply['error']['message']}" in messages(caplog)

    def explode(*args, **kwargs):
        raise ZeroDivisionError("unexpected")

    monkeypatch.setattr(live.async_engine, "add_request", explode)
    headers["X-Request-Id"] = "explode-1"
    status, answered, reply = send(live.port, "POST", "/v1/completions", {"prompt": "x"}, headers)
    assert status == 500 and answered["x-request-id"] == "explode-1" and reply["error"]["type"] == "server_error"
    [record] = [r for r in caplog.records if r.getMessage().startswith("request explode-1: 500 ")]
    assert record.levelno == logging.ERROR and record.exc_info[0] is ZeroDivisionError


def test_access_log_has_one_line_per_request(live, caplog):
    caplog.set_level(logging.INFO, logger="deltaspec.server")
    assert send(live.port, "GET", "/health", headers={"X-Request-Id": "health-1"})[0] == 200
    headers = {**bearer(KEY), "X-Request-Id": "stream-2"}
    body = {"prompt": "def f(x):", "max_tokens": 4, "stream": True}
    assert send(live.port, "POST", "/v1/completions", body, headers)[0] == 200
    [health] = wait_for(lambda: messages(caplog, "request_id=health-1"))  # logged once the response was sent
    assert re.fullmatch(r'127\.0\.0\.1:\d+ "GET /health" 200 [\d.]+ ms request_id=health-1', health)
    [streamed] = wait_for(lambda: messages(caplog, "request_id=stream-2"))
    assert re.fullmatch(r'127\.0\.0\.1:\d+ "POST /v1/completions" 200 [\d.]+ ms request_id=stream-2', streamed)


# ---- keys ----


def test_api_key_guards_v1_only_and_metrics_stay_open(live):
    with pytest.raises(openai.AuthenticationError):
        live.client(api_key="wrong").models.list()
    assert [m.id for m in live.client().models.list().data] == [MODEL]
    assert send(live.port, "GET", "/v1/models")[0] == 401
    for path in ("/metrics", "/health"):
        assert send(live.port, "GET", path)[0] == 200


def test_metrics_key_guards_metrics_and_health(tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-the-environment")  # --api-key wins over the environment
    with serving(tmp_path / "requests.jsonl", api_key=KEY, metrics_key="scrape") as server:
        for path in ("/metrics", "/health"):
            status, _, body = send(server.port, "GET", path)
            assert status == 401 and body["error"]["message"].startswith("The metrics key is missing or wrong;")
            assert send(server.port, "GET", path, headers=bearer(KEY))[0] == 401
            assert send(server.port, "GET", path, headers=bearer("scrape"))[0] == 200
        assert send(server.port, "GET", "/v1/models", headers=bearer("scrape"))[0] == 401
        assert send(server.port, "GET", "/v1/models", headers=bearer("from-the-environment"))[0] == 401
        assert server.client().models.list().data


# ---- token ids ----


def test_a_checkpoint_without_tokenizer_serves_token_ids(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "ckpt", "qwen3_5", tokenizer=False)
    config = EngineConfig.from_flat(
        model=str(checkpoint), dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256
    )
    with serving(tmp_path / "requests.jsonl", config) as server:
        rows = summary_rows(startup_summary(server.engine, "ckpt"))
        assert rows["model"] == f"'ckpt' (checkpoint {checkpoint})"
        assert rows["format"] == "safetensors float32, no tokenizer (token-id prompts on /v1/completions)"
        client = server.client()
        out = client.completions.create(model="ckpt", prompt=[1, 2, 3], max_tokens=5, temperature=0)
        [choice] = out.choices
        ids = choice.model_extra["token_ids"]
        assert choice.text == "" and len(ids) == 5 == out.usage.completion_tokens and choice.finish_reason == "length"
        assert "prompt_token_ids" not in choice.model_extra
        chunks = list(
            client.completions.create(model="ckpt", prompt=[1, 2, 3], max_tokens=5, temperature=0, stream=True)
        )
        assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ids
        assert all(c.choices[0].text == "" for c in chunks) and chunks[-1].choices[0].finish_reason == "length"
        two = client.completions.create(
            model="ckpt", prompt=[[1, 2, 3], [4, 5]], max_tokens=5, temperature=0, extra_body={"return_token_ids": True}
        )
        assert [c.model_extra["prompt_token_ids"] for c in two.choices] == [[1, 2, 3], [4, 5]]
        assert two.choices[0].model_extra["token_ids"] == ids and len(two.choices[1].model_extra["token_ids"]) == 5
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            client.chat.completions.create(model="ckpt", messages=USER, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            client.completions.create(model="ckpt", prompt="text", max_tokens=2)


def test_return_token_ids_adds_the_prompt_and_output_ids(live):
    client, prompt = live.client(), "def add(a, b):"
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    [choice] = out.choices
    assert choice.model_extra["prompt_token_ids"] == live.tokenizer.encode(prompt)
    ids = choice.model_extra["token_ids"]
    assert len(ids) == out.usage.completion_tokens and live.tokenizer.decode(ids) == choice.text
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body={"return_token_ids": True}
        )
    )
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == live.tokenizer.encode(prompt)
    assert not any("prompt_token_ids" in c.choices[0].model_extra for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []] == ids
    _, _, plain = send(live.port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2}, bearer(KEY))
    assert not {"token_ids", "prompt_token_ids"} & set(plain["choices"][0])


# ---- the default length ----


def test_a_completion_without_max_tokens_generates_16_tokens(live):
    body = {"prompt": "def f(x):", "ignore_eos": True, "temperature": 0}
    _, _, out = send(live.port, "POST", "/v1/completions", body, bearer(KEY))
    assert out["usage"]["completion_tokens"] == 16 and out["choices"][0]["finish_reason"] == "length"


def test_without_max_tokens_near_the_end_of_the_context_and_on_chat(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="deltaspec.server")
    monkeypatch.setenv(API_KEY_ENV, "env-key")  # the key from the environment, as VLLM_API_KEY
    config = EngineConfig.from_flat(dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256)
    with serving(tmp_path / "requests.jsonl", config, disable_log_stats=True, log_stats_interval=STATS_S) as server:
        with pytest.raises(openai.AuthenticationError):
            server.client().models.list()
        client = server.client(api_key="env-key")
        time.sleep(3 * STATS_S)  # the module's server logs its last line about earlier tests' requests
        caplog.clear()
        near_end = client.completions.create(model=NAME, prompt=[5] * 250, extra_body={"ignore_eos": True})
        assert near_end.usage.completion_tokens == 6  # what the context leaves, less than 16
        out = client.chat.completions.create(
            model=NAME,
            messages=USER,
            extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
        )
        assert out.usage.completion_tokens == 256 - out.usage.prompt_tokens  # chat: the rest of the context
        time.sleep(3 * STATS_S)
    assert not messages(caplog, "Avg prompt throughput")  # --disable-log-stats


# ---- the request log on a full disk ----


def test_a_full_disk_under_the_request_log_fails_no_request(caplog):
    """/dev/full opens like a file and fails every write with ENOSPC: each request still gets its 200 and its
    tokens, and the log says once that records are dropped."""
    with caplog.at_level(logging.WARNING, logger="deltaspec.server"), serving(Path("/dev/full")) as server:
        client = server.client()
        for _ in range(2):
            chat = client.chat.completions.create(
                model=NAME, messages=USER, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
            )
            assert chat.usage.completion_tokens == 4 and chat.choices[0].finish_reason == "length"
            body = {"prompt": "def f(", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            status, _, body = send(server.port, "POST", "/v1/completions", body)
            assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    dropped = messages(caplog, "Cannot write the request log /dev/full (No space left on device)")
    assert len(dropped) == 1, messages(caplog)


# ---- a real `deltaspec serve` process ----


def test_serve_logs_its_summary_throughput_and_access_lines(tmp_path):
    command = [sys.executable, "-m", "deltaspec.cli", "serve", "--device", "cpu", "--dtype", "float32", "--port", "0"]
    command += ["--max-streams", "2", "--ctx", "1024", "--log-stats-interval", "0.3", "--access-log"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    try:
        line = server.stdout.readline()
        port = int(re.search(r"serving 'deltaspec-default' at http://127\.0\.0\.1:(\d+)/v1", line).group(1))
        body = {"prompt": "def f(x):", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
        status, headers, out = send(port, "POST", "/v1/completions", body, {"X-Request-Id": "sub-1"})
        assert status == 200 and headers["x-request-id"] == "sub-1" and out["usage"]["completion_tokens"] == 300
        time.sleep(1.0)  # a throughput line after the request
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
        rest, log = server.communicate(timeout=30)
    assert rest.splitlines().count("deltaspec: shut down") == 1
    records = [re.sub(r"^INFO \d\d-\d\d \d\d:\d\d:\d\d deltaspec\.server: ", "", r) for r in log.splitlines()]
    rows = summary_rows(
        [r for r in records if re.match(r"(model|format|device|weights|KV cache|GDN states|streams|drafter):", r)]
    )
    assert rows["model"] == "'deltaspec-default' (embedded default model)"
    assert rows["format"] == "safetensors bfloat16"
    assert re.fullmatch(r"[\d.]+ [GM]iB, 2048 tokens \(128 pages x 16\)", rows["KV cache"])
    assert rows["GDN states"].endswith("9 slots (2 streams, 6 prefix checkpoints, 1 scratch)")
    assert (rows["streams"], rows["drafter"]) == ("2 x 1024 tokens", "none")
    throughput = [THROUGHPUT.search(r) for r in records if THROUGHPUT.search(r)]
    assert throughput and max(float(m.group(2)) for m in throughput) > 0, log
    assert any(
        re.fullmatch(r'127\.0\.0\.1:\d+ "POST /v1/completions" 200 [\d.]+ ms request_id=sub-1', r) for r in records
    )
