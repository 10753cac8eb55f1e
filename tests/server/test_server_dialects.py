"""The request fields and endpoints users bring from vLLM, llama-server and OpenAI's Responses API: each accepted
spelling means what it means there (shown by the output it changes, or by equality with the spelling it stands
for), each refused one is a 400 of one sentence naming what works; `tool_choice: "required"` and
`parallel_tool_calls: false` end after the calls they allow. A live server of the embedded model on CPU, driven by
the real `openai` client where it can express the request and by raw HTTP where it cannot."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from importlib.metadata import version

import pytest

from deltaspec.server.context import ServerContext
from tests.server.live import KEY, NO_THINK, TOOLS, USER, Live, ScriptedOutput, one_sentence, serving

MODEL = "tiny"
GREEDY = {"temperature": 0, "repetition_penalty": 1.0}
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    log = tmp_path_factory.mktemp("dialects") / "requests.jsonl"
    with serving(log, api_key=KEY, served_model_name=MODEL, max_n=8) as server:
        yield server


def post(live: Live, path: str, body: dict) -> tuple[int, dict | str]:
    return live.request("POST", path, body)


def ok(live: Live, path: str, body: dict) -> dict:
    status, reply = post(live, path, body)
    assert status == 200, reply
    return reply


def text_of(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


CHAT = {"messages": USER, **NO_THINK}
COMPLETION = {"prompt": PROMPT}


# ---- llama-server's spellings mean what they mean there ----

PLAIN = {"temperature": 0, "repetition_penalty": 1.0}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
SPELLINGS = [  # (path, body, llama-server's spelling, the field it stands for)
    ("/v1/completions", {**COMPLETION, **PLAIN}, {"n_predict": 5}, {"max_tokens": 5}),
    ("/v1/chat/completions", {**CHAT, **PLAIN}, {"n_predict": 5}, {"max_tokens": 5}),
    (
        "/v1/completions",
        {**COMPLETION, "temperature": 0, "max_tokens": 24},
        {"repeat_penalty": 1.6},
        {"repetition_penalty": 1.6},
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "temperature": 0, "max_tokens": 24},
        {"repeat_penalty": 1.6},
        {"repetition_penalty": 1.6},
    ),
    ("/v1/completions", {**COMPLETION, **PLAIN, "max_tokens": 12}, {"json_schema": SCHEMA}, {"guided_json": SCHEMA}),
]


@pytest.mark.parametrize(("path", "body", "spelled", "field"), SPELLINGS)
def test_llama_server_spellings_stand_for_the_fields_they_name(live, path, body, spelled, field):
    by_spelling, by_field = ok(live, path, {**body, **spelled}), ok(live, path, {**body, **field})
    assert text_of(by_spelling) == text_of(by_field)
    assert by_spelling["usage"]["completion_tokens"] == by_field["usage"]["completion_tokens"]
    if "n_predict" in spelled:
        assert by_spelling["usage"]["completion_tokens"] == 5
    if "repeat_penalty" in spelled:  # it changes a looping greedy output, as repetition_penalty does
        assert text_of(ok(live, path, {**body, "repetition_penalty": 1.0})) != text_of(by_spelling)


def test_n_predict_minus_one_runs_to_the_end_of_the_context(live):
    context, ids = live.async_engine.engine.config.scheduler.max_model_len, live.tokenizer.encode(PROMPT)
    ids = ids * ((context - 40) // len(ids))
    room = context - len(ids)
    assert 16 < room < 100
    out = live.client().completions.create(
        model=MODEL, prompt=ids, temperature=0, extra_body={"n_predict": -1, "ignore_eos": True}
    )
    assert out.usage.completion_tokens == room and out.choices[0].finish_reason == "length"


# ---- refused in one sentence naming what works ----

REFUSED = [
    ("/v1/completions", {"n_predict": 5, "max_tokens": 6}, "give one of them"),
    ("/v1/chat/completions", {"n_predict": 5, "max_completion_tokens": 6}, "give one of them"),
    ("/v1/completions", {"repeat_penalty": 1.1, "repetition_penalty": 1.2}, "give one of them"),
    ("/v1/completions", {"n_predict": 0}, "or -1 for no limit"),
    ("/v1/completions", {"mirostat": 2}, "send the request without it"),
    ("/v1/chat/completions", {"repeat_last_n": 64, "repeat_penalty": 1.1}, "covers the whole prompt and output"),
    ("/v1/completions", {"grammar": 'root ::= "a"'}, "structured_outputs.grammar"),
    ("/completion", {"n_probs": 3}, "use logprobs on /v1/completions"),
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of must be at least n"),
    ("/v1/completions", {"best_of": 3, "stream": True, "temperature": 1}, "without stream"),
    ("/v1/chat/completions", {"best_of": 3, "temperature": 0}, "send a temperature above 0"),
    ("/v1/chat/completions", {"best_of": 3, "n": 2, "vote": True, "temperature": 1}, "send one of them"),
    ("/v1/completions", {"prompt_logprobs": 2, "stream": True}, "without stream"),
    ("/v1/chat/completions", {"prompt_logprobs": -1}, "send 0 to 20"),
    ("/v1/chat/completions", {"continue_final_message": True}, "add_generation_prompt false"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "--trust-request-chat-template"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": "x"}}, "use the request field instead"),
    ("/v1/responses", {"previous_response_id": "resp_1"}, "send the whole conversation as input"),
    ("/v1/responses", {"max_tokens": 5}, "is max_output_tokens here"),
    ("/v1/responses", {"n": 2}, "send it to /v1/chat/completions"),
    ("/v1/responses", {"input": [{"type": "web_search_call"}]}, "send message, function_call"),
    ("/v1/responses", {"tools": [{"type": "web_search"}]}, "calls only function tools"),
    ("/completion", {"n": 2}, "send it to /v1/completions"),
    ("/tokenize", {"prompt": "a", "content": "b"}, "Send exactly one of prompt, messages"),
    ("/detokenize", {"tokens": [10**9]}, "outside the vocabulary"),
]
BASES = {
    "/v1/completions": COMPLETION,
    "/v1/chat/completions": {"messages": USER},
    "/v1/responses": {"input": "hi"},
    "/completion": {"prompt": PROMPT},
    "/tokenize": {},
    "/detokenize": {},
}


@pytest.mark.parametrize(("path", "fields", "alternative"), REFUSED)
def test_fields_this_server_cannot_honour_are_refused_naming_what_works(live, path, fields, alternative):
    status, reply = post(live, path, {**BASES[path], **fields})
    assert status == 400, reply
    message = reply["error"]["message"]
    assert alternative in message and one_sentence(message), message


# ---- vLLM's chat template fields ----


def rendered(live: Live, messages: list[dict], **kwargs) -> str:
    return live.tokenizer.apply_chat_template(messages, **kwargs)


def test_add_generation_prompt_false_renders_without_the_reply_opening(live):
    without = ok(live, "/tokenize", {"messages": USER, "add_generation_prompt": False, **NO_THINK})
    with_it = ok(live, "/tokenize", {"messages": USER, **NO_THINK})
    assert with_it["count"] > without["count"]
    assert without["tokens"] == live.tokenizer.encode(
        rendered(live, USER, add_generation_prompt=False, **NO_THINK["chat_template_kwargs"])
    )
    out = live.client().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, extra_body={"add_generation_prompt": False, **GREEDY, **NO_THINK}
    )
    assert out.usage.prompt_tokens == without["count"]


def test_continue_final_message_continues_the_assistant_text(live):
    partial = "def add(a, b):\n    return"
    messages = [*USER, {"role": "assistant", "content": partial}]
    fields = {"continue_final_message": True, "add_generation_prompt": False, **NO_THINK}
    tokens = ok(live, "/tokenize", {"messages": messages, **fields})["tokens"]
    whole = rendered(live, messages, add_generation_prompt=False, enable_thinking=False)
    prompt = whole[: whole.rindex(partial) + len(partial)]  # cut right after the text to continue
    assert live.tokenizer.decode(tokens, False) == prompt and not prompt.endswith(whole)
    out = live.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, extra_body={**fields, **GREEDY}
    )
    continued = live.client().completions.create(model=MODEL, prompt=prompt, max_tokens=8, extra_body=GREEDY)
    assert out.choices[0].message.content.strip() == continued.choices[0].text.strip()
    assert out.usage.prompt_tokens == len(tokens)


def test_a_request_chat_template_renders_the_prompt_when_the_server_trusts_it(live, monkeypatch):
    monkeypatch.setattr(ServerContext, "trusts_request_templates", True)
    template = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
    tokens = ok(live, "/tokenize", {"messages": USER, "chat_template": template})["tokens"]
    assert live.tokenizer.decode(tokens, False) == f"<<user>> {USER[0]['content']}\n"
    out = live.client().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, extra_body={"chat_template": template, **GREEDY}
    )
    plain = live.client().completions.create(model=MODEL, prompt=tokens, max_tokens=6, extra_body=GREEDY)
    assert out.usage.prompt_tokens == len(tokens)
    assert out.choices[0].message.content.strip() == plain.choices[0].text.strip()
    status, reply = post(live, "/v1/chat/completions", {"messages": USER, "chat_template": "{% for %}"})
    assert status == 400 and "not a valid Jinja template" in reply["error"]["message"]


# ---- best_of and prompt_logprobs ----


def test_best_of_answers_the_samples_with_the_highest_cumulative_logprob(live):
    sampling = {"temperature": 1.0, "seed": 11, "max_tokens": 8, "repetition_penalty": 1.0}
    every = ok(live, "/v1/completions", {**COMPLETION, **sampling, "n": 4, "logprobs": 0})
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]]
    ranked = [every["choices"][i]["text"] for i in sorted(range(4), key=lambda i: -scores[i])]
    assert len(set(ranked)) > 1
    best = live.client().completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=4, extra_body=sampling)
    assert [c.text for c in best.choices] == ranked[:2] and [c.index for c in best.choices] == [0, 1]
    assert best.choices[0].logprobs is None
    assert best.usage.completion_tokens == every["usage"]["completion_tokens"]  # all four were generated
    chat = ok(live, "/v1/chat/completions", {**CHAT, **sampling, "best_of": 3})
    assert len(chat["choices"]) == 1 and chat["choices"][0]["index"] == 0


def test_prompt_logprobs_give_each_prompt_tokens_logprob(live):
    ids = live.tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 1, "logprobs": 0, "return_token_ids": True}
    reply = ok(live, "/v1/completions", {**body, **GREEDY})
    [choice] = reply["choices"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3
        assert entry[str(token)]["decoded_token"] == live.tokenizer.decode_token(token)
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]
    # the next request's prompt holds the token just generated: its prompt logprob is that token's logprob
    [generated] = choice["token_ids"]
    longer = ok(live, "/v1/completions", {"prompt": [*ids, generated], "prompt_logprobs": 0, "max_tokens": 1, **GREEDY})
    last = longer["choices"][0]["prompt_logprobs"][len(ids)][str(generated)]["logprob"]
    assert math.isclose(last, choice["logprobs"]["token_logprobs"][0], abs_tol=1e-3)
    chat = ok(live, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 1, "max_tokens": 2, **GREEDY})
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert "prompt_logprobs" not in ok(live, "/v1/completions", {**COMPLETION, "max_tokens": 1})["choices"][0]


# ---- tool calls end after the calls they allow ----

WEATHER = [{"role": "user", "content": "What is the weather in Paris and in Oslo? Use the tools."}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_end_after_the_calls_they_allow(live, stream, parallel):
    out = live.client().chat.completions.create(
        model=MODEL,
        messages=WEATHER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=300,
        stream=stream,
        temperature=0,
        extra_body={"repetition_penalty": 1.0},
    )
    if stream:
        chunks = list(out)
        calls = [(c.function.name, c.function.arguments) for k in chunks for c in (k.choices[0].delta.tool_calls or [])]
        finish = chunks[-1].choices[0].finish_reason
    else:
        calls = [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
        finish = out.choices[0].finish_reason
        assert out.usage.completion_tokens < 300
    assert finish == "tool_calls" and calls
    assert len(set(calls)) == len(calls)  # no call repeats an earlier one
    if not parallel:
        assert len(calls) == 1


TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_one_call(live, monkeypatch, stream):
    monkeypatch.setattr(live.async_engine, "add_request", ScriptedOutput(live.tokenizer.encode(TWO_CALLS)))
    kwargs = {"model": MODEL, "messages": WEATHER, "tools": TOOLS, "max_tokens": 60, "stream": stream}
    for parallel, expected in ((True, ["Paris", "Oslo"]), (False, ["Paris"])):
        out = live.client().chat.completions.create(**kwargs, parallel_tool_calls=parallel)
        if stream:
            chunks = list(out)
            calls = [c for k in chunks for c in (k.choices[0].delta.tool_calls or [])]
            finish = [k.choices[0].finish_reason for k in chunks if k.choices and k.choices[0].finish_reason]
            assert finish == ["tool_calls"]
        else:
            calls = out.choices[0].message.tool_calls
            assert out.choices[0].finish_reason == "tool_calls"
        assert [json.loads(c.function.arguments)["city"] for c in calls] == expected


# ---- /tokenize, /detokenize, /version, /health ----


@pytest.mark.parametrize(
    "request_body",
    [{"prompt": "Hello tokens, again."}, {"model": MODEL, "prompt": "Hello tokens, again.", "return_token_strs": True}],
)
def test_tokenize_and_detokenize_round_trip(live, request_body):
    reply = ok(live, "/tokenize", request_body)
    assert reply["tokens"] == live.tokenizer.encode(request_body["prompt"]) and reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == live.async_engine.engine.config.scheduler.max_model_len
    if request_body.get("return_token_strs"):
        assert reply["token_strs"] == [live.tokenizer.id_to_token(t) for t in reply["tokens"]]
    else:
        assert reply["token_strs"] is None
    back = ok(live, "/detokenize", {"tokens": reply["tokens"]})
    assert back == {"prompt": request_body["prompt"], "content": request_body["prompt"]}


def test_tokenize_speaks_llama_servers_shape_and_chat_messages(live):
    ids = live.tokenizer.encode("Hello tokens")
    assert ok(live, "/tokenize", {"content": "Hello tokens"}) == {"tokens": ids}
    pieces = ok(live, "/tokenize", {"content": "Hello tokens", "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == "Hello tokens"
    chat = ok(live, "/tokenize", {"messages": USER, **NO_THINK})
    reply = live.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=1, extra_body=NO_THINK)
    assert chat["count"] == reply.usage.prompt_tokens


def test_version_and_health(live):
    assert live.request("GET", "/version") == (200, {"version": version("deltaspec")})
    assert live.request("GET", "/health", key=None) == (200, {"status": "ok"})


# ---- OpenAI's Responses API through the openai client ----


def test_responses_text_matches_the_chat_completion(live):
    client = live.client()
    extra = {"ignore_eos": True, **NO_THINK}
    reply = client.responses.create(
        model=MODEL, input=USER[0]["content"], max_output_tokens=12, temperature=0, extra_body=extra
    )
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0, extra_body=extra)
    assert reply.output_text == chat.choices[0].message.content
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.input_tokens == chat.usage.prompt_tokens and reply.usage.output_tokens == 12
    assert reply.id.startswith("resp_") and reply.model == MODEL and reply.output[0].type == "message"
    system = [{"role": "system", "content": "Be brief."}, *USER]
    instructed = client.responses.create(
        model=MODEL, instructions="Be brief.", input=USER, max_output_tokens=6, temperature=0, extra_body=NO_THINK
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=system, max_tokens=6, temperature=0, extra_body=NO_THINK
    )
    assert instructed.output_text == chat.choices[0].message.content
    assert instructed.usage.input_tokens == chat.usage.prompt_tokens


FUNCTION = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_responses_tools_make_function_calls_and_take_their_outputs(live):
    client = live.client()
    reply = client.responses.create(
        model=MODEL, input=WEATHER[0]["content"], tools=[FUNCTION], tool_choice="required", max_output_tokens=200
    )
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and reply.status == "completed"
    assert calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    follow_up = [
        {"role": "user", "content": WEATHER[0]["content"]},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C."},
    ]
    answered = client.responses.create(
        model=MODEL, input=follow_up, tools=[FUNCTION], max_output_tokens=4, temperature=0
    )
    history = [
        WEATHER[0],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": calls[0].call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": calls[0].arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 21 C."},
    ]
    tools = [{"type": "function", "function": {k: v for k, v in FUNCTION.items() if k != "type"}}]
    chat = client.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=4, temperature=0)
    assert answered.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_stream_events_build_the_same_response(live):
    client = live.client()
    extra = {"ignore_eos": True, **NO_THINK}
    whole = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=10, temperature=0, extra_body=extra)
    events = list(
        client.responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=10, temperature=0, stream=True, extra_body=extra
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 10
    with client.responses.stream(
        model=MODEL, input=WEATHER[0]["content"], tools=[FUNCTION], tool_choice="required", max_output_tokens=200
    ) as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["function_call"] * len(final.output) and final.output


def test_responses_text_format_constrains_the_output(live):
    number = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {"type": "object", "properties": {"n": number}, "required": ["n"], "additionalProperties": False}
    reply = live.client().responses.create(
        model=MODEL,
        input="Give a number.",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}},
    )
    assert isinstance(json.loads(reply.output_text)["n"], int)


# ---- llama-server's /completion ----


def test_llama_completion_shape_and_n_predict(live):
    reply = ok(live, "/completion", {"prompt": PROMPT, "n_predict": 7, **GREEDY})
    same = live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, extra_body=GREEDY)
    assert reply["content"] == same.choices[0].text and reply["tokens_predicted"] == 7
    assert reply["stop"] is True and reply["stop_type"] == "limit" and reply["stopping_word"] == ""
    assert reply["tokens_evaluated"] == len(live.tokenizer.encode(PROMPT)) and reply["model"] == MODEL
    assert reply["generation_settings"]["n_predict"] == 7 and reply["prompt"] == PROMPT
    assert (
        reply["timings"]["predicted_n"] == 7
        and reply["timings"]["prompt_n"] + reply["timings"]["cache_n"] == reply["tokens_evaluated"]
    )
    word = reply["content"].split()[1]
    stopped = ok(live, "/completion", {"prompt": PROMPT, "n_predict": 7, "stop": [word], **GREEDY})
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == reply["content"][: reply["content"].index(word)]


def test_llama_completion_streams_pieces_then_the_final_object(live):
    status, raw = post(live, "/completion", {"prompt": PROMPT, "n_predict": 7, "stream": True, **GREEDY})
    assert status == 200 and "[DONE]" not in raw
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    whole = ok(live, "/completion", {"prompt": PROMPT, "n_predict": 7, **GREEDY})
    assert "".join(e["content"] for e in events) == whole["content"] and events[-1]["tokens_predicted"] == 7


# ---- vLLM's metric names ----


def test_metrics_carry_vllms_names(live):
    live.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    metrics = live.metrics()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert name + labels in metrics, name
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_generation_tokens_count",
    ):
        assert metrics[name + labels] > 0, name
    assert metrics[f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}}'] >= 1
    assert metrics["vllm:generation_tokens_total" + labels] == metrics["deltaspec_generation_tokens_total"]
    assert 0 <= metrics["vllm:kv_cache_usage_perc" + labels] <= 1
