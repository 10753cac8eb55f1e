"""Images through the engine and `LLM` on a tiny random multimodal checkpoint (`Qwen3_5ForConditionalGeneration`,
tests/tiny_vision.py): greedy output and prompt logprobs equal transformers' with the same images (float64), chat
content parts, prefix caching keyed by the image's bytes, speculative decoding and trees with images, the planner's
count of the tower, and one sentence for every image a request cannot use."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from deltaspec.engine.planning import plan_for
from deltaspec.errors import DeltaspecError
from deltaspec.llm import LLM
from deltaspec.model.vision.preprocess import decode_image, preprocess, read_image_processing
from deltaspec.sample.params import SamplingParams
from tests.greedy_helpers import assert_follows
from tests.hf_reference import float64_class
from tests.tiny_vision import IMAGE_TOKEN, VISION_END, VISION_START, write_multimodal, write_vision_tokenizer

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def png(height: int, width: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def placeholder() -> list[int]:
    return [VISION_START, IMAGE_TOKEN, VISION_END]


IMAGES = [png(40, 56, 0), png(33, 20, 1)]
PROMPT = [5, 6, *placeholder(), 7, 8, *placeholder(), 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = write_multimodal(tmp_path_factory.mktemp("multimodal"))
    write_vision_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), dtype="float64", device="cpu", max_model_len=512, max_num_seqs=4)


def reference_model(model_dir):
    """transformers' multimodal model of the checkpoint in float64 (its float32 islands computed in float64)."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    model_class = float64_class(tf.AutoModelForImageTextToText._model_mapping[type(config)])
    model = model_class.from_pretrained(
        model_dir, config=config, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    # the wrapper builds its text model from transformers' own module (float32 RoPE): use the float64 copy's
    text_class = float64_class(type(model.model.language_model))
    text_config = model.model.language_model.config  # as loaded: eager attention and experts
    text_model = text_class(text_config).to(torch.float64).eval()
    text_model.load_state_dict(model.model.language_model.state_dict())
    model.model.language_model = text_model
    return model


def embeddings(model_dir, images: list[bytes]) -> list[int]:
    """How many embeddings (image tokens) the processor and tower give each image: 2 x 2 patches merged."""
    _, grids = preprocess([decode_image(b) for b in images], read_image_processing(model_dir))
    return [t * h * w // 4 for t, h, w in grids]


def reference_inputs(model_dir, ids: list[int], images: list[bytes]) -> dict:
    pixels, grids = preprocess([decode_image(b) for b in images], read_image_processing(model_dir))
    input_ids = torch.tensor([ids])
    kinds = (input_ids == IMAGE_TOKEN).int()  # what the processor returns beside the ids: 1 for an image token
    return dict(
        input_ids=input_ids, mm_token_type_ids=kinds, pixel_values=pixels.double(), image_grid_thw=torch.tensor(grids)
    )


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_greedy_output_and_prompt_logprobs_equal_transformers_with_the_same_images(llm, model_dir, kind, tmp_path):
    if kind != "qwen3_5":
        model_dir = write_multimodal(tmp_path / kind, kind)
        llm = LLM(model=str(model_dir), dtype="float64", device="cpu", max_model_len=512)
    reference = reference_model(model_dir)
    params = SamplingParams(max_tokens=10, temperature=0.0, prompt_logprobs=0)
    (out,) = llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": IMAGES}}, params)
    ids = out.prompt_token_ids
    inputs = reference_inputs(model_dir, ids, IMAGES)
    sizes = embeddings(model_dir, IMAGES)
    assert len(ids) == len(PROMPT) - 2 + sum(sizes) and ids.count(IMAGE_TOKEN) == sum(sizes)
    with torch.no_grad():
        expected = reference.generate(**inputs, max_new_tokens=10, do_sample=False)[0, len(ids) :].tolist()
        logits = reference(**inputs).logits[0].log_softmax(-1)
    assert out.outputs[0].token_ids == expected
    ours = [next(iter(entry.values())).logprob for entry in out.prompt_logprobs[1:]]
    theirs = logits[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert ours == pytest.approx(theirs, abs=1e-9)  # the image rows and the text after them alike


def test_images_change_the_output_and_text_only_prompts_run_as_before(llm):
    first = llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": IMAGES}}, GREEDY)[0]
    swapped = llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": IMAGES[::-1]}}, GREEDY)[0]
    text = llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, GREEDY)[0]
    assert first.outputs[0].token_ids != swapped.outputs[0].token_ids
    assert len(text.prompt_token_ids) == 5 and len(text.outputs[0].token_ids) == 10


def test_an_expanded_placeholder_and_a_pillow_image_are_taken_too(llm):
    one = llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": IMAGES}}, GREEDY)[0]
    expanded = list(one.prompt_token_ids)  # as another processor expands the placeholders
    pillow = [Image.open(io.BytesIO(image)) for image in IMAGES]
    again = llm.generate({"prompt_token_ids": expanded, "multi_modal_data": {"image": pillow}}, GREEDY)[0]
    assert again.prompt_token_ids == one.prompt_token_ids and again.outputs[0].token_ids == one.outputs[0].token_ids


def test_chat_takes_image_url_and_image_parts_where_the_template_puts_them(llm, model_dir):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look "},
                {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}},
                {"type": "text", "text": " and "},
                {"type": "image", "image": IMAGES[1]},
                {"type": "text", "text": "?"},
            ],
        }
    ]
    prompt = llm.chat_prompt(messages)
    assert prompt["multi_modal_data"]["image"] == IMAGES
    (out,) = llm.chat(messages, GREEDY)
    direct = llm.generate(prompt, GREEDY)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    assert out.prompt_token_ids.count(IMAGE_TOKEN) == sum(embeddings(model_dir, IMAGES))


def test_prefix_caching_keys_image_tokens_by_the_image_bytes(model_dir):
    cached = LLM(
        model=str(model_dir),
        dtype="float64",
        device="cpu",
        max_model_len=512,
        max_num_seqs=4,
        prefix_checkpoints=8,
        prefix_checkpoint_min_prompt=8,
    )
    plain = LLM(model=str(model_dir), dtype="float64", device="cpu", max_model_len=512, enable_prefix_caching=False)
    shared = [*PROMPT, 10, 11, 12]  # a chat's history: what its next turn shares

    def ask(llm, images, turn):
        request = {"prompt_token_ids": [*shared, *turn], "multi_modal_data": {"image": images}}
        return llm.generate(request | {"history_len": len(shared)}, GREEDY)[0]

    first = ask(cached, IMAGES, [13, 14])
    follow_up = ask(cached, IMAGES, [15, 16])
    history = len(shared) - 2 + sum(embeddings(model_dir, IMAGES))  # the history with its images expanded
    assert first.num_cached_tokens == 0 and follow_up.num_cached_tokens == history
    assert follow_up.outputs[0].token_ids == ask(plain, IMAGES, [15, 16]).outputs[0].token_ids
    other = [IMAGES[0], png(33, 20, 7)]  # the same text and sizes, another second image
    different = ask(cached, other, [15, 16])
    assert different.num_cached_tokens == 0  # the only checkpoint holds the other image
    assert different.outputs[0].token_ids == ask(plain, other, [15, 16]).outputs[0].token_ids
    again = ask(cached, other, [17])
    assert again.num_cached_tokens == history  # its own checkpoint


@pytest.mark.parametrize("tree", [0, 8], ids=["chain", "tree"])
def test_speculative_greedy_with_images_equals_plain_greedy(model_dir, llm, tree):
    spec = LLM(
        model=str(model_dir),
        dtype="float64",
        device="cpu",
        max_model_len=512,
        speculative="draft",
        draft_model=str(model_dir),  # its own text model drafts, blind to the images: its drafts are often wrong
        draft_tokens=4,
        speculative_tree=tree,
    )
    request = {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": IMAGES}}
    params = SamplingParams(max_tokens=24, temperature=0.0)
    out = spec.generate(request, params)[0]
    assert out.outputs[0].token_ids == llm.generate(request, params)[0].outputs[0].token_ids
    assert out.metrics["spec_rounds"] > 0 and out.metrics["acceptance_length"] > 0


def test_a_structured_output_constraint_holds_with_an_image_in_the_prompt(llm):
    import json

    from deltaspec.sample.params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    spec = StructuredOutputsParams(json=schema)
    messages = [{"role": "user", "content": [{"type": "image", "image": IMAGES[0]}, {"type": "text", "text": "n?"}]}]
    for seed in range(3):
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=seed, structured_outputs=spec)
        out = llm.chat(messages, params)[0].outputs[0]
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text)["n"], int)


def test_the_plan_counts_the_tower_and_a_limit_of_zero_leaves_it_out(model_dir):
    from safetensors.torch import load_file

    tower = sum(t.numel() for name, t in load_file(model_dir / "model.safetensors").items() if ".visual." in name)
    with_tower = plan_for(_config(model_dir))
    without = plan_for(_config(model_dir, limit_mm_per_prompt="image=0"))
    assert with_tower.images_per_prompt == 8 and without.images_per_prompt == 0
    assert with_tower.plan.weights - without.plan.weights == tower * 8  # float64
    offloaded = plan_for(_config(model_dir, vision_tower_offload=True))
    assert offloaded.plan.weights == without.plan.weights  # the tower is lent device memory per request instead
    text_only = LLM(
        model=str(model_dir), dtype="float64", device="cpu", max_model_len=512, limit_mm_per_prompt="image=0"
    )
    with pytest.raises(DeltaspecError, match="takes no images"):
        text_only.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": IMAGES}}, GREEDY)


def test_an_offloaded_tower_gives_the_same_output(model_dir, llm):
    offloaded = LLM(model=str(model_dir), dtype="float64", device="cpu", max_model_len=512, vision_tower_offload=True)
    request = {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": IMAGES}}
    assert (
        offloaded.generate(request, GREEDY)[0].outputs[0].token_ids
        == llm.generate(request, GREEDY)[0].outputs[0].token_ids
    )


def _config(model_dir, **settings):
    from deltaspec.config.engine import EngineConfig

    return EngineConfig.from_flat(model=str(model_dir), dtype="float64", device="cpu", max_model_len=512, **settings)


@pytest.mark.parametrize(
    ("images", "prompt", "message"),
    [
        ([b"not an image"], PROMPT[:5], "could not be decoded"),
        ([IMAGES[0]], PROMPT, "2 image placeholders for 1 images"),
        ([IMAGES[0]] * 9, [*placeholder()] * 9, "more than the limit of 8"),
        (["https://example.com/cat.png"], PROMPT[:5], "does not fetch images from the network"),
        (["file:///etc/hostname"], PROMPT[:5], "--allowed-local-media-path"),
        (["data:image/png;base64,@@@"], PROMPT[:5], "valid base64"),
        ([3], PROMPT[:5], "not int"),
    ],
    ids=["undecodable", "placeholders", "too-many", "network", "local-file", "base64", "type"],
)
def test_every_unusable_image_is_one_sentence(llm, images, prompt, message):
    with pytest.raises(DeltaspecError, match=message):
        llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}, GREEDY)


def test_local_files_are_read_only_under_the_allowed_path(model_dir, tmp_path):
    (tmp_path / "a.png").write_bytes(IMAGES[0])
    local = LLM(
        model=str(model_dir), dtype="float64", device="cpu", max_model_len=512, allowed_local_media_path=str(tmp_path)
    )
    inline = local.generate({"prompt_token_ids": PROMPT[:5], "multi_modal_data": {"image": [IMAGES[0]]}}, GREEDY)[0]
    for source in (str(tmp_path / "a.png"), f"file://{tmp_path / 'a.png'}"):
        out = local.generate({"prompt_token_ids": PROMPT[:5], "multi_modal_data": {"image": [source]}}, GREEDY)[0]
        assert out.outputs[0].token_ids == inline.outputs[0].token_ids
    with pytest.raises(DeltaspecError, match="outside the allowed local media path"):
        local.generate({"prompt_token_ids": PROMPT[:5], "multi_modal_data": {"image": [str(model_dir / "x.png")]}})


def test_the_server_takes_image_url_parts_from_the_openai_client(model_dir, llm, tmp_path):
    import openai

    from deltaspec.config.engine import EngineConfig
    from tests.server.live import KEY, serving

    config = EngineConfig.from_flat(model=str(model_dir), dtype="float64", device="cpu", max_model_len=512)
    content = [
        {"type": "text", "text": "what is "},
        {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}},
        {"type": "text", "text": "?"},
    ]
    messages = [{"role": "user", "content": content}]
    expected = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0))[0]
    with serving(tmp_path / "log.jsonl", config, api_key=KEY, served_model_name="mm") as live:
        client = live.client()
        reply = client.chat.completions.create(model="mm", messages=messages, max_tokens=8, temperature=0.0)
        assert reply.choices[0].message.content == expected.outputs[0].text
        assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)  # the image's tokens counted
        broken = [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
        ]
        with pytest.raises(openai.BadRequestError, match="could not be decoded"):
            client.chat.completions.create(model="mm", messages=broken, max_tokens=4)
        remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]}]
        with pytest.raises(openai.BadRequestError, match="does not fetch images from the network"):
            client.chat.completions.create(model="mm", messages=remote, max_tokens=4)
        too_many = [{"role": "user", "content": [content[1]] * 9}]
        with pytest.raises(openai.BadRequestError, match="more than the limit of 8"):
            client.chat.completions.create(model="mm", messages=too_many, max_tokens=4)
        parts = [
            {"type": "input_text", "text": "what is "},
            {"type": "input_image", "image_url": data_url(IMAGES[0])},
            {"type": "input_text", "text": "?"},
        ]
        response = client.responses.create(
            model="mm", input=[{"role": "user", "content": parts}], max_output_tokens=8, temperature=0.0
        )
        assert response.output_text == expected.outputs[0].text  # the Responses API's input_image part too
        assert client.chat.completions.create(model="mm", messages=messages, max_tokens=8, temperature=0.0).choices


def test_the_cli_chat_shows_the_model_an_image_file(model_dir, llm, tmp_path, capsys):
    from deltaspec.cli import main

    (tmp_path / "a.png").write_bytes(IMAGES[0])
    flags = ["--model", str(model_dir), "--dtype", "float64", "--device", "cpu", "--max-model-len", "512"]
    sampling = ["--max-tokens", "6", "--temperature", "0"]
    assert main(["chat", *flags, *sampling, "--image", str(tmp_path / "a.png"), "what is this?"]) == 0
    out, _ = capsys.readouterr()
    messages = [
        {"role": "user", "content": [{"type": "image", "image": IMAGES[0]}, {"type": "text", "text": "what is this?"}]}
    ]
    assert out.strip() == llm.chat(messages, SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].text.strip()
    assert main(["chat", *flags, *sampling, "--image", str(tmp_path / "missing.png"), "hi"]) == 2
    assert "cannot be read" in capsys.readouterr().err


@pytest.mark.gpu
def test_on_cuda_images_match_the_cpu_and_an_offloaded_tower_returns_its_memory(model_dir, llm):
    """On the GPU in float32 with the kernels (RoPE at the images' positions) and CUDA graphs for the decode rows
    after the image prompt: the CPU float64 engine's prompt logprobs within 1e-4 and its greedy tokens
    (`assert_follows`); with the tower offloaded, the same tokens, and no device memory held by the tower once a
    request's images are encoded."""
    request = {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": IMAGES}}
    scored = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, prompt_logprobs=0)
    want = llm.generate(request, scored)[0]
    tokens = None
    for offload in (False, True):
        gpu = LLM(model=str(model_dir), dtype="float32", device="cuda", max_model_len=512, vision_tower_offload=offload)
        got = gpu.generate(request, scored)[0]
        for mine, theirs in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            token = next(iter(theirs))
            assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
        assert_follows(got.outputs[0], want.outputs[0], 1e-4)
        assert tokens is None or got.outputs[0].token_ids == tokens  # the offloaded tower's output is the same
        tokens = got.outputs[0].token_ids
        front = gpu.engine.images
        assert next(front.tower.parameters()).device.type == ("cpu" if offload else "cuda")
        before = torch.cuda.memory_allocated()
        _, embeds = front.encode([decode_image(IMAGES[0])])
        held = sum(-(-e.numel() * e.element_size() // 512) * 512 for e in embeds)  # the allocator's 512-byte units
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before <= held  # only the embeddings stay


def test_two_tensor_parallel_ranks_answer_images_as_one(model_dir, llm):
    """Rank 0 records each request's image files; the follower encodes them itself and steps in lock step."""
    split = LLM(model=str(model_dir), dtype="float64", device="cpu", max_model_len=512, tensor_parallel_size=2)
    try:
        request = {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": IMAGES}}
        got = split.generate(request, GREEDY)[0].outputs[0].token_ids
    finally:
        split.close()
    assert got == llm.generate(request, GREEDY)[0].outputs[0].token_ids
