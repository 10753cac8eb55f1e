"""Multi-turn reuse through the server and the `openai` client: a five-turn conversation of short turns, with 32
other chats served between its turns, resumes each turn from the checkpoint its previous turn left where the next
prompt parts from it (Qwen's template drops the empty think block the generation prompt opened the reply with, so
that is before the reply's markup, not the prompt's end). Turns 2-5 report as cached at least 80 % of the previous
turn's prompt, and the replies are those of the same conversation on a server without prefix caching (float64)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from deltaspec.config.engine import EngineConfig
from deltaspec.model.tokenizer import Tokenizer
from tests.server.live import KEY, MODEL, NO_THINK, serving

TURNS = (
    "Write a function that adds two numbers.",
    "Now make it subtract them.",
    "Add a docstring.",
    "Rename it to diff.",
    "Thanks!",
)


def config(prefix_caching: bool) -> EngineConfig:
    return EngineConfig.from_flat(
        dtype="float64",
        device="cpu",
        max_num_seqs=8,
        max_model_len=2048,
        enable_prefix_caching=prefix_caching,
        prefix_checkpoints=48,
    )


def converse(live, others: int) -> list[tuple[str, int, int]]:
    """Each turn's (reply, prompt tokens, cached tokens), with `others` unrelated chats served after each turn."""
    client, history, turns = live.client(), [], []
    for turn, text in enumerate(TURNS):
        history.append({"role": "user", "content": text})
        reply = client.chat.completions.create(
            model=MODEL, messages=history, max_tokens=24, temperature=0.0, extra_body=NO_THINK
        )
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        turns.append((reply.choices[0].message.content, usage.prompt_tokens, cached))
        history.append({"role": "assistant", "content": reply.choices[0].message.content})
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(other_chat, [client] * others, [turn] * others, range(others)))
    return turns


def other_chat(client, turn: int, i: int) -> None:
    message = [{"role": "user", "content": f"Tell me fact number {i} about topic {turn}."}]
    client.chat.completions.create(model=MODEL, messages=message, max_tokens=4, temperature=0.0, extra_body=NO_THINK)


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn")
    with serving(root / "cached.jsonl", config(True), api_key=KEY, served_model_name=MODEL) as live:
        cached = converse(live, others=32)
    with serving(root / "plain.jsonl", config(False), api_key=KEY, served_model_name=MODEL) as live:
        plain = converse(live, others=0)
    return cached, plain


def test_each_turn_resumes_from_the_previous_one(conversations):
    cached, _ = conversations
    for (_, previous_prompt, _), (_, _, hit) in zip(cached, cached[1:]):
        assert hit >= 0.8 * previous_prompt, (hit, previous_prompt)


def test_the_replies_are_those_without_the_cache(conversations):
    cached, plain = conversations
    assert [reply for reply, _, _ in cached] == [reply for reply, _, _ in plain]
    assert all(hit == 0 for _, _, hit in plain)


def test_the_checkpoint_sits_where_the_next_prompt_parts():
    """Qwen's template renders an earlier assistant turn without the `<think></think>` block the generation prompt
    opened it with: the next prompt shares this one up to the reply's markup."""
    from deltaspec.model.weights import default_model_path

    tokenizer = Tokenizer.from_dir(default_model_path())
    messages = [{"role": "user", "content": TURNS[0]}]
    options = NO_THINK["chat_template_kwargs"]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, **options))
    parting = tokenizer.history_length(prompt, messages, **options)
    follow_up = [*messages, {"role": "assistant", "content": "x"}, {"role": "user", "content": TURNS[1]}]
    next_prompt = tokenizer.encode(tokenizer.apply_chat_template(follow_up, **options))
    assert next_prompt[:parting] == prompt[:parting] and next_prompt[parting] != prompt[parting]
    assert tokenizer.decode(prompt[parting:], skip_special_tokens=False) == "<think>\n\n</think>\n\n"
