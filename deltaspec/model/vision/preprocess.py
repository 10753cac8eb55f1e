"""Image bytes -> the tower's input, as the checkpoint's image processor makes it (`preprocessor_config.json`).

`decode_image` opens the bytes with Pillow (refusing, in one sentence, bytes it cannot decode and images over a
pixel limit) and applies the EXIF orientation, as transformers' `load_image` does. `preprocess` then follows
transformers' Pillow image processor for these checkpoints (`Qwen2VLImageProcessorPil`) step by step, so its
output is the same to the bit:

1. to RGB, compositing any transparency onto white;
2. resize (Pillow, the file's `resample`, bicubic by default) to `smart_resize`'s size: each side rounded to a
   multiple of `patch_size * merge_size`, then scaled (keeping the aspect ratio) into
   [`shortest_edge`, `longest_edge`] pixels in all (`min_pixels` / `max_pixels` in older files);
3. `x * rescale_factor` (computed in float64, kept in float32), then `(x - mean) / std` in float32;
4. cut into patches in merge-block order, each patch repeated `temporal_patch_size` times (an image is one
   frame), flattened as [C, Tp, P, P].
"""

from __future__ import annotations

import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from deltaspec.errors import DeltaspecError
from deltaspec.model.vision.grid import Grid

CONFIG_NAME = "preprocessor_config.json"
MAX_ASPECT_RATIO = 200
# transformers' Qwen2VLImageProcessorPil defaults, for what a preprocessor_config.json leaves out
DEFAULTS = dict(
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=(0.48145466, 0.4578275, 0.40821073),
    image_std=(0.26862954, 0.26130258, 0.27577711),
    rescale_factor=1 / 255,
    resample=Image.Resampling.BICUBIC,
)
DEFAULT_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
FLAGS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")


@dataclass(frozen=True)
class ImageProcessing:
    """What the checkpoint's image processor does to an image."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    resample: int


def parse_image_processing(raw: dict) -> ImageProcessing:
    """An image processor's settings from its parsed `preprocessor_config.json`."""
    for flag in FLAGS:
        if raw.get(flag, True) is not True:
            raise DeltaspecError(f"{CONFIG_NAME} sets {flag} to {raw[flag]!r}; deltaspec runs only the default, true.")
    size = dict(raw.get("size") or DEFAULT_SIZE)
    size["shortest_edge"] = raw.get("min_pixels", size.get("shortest_edge"))
    size["longest_edge"] = raw.get("max_pixels", size.get("longest_edge"))
    values = {key: raw.get(key, default) for key, default in DEFAULTS.items()}
    ints = dict(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]) | {
        key: values[key] for key in ("patch_size", "temporal_patch_size", "merge_size", "resample")
    }
    for key, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "resample" else 1):
            raise DeltaspecError(f"{CONFIG_NAME}'s {key} is {value!r}, not a positive integer; restore the file.")
    for key in ("image_mean", "image_std"):
        if not isinstance(values[key], (list, tuple)) or len(values[key]) != 3:
            raise DeltaspecError(f"{CONFIG_NAME}'s {key} must list 3 numbers, one per RGB channel; restore the file.")
    return ImageProcessing(
        **ints,
        image_mean=tuple(float(v) for v in values["image_mean"]),
        image_std=tuple(float(v) for v in values["image_std"]),
        rescale_factor=float(values["rescale_factor"]),
    )


def read_image_processing(model_dir: Path) -> ImageProcessing:
    """The image processing of the checkpoint at `model_dir`."""
    path = model_dir / CONFIG_NAME
    if not path.is_file():
        raise DeltaspecError(f"{model_dir} has no {CONFIG_NAME}, so its images cannot be prepared; restore it.")
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise DeltaspecError(f"{path} is not valid JSON ({exc}); restore the checkpoint's {CONFIG_NAME}.") from None
    if not isinstance(raw, dict):
        raise DeltaspecError(f"{path} must hold a JSON object; restore the checkpoint's {CONFIG_NAME}.")
    return parse_image_processing(raw)


def decode_image(data: bytes, max_pixels: int = Image.MAX_IMAGE_PIXELS) -> Image.Image:
    """The image encoded in `data` (any format Pillow reads), EXIF orientation applied; one sentence if the bytes
    are no image Pillow can decode or the image has more than `max_pixels` pixels (checked before decoding)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise DeltaspecError("The image has too many pixels to decode safely; send a smaller image.") from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad input
        raise DeltaspecError(f"The image could not be decoded ({exc}); send a PNG, JPEG, GIF or WebP file.") from None
    width, height = image.size
    if width * height > max_pixels:
        raise DeltaspecError(
            f"The image has {width}x{height} = {width * height} pixels, more than the limit of {max_pixels}; "
            "send a smaller image."
        )
    try:
        image.load()
        return ImageOps.exif_transpose(image)
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad input
        raise DeltaspecError(f"The image could not be decoded ({exc}); send a PNG, JPEG, GIF or WebP file.") from None


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of `factor`, the aspect ratio kept as far as that
    allows, and the area within [min_pixels, max_pixels] (transformers' `smart_resize`)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise DeltaspecError(
            f"The image is {width}x{height} pixels, longer than {MAX_ASPECT_RATIO} times its width or height; "
            "crop it or pad it closer to square."
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, any transparency composited onto white (transformers' `convert_to_rgb`)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _patches(image: np.ndarray, p: ImageProcessing) -> tuple[np.ndarray, Grid]:
    """An image [H, W, C] (float32, normalised) as patches in merge-block order.  # [gh * gw, C * Tp * P * P]"""
    height, width, channels = image.shape
    m, size = p.merge_size, p.patch_size
    gh, gw = height // size, width // size
    blocks = image.transpose(2, 0, 1).reshape(channels, gh // m, m, size, gw // m, m, size)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], p.temporal_patch_size, size, size))
    return frames.reshape(gh * gw, -1), (1, gh, gw)


def preprocess(images: list[Image.Image], p: ImageProcessing) -> tuple[torch.Tensor, list[Grid]]:
    """The tower's input for `images`: their patches back to back (float32) and each one's grid (t, h, w).
    # pixels [sum of t * h * w, C * Tp * P * P]"""
    mean, std = np.array(p.image_mean, dtype=np.float32), np.array(p.image_std, dtype=np.float32)
    factor = p.patch_size * p.merge_size
    parts, grids = [], []
    for image in images:
        rgb = to_rgb(image)
        height, width = smart_resize(rgb.height, rgb.width, factor, p.min_pixels, p.max_pixels)
        resized = np.asarray(rgb.resize((width, height), resample=p.resample))  # [H, W, 3] uint8
        scaled = (resized.astype(np.float64) * p.rescale_factor).astype(np.float32)
        patches, grid = _patches((scaled - mean) / std, p)
        parts.append(patches)
        grids.append(grid)
    return torch.from_numpy(np.concatenate(parts)), grids
