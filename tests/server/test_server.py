"""`deltaspec serve` end to end: a live uvicorn server on a free port, driven by the real `openai` client
(and raw HTTP where the client would hide the wire format), with the embedded default model on CPU."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from deltaspec.cli import main
from deltaspec.config.engine import EngineConfig
from deltaspec.provenance import commit
from deltaspec.server.reasoning import split_reasoning
from tests.server.live import (
    CTX,
    JSON_WITH_KEY,
    KEY,
    MAX_SEQS,
    MODEL,
    NO_THINK,
    THINK,
    TOOLS,
    USER,
    Live,
    ScriptedOutput,
    one_sentence,
    serving,
)


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    log = tmp_path_factory.mktemp("server") / "requests.jsonl"
    with serving(log, api_key=KEY, served_model_name=MODEL, max_n=8) as server:
        yield server


def chat(live: Live, messages=USER, **kwargs):
    """A chat completion through the openai client: greedy and without the model's default penalty unless asked."""
    kwargs.setdefault("max_tokens", 16)
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("repetition_penalty", 1.0)
    extra = {
        k: kwargs.pop(k)
        for k in ("chat_template_kwargs", "vote", "top_k", "repetition_penalty", "stop_token_ids", "ignore_eos")
        if k in kwargs
    }
    return live.client().chat.completions.create(model=MODEL, messages=messages, extra_body=extra or None, **kwargs)


def complete(live: Live, prompt, **kwargs):
    """A completion through the openai client: greedy and without the model's default penalty unless asked."""
    kwargs.setdefault("max_tokens", 16)
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("repetition_penalty", 1.0)
    extra = {k: kwargs.pop(k) for k in ("stop_token_ids", "ignore_eos", "repetition_penalty", "vote") if k in kwargs}
    return live.client().completions.create(model=MODEL, prompt=prompt, extra_body=extra or None, **kwargs)


def rendered(live: Live, messages=USER, **kwargs) -> str:
    return live.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)


def test_health_models_and_api_key(live):
    assert live.request("GET", "/health", key=None) == (200, {"status": "ok"})
    models = live.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        live.client(api_key="wrong").models.list()
    status, body = live.request("GET", "/v1/models", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert one_sentence(body["error"]["message"])
    assert live.request("GET", "/metrics", key=None)[0] == 200  # open to scrapers without --metrics-key
    status, body = live.request("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2}, key="nope")
    assert status == 401
    assert live.request("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2})[0] == 200


def test_chat_matches_a_completion_of_the_rendered_prompt(live):
    out = chat(live, max_tokens=24, **NO_THINK)
    prompt = rendered(live, enable_thinking=False)
    raw = complete(live, prompt, max_tokens=24)
    [choice] = out.choices
    assert out.model == MODEL and out.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == raw.choices[0].text and choice.message.content
    assert choice.message.reasoning_content is None
    assert choice.finish_reason == raw.choices[0].finish_reason
    assert out.usage.prompt_tokens == len(live.tokenizer.encode(prompt)) == raw.usage.prompt_tokens
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.completion_tokens == 24 or choice.finish_reason == "stop"


def test_thinking_on_gives_reasoning_content(live):
    prompt = rendered(live, enable_thinking=True)
    assert prompt.endswith("<think>\n")
    out = chat(live, max_tokens=20, **THINK)
    raw = complete(live, prompt, max_tokens=20).choices[0].text
    reasoning, content = split_reasoning(raw, True)
    message = out.choices[0].message
    assert message.reasoning_content == reasoning and reasoning
    assert message.content == content
    off = chat(live, max_tokens=20, **NO_THINK).choices[0].message
    assert off.reasoning_content is None and off.content
    default = chat(live, max_tokens=20).choices[0].message  # the embedded template's default: no thinking
    assert (default.reasoning_content, default.content) == (None, off.content)


def stream_text(chunks) -> dict:
    out = {"content": "", "reasoning": "", "roles": [], "finish": {}, "usage": None, "chunks": 0}
    for chunk in chunks:
        out["chunks"] += 1
        if chunk.usage is not None:
            assert chunk.choices == []
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if delta.role:
                out["roles"].append((choice.index, delta.role))
            out["content"] += delta.content or ""
            out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            if choice.finish_reason is not None:
                out["finish"][choice.index] = choice.finish_reason
    return out


@pytest.mark.parametrize("thinking", [False, True])
def test_streaming_equals_the_non_streamed_output(live, thinking):
    options = {"chat_template_kwargs": {"enable_thinking": thinking}}
    whole = chat(live, max_tokens=30, **options)
    streamed = stream_text(chat(live, max_tokens=30, stream=True, stream_options={"include_usage": True}, **options))
    message = whole.choices[0].message
    assert streamed["roles"] == [(0, "assistant")]
    assert streamed["content"] == message.content
    assert streamed["reasoning"] == (message.reasoning_content or "")
    assert streamed["finish"] == {0: whole.choices[0].finish_reason}
    assert streamed["usage"].completion_tokens == whole.usage.completion_tokens
    assert streamed["usage"].prompt_tokens == whole.usage.prompt_tokens
    assert streamed["chunks"] > 5


def test_completion_streaming_and_stop_strings(live):
    prompt = "def read_lines(path):\n"
    full = complete(live, prompt, max_tokens=40).choices[0].text
    stop = full[12:17]
    assert stop.strip() and full.index(stop) == 12
    cut = complete(live, prompt, max_tokens=40, stop=[stop])
    assert cut.choices[0].text == full[:12]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop
    chunks = list(complete(live, prompt, max_tokens=40, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[:12]
    assert chunks[-1].choices[0].finish_reason == "stop"
    plain = list(complete(live, prompt, max_tokens=40, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in plain if c.choices) == full
    assert plain[-1].choices == [] and plain[-1].usage.completion_tokens == 40


def test_completion_prompt_forms_and_stop_token_ids(live):
    ids = live.tokenizer.encode("def add(a, b):")
    by_text = complete(live, "def add(a, b):", max_tokens=6)
    by_ids = complete(live, ids, max_tokens=6)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = complete(live, [ids, ids[:3]], max_tokens=6, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == by_text.choices[0].text  # greedy
    assert many.usage.prompt_tokens == len(ids) + 3
    two = complete(live, ["def add(a, b):", "import os"], max_tokens=6)
    assert two.choices[0].text == by_text.choices[0].text and len(two.choices) == 2
    comma = live.tokenizer.encode(",")
    assert len(comma) == 1
    text = by_text.choices[0].text
    assert "," in text
    stopped = complete(live, "def add(a, b):", max_tokens=6, stop_token_ids=comma).choices[0]
    assert stopped.finish_reason == "stop" and stopped.model_extra["stop_reason"] == comma[0]
    assert text.startswith(stopped.text.removesuffix(",")) and stopped.text.count(",") <= 1


def test_n_samples_and_seeds(live):
    out = chat(live, n=3, temperature=1.0, seed=5, max_tokens=12, **NO_THINK)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) > 1
    assert 3 <= out.usage.completion_tokens <= 36
    again = chat(live, n=3, temperature=1.0, seed=5, max_tokens=12, **NO_THINK)
    assert [c.message.content for c in again.choices] == texts
    second = chat(live, temperature=1.0, seed=6, max_tokens=12, **NO_THINK)  # sample 1 is seeded seed + 1
    assert second.choices[0].message.content == texts[1]


def test_penalties_change_greedy_output(live):
    plain = complete(live, "def add(a, b):", max_tokens=24).choices[0].text
    assert plain.count(" b,") > 3  # greedy loops
    penalised = complete(live, "def add(a, b):", max_tokens=24, repetition_penalty=1.5).choices[0].text
    assert penalised != plain
    presence = complete(live, "def add(a, b):", max_tokens=24, presence_penalty=2.0, frequency_penalty=2.0)
    assert presence.choices[0].text != plain


def test_vote_stops_sampling_once_decided(live):
    # greedy samples agree; with MAX_SEQS slots the last samples wait, so they are aborted once decided
    n = MAX_SEQS + 2
    status, body = live.request(
        "POST",
        "/v1/chat/completions",
        {
            "messages": USER,
            "n": n,
            "vote": True,
            "temperature": 0,
            "repetition_penalty": 1.0,
            "max_tokens": 40,
            **NO_THINK,
        },
    )
    assert status == 200, body
    [choice] = body["choices"]
    greedy = chat(live, max_tokens=40, **NO_THINK).choices[0].message.content
    assert choice["index"] == 0 and choice["message"]["content"] == greedy
    vote = body["vote"]
    assert vote["winner"] is not None and vote["counts"] == {vote["winner"]: vote["samples_finished"]}
    assert vote["samples_aborted"] >= 1 and vote["samples_finished"] + vote["samples_aborted"] == n
    assert vote["samples_finished"] >= 3
    assert "vote" not in live.request("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2})[1]


def test_completion_vote_stops_sampling_once_decided(live):
    prompt = "def add(a, b):"
    n = MAX_SEQS + 2
    status, body = live.request(
        "POST",
        "/v1/completions",
        {"prompt": prompt, "n": n, "vote": True, "temperature": 0, "repetition_penalty": 1.0, "max_tokens": 40},
    )
    assert status == 200, body
    [choice] = body["choices"]
    greedy = complete(live, prompt, max_tokens=40).choices[0].text
    assert choice["index"] == 0 and choice["text"] == greedy
    vote = body["vote"]
    assert vote["winner"] is not None and vote["counts"] == {vote["winner"]: vote["samples_finished"]}
    assert vote["samples_aborted"] >= 1 and vote["samples_finished"] + vote["samples_aborted"] == n
    assert vote["samples_finished"] >= 3
    assert "vote" not in live.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2})[1]
    voted = complete(live, prompt, max_tokens=8, n=3, vote=True)  # the openai client, through extra_body
    assert len(voted.choices) == 1 and voted.model_extra["vote"]["samples_finished"] >= 2


def test_logprobs(live):
    out = chat(live, max_tokens=8, logprobs=True, top_logprobs=3, **NO_THINK)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for token in content:
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token and token.top_logprobs[0].logprob == token.logprob  # greedy
        assert token.bytes == list(token.token.encode()) and token.logprob <= 0
    plain = chat(live, max_tokens=8, **NO_THINK)
    assert plain.choices[0].logprobs is None
    comp = complete(live, "def add(a, b):", max_tokens=8, logprobs=2).choices[0]
    lp = comp.logprobs
    assert "".join(lp.tokens) == comp.text and len(lp.token_logprobs) == 8
    assert all(len(top) <= 2 and max(top.values()) == lp.token_logprobs[i] for i, top in enumerate(lp.top_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    streamed = list(complete(live, "def add(a, b):", max_tokens=8, logprobs=2, stream=True))
    assert [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in streamed if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_tools_reach_the_template(live):
    plain = chat(live, max_tokens=2, **NO_THINK).usage.prompt_tokens
    with_tools = chat(live, max_tokens=2, tools=TOOLS, **NO_THINK).usage.prompt_tokens
    assert with_tools == len(live.tokenizer.encode(rendered(live, tools=TOOLS, enable_thinking=False)))
    assert with_tools > plain
    assert chat(live, max_tokens=2, tools=TOOLS, tool_choice="none", **NO_THINK).usage.prompt_tokens == plain
    named = chat(
        live, max_tokens=2, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, **NO_THINK
    ).usage.prompt_tokens
    assert named == len(live.tokenizer.encode(rendered(live, tools=TOOLS[1:], enable_thinking=False)))
    history = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    out = chat(live, history, max_tokens=2, tools=TOOLS, **NO_THINK)
    template_history = history[:1] + [
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    expected = rendered(live, template_history, tools=TOOLS, enable_thinking=False)
    assert '{"name": "get_time", "arguments": {"city": "Oslo"}}' in expected
    assert out.usage.prompt_tokens == len(live.tokenizer.encode(expected))


TOOL_OUTPUT = (
    'The user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Paris"}}\n</tool_call>'
)


def test_tool_calls_are_parsed_from_the_output(live, monkeypatch):
    monkeypatch.setattr(live.async_engine, "add_request", ScriptedOutput(live.tokenizer.encode(TOOL_OUTPUT)))
    out = chat(live, tools=TOOLS, **THINK)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "The user wants the weather."
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "get_weather",
        {"city": "Paris"},
    )
    streamed = list(chat(live, tools=TOOLS, stream=True, **THINK))
    calls = [tc for c in streamed for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert calls[0].id.startswith("call_")
    assert (
        "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in streamed)
        == "The user wants the weather."
    )
    assert all(not c.choices[0].delta.content for c in streamed)
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    no_tools = chat(live, **THINK).choices[0]  # without tools the block stays text
    assert no_tools.finish_reason == "stop" and no_tools.message.content.startswith("<tool_call>")


def test_engine_failures_are_a_500_for_that_request_only(live, monkeypatch):
    failing = ScriptedOutput(live.tokenizer.encode("abc"), finish_reason="error", error="RuntimeError: boom")
    monkeypatch.setattr(live.async_engine, "add_request", failing)
    status, body = live.request("POST", "/v1/chat/completions", {"messages": USER})
    assert status == 500 and "RuntimeError: boom" in body["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps({"prompt": "x", "stream": True}),
        headers=JSON_WITH_KEY,
    )
    events = conn.getresponse().read().decode().split("\n\n")
    conn.close()
    assert json.loads(events[-3].removeprefix("data: "))["error"]["type"] == "server_error"
    assert events[-2] == "data: [DONE]"

    def explode(*args, **kwargs):
        raise ZeroDivisionError("unexpected")

    monkeypatch.setattr(live.async_engine, "add_request", explode)
    status, body = live.request("POST", "/v1/completions", {"prompt": "x"})
    assert status == 500 and body["error"]["type"] == "server_error" and one_sentence(body["error"]["message"])
    monkeypatch.undo()
    assert complete(live, "x", max_tokens=2).usage.completion_tokens >= 1  # the server goes on


LONG = "x " * (CTX + 10)
BAD = [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "'messages'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "'messages[0].content'"),
    ("/v1/chat/completions", {"messages": USER, "temperature": "hot"}, 400, "'temperature'"),
    ("/v1/chat/completions", {"messages": USER, "n": "many"}, 400, "'n'"),
    ("/v1/chat/completions", {"messages": []}, 400, "at least one message"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, 400, "max_tokens must be at least 1"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "exceeds the context"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": CTX}, 400, "exceeds the context"),
    ("/v1/chat/completions", {"messages": USER, "n": 9}, 400, "n must be at most 8"),
    ("/v1/chat/completions", {"messages": USER, "vote": True}, 400, "vote needs n of at least 2"),
    ("/v1/chat/completions", {"messages": USER, "vote": True, "n": 3, "stream": True}, 400, "vote cannot be"),
    ("/v1/chat/completions", {"messages": USER, "model": "gpt-4"}, 404, "'gpt-4' does not exist"),
    ("/v1/chat/completions", {"messages": USER, "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ("/v1/chat/completions", {"messages": USER, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "needs logprobs"),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}, 400, "has no tools"),
    (
        "/v1/chat/completions",
        {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        400,
        "'nope'",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "wizard"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "needs a content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
        400,
        "only text and image_url parts",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "image_url part without a URL",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,iVBO"}]}]},
        400,
        "takes no images",
    ),
    ("/v1/completions", {"prompt": []}, 400, "prompt must not be empty"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo is not supported"),
    ("/v1/completions", {"prompt": [10**6]}, 400, "Prompt token ids must lie in"),
    ("/v1/completions", {"prompt": "x", "model": "other"}, 404, "'other' does not exist"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop must be"),
    ("/v1/nowhere", {"prompt": "x"}, 404, "/v1/nowhere"),
]


def test_bad_requests_get_one_clear_sentence(live):
    for path, body, status, fragment in BAD:
        got, reply = live.request("POST", path, body)
        assert got == status, (body, reply)
        error = reply["error"]
        assert fragment in error["message"], (body, error)
        assert one_sentence(error["message"]), error["message"]
        assert set(error) == {"message", "type", "param", "code"}
    assert live.request("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 1})[0] == 200  # no model


def test_concurrent_clients_match_their_solo_runs(live):
    prompts = [f"def function_{i}(x):" if i % 2 else f"Write a function number {i}." for i in range(16)]

    def run(i: int) -> str:
        if i % 2:
            return complete(live, prompts[i], max_tokens=10).choices[0].text
        return (
            chat(live, [{"role": "user", "content": prompts[i]}], max_tokens=10, **NO_THINK).choices[0].message.content
        )

    solo = [run(i) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, range(16)))
    assert together == solo


def wait_until_idle(live: Live, timeout: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = live.metrics()
        if (
            metrics["deltaspec_num_requests_running"] == 0
            and metrics["deltaspec_kv_blocks_used"] == 0
            and metrics["deltaspec_num_requests_waiting"] == 0
        ):
            return metrics
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)


def test_a_client_that_disconnects_frees_its_sequence(live):
    body = {"messages": USER, "max_tokens": CTX - 100, "ignore_eos": True, "temperature": 0, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=JSON_WITH_KEY)
    response = conn.getresponse()
    first = response.readline()
    assert first.startswith(b"data: ")
    request_id = json.loads(first[6:])["id"]
    for _ in range(3):  # a few content chunks
        assert response.readline() == b"\n"
        assert response.readline().startswith(b"data: ")
    metrics = live.metrics()
    assert metrics["deltaspec_num_requests_running"] == 1 and metrics["deltaspec_kv_blocks_used"] > 0
    conn.sock.close()
    conn.close()
    wait_until_idle(live)
    # a non-streamed request whose client leaves before the answer
    body["stream"] = False
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=JSON_WITH_KEY)
    deadline = time.monotonic() + 5
    while live.metrics()["deltaspec_num_requests_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    conn.sock.close()
    conn.close()
    wait_until_idle(live)
    deadline = time.monotonic() + 5
    while not any(r["request_id"] == request_id for r in live.log_records()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    record = next(r for r in live.log_records() if r["request_id"] == request_id)
    assert record["finish_reason"] == "abort" and 0 < record["generated_tokens"] < CTX - 100
    aborted = [r for r in live.log_records() if r["finish_reason"] == "abort"]
    assert len(aborted) >= 2


def test_metrics_and_request_log(live):
    out = chat(live, max_tokens=5, n=2, temperature=0.5, seed=1, ignore_eos=True, **NO_THINK)
    complete(live, "import", max_tokens=3, ignore_eos=True)
    metrics = wait_until_idle(live)
    assert metrics['deltaspec_requests_total{endpoint="chat",finish_reason="length"}'] >= 1
    assert metrics['deltaspec_requests_total{endpoint="completions",finish_reason="length"}'] >= 1
    assert metrics["deltaspec_prompt_tokens_total"] >= out.usage.prompt_tokens
    assert metrics["deltaspec_generation_tokens_total"] >= out.usage.completion_tokens
    assert metrics["deltaspec_time_to_first_token_seconds_count"] >= 2
    assert metrics["deltaspec_time_per_output_token_seconds_count"] >= 2
    assert metrics["deltaspec_kv_blocks_total"] == live.engine.usage()["kv_blocks_total"] > 0
    assert metrics["deltaspec_state_slots_total"] == MAX_SEQS and metrics["deltaspec_state_slots_used"] == 0
    assert metrics["deltaspec_engine_steps_total"] > 0
    record = next(r for r in live.log_records() if r["request_id"] == out.id)
    assert record["endpoint"] == "chat" and record["n"] == 2 and record["finish_reason"] == "length"
    assert record["prompt_tokens"] == out.usage.prompt_tokens
    assert record["generated_tokens"] == out.usage.completion_tokens == 10
    assert record["cached_tokens"] == out.usage.prompt_tokens_details.cached_tokens
    assert 0 < record["ttft_s"] < 30 and 0 < record["tpot_s"] < 30
    assert abs(record["arrival_time"] - time.time()) < 120


def test_bench_agents_names_the_shape_and_drafter_the_server_ran(tmp_path, capsys):
    shape = (("num_hidden_layers", 4), ("hidden_size", 64), ("intermediate_size", 128), ("vocab_size", 8192))
    config = EngineConfig.from_flat(
        random_weights=True,
        shape="qwen3.5-27b",
        shape_overrides=shape,
        speculative="ngram",
        draft_tokens=2,
        dtype="float32",
        device="cpu",
        max_model_len=1024,
        max_num_seqs=2,
    )
    out = tmp_path / "agents.json"
    with serving(tmp_path / "requests.jsonl", config) as server:
        flags = ["--agents", "1", "--doc-chars", "300", "--stagger", "0", "--max-tokens", "2", "--runs", "1"]
        assert main(["bench", "agents", "--url", server.url, *flags, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["model"], report["shape"]) == ("qwen3.5-27b-random", "qwen3.5-27b")
    assert (report["speculative"], report["draft_tokens"], report["max_model_len"]) == ("ngram", 2, 1024)
    assert report["commit"] == commit() and report["benchmark"] == "agents"
