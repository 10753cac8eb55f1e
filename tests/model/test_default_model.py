"""The embedded default model: it loads with no arguments, writes valid Python, and its measured
quality holds. Bounds are set from measurements of the shipped weights (docs/default-model.md), loose enough for
float32 CPU arithmetic and tight enough that an untrained or broken model fails every one."""

import ast
import json
from pathlib import Path

import pytest
import torch

from deltaspec import LLM, SamplingParams
from deltaspec.evaluate import perplexity
from deltaspec.model.weights import default_model_path
from tests.engine_helpers import forward_in_chunks
from tests.spec.test_mtp import mtp_rows, target_hidden

DATA = Path(__file__).parents[1] / "data"
SAMPLE = (DATA / "heldout_code_sample.txt").read_text()
DRAFT = default_model_path().parent / "draft"


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", speculative="mtp")


def valid_body(prompt: str, completion: str) -> tuple[bool, float]:
    """Does the completed function parse, and what share of its generated lines does the longest
    parsing prefix keep? The function ends at the first line back at column 0; a generation cut by
    max_tokens loses its last (possibly partial) line."""
    lines, ended = [], False
    for line in completion.split("\n"):
        if line.strip() and not line[0].isspace():
            ended = True
            break
        lines.append(line)
    if not ended:
        lines = lines[:-1]
    for keep in range(len(lines), 0, -1):
        try:
            function = ast.parse(prompt + "\n".join(lines[:keep])).body[0]
        except SyntaxError:
            continue
        return len(function.body) > 1, keep / len(lines)
    return False, 0.0


def test_default_model_loads_with_its_mtp_head_and_draft(llm):
    assert llm.engine.model_dir == default_model_path()
    assert llm.engine.model.mtp is not None
    assert llm.engine.model_config.vocab_size == 8192 and llm.tokenizer.vocab_size == 8192
    draft = LLM(str(DRAFT), dtype="float32", device="cpu")
    assert draft.tokenizer.encode(SAMPLE[:2000]) == llm.tokenizer.encode(SAMPLE[:2000])
    sizes = sum(f.stat().st_size for f in default_model_path().parent.glob("*/*.safetensors"))
    assert sizes <= 34_000_000  # target, MTP head, draft model and block drafter: the tree stays under 64 MiB


def test_greedy_completions_of_heldout_functions_are_valid_python(llm):
    prompts = json.loads((DATA / "heldout_functions.json").read_text())
    outs = llm.generate([p["prompt"] for p in prompts], SamplingParams(max_tokens=128, temperature=0.0))
    results = [valid_body(p["prompt"], o.outputs[0].text) for p, o in zip(prompts, outs)]
    # measured: 32 of 38 functions, 95 % of generated lines kept; an untrained model: 0 of 38
    assert sum(ok for ok, _ in results) >= 0.7 * len(prompts)
    assert sum(kept for _, kept in results) / len(results) >= 0.8


def test_heldout_perplexity_of_target_and_draft(llm):
    target = perplexity(llm, SAMPLE, window=512)
    draft = perplexity(LLM(str(DRAFT), dtype="float32", device="cpu"), SAMPLE, window=512)
    # measured: target 16.65 (1.133 bits/byte), draft 23.29 (1.268 bits/byte); untrained: ~8000
    assert target["ppl"] < 18.5 and target["bits_per_byte"] < 1.18
    assert draft["ppl"] < 26.0 and draft["bits_per_byte"] < 1.32
    assert target["ppl"] < draft["ppl"]


def test_mtp_head_predicts_two_tokens_ahead(llm):
    ids = llm.tokenizer.encode(SAMPLE)[: 2 * 512 + 2]
    correct = 0
    for start in (0, 512):
        window = ids[start : start + 514]
        hidden = target_hidden(llm.engine, window[:512])
        logits = llm.engine.model.compute_logits(mtp_rows(llm.engine, hidden, window[1:513], [512]))
        correct += (logits.argmax(-1) == torch.tensor(window[2:514])).sum().item()
    # measured on the whole sample: 0.36 (0.48 on all held-out code at 2048-token windows)
    assert correct / 1024 > 0.28


def test_chat_answers_a_coding_request_with_code(llm):
    requests = [
        "Write a function that reverses a string.",
        "Write a Python function that returns the sum of a list.",
        "Implement a function that checks whether a number is even.",
    ]
    outs = llm.chat(
        [[{"role": "user", "content": r}] for r in requests],
        SamplingParams(max_tokens=64, temperature=0),
        chat_template_kwargs={"enable_thinking": False},
    )
    assert sum("def " in o.outputs[0].text for o in outs) >= 2


@pytest.mark.parametrize("which", ["target", "draft"])
def test_transformers_loads_the_shipped_weights_with_the_same_logits(llm, which):
    import transformers as tf

    path = default_model_path() if which == "target" else DRAFT
    reference = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = llm.tokenizer.encode(SAMPLE[:1500])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    engine = llm.engine if which == "target" else LLM(str(path), dtype="float32", device="cpu").engine
    torch.testing.assert_close(forward_in_chunks(engine, ids, [len(ids)]), expected, rtol=0, atol=1e-4)


def test_a_default_chat_request_ends_in_seconds(tmp_path):
    """The shipped generation config (repetition penalty 1.2, at most 448 new tokens: chosen on the model's own
    held-out requests, benchmarks/generation-defaults-cpu-default-model.json) ends a chat request that sets no
    max_tokens, where plain greedy looped for 4,074 tokens and 181 s."""
    import time

    from tests.server.live import KEY, MODEL, serving

    report = json.loads((DATA.parent.parent / "benchmarks" / "generation-defaults-cpu-default-model.json").read_text())
    config = json.loads((default_model_path() / "generation_config.json").read_text())
    assert report["chosen"] == {key: config[key] for key in ("repetition_penalty", "max_new_tokens")}
    with serving(tmp_path / "requests.jsonl", api_key=KEY, served_model_name=MODEL) as live:
        started = time.monotonic()
        reply = live.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a function that reverses a string."}]
        )
        assert time.monotonic() - started < 60
    assert reply.usage.completion_tokens <= config["max_new_tokens"] and "def " in reply.choices[0].message.content
