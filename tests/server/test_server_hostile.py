"""Hostile and malformed requests against one live server (issue #13): every one gets a 4xx whose body is an
OpenAI-shaped error of one sentence, which echoes nothing un-encodable and no file path; a long prompt
tokenizes without stalling the event loop; an oversized body is a 413; and after all of it the server still
serves. Raw HTTP for bodies a client library would not send, the `openai` client where it can say the case."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import openai
import pytest

from deltaspec.config.engine import EngineConfig
from tests.server.live import CTX, KEY, MODEL, TOOLS, USER, Live, one_sentence, serving

LIMIT = 2 << 20  # the hostile server's --max-request-bytes
SEQUENCES = 16  # its --max-sequences-per-request
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SURROGATE = b"a\\ud800"  # the JSON escape of a lone surrogate
DEEP = b"[" * 100_000 + b"]" * 100_000
INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Live:
    log = tmp_path_factory.mktemp("hostile") / "requests.jsonl"
    with serving(
        log,
        api_key=KEY,
        served_model_name=MODEL,
        max_n=8,
        max_sequences_per_request=SEQUENCES,
        max_request_bytes=LIMIT,
    ) as server:
        yield server


def chat_body(**fields) -> dict:
    return {"messages": USER, "max_tokens": 2, **fields}


def raw_chat(fragment: bytes) -> bytes:
    """A chat body with `fragment` spliced in raw, for what `json.dumps` cannot write."""
    return b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, ' + fragment + b"}"


def raw_completion(fragment: bytes) -> bytes:
    return b'{"max_tokens": 2, ' + fragment + b"}"


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
NESTED_100 = {"a": json.loads("[" * 100 + "]" * 100)}

# (id, path, body, status, a fragment of the error message)
CASES = [
    # nesting and text a parser accepts but nothing after it should see
    ("deep-body", CHAT, b'{"messages": ' + DEEP + b"}", 400, "more than 64 deep"),
    ("deep-template-kwargs", CHAT, raw_chat(b'"chat_template_kwargs": {"a": ' + DEEP + b"}"), 400, "more than 64 deep"),
    ("nested-100-template-kwargs", CHAT, chat_body(chat_template_kwargs=NESTED_100), 400, "'chat_template_kwargs'"),
    ("surrogate-prompt", COMPLETIONS, raw_completion(b'"prompt": "' + SURROGATE + b'"'), 400, "surrogate"),
    (
        "surrogate-content",
        CHAT,
        b'{"messages": [{"role": "user", "content": "' + SURROGATE + b'"}]}',
        400,
        "'messages[0].content'",
    ),
    ("surrogate-model", CHAT, raw_chat(b'"model": "' + SURROGATE + b'"'), 400, "'model'"),
    ("surrogate-role", CHAT, b'{"messages": [{"role": "' + SURROGATE + b'", "content": "x"}]}', 400, "surrogate"),
    (
        "surrogate-tool-choice",
        CHAT,
        raw_chat(
            b'"tools": '
            + json.dumps([TOOL]).encode()
            + b', "tool_choice": {"type": "function", "function": {"name": "'
            + SURROGATE
            + b'"}}'
        ),
        400,
        "'tool_choice.function.name'",
    ),
    ("surrogate-key", CHAT, raw_chat(b'"chat_template_kwargs": {"' + SURROGATE + b'": 1}'), 400, "surrogate"),
    ("invalid-utf8", CHAT, b'{"messages": "\xff\xfe"}', 400, "not valid UTF-8"),
    # numbers JSON should not carry, and numbers too large or small for a float
    ("nan-literal", CHAT, raw_chat(b'"temperature": NaN'), 400, "NaN"),
    ("infinity-literal", CHAT, raw_chat(b'"top_p": Infinity'), 400, "Infinity"),
    (
        "minus-infinity-literal",
        COMPLETIONS,
        raw_completion(b'"prompt": "x", "temperature": -Infinity'),
        400,
        "Infinity",
    ),
    ("overflowing-float", CHAT, raw_chat(b'"temperature": 1e400'), 400, "too large"),
    ("underflowing-penalty", CHAT, raw_chat(b'"repetition_penalty": 1e-400'), 400, "1e-400"),
    ("huge-integer-float", CHAT, chat_body(temperature=10**400), 400, "'temperature'"),
    ("integer-too-long-to-read", CHAT, raw_chat(b'"max_tokens": ' + b"9" * 5000), 400, "number too long"),
    # wrong types: strict, no coercion
    ("max-tokens-true", CHAT, chat_body(max_tokens=True), 400, "'max_tokens'"),
    ("max-tokens-string", CHAT, chat_body(max_tokens="16"), 400, "'max_tokens'"),
    ("max-tokens-float", COMPLETIONS, {"prompt": "x", "max_tokens": 1.5}, 400, "'max_tokens'"),
    ("n-true", CHAT, chat_body(n=True), 400, "'n'"),
    ("temperature-string", CHAT, chat_body(temperature="0.5"), 400, "'temperature'"),
    ("stream-string", CHAT, chat_body(stream="true"), 400, "'stream'"),
    ("stream-options-int", CHAT, chat_body(stream=True, stream_options={"include_usage": 1}), 400, "include_usage"),
    ("logprobs-string", CHAT, chat_body(logprobs="yes"), 400, "'logprobs'"),
    ("seed-string", CHAT, chat_body(seed="1"), 400, "'seed'"),
    ("model-number", CHAT, chat_body(model=5), 400, "'model'"),
    ("user-number", CHAT, chat_body(user=5), 400, "'user'"),
    # out-of-range values
    ("n-zero", CHAT, chat_body(n=0), 400, "n must be at least 1"),
    ("n-huge", CHAT, chat_body(n=10**30), 400, "n must be at most 8"),
    ("max-tokens-negative", COMPLETIONS, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens must be at least 1"),
    ("max-tokens-over-context", CHAT, chat_body(max_tokens=10**30), 400, "exceeds the context"),
    ("temperature-negative", CHAT, chat_body(temperature=-1), 400, "temperature"),
    ("top-p-zero", CHAT, chat_body(top_p=0), 400, "top_p"),
    ("top-k-minus-two", CHAT, chat_body(top_k=-2), 400, "top_k"),
    ("min-p-two", CHAT, chat_body(min_p=2), 400, "min_p"),
    ("frequency-penalty-huge", CHAT, chat_body(frequency_penalty=1e300), 400, "frequency_penalty"),
    ("repetition-penalty-zero", CHAT, chat_body(repetition_penalty=0), 400, "repetition_penalty"),
    ("min-tokens-over-max", CHAT, chat_body(min_tokens=5), 400, "min_tokens"),
    ("top-logprobs-21", CHAT, chat_body(logprobs=True, top_logprobs=21), 400, "'top_logprobs'"),
    ("completion-logprobs-21", COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "'logprobs'"),
    ("seed-overflows-with-n", CHAT, chat_body(seed=INT64_MAX, n=2), 400, f"got {INT64_MAX}."),
    ("seed-over-64-bits", COMPLETIONS, {"prompt": "x", "seed": 2**64}, 400, f"got {2**64}."),
    ("prompts-times-n", COMPLETIONS, {"prompt": [[1, 2, 3]] * 500, "n": 8}, 400, "= 4000 sequences"),
    # stop strings and token ids
    ("stop-1000-strings", CHAT, chat_body(stop=[f"s{i}" for i in range(1000)]), 400, "at most 64 items"),
    ("stop-empty-string", CHAT, chat_body(stop=[""]), 400, "stop must be"),
    ("stop-number", CHAT, chat_body(stop=5), 400, "a string or a list of strings"),
    ("stop-token-ids-negative", CHAT, chat_body(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("stop-token-ids-1000", CHAT, chat_body(stop_token_ids=list(range(1000))), 400, "'stop_token_ids'"),
    # prompts
    ("prompt-missing", COMPLETIONS, {"max_tokens": 2}, 400, "'prompt'"),
    ("prompt-number", COMPLETIONS, {"prompt": 5}, 400, "token-id lists"),
    ("prompt-booleans", COMPLETIONS, {"prompt": [True]}, 400, "token-id lists"),
    ("prompt-mixed-list", COMPLETIONS, {"prompt": [1, "a"]}, 400, "token-id lists"),
    ("prompt-empty-list", COMPLETIONS, {"prompt": []}, 400, "prompt must not be empty"),
    ("prompt-empty-string", COMPLETIONS, {"prompt": ""}, 400, "The prompt is empty"),
    ("prompt-empty-token-list", COMPLETIONS, {"prompt": [[]]}, 400, "The prompt is empty"),
    ("prompt-token-id-too-large", COMPLETIONS, {"prompt": [10**6]}, 400, "Prompt token ids must lie in"),
    ("prompt-token-id-negative", COMPLETIONS, {"prompt": [[1, -1]]}, 400, "Prompt token ids must lie in"),
    ("prompt-over-context", COMPLETIONS, {"prompt": "x " * (CTX + 10)}, 400, "exceeds the context"),
    ("echo", COMPLETIONS, {"prompt": "x", "echo": True}, 400, "echo is not supported"),
    # messages
    ("messages-object", CHAT, {"messages": {"role": "user"}}, 400, "'messages'"),
    ("messages-empty", CHAT, {"messages": []}, 400, "at least one message"),
    ("message-number", CHAT, {"messages": [5]}, 400, "'messages[0]'"),
    ("content-object", CHAT, {"messages": [{"role": "user", "content": {"a": 1}}]}, 400, "'messages[0].content'"),
    ("role-missing", CHAT, {"messages": [{"content": "x"}]}, 400, "'messages[0].role'"),
    ("role-unknown", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "wizard"),
    ("text-part-without-text", CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "without"),
    (
        "tool-call-without-arguments",
        CHAT,
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
        400,
        "arguments",
    ),
    # tools
    ("tools-string", CHAT, chat_body(tools="get_weather"), 400, "'tools'"),
    ("tool-without-function", CHAT, chat_body(tools=[{"type": "function"}]), 400, "'tools[0].function'"),
    ("tool-wrong-type", CHAT, chat_body(tools=[{**TOOL, "type": "retrieval"}]), 400, "'tools[0].type'"),
    (
        "tool-parameters-string",
        CHAT,
        chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
        400,
        "parameters",
    ),
    ("tool-choice-unknown", CHAT, chat_body(tools=TOOLS, tool_choice="sometimes"), 400, "'tool_choice'"),
    ("tool-choice-without-tools", CHAT, chat_body(tool_choice="required"), 400, "has no tools"),
    # template kwargs the renderer owns
    ("template-kwargs-string", CHAT, chat_body(chat_template_kwargs="x"), 400, "'chat_template_kwargs'"),
    ("template-raise-exception", CHAT, chat_body(chat_template_kwargs={"raise_exception": 1}), 400, "raise_exception"),
    ("template-eos-token", CHAT, chat_body(chat_template_kwargs={"eos_token": "x"}), 400, "'eos_token'"),
    ("template-messages", CHAT, chat_body(chat_template_kwargs={"messages": []}), 400, "use the request field"),
    # fields that would change the answer if ignored
    # structured output that cannot be compiled, or is given twice
    (
        "response-format-bad-schema",
        CHAT,
        chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
        400,
        "JSON schema the output is constrained to is invalid",
    ),
    (
        "response-format-no-schema",
        COMPLETIONS,
        {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}},
        400,
        "needs json_schema.schema",
    ),
    ("response-format-unknown", CHAT, chat_body(response_format={"type": "xml"}), 400, "response_format"),
    ("guided-regex-bad", COMPLETIONS, {"prompt": "x", "guided_regex": "[a-"}, 400, "regex the output is constrained"),
    ("guided-grammar-bad", CHAT, chat_body(guided_grammar="start: undefined_rule"), 400, "grammar the output"),
    ("guided-choice-empty", CHAT, chat_body(guided_choice=[]), 400, "non-empty list of strings"),
    (
        "constrained-twice",
        CHAT,
        chat_body(guided_regex="a+", response_format={"type": "json_object"}),
        400,
        "constrains its output twice",
    ),
    (
        "structured-outputs-two-kinds",
        COMPLETIONS,
        {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
        400,
        "exactly one of json",
    ),
    (
        "tool-choice-and-format",
        CHAT,
        chat_body(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
        400,
        "tool_choice forces a tool call",
    ),
    ("logit-bias", CHAT, chat_body(logit_bias={"1": 100}), 400, "logit_bias"),
    ("suffix", COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("vote-n-1", COMPLETIONS, {"prompt": "x", "vote": True}, 400, "vote needs n of at least 2"),
    ("vote-two-prompts", COMPLETIONS, {"prompt": ["x", "y"], "n": 2, "vote": True}, 400, "single prompt"),
    ("vote-stream", COMPLETIONS, {"prompt": "x", "n": 2, "vote": True, "stream": True}, 400, "vote cannot be"),
    # the body itself
    ("body-empty", CHAT, b"", 400, "not valid JSON"),
    ("body-not-json", CHAT, b"{messages: 1}", 400, "not valid JSON"),
    ("body-array", COMPLETIONS, b"[1, 2]", 400, "must be a JSON object"),
    ("model-unknown", CHAT, chat_body(model="gpt-4"), 404, "'gpt-4' does not exist"),
    ("path-unknown", "/v1/embeddings", {"input": "x"}, 404, "/v1/embeddings"),
]


def check_error(status: int, reply: dict | str, expected: int, fragment: str) -> None:
    assert status == expected, reply
    assert isinstance(reply, dict) and set(reply) == {"error"}, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"], error
    assert one_sentence(error["message"]), error["message"]
    assert "/work/" not in error["message"] and "default_model" not in error["message"]


@pytest.mark.parametrize("path, body, status, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_requests_get_a_clear_4xx(hostile, path, body, status, fragment):
    check_error(*hostile.request("POST", path, body), status, fragment)


@pytest.mark.parametrize(
    "content_type, status",
    [
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        (None, 415),  # as vLLM: a body must say it is JSON, with an API key too
        ("application/json; charset=utf-8", 200),
    ],
)
def test_the_body_must_be_sent_as_json(hostile, content_type, status):
    got, reply = hostile.request("POST", COMPLETIONS, {"prompt": "x", "max_tokens": 1}, content_type=content_type)
    if status == 200:
        assert got == 200, reply
    else:
        check_error(got, reply, status, "application/json")


@pytest.mark.parametrize("key", [None, "wrong", "x" * 10_000])
def test_a_bad_api_key_is_a_401(hostile, key):
    check_error(*hostile.request("POST", COMPLETIONS, {"prompt": "x"}, key=key), 401, "API key")


def openai_call(live: Live, case: str):
    client = live.client(api_key="wrong" if case == "bad-key" else KEY)
    calls = {
        "bad-key": lambda: client.models.list(),
        "unknown-model": lambda: client.completions.create(model="gpt-4", prompt="x"),
        "n-zero": lambda: client.chat.completions.create(model=MODEL, messages=USER, n=0),
        "response-format": lambda: client.chat.completions.create(
            model=MODEL,
            messages=USER,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
        ),
        "seed-overflow": lambda: client.completions.create(model=MODEL, prompt="x", n=3, seed=INT64_MAX - 1),
        "max-tokens-true": lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=True),
        "too-many-sequences": lambda: client.completions.create(model=MODEL, prompt=[[1, 2]] * 3, n=8),
    }
    return calls[case]()


@pytest.mark.parametrize(
    "case, error, fragment",
    [
        ("bad-key", openai.AuthenticationError, "API key"),
        ("unknown-model", openai.NotFoundError, "'gpt-4'"),
        ("n-zero", openai.BadRequestError, "n must be at least 1"),
        ("response-format", openai.BadRequestError, "is invalid"),
        ("seed-overflow", openai.BadRequestError, f"got {INT64_MAX - 1}."),
        ("max-tokens-true", openai.BadRequestError, "'max_tokens'"),
        ("too-many-sequences", openai.BadRequestError, "at most 16 per request"),
    ],
)
def test_the_openai_client_sees_the_same_errors(hostile, case, error, fragment):
    with pytest.raises(error) as info:
        openai_call(hostile, case)
    assert fragment in info.value.body["message"]


def test_error_bodies_name_no_path_and_the_models_root_is_the_served_name(hostile, monkeypatch):
    render = hostile.tokenizer.apply_chat_template

    def broken_template(messages, **kwargs):  # content the template cannot concatenate: a TypeError inside Jinja
        return render([{**m, "content": 5} for m in messages], **kwargs)

    monkeypatch.setattr(hostile.tokenizer, "apply_chat_template", broken_template)
    status, reply = hostile.request("POST", CHAT, chat_body())
    check_error(status, reply, 400, f"The chat template of the model at {MODEL} could not render")
    monkeypatch.undo()
    status, models = hostile.request("GET", "/v1/models")
    assert status == 200 and models["data"][0]["root"] == MODEL
    assert (models["data"][0]["speculative"], models["data"][0]["draft_tokens"]) == ("none", None)


@pytest.fixture(scope="module")
def long_context(tmp_path_factory) -> Live:
    """A server of an 8192-token context, whose prompts may be 1.4 MB before they are refused untokenized."""
    config = EngineConfig.from_flat(
        dtype="float32", device="cpu", max_num_seqs=1, max_model_len=8192, allow_long_max_model_len=True
    )
    with serving(tmp_path_factory.mktemp("long") / "requests.jsonl", config, api_key=KEY) as server:
        yield server


def test_a_long_prompt_tokenizes_while_health_answers(long_context):
    # 1.4 MB: under the bytes 8192 tokens could cover (2 x 8192 x 86, the longest token's), so it is tokenized
    # before it is found too long (a longer one is refused before tokenizing: test_server_dos.py)
    hostile = long_context
    prompt = "hello world, this is some text with words 123 " * 30_000
    started = time.monotonic()
    hostile.tokenizer.encode(prompt)
    alone = time.monotonic() - started  # what tokenizing it takes on this machine (a quarter of a second)
    result = {}

    def send() -> None:
        result["reply"] = hostile.request("POST", COMPLETIONS, {"prompt": prompt, "max_tokens": 1})

    sender = threading.Thread(target=send)
    sender.start()
    waits = []
    while sender.is_alive():
        sent = time.monotonic()
        assert hostile.request("GET", "/health", key=None) == (200, {"status": "ok"})
        waits.append(time.monotonic() - sent)
        time.sleep(0.02)
    sender.join()
    check_error(*result["reply"], 400, "exceeds the context")
    assert len(waits) >= 5, (alone, waits)  # health was asked while the prompt tokenized
    assert max(waits) < alone / 3, (alone, max(waits))  # and never waited for the tokenizer


def test_an_oversized_body_is_a_413(hostile):
    with socket.create_connection(("127.0.0.1", hostile.port), timeout=10) as sock:  # told by Content-Length
        head = (
            f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {LIMIT + 1}\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt": "')  # the rest is never sent: the answer must not wait for it
        response = http.client.HTTPResponse(sock)
        response.begin()
        check_error(response.status, json.loads(response.read()), 413, f"limit of {LIMIT} bytes")

    def chunks():  # no Content-Length: counted while reading
        yield b'{"prompt": "'
        for _ in range(3):
            yield b"a" * (LIMIT // 2)
        yield b'"}'

    conn = http.client.HTTPConnection("127.0.0.1", hostile.port, timeout=30)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    conn.request("POST", COMPLETIONS, body=chunks(), headers=headers, encode_chunked=True)
    response = conn.getresponse()
    check_error(response.status, json.loads(response.read()), 413, "--max-request-bytes")
    conn.close()


def test_the_server_still_serves_after_all_of_it(hostile):
    assert hostile.request("GET", "/health", key=None) == (200, {"status": "ok"})
    out = hostile.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    status, reply = hostile.request("POST", COMPLETIONS, {"prompt": [[1, 2, 3]] * 2, "n": 8, "max_tokens": 2})
    assert status == 200 and len(reply["choices"]) == SEQUENCES
