"""What a web page can make a server without a key do (issue #47, item 7), and numeric fields range-checked as vLLM
does (item 9), against live servers on loopback: a POST not declared as JSON is a 415, a Host that does not name
the server is a 403 (DNS rebinding), no CORS header is sent unless `--allowed-origins` asks for it, and every
meaningless value is a 400 of one sentence naming the field and the accepted range, while the values next to it
are accepted and mean what they should."""

from __future__ import annotations

import http.client
import json

import pytest

from deltaspec.cli import build_parser, config_from_args
from deltaspec.config.server import ServerConfig, flag_list
from deltaspec.errors import DeltaspecError
from deltaspec.sample.params import SamplingParams, check_token_ids
from deltaspec.server.browsers import allowed_host_names, host_name
from tests.server.live import MODEL, USER, Live, serving
from tests.server.test_server_hostile import CHAT, COMPLETIONS, check_error

VOCAB = 8192  # the embedded model's vocabulary
APP = "https://app.example"
EVIL = "https://evil.example"


@pytest.fixture(scope="module")
def open_server(tmp_path_factory) -> Live:
    """The default: no API key, listening on 127.0.0.1."""
    with serving(tmp_path_factory.mktemp("open") / "requests.jsonl", served_model_name=MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def proxied_server(tmp_path_factory) -> Live:
    """No API key, behind a proxy named llm.example, called from the pages of APP."""
    log = tmp_path_factory.mktemp("proxied") / "requests.jsonl"
    with serving(log, served_model_name=MODEL, allowed_hosts="llm.example", allowed_origins=f'["{APP}"]') as server:
        yield server


def send(
    live: Live, method: str, path: str, body: dict | None = None, headers: dict | None = None
) -> tuple[int, dict | str, http.client.HTTPResponse]:
    """One raw request with exactly these headers (http.client adds Host only when they have none)."""
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
    conn.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=headers or {})
    response = conn.getresponse()
    raw = response.read().decode()
    conn.close()
    try:
        return response.status, json.loads(raw), response
    except ValueError:
        return response.status, raw, response


JSON = {"Content-Type": "application/json"}
SMALL = {"prompt": "x", "max_tokens": 1}


# ---------------------------------------------------------------- item 7: pages cannot post


@pytest.mark.parametrize(
    "content_type, status",
    [
        ("text/plain", 415),  # what a cross-site page can send without a preflight
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        (None, 415),
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
    ],
)
def test_a_post_must_declare_json(open_server, content_type, status):
    headers = {} if content_type is None else {"Content-Type": content_type}
    got, reply, _ = send(open_server, "POST", COMPLETIONS, SMALL, headers)
    if status == 200:
        assert got == 200, reply
    else:
        check_error(got, reply, 415, "'Content-Type: application/json'")


# ---------------------------------------------------------------- item 7: Host names (DNS rebinding)


@pytest.mark.parametrize(
    "host, status",
    [
        ("127.0.0.1:{port}", 200),
        ("localhost:{port}", 200),
        ("LocalHost", 200),
        ("localhost.:{port}", 200),
        ("[::1]:{port}", 200),
        ("evil.example", 403),
        ("evil.example:{port}", 403),
        ("127.0.0.1.nip.io:{port}", 403),
        ("localhost.evil.example", 403),
        ("llm.example", 403),  # a proxy's name needs --allowed-hosts
        ("", 403),
    ],
)
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", COMPLETIONS), ("GET", "/metrics")])
def test_a_loopback_server_answers_loopback_names_only(open_server, host, status, method, path):
    headers = {"Host": host.format(port=open_server.port), **(JSON if method == "POST" else {})}
    got, reply, _ = send(open_server, method, path, SMALL if method == "POST" else None, headers)
    if status == 200:
        assert got == 200, reply
    else:
        check_error(got, reply, 403, "--allowed-hosts")


def test_health_answers_any_host(open_server):
    assert send(open_server, "GET", "/health", headers={"Host": "evil.example"})[:2] == (200, {"status": "ok"})


@pytest.mark.parametrize("host, status", [("llm.example", 200), ("LLM.example:443", 200), ("localhost", 200)])
def test_allowed_hosts_adds_a_proxys_name(proxied_server, host, status):
    got, reply, _ = send(proxied_server, "GET", "/v1/models", headers={"Host": host})
    assert got == status, reply
    check_error(*send(proxied_server, "GET", "/v1/models", headers={"Host": "evil.example"})[:2], 403, "evil.example")


@pytest.mark.parametrize(
    "bind, allowed, names",
    [
        ("127.0.0.1", None, {"localhost", "127.0.0.1", "::1"}),
        ("localhost", None, {"localhost", "127.0.0.1", "::1"}),
        ("::1", None, {"localhost", "127.0.0.1", "::1"}),
        ("127.0.0.2", None, {"localhost", "127.0.0.1", "::1", "127.0.0.2"}),
        ("192.168.1.5", None, {"192.168.1.5"}),
        ("myhost.lan", None, {"myhost.lan"}),
        ("0.0.0.0", None, None),
        ("::", None, None),
        ("0.0.0.0", "llm.example", {"localhost", "127.0.0.1", "::1", "llm.example"}),
        ("127.0.0.1", "*", None),
        ("127.0.0.1", '["a.example", "B.example:8443"]', {"localhost", "127.0.0.1", "::1", "a.example", "b.example"}),
        ("10.0.0.2", "a.example, b.example", {"10.0.0.2", "a.example", "b.example"}),
    ],
)
def test_the_host_names_a_bind_address_answers(bind, allowed, names):
    assert allowed_host_names(bind, allowed) == (None if names is None else frozenset(names))


@pytest.mark.parametrize(
    "header, name",
    [
        ("localhost:8000", "localhost"),
        ("[::1]:8000", "::1"),
        ("[0:0:0:0:0:0:0:1]", "::1"),
        ("::1", "::1"),
        ("Example.COM.", "example.com"),
        ("127.0.0.1", "127.0.0.1"),
    ],
)
def test_host_names_are_compared_without_port_case_or_brackets(header, name):
    assert host_name(header) == name


# ---------------------------------------------------------------- item 7: CORS only when asked


def preflight(origin: str) -> dict:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }


def test_no_cors_headers_by_default(open_server):
    status, _, response = send(open_server, "OPTIONS", CHAT, headers=preflight(EVIL))
    assert status == 405 and response.getheader("access-control-allow-origin") is None
    status, _, response = send(open_server, "GET", "/v1/models", headers={"Origin": EVIL})
    assert status == 200 and response.getheader("access-control-allow-origin") is None


def test_allowed_origins_turns_cors_on_for_those_origins(proxied_server):
    status, _, response = send(proxied_server, "OPTIONS", CHAT, headers=preflight(APP))
    assert status == 200 and response.getheader("access-control-allow-origin") == APP
    assert "POST" in response.getheader("access-control-allow-methods")
    status, _, response = send(proxied_server, "GET", "/v1/models", headers={"Origin": APP})
    assert status == 200 and response.getheader("access-control-allow-origin") == APP
    assert response.getheader("access-control-allow-credentials") is None  # --allow-credentials is off
    status, _, response = send(proxied_server, "OPTIONS", CHAT, headers=preflight(EVIL))
    assert status == 400 and response.getheader("access-control-allow-origin") is None


def test_the_cors_flags_take_vllms_json_lists_or_commas():
    args = build_parser().parse_args(
        [
            "serve",
            "--allowed-origins",
            '["https://a.example", "https://b.example"]',
            "--allowed-methods",
            "GET,POST",
            "--allow-credentials",
            "--allowed-hosts",
            "llm.example",
        ]
    )
    server = config_from_args(args, ServerConfig)
    assert flag_list(server.allowed_origins, "--allowed-origins") == ("https://a.example", "https://b.example")
    assert flag_list(server.allowed_methods, "--allowed-methods") == ("GET", "POST")
    assert (server.allowed_headers, server.allow_credentials, server.allowed_hosts) == ("*", True, "llm.example")
    assert ServerConfig().allowed_origins is None  # no CORS unless asked (vLLM's default is every origin)
    with pytest.raises(DeltaspecError, match="--allowed-origins must be a JSON list of strings"):
        ServerConfig(allowed_origins='["https://a.example"')


# ---------------------------------------------------------------- item 9: numeric ranges

# (id, path, extra fields, a fragment of the error message)
REFUSED = [
    ("temperature-1e300", CHAT, {"temperature": 1e300}, "temperature must be a number in [0, 2]"),
    ("temperature-2.5", COMPLETIONS, {"temperature": 2.5}, "temperature must be a number in [0, 2]"),
    ("temperature-negative", CHAT, {"temperature": -0.5}, "temperature must be a number in [0, 2]"),
    ("top-k-1e20-integer", CHAT, {"top_k": 10**20}, f"from 1 to {VOCAB}"),
    ("top-k-over-vocabulary", COMPLETIONS, {"top_k": VOCAB + 1}, f"from 1 to {VOCAB}"),
    ("top-k-1e20-float", CHAT, {"top_k": 1e20}, "'top_k'"),
    ("top-k-minus-two", CHAT, {"top_k": -2}, "top_k must be"),
    ("repetition-penalty-1e-300", CHAT, {"repetition_penalty": 1e-300}, "repetition_penalty must be a number in"),
    ("repetition-penalty-0.001", COMPLETIONS, {"repetition_penalty": 0.001}, "[0.01, 100]"),
    ("repetition-penalty-101", CHAT, {"repetition_penalty": 101}, "[0.01, 100]"),
    ("stop-token-ids-2-70", CHAT, {"stop_token_ids": [2**70]}, f"in [0, {VOCAB})"),
    ("stop-token-ids-vocabulary", COMPLETIONS, {"stop_token_ids": [1, VOCAB]}, f"got {VOCAB}."),
    ("top-p-1.5", CHAT, {"top_p": 1.5}, "top_p must be in (0, 1]"),
    ("min-p-negative", COMPLETIONS, {"min_p": -0.1}, "min_p must be in [0, 1]"),
    ("presence-penalty-2.5", CHAT, {"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ("frequency-penalty-minus-3", COMPLETIONS, {"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
    ("min-tokens-negative", CHAT, {"min_tokens": -1}, "min_tokens must be"),
    ("seed-under-64-bits", COMPLETIONS, {"seed": -(2**63) - 1}, "seed must be an integer in"),
    ("n-zero", COMPLETIONS, {"n": 0}, "n must be at least 1"),
    ("max-completion-tokens-zero", CHAT, {"max_completion_tokens": 0}, "max_completion_tokens must be at least 1"),
    ("top-logprobs-negative", CHAT, {"logprobs": True, "top_logprobs": -1}, "'top_logprobs'"),
    ("completion-logprobs-negative", COMPLETIONS, {"logprobs": -1}, "'logprobs'"),
    # vLLM's chat flags: typed, and refused when true (not implemented)
    ("chat-echo", CHAT, {"echo": True}, "echo is not supported on /v1/chat/completions"),
    ("chat-echo-string", CHAT, {"echo": "x"}, "'echo'"),
    ("chat-return-token-ids-string", CHAT, {"return_token_ids": "x"}, "'return_token_ids'"),
    ("chat-return-token-ids", CHAT, {"return_token_ids": True}, "return_token_ids is not supported"),
]


def request_body(path: str, fields: dict) -> dict:
    base = {"messages": USER} if path == CHAT else {"prompt": "def add(a, b):"}
    return {**base, "max_tokens": 2, **fields}


@pytest.mark.parametrize("path, fields, fragment", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_meaningless_values_are_a_400_naming_the_range(open_server, path, fields, fragment):
    status, reply = open_server.request("POST", path, request_body(path, fields), key=None)
    check_error(status, reply, 400, fragment)


ACCEPTED = [
    ("temperature-0", {"temperature": 0}),
    ("temperature-2", {"temperature": 2, "seed": 1}),
    ("top-k-minus-one", {"top_k": -1, "seed": 1}),
    ("top-k-vocabulary", {"top_k": VOCAB, "seed": 1}),
    ("repetition-penalty-0.01", {"repetition_penalty": 0.01}),
    ("repetition-penalty-100", {"repetition_penalty": 100}),
    ("stop-token-ids-last", {"stop_token_ids": [VOCAB - 1]}),
    ("chat-flags-false", {"echo": False, "return_token_ids": False}),
]


@pytest.mark.parametrize("fields", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_values_at_the_edges_are_accepted(open_server, fields):
    status, reply = open_server.request("POST", CHAT, request_body(CHAT, fields), key=None)
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply


def completion_text(live: Live, **fields) -> str:
    status, reply = live.request("POST", COMPLETIONS, request_body(COMPLETIONS, {"max_tokens": 8, **fields}), key=None)
    assert status == 200, reply
    return reply["choices"][0]["text"]


def test_accepted_spellings_mean_what_they_should(open_server):
    sampled = completion_text(open_server, temperature=1.0, seed=7, top_k=0)
    assert completion_text(open_server, temperature=1.0, seed=7, top_k=-1) == sampled  # -1 is off, as 0
    assert completion_text(open_server, temperature=1.0, seed=7, top_k=VOCAB) == sampled  # the whole vocabulary
    greedy = completion_text(open_server, temperature=0)  # with the model's own repetition penalty
    off = completion_text(open_server, temperature=0, repetition_penalty=1.0)
    assert completion_text(open_server, temperature=0, repetition_penalty=1) == off  # the integer 1 is 1.0: off
    assert completion_text(open_server, temperature=1.0, seed=7, top_k=1) == greedy  # top_k 1 is the argmax
    assert open_server.request("POST", CHAT, request_body(CHAT, {"echo": False}), key=None)[0] == 200


# ---------------------------------------------------------------- item 9: the rules themselves (offline API too)


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"temperature": 1e300}, "temperature must be a number in [0, 2] (0: greedy), got 1e+300."),
        ({"temperature": 2.000001}, "temperature must be"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty must be a number in [0.01, 100] (1: off), got 1e-300."),
        ({"repetition_penalty": 100.5}, "repetition_penalty must be"),
    ],
)
def test_sampling_params_refuse_out_of_range_values(fields, fragment):
    with pytest.raises(DeltaspecError) as info:
        SamplingParams(**fields)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"top_k": VOCAB + 1}, f"top_k must be 0 or -1 (off) or an integer from 1 to {VOCAB}"),
        ({"stop_token_ids": [3, 2**70]}, f"stop_token_ids must be token ids in [0, {VOCAB}) (the vocabulary), got"),
        ({"stop_token_ids": [-1]}, "got -1."),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(fields, fragment):
    with pytest.raises(DeltaspecError) as info:
        check_token_ids(VOCAB, **fields)
    assert fragment in str(info.value)
    check_token_ids(VOCAB, top_k=VOCAB, stop_token_ids=[0, VOCAB - 1])
