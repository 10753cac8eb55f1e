"""Server pieces without a server: detokenizer hold-back, response shaping from fake engine deltas,
logprob formats, validation messages, vote wiring, and the `serve` command line."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import socket
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from deltaspec.cli import build_parser, config_from_args, engine_config, main
from deltaspec.config.server import ServerConfig
from deltaspec.engine.async_engine import RequestDelta
from deltaspec.errors import DeltaspecError
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.model.weights import default_model_path
from deltaspec.sample.logprobs import Logprob
from deltaspec.sample.params import SamplingParams
from deltaspec.server import metrics
from deltaspec.server.chat import voted_choice
from deltaspec.server.chat_format import ChatFormat
from deltaspec.server.detokenizer import IncrementalDetokenizer, stop_hold_start
from deltaspec.server.errors import validation_error
from deltaspec.server.logprobs import chat_logprobs, completion_logprobs
from deltaspec.server.metrics import RequestLog, TokenTally
from deltaspec.server.protocol import ChatCompletionRequest, CompletionRequest
from deltaspec.server.respond import Submitted
from deltaspec.server.samples import Sample

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(default_model_path())


def deltas_of(
    token_ids: list[int], sizes: list[int], finish_reason: str = "stop", stop_text: str | None = None
) -> list[RequestDelta]:
    """Fake engine deltas: `token_ids` cut into pieces of the given sizes (cycled), the last one finishing."""
    out, start, i = [], 0, 0
    while start < len(token_ids):
        piece = token_ids[start : start + sizes[i % len(sizes)]]
        start += len(piece)
        i += 1
        last = start >= len(token_ids)
        out.append(
            RequestDelta(
                "r-0", piece, None, 5, last, finish_reason if last else None, stop_text=stop_text if last else None
            )
        )
    return out


def test_detokenizer_holds_back_partial_utf8(tokenizer):
    text = "é = 数 🙂!"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # some characters are split over byte tokens
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]) for t in ids[:-1]] + [detok.finish(ids[-1:])]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert pieces.count("") >= 3  # the bytes of split characters were held


def test_detokenizer_holds_back_a_possible_stop_string(tokenizer):
    text = "def add(a, b):\n    return a + b\n"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop=["return a - b"])
    held_seen = False
    emitted = ""
    for i in range(len(ids)):
        emitted += detok.add([ids[i]])
        decoded = tokenizer.decode(ids[: i + 1])
        assert decoded.startswith(emitted)
        if decoded.endswith("return a"):  # could still become the stop string: held back
            held_seen = True
            assert "return" not in emitted
    assert held_seen
    assert emitted + detok.finish([]) == text
    # the engine matched "a + b" on the last token: it reports the text cut there, and none of it was emitted
    cut = IncrementalDetokenizer(tokenizer, stop=["a + b"])
    last = next(i for i in range(len(ids)) if "a + b" in tokenizer.decode(ids[: i + 1]))
    emitted = "".join(cut.add([t]) for t in ids[:last])
    stop_text = text[: text.index("a + b")]
    assert stop_text.startswith(emitted) and "a +" not in emitted
    assert emitted + cut.finish([ids[last]], stop_text=stop_text) == stop_text


def test_stop_hold_start():
    assert stop_hold_start("abc xy", ["xyz"]) == 4
    assert stop_hold_start("abc xy", ["q"]) == 6
    assert stop_hold_start("abc x", ["xyz", "c x!"]) == 2
    assert stop_hold_start("abc x", ["xyz"], start=5) == 5
    assert stop_hold_start("abc", []) == 3


def stream_choice(fmt: ChatFormat, deltas: list[RequestDelta], params: SamplingParams) -> dict:
    """Concatenate a ChatStream's chunks into one message dict."""
    stream = fmt.stream(0, params)
    out = {"reasoning_content": "", "content": "", "tool_calls": [], "finish_reason": None, "chunks": 0}
    for delta in deltas:
        choice = stream.feed(delta)
        if choice is None:
            continue
        out["chunks"] += 1
        out["reasoning_content"] += choice.delta.reasoning_content or ""
        out["content"] += choice.delta.content or ""
        out["tool_calls"] += choice.delta.tool_calls or []
        if choice.finish_reason is not None:
            assert delta.finished
            out["finish_reason"] = choice.finish_reason
    return out


def test_tool_call_and_reasoning_from_fake_deltas(tokenizer):
    text = (
        'I need the weather.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    )
    ids = tokenizer.encode(text)
    fmt = ChatFormat(tokenizer, started_in_thinking=True, tools=TOOLS, top_logprobs=None)
    whole = fmt.choice(0, tokenizer.decode(ids), "stop", None, [])
    assert whole.finish_reason == "tool_calls"
    assert whole.message.reasoning_content == "I need the weather."
    assert whole.message.content == "Let me check."
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris", "days": 2}'
    assert call.id.startswith("call_")
    for sizes in ([1], [2, 3], [len(ids)]):
        streamed = stream_choice(fmt, deltas_of(ids, sizes), SamplingParams())
        assert streamed["reasoning_content"] == whole.message.reasoning_content
        assert streamed["content"] == whole.message.content
        assert [c["function"] for c in streamed["tool_calls"]] == [
            {"name": "get_weather", "arguments": call.function.arguments}
        ]
        assert streamed["tool_calls"][0]["index"] == 0 and streamed["tool_calls"][0]["type"] == "function"
        assert streamed["finish_reason"] == "tool_calls"


def test_no_tools_means_tool_calls_stay_text_and_no_thinking_means_no_reasoning(tokenizer):
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    ids = tokenizer.encode(text)
    fmt = ChatFormat(tokenizer, started_in_thinking=False, tools=None, top_logprobs=None)
    whole = fmt.choice(0, text, "stop", None, [])
    assert whole.message.content == text and whole.message.tool_calls == []
    assert whole.message.reasoning_content is None and whole.finish_reason == "stop"
    streamed = stream_choice(fmt, deltas_of(ids, [2]), SamplingParams())
    assert streamed["content"] == text and streamed["reasoning_content"] == ""
    assert streamed["finish_reason"] == "stop"


def test_thinking_cut_by_length_is_all_reasoning(tokenizer):
    text = "Let me think about lists and"
    ids = tokenizer.encode(text)
    fmt = ChatFormat(tokenizer, started_in_thinking=True, tools=None, top_logprobs=None)
    whole = fmt.choice(0, text, "length", None, [])
    assert (whole.message.reasoning_content, whole.message.content, whole.finish_reason) == (text, "", "length")
    streamed = stream_choice(fmt, deltas_of(ids, [1], finish_reason="length"), SamplingParams())
    assert (streamed["reasoning_content"], streamed["content"]) == (text, "")


def test_stream_uses_the_engine_stop_text(tokenizer):
    text = "x = 1\ny = 2\nz = 3\n"
    ids = tokenizer.encode(text)
    last = next(i for i in range(len(ids)) if "y =" in tokenizer.decode(ids[: i + 1]))  # where the engine stops
    params = SamplingParams(stop=["y ="])
    fmt = ChatFormat(tokenizer, started_in_thinking=False, tools=None, top_logprobs=None)
    streamed = stream_choice(fmt, deltas_of(ids[: last + 1], [1], stop_text="x = 1\n"), params)
    assert streamed["content"] == "x = 1\n"
    assert fmt.choice(0, "x = 1\n", "stop", "y =", []).message.content == "x = 1\n"


def test_chat_and_completion_logprob_shapes(tokenizer):
    entries = [
        {5: Logprob(-0.5, 2, "ab"), 9: Logprob(-0.25, 1, "c"), 50: Logprob(-3.0, 3, "d")},
        {7: Logprob(float("-inf"), 8192, "é"), 9: Logprob(-0.01, 1, "c")},
    ]
    chat = chat_logprobs(entries, 2, tokenizer)
    first, second = chat.content
    assert (first.token, first.logprob, first.bytes) == ("ab", -0.5, [97, 98])
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("c", -0.25), ("ab", -0.5)]
    assert second.logprob == -9999.0 and second.bytes == [0xC3, 0xA9]
    assert [t.token for t in second.top_logprobs] == ["c"]
    comp = completion_logprobs(entries, 1, tokenizer, offset=10)
    assert comp.tokens == ["ab", "é"]
    assert comp.token_logprobs == [-0.5, -9999.0]
    assert comp.top_logprobs == [{"c": -0.25}, {"c": -0.01}]
    assert comp.text_offset == [10, 12]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"messages": [{"role": "user", "content": 5}]}, "Invalid value for 'messages[0].content': input should be"),
        ({"messages": [{"content": "x"}]}, "The request is missing the required field 'messages[0].role'."),
        ({}, "The request is missing the required field 'messages'."),
        ({"messages": [], "temperature": "hot"}, "Invalid value for 'temperature': input should be a valid number"),
        ({"messages": [], "top_logprobs": 21}, "Invalid value for 'top_logprobs': input should be less than or equal"),
    ],
)
def test_validation_errors_name_the_field_in_one_sentence(body, message):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    error = validation_error(info.value)
    assert error.status == 400
    assert error.message.startswith(message)
    assert error.message.endswith(".") and "\n" not in error.message


def test_requests_ignore_unknown_fields_and_accept_every_prompt_form():
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "foo": 1, "logit_bias": {"1": 2}}
    )
    assert not hasattr(req, "foo")
    for prompt in ("text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert CompletionRequest.model_validate({"prompt": prompt}).prompt == prompt


class FakeEngine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class FakeContext:
    def __init__(self) -> None:
        self.engine = FakeEngine()
        self.metrics = SimpleNamespace(tally=TokenTally())


def finished_sample(index: int, text: str, tokenizer: Tokenizer, reason: str = "stop") -> Sample:
    sample = Sample(index, f"r-{index}", None, SamplingParams(), 3)
    sample.apply(RequestDelta(sample.request_id, tokenizer.encode(text), None, 3, True, reason))
    return sample


def test_vote_returns_the_first_finished_winner_and_aborts_once_decided(tokenizer):
    ctx = FakeContext()
    fmt = ChatFormat(tokenizer, started_in_thinking=False, tools=None, top_logprobs=None)
    samples = [Sample(i, f"r-{i}", None, SamplingParams(), 3) for i in range(5)]
    voting = Submitted(ctx, "chat", "r", 0.0, samples, 3, 5).stop_once_decided(voted_choice(fmt))
    answers = {0: "The answer is 7.", 1: "so the answer is 12", 2: "Answer: 12.0", 3: "#### 12"}
    for i in (1, 0, 2):
        samples[i].apply(RequestDelta(f"r-{i}", tokenizer.encode(answers[i]), None, 3, True, "stop"))
        voting.on_finished(samples[i])
    assert ctx.engine.aborted == []  # 12: 2 votes, 7: 1, two samples to come: not decided
    samples[3].apply(RequestDelta("r-3", tokenizer.encode(answers[3]), None, 3, True, "stop"))
    voting.on_finished(samples[3])
    assert ctx.engine.aborted == ["r-4"]  # 12: 3 votes vs 1 with one to come
    samples[4].apply(RequestDelta("r-4", [], None, 3, True, "abort"))
    voting.on_finished(samples[4])
    choice, info = voting.result()
    assert choice.index == 0 and choice.message.content == answers[1]
    assert (info.winner, info.counts) == ("12", {"12": 3, "7": 1})
    assert (info.samples_finished, info.samples_aborted) == (4, 1)


def test_serve_flags_build_both_configs():
    args = build_parser().parse_args(
        [
            "serve",
            "--ctx",
            "512",
            "--max-streams",
            "3",
            "--api-key",
            "k",
            "--port",
            "9001",
            "--served-model-name",
            "m",
            "--request-log",
            "log.jsonl",
            "--max-n",
            "4",
            "--dtype",
            "float32",
        ]
    )
    engine = engine_config(args)
    server = config_from_args(args, ServerConfig)
    assert (engine.scheduler.max_model_len, engine.scheduler.max_num_seqs, engine.load.dtype) == (512, 3, "float32")
    assert server == ServerConfig(port=9001, api_key="k", served_model_name="m", request_log="log.jsonl", max_n=4)


def test_serve_limit_flags_and_their_defaults():
    args = build_parser().parse_args(["serve", "--max-sequences-per-request", "32", "--max-request-bytes", "4096"])
    server = config_from_args(args, ServerConfig)
    assert (server.max_sequences_per_request, server.max_request_bytes) == (32, 4096)
    assert (ServerConfig().max_sequences_per_request, ServerConfig().max_request_bytes) == (64, 8 << 20)


def test_serve_on_a_busy_port_is_one_error_line(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: Cannot listen on 127.0.0.1:") and lines[0].endswith(".")


def test_detokenizer_deltas_equal_the_whole_decode_for_random_splits(tokenizer):
    import random

    rng = random.Random(0)
    texts = ["def f(x):\n    return x ** 2  # квадрат ✓\n", "naïve café — 東京 🚀 done", "a\n\n\tb  c" * 20]
    for text in texts:
        ids = tokenizer.encode(text)
        for _ in range(20):
            detok, out, i = IncrementalDetokenizer(tokenizer), "", 0
            while i < len(ids):
                step = rng.randint(1, 4)
                out += detok.add(ids[i : i + step])
                i += step
            out += detok.finish([])
            assert out == tokenizer.decode(ids)


def test_usage_reports_the_prompt_tokens_resumed_from_a_prefix_checkpoint():
    from deltaspec.server.samples import usage_of

    samples = [
        Sample(i, f"r-{i}", None, SamplingParams(), 40, token_ids=[1, 2, 3], metrics={"num_cached_tokens": cached})
        for i, cached in enumerate((31, 31))
    ]
    usage = usage_of(40, samples)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (40, 6, 46)
    assert usage.prompt_tokens_details.cached_tokens == 31
    assert usage_of(40, [Sample(0, "r", None, SamplingParams(), 40)]).prompt_tokens_details.cached_tokens == 0


# ---- the request log on a failing disk ----


def request_log_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "deltaspec.server" and "request log" in r.getMessage()]


def test_a_full_disk_drops_request_log_records_with_one_warning_per_run_of_failures(tmp_path, caplog):
    log = RequestLog("/dev/full")  # opens like any file; every write fails with ENOSPC
    with caplog.at_level(logging.WARNING, logger="deltaspec.server"):
        for i in range(3):
            log.write({"request_id": f"lost-{i}"})  # never raises: the request it records still succeeds
        [warning] = request_log_warnings(caplog)
        assert warning == (
            "Cannot write the request log /dev/full (No space left on device); requests are served without it "
            "until writing works."
        )
        log.path = tmp_path / "requests.jsonl"  # space again
        log.write({"request_id": "kept"})
        log.write({"request_id": "kept-too"})
    assert request_log_warnings(caplog)[1:] == [f"The request log {log.path} is written again; 3 records were dropped."]
    assert [json.loads(line)["request_id"] for line in log.path.read_text().splitlines()] == ["kept", "kept-too"]


def test_a_request_log_write_cut_short_leaves_only_whole_lines(tmp_path, monkeypatch, caplog):
    log = RequestLog(str(tmp_path / "requests.jsonl"))
    log.write({"request_id": "before"})

    class FillsUp(io.FileIO):
        """Writes half of what it is given, then the disk is full."""

        def write(self, data):
            if len(data) > 1:
                return super().write(bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics, "open", lambda path, mode, buffering: FillsUp(path, mode), raising=False)
    with caplog.at_level(logging.WARNING, logger="deltaspec.server"):
        log.write({"request_id": "cut"})
    monkeypatch.undo()
    log.write({"request_id": "after"})
    assert [json.loads(line)["request_id"] for line in log.path.read_text().splitlines()] == ["before", "after"]
    assert "No space left on device" in request_log_warnings(caplog)[0]


def test_a_removed_request_log_directory_is_a_warning(tmp_path, caplog):
    log = RequestLog(str(tmp_path / "logs" / "requests.jsonl"))
    shutil.rmtree(tmp_path / "logs")
    with caplog.at_level(logging.WARNING, logger="deltaspec.server"):
        log.write({"request_id": "lost"})
    assert "No such file or directory" in request_log_warnings(caplog)[0]


def test_a_request_log_that_cannot_be_created_is_refused_at_start(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(DeltaspecError, match=r"^Cannot write the request log .*a-file/requests\.jsonl \(.+\)\.$"):
        RequestLog(str(tmp_path / "a-file" / "requests.jsonl"))
