"""llama.cpp's multimodal projector files, as its own converter writes them (`convert_hf_to_gguf.py --mmproj`, f32,
f16 and q8_0; `tools/make_mmproj_fixtures.py`, `tests/data/gguf_llama/vision/`): their tower equals the checkpoint's
they were made from, and a GGUF model with `--mmproj` answers an image as the safetensors checkpoint does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaspec.config.engine import EngineConfig
from deltaspec.engine.planning import plan_for
from deltaspec.errors import DeltaspecError
from deltaspec.llm import LLM
from deltaspec.model.vision.load import load_vision_tower
from deltaspec.model.vision.mmproj import load_mmproj_tower
from deltaspec.sample.params import SamplingParams
from tests.tiny_vision import IMAGE_TOKEN, VISION_END, VISION_START
from tests.vision.test_vision_engine import IMAGES, PROMPT

DATA = Path(__file__).parents[1] / "data" / "gguf_llama" / "vision"
CHECKPOINT, TEXT = DATA / "checkpoint", DATA / "text-f32.gguf"
TOKENS = {"<|image_pad|>": IMAGE_TOKEN, "<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END}
# the largest difference from the checkpoint's float32 parameters each stored type allows
TOLERANCE = {"f32": 0.0, "f16": 1e-3, "q8_0": 2e-2}


@pytest.mark.parametrize("kind", sorted(TOLERANCE))
def test_the_projector_holds_the_checkpoints_tower(kind):
    tower, processing = load_mmproj_tower(DATA / f"mmproj-{kind}.gguf", TOKENS.get, (11, 11, 10), torch.float32)
    reference = load_vision_tower(CHECKPOINT, torch.float32)
    assert tower.config == reference.config
    ours, theirs = dict(tower.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in theirs.items():
        scale = param.abs().max().item()
        assert (ours[name] - param).abs().max().item() <= TOLERANCE[kind] * scale, name
    assert (processing.patch_size, processing.merge_size, processing.image_mean) == (4, 2, (0.5, 0.5, 0.5))
    assert (processing.min_pixels, processing.max_pixels) == (8 * 64, 4096 * 64)  # llama.cpp's 8 to 4096 tokens


def test_a_gguf_model_with_its_projector_answers_images_as_the_checkpoint():
    """Images of 2240 and 660 pixels: inside both the checkpoint's and llama.cpp's bounds, so both resize alike."""
    gguf = LLM(model=str(TEXT), mmproj=str(DATA / "mmproj-f32.gguf"), dtype="float64", device="cpu", max_model_len=512)
    checkpoint = LLM(model=str(CHECKPOINT), dtype="float64", device="cpu", max_model_len=512)
    request = {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": IMAGES}}
    params = SamplingParams(max_tokens=10, temperature=0.0, prompt_logprobs=0)
    ours, theirs = gguf.generate(request, params)[0], checkpoint.generate(request, params)[0]
    assert ours.prompt_token_ids == theirs.prompt_token_ids and ours.outputs[0].token_ids == theirs.outputs[0].token_ids
    for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
        assert next(iter(a.values())).logprob == pytest.approx(next(iter(b.values())).logprob, abs=1e-12)
    messages = [{"role": "user", "content": [{"type": "image", "image": IMAGES[0]}, {"type": "text", "text": "?"}]}]
    assert (
        gguf.chat(messages, params)[0].outputs[0].token_ids == checkpoint.chat(messages, params)[0].outputs[0].token_ids
    )


def test_the_plan_counts_the_projectors_tower():
    with_tower = plan_for(EngineConfig.from_flat(model=str(TEXT), mmproj=str(DATA / "mmproj-f16.gguf"), device="cpu"))
    alone = plan_for(EngineConfig.from_flat(model=str(TEXT), device="cpu"))
    tower = load_vision_tower(CHECKPOINT, torch.float32)
    elements = sum(p.numel() for p in tower.parameters())
    assert with_tower.plan.weights - alone.plan.weights == elements * 4  # float32 on the CPU
    assert with_tower.images_per_prompt == 8 and alone.images_per_prompt == 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(model=str(CHECKPOINT), mmproj=str(DATA / "mmproj-f32.gguf")), "projector file for a GGUF model"),
        (dict(model=str(TEXT), mmproj=str(DATA / "missing.gguf")), "does not exist"),
        (dict(model=str(TEXT), mmproj=str(TEXT)), "is not a Qwen3.5 / Qwen3-VL multimodal projector"),
    ],
    ids=["safetensors", "missing", "not-a-projector"],
)
def test_a_projector_that_cannot_serve_is_one_sentence(settings, message):
    with pytest.raises(DeltaspecError, match=message):
        plan_for(EngineConfig.from_flat(device="cpu", **settings))
