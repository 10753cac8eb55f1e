"""Image decoding and preprocessing against transformers' Pillow image processor (`Qwen2VLImageProcessorPil`):
pixel values equal to the bit, grids equal."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from deltaspec.errors import DeltaspecError
from deltaspec.model.vision.preprocess import (
    decode_image,
    parse_image_processing,
    preprocess,
    read_image_processing,
    smart_resize,
)
from tests.tiny_vision import PROCESSOR

# the tiny checkpoints' processor (patch 4, merge 2: sides are multiples of 8; 16^2 .. 48^2 pixels) and the
# older spelling with min_pixels / max_pixels and transformers' defaults for everything else (patch 14, CLIP mean)
CONFIGS = {
    "size": PROCESSOR,
    "min_max_pixels": dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 9, resample=2),
}


def _image(width, height, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    channels = {"RGB": (3,), "RGBA": (4,), "L": ()}[mode]
    return Image.fromarray(rng.integers(0, 256, (height, width, *channels), dtype=np.uint8), mode=mode)


def _images():
    """Odd sizes: inside the bounds, below min_pixels, above max_pixels, thin, and RGBA, grey and palette ones."""
    palette = _image(41, 29, seed=5).convert("P")
    palette.info["transparency"] = 3
    return [
        _image(37, 29),
        _image(7, 9, seed=1),
        _image(1000, 700, seed=2),
        _image(300, 17, seed=3),
        _image(61, 61, "RGBA", seed=4),
        _image(45, 33, "L", seed=6),
        palette,
    ]


@pytest.mark.parametrize("name", CONFIGS)
def test_pixels_and_grids_match_transformers(tmp_path, name):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    raw = CONFIGS[name] | dict(image_processor_type="Qwen2VLImageProcessor")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw))
    reference = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    processing = parse_image_processing(raw)
    images = _images()
    for image in images:
        expected = reference(images=[image], return_tensors="pt")
        pixels, grids = preprocess([image], processing)
        assert grids == [tuple(expected["image_grid_thw"][0].tolist())], image.size
        assert torch.equal(pixels, expected["pixel_values"]), image.size
    expected = reference(images=images, return_tensors="pt")
    pixels, grids = preprocess(images, processing)
    assert torch.equal(pixels, expected["pixel_values"])
    assert grids == [tuple(g) for g in expected["image_grid_thw"].tolist()]


def test_smart_resize_keeps_within_bounds():
    assert smart_resize(29, 37, 8, 256, 2304) == (32, 40)  # rounded to multiples of 8
    assert smart_resize(9, 7, 8, 256, 2304) == (24, 16)  # scaled up to at least 256 pixels
    assert smart_resize(700, 1000, 8, 256, 2304) == (40, 56)  # scaled down to at most 2304
    with pytest.raises(DeltaspecError, match="longer than 200 times"):
        smart_resize(2, 500, 8, 256, 2304)


def _encoded(image, fmt="PNG"):
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def test_decode_round_trips_and_applies_exif_orientation():
    image = _image(30, 20)
    assert np.array_equal(np.asarray(decode_image(_encoded(image))), np.asarray(image))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif)
    assert decode_image(buffer.getvalue()).size == (20, 30)


def test_undecodable_and_oversized_images_are_refused():
    with pytest.raises(DeltaspecError, match=r"^The image could not be decoded \(.*\); send a PNG"):
        decode_image(b"definitely not an image")
    with pytest.raises(DeltaspecError, match="could not be decoded"):
        decode_image(_encoded(_image(64, 64))[:-200])  # truncated
    with pytest.raises(DeltaspecError, match=r"^The image has 100x80 = 8000 pixels, more than the limit of 5000;"):
        decode_image(_encoded(_image(100, 80)), max_pixels=5000)


def test_unsupported_processor_settings_are_refused(tmp_path):
    with pytest.raises(DeltaspecError, match="sets do_normalize to False"):
        parse_image_processing(PROCESSOR | dict(do_normalize=False))
    with pytest.raises(DeltaspecError, match="patch_size is 0"):
        parse_image_processing(PROCESSOR | dict(patch_size=0))
    with pytest.raises(DeltaspecError, match="has no preprocessor_config.json"):
        read_image_processing(tmp_path)
