"""The Python API end to end: text and chat prompts, stops, logprobs, seeds, n, and user errors."""

import pytest
import torch

from deltaspec import LLM, DeltaspecError, SamplingParams
from tests.hf_reference import load_reference, reference_logits

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(text_checkpoint):
    return LLM(str(text_checkpoint), dtype="float64", device="cpu")


def test_text_prompt_round_trips_through_the_tokenizer(llm):
    out = llm.generate("def add(a, b):", GREEDY)[0]
    assert out.prompt == "def add(a, b):"
    assert out.prompt_token_ids == llm.tokenizer.encode("def add(a, b):")
    assert len(out.outputs[0].token_ids) == 16 and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert out.metrics["num_prompt_tokens"] == len(out.prompt_token_ids)
    assert out.metrics["time_to_first_token"] > 0 and out.metrics["decode_tok_s"] > 0


def test_chat_renders_the_template_with_enable_thinking(llm):
    messages = [{"role": "user", "content": "Write hello world."}]
    off = llm.chat(messages, GREEDY, chat_template_kwargs={"enable_thinking": False})[0]
    on = llm.chat(messages, GREEDY)[0]
    assert off.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert off.prompt == llm.tokenizer.apply_chat_template(messages, enable_thinking=False)
    batch = llm.chat(
        [messages, messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]], GREEDY
    )
    assert len(batch) == 2 and batch[0].outputs[0].token_ids == on.outputs[0].token_ids


def test_stop_token_ids_and_eos(llm):
    free = llm.generate("x = 1", GREEDY)[0].outputs[0].token_ids
    stop_id = free[4]
    first = free.index(stop_id)
    out = llm.generate("x = 1", SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == free[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.text == llm.tokenizer.decode(free[:first])  # the stop token's text is dropped, as in vLLM
    kept = llm.generate(
        "x = 1", SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == llm.tokenizer.decode(free[: first + 1])
    eos_llm_out = llm.generate("x = 1", SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
    eos = llm.tokenizer.token_to_id("<|im_end|>")
    if eos in free:
        assert eos_llm_out.token_ids == free[: free.index(eos) + 1] and eos_llm_out.finish_reason == "stop"
    else:
        assert eos_llm_out.token_ids == free


def test_stop_strings_cut_the_text(llm):
    full = llm.generate("import os", GREEDY)[0].outputs[0]
    text = full.text
    assert len(text) >= 6
    stop = text[3:5]
    at = text.find(stop)
    cut = llm.generate("import os", SamplingParams(max_tokens=16, temperature=0, stop=[stop]))[0].outputs[0]
    assert cut.text == text[:at] and cut.finish_reason == "stop" and cut.stop_reason == stop
    assert len(cut.token_ids) < len(full.token_ids) or at + len(stop) > len(llm.tokenizer.decode(full.token_ids[:-1]))
    kept = llm.generate(
        "import os", SamplingParams(max_tokens=16, temperature=0, stop=stop, include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == text[: at + len(stop)]


def test_logprobs_match_the_reference_distribution(llm, text_checkpoint):
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate("class A:", params)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    reference = torch.log_softmax(reference_logits(load_reference(text_checkpoint, torch.float64), ids), -1)
    n_prompt = len(out.prompt_token_ids)
    for step, (token, lps) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = reference[n_prompt - 1 + step]
        top = row.topk(3).indices.tolist()
        assert list(lps)[0] == token and set(top) <= set(lps)
        for t, lp in lps.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=1e-9)
            assert lp.decoded_token == llm.tokenizer.decode_token(t)
        assert lps[top[0]].rank == 1
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n_prompt
    for i in range(1, n_prompt):
        target = out.prompt_token_ids[i]
        assert out.prompt_logprobs[i][target].logprob == pytest.approx(reference[i - 1, target].item(), abs=1e-9)


def test_prompt_logprobs_survive_chunked_prefill(text_checkpoint):
    chunked = LLM(str(text_checkpoint), dtype="float64", device="cpu", max_num_batched_tokens=3)
    whole = LLM(str(text_checkpoint), dtype="float64", device="cpu")
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    prompt = "def add(a, b):\n    return a + b\n"
    a, b = chunked.generate(prompt, params)[0], whole.generate(prompt, params)[0]
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert {t: p.logprob for t, p in x.items()} == pytest.approx({t: p.logprob for t, p in y.items()}, abs=1e-12)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate("def f():", params)[0].outputs[0].token_ids
    batched = llm.generate(
        ["x", "def f():", "y"],
        [SamplingParams(max_tokens=5, temperature=1.0), params, SamplingParams(max_tokens=3, temperature=0.0)],
    )
    assert batched[1].outputs[0].token_ids == alone
    other = llm.generate("def f():", SamplingParams(max_tokens=12, temperature=1.0, seed=43, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_n_samples_come_back_in_one_request_output(llm):
    out = llm.generate("if x:", SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True))
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1


def test_user_errors_are_one_clear_sentence(llm):
    cases = [
        (lambda: llm.generate({"prompt_token_ids": [i % 500 for i in range(5000)]}, GREEDY), "exceeds the context"),
        (lambda: llm.generate({"prompt_token_ids": [1, 10**6]}, GREEDY), "must lie in"),
        (lambda: llm.generate({"prompt_token_ids": []}, GREEDY), "empty"),
        (lambda: llm.generate({"prompt": ["x"]}, GREEDY), "a 'prompt' string or a 'prompt_token_ids' list"),
        (lambda: llm.generate({"prompt": "x", "images": []}, GREEDY), "unknown key(s) images"),
        (lambda: llm.generate({"prompt": "x", "multi_modal_data": {"audio": b""}}, GREEDY), "images are all"),
        (lambda: llm.generate({"prompt": "x", "multi_modal_data": {"image": b"\x89PNG"}}, GREEDY), "no images"),
        (lambda: llm.generate(["a", "b"], [GREEDY] * 3), "sampling params"),
        (lambda: LLM(str(llm.engine.model_dir), dtype="float64", device="cpu", max_num_seq=3), "Unknown LLM option"),
        (lambda: LLM(str(llm.engine.model_dir), device="cpu", block_size=0), "block_size must be at least 1"),
        (lambda: LLM(str(llm.engine.model_dir), device="cpu", dtype="int7"), "Unknown dtype"),
    ]
    if not torch.cuda.is_available():
        cases.append((lambda: LLM(str(llm.engine.model_dir), device="cuda"), "CUDA is not available"))
    for call, fragment in cases:
        with pytest.raises(DeltaspecError) as err:
            call()
        message = str(err.value)
        assert fragment in message and "\n" not in message and message.endswith(".")


def test_no_model_without_the_embedded_default_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr("deltaspec.model.weights.default_model_path", lambda: tmp_path / "missing")
    with pytest.raises(DeltaspecError, match="embedded default model"):
        LLM()
