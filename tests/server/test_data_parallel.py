"""`deltaspec serve --data-parallel-size 2` on the CPU, driven through its front door by the `openai` client: a
follow-up lands on the replica that served its prefix and resumes from its checkpoint (cached tokens > 0), an
unrelated prompt goes to the other replica, streams and errors pass through unchanged, /health and /metrics report
each replica, and a replica that dies stops the server with one sentence. A front door whose replica does not
answer gives a 503 of one sentence."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest
import uvicorn

from deltaspec.config.engine import EngineConfig
from deltaspec.config.server import ServerConfig
from deltaspec.errors import DeltaspecError
from deltaspec.server.app import bind_socket
from deltaspec.server.data_parallel.front_door import build_front_door
from deltaspec.server.data_parallel.processes import replica_environments
from deltaspec.server.data_parallel.ray_serve import serve_on_ray

KEY = "dp-key"
MODEL = "tiny"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
SYSTEM = (
    "You are a careful assistant who answers questions about Python programming with short, correct code examples, "
    "and explains each step of the code in one plain sentence."
)
QUESTION = "Write a function that adds two numbers."
SERVING = re.compile(r"serving 'tiny' at http://127\.0\.0\.1:(\d+)/v1 \(2 data-parallel replicas\)")
REPLICA = re.compile(r"deltaspec: replica (\d) \(pid (\d+)\) at http://127\.0\.0\.1:\d+/v1")


class DataParallelServer:
    """A `deltaspec serve -dp 2` process, its front door's port and its replicas' pids."""

    def __init__(self) -> None:
        command = [sys.executable, "-m", "deltaspec.cli", "serve", "-dp", "2", "--port", "0", "--device", "cpu"]
        command += ["--dtype", "float32", "--max-num-seqs", "2", "--max-model-len", "1024", "--disable-log-stats"]
        command += ["--api-key", KEY, "--served-model-name", MODEL]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.pids: dict[int, int] = {}
        for line in self.process.stdout:
            if match := REPLICA.match(line):
                self.pids[int(match.group(1))] = int(match.group(2))
            if match := SERVING.search(line):
                self.port = int(match.group(1))
                return
        raise AssertionError(f"serve -dp 2 did not start: {self.process.stderr.read()[-3000:]}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=KEY, max_retries=0, timeout=120)

    def get(self, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def server():
    live = DataParallelServer()
    yield live
    live.stop()


def ask(client: openai.OpenAI, messages: list[dict]) -> tuple[int, object]:
    """(the replica that answered, the completion) of a short greedy chat."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0.0, extra_body=NO_THINK
    )
    return int(raw.headers["x-deltaspec-replica"]), raw.parse()


def test_a_follow_up_lands_on_the_replica_holding_its_prefix(server):
    client = server.client()
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    first, reply = ask(client, history)
    other, _ = ask(client, [{"role": "user", "content": "Name three colours of the rainbow, one per line, please."}])
    history += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "Why?"}]
    again, follow_up = ask(client, history)
    assert other != first and again == first
    assert follow_up.usage.prompt_tokens_details.cached_tokens > 0


def test_streams_pass_through(server):
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**NO_THINK, "ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens == 6


def test_errors_pass_through_with_the_replicas_sentence(server):
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().completions.create(model=MODEL, prompt="def f(", max_tokens=-3)
    assert refused.value.body["message"] == "max_tokens must be at least 1, got -3."
    wrong_key = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert [m.id for m in server.client().models.list()] == [MODEL]


def test_health_and_metrics_report_each_replica(server):
    status, body = server.get("/health")
    assert status == 200 and [r["status"] for r in json.loads(body)["replicas"]] == ["ok", "ok"]
    status, text = server.get("/metrics")
    assert status == 200
    for replica in ("0", "1"):
        assert f'deltaspec_router_requests_in_flight{{replica="{replica}"}} 0.0' in text
        assert f'deltaspec_num_requests_running{{replica="{replica}"}}' in text
    routed = re.findall(r'deltaspec_router_requests_total\{replica="(\d)",route="(\w+)"\} (\d+)', text)
    assert sum(int(n) for _, route, n in routed if route == "prefix") >= 1


def test_a_client_that_leaves_frees_its_sequence_on_the_replica(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": MODEL, "prompt": "def f(", "max_tokens": 900, "ignore_eos": True, "stream": True}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    conn.close()
    deadline = time.monotonic() + 10
    while True:
        text = server.get("/metrics")[1]
        busy = re.findall(
            r"^(?:deltaspec_router_requests_in_flight|deltaspec_num_requests_running)\{.*\} (\S+)$", text, re.M
        )
        if len(busy) == 4 and all(float(value) == 0 for value in busy):
            break
        assert time.monotonic() < deadline, busy
        time.sleep(0.2)


def test_a_dead_replica_stops_the_server(server):
    """Runs last: it ends the module's server."""
    os.kill(server.pids[1], signal.SIGKILL)
    assert server.process.wait(timeout=60) == 1
    assert "deltaspec: data-parallel replica 1 exited (code -9); the server stops." in server.process.stderr.read()


def test_a_replica_that_does_not_answer_gets_a_503():
    closed = bind_socket("127.0.0.1", 0)
    dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    app = build_front_door([dead_url], ServerConfig())
    sock = bind_socket("127.0.0.1", 0)
    door = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=door.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not door.started:
        time.sleep(0.02)
    try:
        answers = [post(sock.getsockname()[1], "/v1/completions", {"prompt": "x", "max_tokens": 1}) for _ in range(2)]
    finally:
        door.should_exit = True
        thread.join(timeout=15)
        sock.close()
    assert answers[0] == (
        503,
        f"Data-parallel replica 0 at {dead_url} is not answering (ConnectError); this request was not served, try "
        "again.",
    )
    assert answers[1] == (503, "No data-parallel replica is answering; the server cannot serve requests now.")


def post(port: int, path: str, body: dict) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())["error"]["message"]


def test_each_replica_gets_its_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0")
    two_gpus = EngineConfig.from_flat(device="cuda", tensor_parallel_size=2)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in replica_environments(two_gpus, 2)] == ["4,5", "6,7"]
    with pytest.raises(
        DeltaspecError, match=r"3 x 2 GPUs per replica \(tensor x pipeline parallel\) needs 6 GPUs, but"
    ):
        replica_environments(two_gpus, 3)
    stages = EngineConfig.from_flat(device="cuda", pipeline_parallel_size=2)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in replica_environments(stages, 2)] == ["4,5", "6,7"]
    with pytest.raises(DeltaspecError, match=r"needs 8 GPUs, but this process sees 5; give fewer replicas"):
        replica_environments(stages.with_settings(tensor_parallel_size=2), 2)
    with pytest.raises(DeltaspecError, match=r"^--device cuda:1 names one GPU, but --data-parallel-size 2 gives"):
        replica_environments(EngineConfig.from_flat(device="cuda:1"), 2)


def test_user_errors_are_one_sentence():
    with pytest.raises(DeltaspecError, match=r"^--data-parallel-size must be 1 or more, got 0\.$"):
        ServerConfig(data_parallel_size=0)
    with pytest.raises(DeltaspecError, match=r"^--data-parallel-backend must be mp or ray, got 'k8s'\.$"):
        ServerConfig(data_parallel_backend="k8s")


def test_the_ray_backend_says_when_ray_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, installed or not
    config = ServerConfig(data_parallel_size=2, data_parallel_backend="ray")
    with pytest.raises(DeltaspecError, match=r"^--data-parallel-backend ray needs Ray Serve, which is not installed;"):
        serve_on_ray(EngineConfig(), config)
