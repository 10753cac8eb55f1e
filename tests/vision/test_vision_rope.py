"""The text model's three position streams for prompts with images, and their cos / sin tables, against
transformers (`Qwen3_5Model.get_rope_index`, `Qwen3_5TextRotaryEmbedding`)."""

from __future__ import annotations

import copy

import pytest
import torch

from deltaspec.errors import DeltaspecError
from deltaspec.model.vision.rope_index import expand_image_tokens, mrope_positions
from deltaspec.ops.mrope import mrope_cos_sin
from deltaspec.ops.rope import cos_sin, inv_frequencies
from tests.tiny_vision import IMAGE_TOKEN, VISION_END, VISION_START, make_multimodal

IMAGE = [VISION_START, IMAGE_TOKEN, VISION_END]
# (prompt with one image token per image, grids): images first, last, side by side, alone; wide, tall and square
# grids; text only
PROMPTS = [
    ([5, 6, 7, *IMAGE, 8, 9], [(1, 4, 6)]),
    ([*IMAGE, 10, 11, *IMAGE, *IMAGE, 12], [(1, 8, 2), (1, 2, 2), (1, 6, 10)]),
    ([20, 21, *IMAGE], [(1, 12, 4)]),
    ([*IMAGE], [(1, 4, 4)]),
    ([30, 31, 32, 33], []),
]


@pytest.fixture(scope="module")
def reference():
    return make_multimodal().model


@pytest.mark.parametrize(("prompt", "grids"), PROMPTS)
def test_positions_match_get_rope_index(reference, prompt, grids):
    ids = expand_image_tokens(prompt, grids, IMAGE_TOKEN, 2)
    positions, delta = mrope_positions(ids, grids, IMAGE_TOKEN, 2)
    input_ids = torch.tensor([ids])
    expected, expected_delta = reference.get_rope_index(
        input_ids,
        mm_token_type_ids=(input_ids == IMAGE_TOKEN).int(),  # what the processor marks: image tokens 1, text 0
        image_grid_thw=torch.tensor(grids) if grids else None,
    )
    assert torch.equal(positions, expected[:, 0]) and delta == int(expected_delta)


def test_expand_gives_each_image_its_embeddings():
    assert expand_image_tokens([1, IMAGE_TOKEN, 2], [(1, 4, 6)], IMAGE_TOKEN, 2) == [1, *[IMAGE_TOKEN] * 6, 2]
    with pytest.raises(DeltaspecError, match="2 image placeholders for 1 images"):
        expand_image_tokens([IMAGE_TOKEN, IMAGE_TOKEN], [(1, 2, 2)], IMAGE_TOKEN, 2)


def test_mismatched_image_tokens_are_refused():
    with pytest.raises(DeltaspecError, match="1 runs of image tokens for 2 images"):
        mrope_positions([1, *[IMAGE_TOKEN] * 2], [(1, 2, 2), (1, 2, 2)], IMAGE_TOKEN, 2)
    with pytest.raises(DeltaspecError, match="6 embeddings has 5 image tokens"):
        mrope_positions([1, *[IMAGE_TOKEN] * 5], [(1, 4, 6)], IMAGE_TOKEN, 2)


def test_cos_sin_match_transformers(reference):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    text = copy.deepcopy(reference.config.text_config)
    # all 16 dims of the tiny model's heads rotary: 8 frequency pairs, interleaved 3 / 3 / 2
    text.rope_parameters |= dict(partial_rotary_factor=1.0, mrope_section=[3, 3, 2])
    ids = expand_image_tokens(PROMPTS[1][0], PROMPTS[1][1], IMAGE_TOKEN, 2)
    positions, _ = mrope_positions(ids, PROMPTS[1][1], IMAGE_TOKEN, 2)
    rotary = Qwen3_5TextRotaryEmbedding(text)
    expected = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    inv_freq = inv_frequencies(rotary.inv_freq.shape[0] * 2, text.rope_parameters["rope_theta"], torch.float32, "cpu")
    assert torch.equal(inv_freq, rotary.inv_freq)
    ours = mrope_cos_sin(positions, inv_freq, (3, 3, 2), torch.float32)
    assert torch.equal(ours[0], expected[0][0]) and torch.equal(ours[1], expected[1][0])


def test_equal_streams_are_plain_rope():
    positions = torch.arange(40)
    inv_freq = inv_frequencies(16, 1e7, torch.float64, "cpu")
    ours = mrope_cos_sin(positions.expand(3, -1), inv_freq, (3, 3, 2), torch.float64)
    plain = cos_sin(positions, inv_freq, torch.float64)
    assert torch.equal(ours[0], plain[0]) and torch.equal(ours[1], plain[1])
