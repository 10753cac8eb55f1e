"""First-contact defaults: thinking follows the chat template's default (the embedded model's is off), sampling
defaults come from the checkpoint's generation_config.json unless a request sets them, a chat's follow-up turns
resume where its history ends, and the prefix-checkpoint threshold comes from the memory plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaspec import LLM, DeltaspecError, SamplingParams
from deltaspec.config.engine import EngineConfig
from deltaspec.engine.engine import Engine
from deltaspec.model.generation_config import sampling_defaults
from deltaspec.server.protocol import ChatCompletionRequest
from deltaspec.server.samples import sampling_params
from tests.server.live import KEY, serving
from tests.tiny_models import write_checkpoint

TURNS = [
    "Write a function that reverses a string.",
    "Now make it return None for None.",
    "Add a docstring to it.",
    "Write a test for it.",
]


def test_the_embedded_template_defaults_to_no_thinking():
    llm = LLM(device="cpu", max_num_seqs=1)
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    default = llm.tokenizer.apply_chat_template(messages)
    assert default == llm.tokenizer.apply_chat_template(messages, enable_thinking=False)
    assert default.endswith("<think>\n\n</think>\n\n")
    assert llm.tokenizer.apply_chat_template(messages, enable_thinking=True).endswith("<think>\n")


def test_server_chat_without_options_answers_in_content(tmp_path):
    """The server leaves thinking to the template's default, like `deltaspec chat`: the embedded model answers in
    `content`, with no reasoning; asked to think, the text goes to `reasoning_content`."""
    with serving(tmp_path / "log.jsonl", api_key=KEY) as live:
        client = live.client()
        user = [{"role": "user", "content": "Write a function that adds two numbers."}]
        plain = client.chat.completions.create(model="deltaspec-default", messages=user, max_tokens=60)
        message = plain.choices[0].message
        assert message.content and getattr(message, "reasoning_content", None) is None
        thinking = client.chat.completions.create(
            model="deltaspec-default",
            messages=user,
            max_tokens=30,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
        assert thinking.choices[0].message.model_extra["reasoning_content"]


def _with_generation_config(tmp_path: Path, config: dict) -> Path:
    model = write_checkpoint(tmp_path / "m", "qwen3_5", tokenizer=True)
    (model / "generation_config.json").write_text(json.dumps(config))
    return model


def test_generation_config_gives_the_sampling_defaults(tmp_path):
    model = _with_generation_config(
        tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7}
    )
    assert sampling_defaults(model) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7}
    llm = LLM(str(model), device="cpu", dtype="float32", max_num_seqs=1)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.95, 20, 7)
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}])[0].outputs[0].token_ids) <= 7
    defaults = llm.engine.sampling_defaults
    unset = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    built = sampling_params(unset, 5, None, defaults)
    assert (built.temperature, built.top_p, built.top_k, built.repetition_penalty) == (0.6, 0.95, 20, 1.0)
    given = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "top_k": 0}
    )
    built = sampling_params(given, 5, None, defaults)
    assert (built.temperature, built.top_p, built.top_k) == (0.0, 0.95, 0)
    assert sampling_params(unset, 5, None, {}).temperature == 1.0  # no generation config: OpenAI's default


def test_do_sample_false_makes_unset_requests_greedy_through_the_server(tmp_path):
    model = _with_generation_config(tmp_path, {"do_sample": False, "temperature": 0.9})
    config = EngineConfig.from_flat(model=str(model), device="cpu", dtype="float32", max_num_seqs=2)
    greedy = LLM(str(model), device="cpu", dtype="float32", max_num_seqs=1).generate(
        [{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )[0]
    with serving(tmp_path / "log.jsonl", config) as live:
        client = live.client()
        outs = [
            client.completions.create(
                model="m", prompt=[3, 4, 5], max_tokens=12, seed=seed, extra_body={"ignore_eos": True}
            )
            for seed in (1, 2)
        ]
        sampled = [
            client.completions.create(
                model="m", prompt=[3, 4, 5], max_tokens=12, seed=seed, temperature=1.0, extra_body={"ignore_eos": True}
            )
            for seed in (1, 2, 3)
        ]
    texts = {o.choices[0].text for o in outs}
    assert texts == {greedy.outputs[0].text}
    assert len({o.choices[0].text for o in sampled}) > 1  # the request's temperature wins


@pytest.mark.parametrize(
    "config, message",
    [({"temperature": "hot"}, "sets temperature to 'hot'"), ({"top_p": 0}, "invalid sampling default: top_p")],
)
def test_a_bad_generation_config_is_one_sentence(tmp_path, config, message):
    model = _with_generation_config(tmp_path, config)
    with pytest.raises(DeltaspecError, match=message):
        LLM(str(model), device="cpu", dtype="float32", max_num_seqs=1)


def test_a_four_turn_chat_prefills_only_each_turns_new_tokens(tmp_path):
    """Each follow-up resumes where it parts from the previous prompt (the previous turn rendered as this one
    renders it: up to the reply's markup): it prefills the re-rendered answer and the new user turn, nothing before
    (turns far shorter than the long-prompt threshold)."""
    with serving(tmp_path / "log.jsonl", api_key=KEY) as live:
        client, tokenizer = live.client(), live.tokenizer
        assert live.engine.config.cache.prefix_checkpoint_min_prompt > 300  # every turn here is a short prompt
        history: list[dict] = []
        cached, expected, asked = [], [], None
        for turn in TURNS:
            history.append({"role": "user", "content": turn})
            reply = client.chat.completions.create(
                model="deltaspec-default", messages=history, max_tokens=40, temperature=0
            )
            details = reply.usage.prompt_tokens_details
            cached.append(details.cached_tokens if details else 0)
            # where this prompt parts from the previous request's: where it resumes
            asked_ids = tokenizer.encode(tokenizer.apply_chat_template(asked)) if asked else []
            expected.append(tokenizer.history_length(asked_ids, asked) if asked else 0)
            asked = list(history)
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
        assert cached == expected and all(c > 0 for c in cached[1:])


def _run(engine: Engine, request_id: str, ids: list[int], history_len: int = 0, passes: int | None = None) -> None:
    engine.add_request(request_id, None, ids, SamplingParams(max_tokens=1, temperature=0), history_len=history_len)
    while engine.has_unfinished() and (passes is None or passes > 0):
        engine.step()
        passes = None if passes is None else passes - 1


def test_a_chats_parting_checkpoint_may_evict_and_its_end_checkpoint_only_takes_a_free_slot():
    """Where a chat's next turn parts from it is where the conversation resumes: that checkpoint may evict another
    whatever the prompt's length (others of a short prompt only take a free slot); a chat turn's end checkpoint
    only takes a free slot (its next turn resumes where it parts), and is evicted first."""
    config = EngineConfig.from_flat(device="cpu", dtype="float32", max_num_seqs=1, prefix_checkpoints=1)
    short = [5, 6, 7, 8, 9, 10, 11, 12]
    engine = Engine(config, progress=False)
    assert engine.config.cache.prefix_checkpoint_min_prompt == engine.plan.state_in_tokens()
    long_ids = list(range(10, 10 + engine.config.cache.prefix_checkpoint_min_prompt + 20))
    _run(engine, "long", long_ids)
    kept = {c.tokens for c in engine.cache.prefix.checkpoints.values()}
    assert len(kept) == 1 and len(next(iter(kept))) == len(long_ids)  # its end checkpoint evicted the -64 one
    _run(engine, "chat", short, history_len=5)  # its parting checkpoint evicts; its end one finds no free slot
    assert {c.tokens for c in engine.cache.prefix.checkpoints.values()} == {tuple(short[:5])}

    engine = Engine(config.with_settings(prefix_checkpoints=2), progress=False)
    _run(engine, "chat", short, history_len=5)  # the parting and the end checkpoint, each in a free slot
    _run(engine, "long", long_ids, passes=1)  # a long prompt's first checkpoint evicts the chat's end one first
    kept = {c.tokens for c in engine.cache.prefix.checkpoints.values()}
    assert tuple(short[:5]) in kept and len(kept) == 2
