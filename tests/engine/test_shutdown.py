"""SIGTERM under load: `deltaspec serve` (a real process, embedded model, CPU) stops admitting, lets the requests in
flight finish within its drain time, ends the rest with an OpenAI error (an error event and [DONE] on a stream, a
503 JSON body otherwise), logs every request, and exits 0."""

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

DRAIN_S = 2.0


def post(port: int, body: dict, started: threading.Event) -> dict:
    """A completion over raw HTTP; for a stream, the events up to [DONE] (`started` is set at the first one)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    out = {"status": response.status, "type": response.getheader("content-type"), "events": [], "done": False}
    if not body.get("stream"):
        started.set()
        out["body"] = json.loads(response.read())
        return out
    for line in response:
        line = line.decode().strip()
        if line == "data: [DONE]":
            out["done"] = True
        elif line.startswith("data: "):
            out["events"].append(json.loads(line[len("data: ") :]))
            started.set()
    return out


def test_sigterm_drains_in_flight_requests_and_exits_cleanly(tmp_path):
    log = tmp_path / "requests.jsonl"
    command = [sys.executable, "-m", "deltaspec.cli", "serve", "--device", "cpu", "--dtype", "float32"]
    command += ["--port", "0", "--max-streams", "4", "--shutdown-timeout", str(DRAIN_S), "--request-log", str(log)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    try:
        line = server.stdout.readline()
        port = int(re.search(r":(\d+)/v1", line).group(1))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/models")
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        long = {"model": model, "prompt": "def f(x):\n", "max_tokens": 3000, "ignore_eos": True, "temperature": 0.0}
        bodies = [{**long, "stream": True}, {**long, "stream": True}, long, {**long, "max_tokens": 4, "stream": True}]
        results: list[dict | None] = [None] * len(bodies)
        started = [threading.Event() for _ in bodies]

        def run(i: int) -> None:
            results[i] = post(port, bodies[i], started[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
        for thread in threads:
            thread.start()
        assert all(event.wait(60) for event in started[:2] + started[3:])  # the streams are under way
        time.sleep(0.3)
        server.send_signal(signal.SIGTERM)
        began = time.monotonic()
        assert server.wait(timeout=DRAIN_S + 20) == 0
        assert time.monotonic() - began < DRAIN_S + 15
        for thread in threads:
            thread.join(timeout=30)
        for stream in (results[0], results[1]):  # cut by the drain: an OpenAI error event, then [DONE]
            assert stream["status"] == 200 and stream["done"]
            assert "shutting down" in stream["events"][-1]["error"]["message"]
        assert results[2]["status"] == 503 and results[2]["type"].startswith("application/json")
        assert "shutting down" in results[2]["body"]["error"]["message"]
        short = results[3]  # finished within the drain time
        assert short["done"] and short["events"][-1]["choices"][0]["finish_reason"] == "length"
        assert len(log.read_text().splitlines()) == len(bodies)  # every request logged
    finally:
        if server.poll() is None:
            server.kill()
        server.communicate(timeout=30)
