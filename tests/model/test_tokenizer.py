"""Tests for deltaspec.model.tokenizer: encoding, special tokens, eos ids and chat-template rendering.

Rendering is checked against exact strings and against transformers' `apply_chat_template` as the oracle.
"""

import json
import shutil
from pathlib import Path

import pytest

from deltaspec.errors import DeltaspecError
from deltaspec.model.tokenizer import Tokenizer
from tests.tiny_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, TEXT_TOKENS, write_tiny_tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city, e.g. <Paris> & Zürich.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "kelvin"]}},
            "required": ["city"],
        },
    },
}

TOOL_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "I should call the tool.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}},
        ],
    },
    {"role": "tool", "content": "21 C"},
    {"role": "tool", "content": "19 C"},
]

# Exercises what the tiny template does not: plain `{% %}` tags (trim_blocks / lstrip_blocks), special-token
# variables, tojson options and HTML characters, namespace, loop controls and template kwargs.
FEATURE_TEMPLATE = """{{ bos_token }}[{{ eos_token }}|{{ pad_token }}]
{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message.role == 'stop' %}{% break %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    <{{ message.role }}> {{ message | tojson(indent=2, sort_keys=true) }}
    {% if message.thinking is defined %}thinking={{ message.thinking }}{% endif %}
{% endfor %}
count={{ ns.count }} tools={{ tools | tojson(separators=(',', ':')) }} style={{ style | default('none') }}
documents_is_none={{ documents is none }}
{% if add_generation_prompt %}GO{% endif %}
"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the tiny tokenizer and its chat template."""
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    """The tiny tokenizer loaded by deltaspec."""
    loaded = Tokenizer.from_dir(tiny_dir)
    assert loaded is not None
    return loaded


def copy_tokenizer(tiny_dir: Path, tmp_path: Path, **config_updates: object) -> Path:
    """Copy the tiny tokenizer into `tmp_path`, changing tokenizer_config.json keys (None removes a key)."""
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    for key, value in config_updates.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox.",
        "  leading and trailing spaces  \n\n\ttabs\r\n",
        "unicode: héllo wörld, 日本語, emoji 🦊🚀, math ∑∫√, combining é",
        'def f(x: int) -> int:\n    """Doc."""\n    return {"a": [x ** 2, None]}["a"][0]  # comment\n',
        "",
    ],
)
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_decode_token_gives_each_token_text(tok: Tokenizer) -> None:
    assert "".join(tok.decode_token(i) for i in tok.encode("plain ascii text")) == "plain ascii text"
    assert tok.decode_token(tok.token_to_id("<|endoftext|>")) == "<|endoftext|>"


def test_vocab_and_added_token_layout(tok: Tokenizer) -> None:
    assert tok.vocab_size == 384
    added = SPECIAL_TOKENS + TEXT_TOKENS
    assert [tok.token_to_id(t) for t in added] == list(range(384 - len(added), 384))
    assert tok.id_to_token(tok.token_to_id("<think>")) == "<think>"
    assert tok.id_to_token(10_000) is None
    assert tok.token_to_id("<not a token>") is None


def test_special_tokens_encode_to_single_ids_and_skip(tok: Tokenizer) -> None:
    im_start, im_end, think, end_think = (tok.token_to_id(t) for t in SPECIAL_TOKENS[1:] + TEXT_TOKENS[:2])
    text = "<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHi!<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == im_start and ids[-1] == im_end
    assert think in ids and end_think in ids
    assert tok.decode(ids) == "assistant\n<think>\nhmm\n</think>\n\nHi!"
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode_token(im_end) == "<|im_end|>"


def test_eos_ids_from_tokenizer_config_only(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == frozenset({tok.token_to_id("<|im_end|>")})


def test_eos_ids_union_with_generation_config(tiny_dir: Path, tmp_path: Path) -> None:
    directory = copy_tokenizer(tiny_dir, tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [377, 5]}))
    loaded = Tokenizer.from_dir(directory)
    assert loaded is not None
    assert loaded.eos_token_ids == frozenset({377, 5, loaded.token_to_id("<|im_end|>")})

    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    copy_tokenizer(tiny_dir, tmp_path, eos_token=None)
    loaded = Tokenizer.from_dir(directory)
    assert loaded is not None
    assert loaded.eos_token_ids == frozenset({7})


def test_missing_tokenizer_json_gives_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert Tokenizer.from_dir(tmp_path) is None


def test_corrupt_tokenizer_json_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(DeltaspecError, match="tokenizer.json could not be read"):
        Tokenizer.from_dir(tmp_path)


def test_added_tokens_decoder_adds_missing_tokens(tiny_dir: Path, tmp_path: Path) -> None:
    decoder = json.loads((tiny_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    decoder["384"] = {"content": "<|extra|>", "special": True}
    loaded = Tokenizer.from_dir(copy_tokenizer(tiny_dir, tmp_path, added_tokens_decoder=decoder))
    assert loaded is not None
    assert loaded.token_to_id("<|extra|>") == 384
    assert loaded.vocab_size == 385
    assert loaded.decode(loaded.encode("a<|extra|>b")) == "ab"


def test_user_message_generation_prompt_thinking_on_and_off(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    head = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages) == head + "<think>\n"
    assert tok.apply_chat_template(messages, enable_thinking=True) == head + "<think>\n"
    assert tok.apply_chat_template(messages, enable_thinking=False) == head + "<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "<|im_start|>user\nHi there<|im_end|>\n"


def test_tools_appear_in_system_block(tok: Tokenizer) -> None:
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL]
    )
    system, rest = rendered.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert rest == "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_assistant_tool_call_and_tool_responses_render(tok: Tokenizer) -> None:
    rendered = tok.apply_chat_template(TOOL_CONVERSATION[1:], enable_thinking=False)
    assert rendered == (
        "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\n19 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_reasoning_aliases_reach_the_template(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "thinking": "Add."}]
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\nAdd.\n</think>\n\n4<|im_end|>\n"
    )


def test_chat_template_jinja_overrides_config(tiny_dir: Path, tmp_path: Path) -> None:
    directory = copy_tokenizer(tiny_dir, tmp_path)
    (directory / "chat_template.jinja").write_text("FILE:{{ messages[0].content }}")
    loaded = Tokenizer.from_dir(directory)
    assert loaded is not None
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "FILE:x"


def test_named_templates_pick_default_and_tool_use(tiny_dir: Path, tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "TOOLS:{{ tools | length }}"},
        {"name": "default", "template": "DEFAULT:{{ messages | length }}"},
    ]
    loaded = Tokenizer.from_dir(copy_tokenizer(tiny_dir, tmp_path, chat_template=templates))
    assert loaded is not None
    messages = [{"role": "user", "content": "x"}]
    assert loaded.apply_chat_template(messages) == "DEFAULT:1"
    assert loaded.apply_chat_template(messages, tools=[WEATHER_TOOL]) == "TOOLS:1"


def test_missing_template_is_a_user_error(tiny_dir: Path, tmp_path: Path) -> None:
    loaded = Tokenizer.from_dir(copy_tokenizer(tiny_dir, tmp_path, chat_template=None))
    assert loaded is not None and not loaded.has_chat_template
    with pytest.raises(DeltaspecError, match="has no chat template; use generate"):
        loaded.apply_chat_template([{"role": "user", "content": "x"}])


def test_raise_exception_in_template_is_a_user_error(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]
    with pytest.raises(DeltaspecError, match="System message must be at the beginning"):
        tok.apply_chat_template(messages)
    with pytest.raises(DeltaspecError, match="Unexpected message role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_broken_templates_and_messages_are_user_errors(tiny_dir: Path, tmp_path: Path) -> None:
    loaded = Tokenizer.from_dir(copy_tokenizer(tiny_dir, tmp_path, chat_template="{% for m in messages %}"))
    assert loaded is not None
    with pytest.raises(DeltaspecError, match="is not valid Jinja"):
        loaded.apply_chat_template([{"role": "user", "content": "x"}])
    loaded = Tokenizer.from_dir(copy_tokenizer(tiny_dir, tmp_path, chat_template="{{ messages[0].content.x.y }}"))
    assert loaded is not None
    with pytest.raises(DeltaspecError, match="could not render these messages"):
        loaded.apply_chat_template([{"role": "user", "content": "x"}])
    loaded = Tokenizer.from_dir(copy_tokenizer(tiny_dir, tmp_path, chat_template="{{ 'a' + messages[0].content }}"))
    assert loaded is not None
    with pytest.raises(DeltaspecError, match="could not render these messages"):
        loaded.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    with pytest.raises(DeltaspecError, match="empty conversation"):
        loaded.apply_chat_template([])
    with pytest.raises(DeltaspecError, match="must be dicts"):
        loaded.apply_chat_template(["hello"])


def test_tiny_tokenizer_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE


def _transformers_normalises_messages() -> bool:
    """Newer transformers (seen in 5.24, not in 5.17) drop None-valued message keys and alias
    `reasoning` / `thinking` / `reasoning_content` before rendering; we follow the newer behaviour."""
    try:
        import transformers
        from packaging.version import Version
    except ImportError:
        return False
    return Version(transformers.__version__) >= Version("5.24")


needs_message_normalisation = pytest.mark.skipif(
    not _transformers_normalises_messages(), reason="this transformers does not normalise messages before rendering"
)

PARITY_CASES = [
    ([{"role": "user", "content": "Hi"}], None, {}),
    ([{"role": "user", "content": "Hi"}], None, {"enable_thinking": False}),
    ([{"role": "user", "content": "Hi"}], None, {"add_generation_prompt": False}),
    pytest.param(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning": "Simple <sum> & carry."},
            {"role": "user", "content": "And 3+3? ✓"},
        ],
        None,
        {"enable_thinking": True},
        marks=needs_message_normalisation,
    ),
    pytest.param(TOOL_CONVERSATION, [WEATHER_TOOL], {}, marks=needs_message_normalisation),
    pytest.param(TOOL_CONVERSATION[1:], [WEATHER_TOOL], {"enable_thinking": False}, marks=needs_message_normalisation),
]


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, FEATURE_TEMPLATE], ids=["tiny", "features"])
@pytest.mark.parametrize("messages,tools,kwargs", PARITY_CASES)
def test_rendering_matches_transformers(
    tiny_dir: Path, tmp_path: Path, template: str, messages: list[dict], tools: list[dict] | None, kwargs: dict
) -> None:
    transformers = pytest.importorskip("transformers")
    directory = copy_tokenizer(tiny_dir, tmp_path, chat_template=template)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|endoftext|>"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_dir(directory)
    assert ours is not None
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    kwargs = {"add_generation_prompt": True, **kwargs, "style": "terse"}
    expected = reference.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, tools=tools, **kwargs) == expected
