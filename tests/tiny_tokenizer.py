"""Builds a tiny Qwen-style byte-level BPE tokenizer and chat template for tests.

`write_tiny_tokenizer` trains the tokenizer deterministically on the text embedded below (no downloads)
and writes `tokenizer.json` and `tokenizer_config.json` into a directory, next to a tiny test model.
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Control tokens that `decode(skip_special_tokens=True)` removes."""

TEXT_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
"""Added tokens that are not special, as in real Qwen tokenizers: they survive `skip_special_tokens`."""

CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.reasoning_content is string %}
            {{- '<think>\n' + message.reasoning_content | trim + '\n</think>\n\n' }}
        {%- endif %}
        {%- if message.content is string %}
            {{- message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if not loop.first or message.content %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role + '.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""
"""A compact Qwen3.5-style template: ChatML turns, JSON tool calls, and an open `<think>` unless thinking is off."""

_TRAINING_TEXT = '''\
The quick brown fox jumps over the lazy dog. A tokenizer splits text into pieces, and the model
predicts the next piece from the ones before it. When the answer is ready, the assistant stops.
Speculative decoding drafts several tokens with a small model and verifies them with the large one
in a single forward pass; accepted tokens are kept and the first rejected token is resampled.
Hybrid models mix linear attention layers, which keep a fixed-size recurrent state, with full
attention layers, which keep a key and value cache that grows with the sequence length.
Please write a short function that returns the sum of the squares of a list of numbers.
Sure! Here is a simple version, followed by a test that checks the result for a few inputs.
What is the weather like in Paris today? It is sunny and warm, with a light wind from the west.
The user asked for the time in Tokyo, so I should call the get_time tool with the city name.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14 2.718 -1 1e-6 and dates like 2024-05-01.

def sum_of_squares(values: list[float]) -> float:
    """Return the sum of the squares of the values."""
    total = 0.0
    for value in values:
        total += value * value
    return total


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.count = start

    def increment(self, step: int = 1) -> int:
        self.count += step
        return self.count


def test_sum_of_squares() -> None:
    assert sum_of_squares([]) == 0.0
    assert sum_of_squares([1.0, 2.0, 3.0]) == 14.0
    counter = Counter()
    for _ in range(3):
        counter.increment()
    assert counter.count == 3


if __name__ == "__main__":
    import json
    print(json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}))
    data = {"items": [1, 2, 3], "ok": True, "error": None}
    print(f"{len(data['items'])} items, ok={data['ok']}")
'''


def write_tiny_tokenizer(directory: Path, vocab_size: int = 384) -> None:
    """Train the tiny tokenizer and write `tokenizer.json` and `tokenizer_config.json` into `directory`.

    The byte-level BPE gets `vocab_size - 7` entries (256 bytes plus merges); the three special tokens and the four
    text tokens follow at the end of the vocabulary in the order `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`,
    `<think>`, `</think>`, `<tool_call>`, `</tool_call>`, as in real Qwen tokenizers. Training is deterministic.
    """
    added = len(SPECIAL_TOKENS) + len(TEXT_TOKENS)
    if not 256 + added <= vocab_size <= 512:
        raise ValueError(f"vocab_size must be between {256 + added} and 512, got {vocab_size}.")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - added,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    write_tokenizer_config(tokenizer, directory, max_length=4096)


def write_tokenizer_config(tokenizer: Tokenizer, directory: Path, max_length: int) -> None:
    """`tokenizer_config.json` for a Qwen-style tokenizer with the added tokens at the end and the chat template."""
    added_tokens_decoder = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
        for token in SPECIAL_TOKENS + TEXT_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
