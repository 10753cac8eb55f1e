"""The vision tower against transformers' (`Qwen3_5VisionModel`) on tiny random multimodal checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from deltaspec.errors import DeltaspecError
from deltaspec.model.vision.config import parse_vision_config
from deltaspec.model.vision.grid import merged_tokens, position_taps, rotary_positions
from deltaspec.model.vision.load import load_vision_tower
from deltaspec.model.vision.preprocess import preprocess, read_image_processing
from tests.tiny_vision import reference_tower, write_multimodal

# odd shapes in patches (multiples of the merge size 2): smaller and larger than the 6 x 6 position table, wide and
# tall, and a two-frame grid (attention stays within each frame)
GRIDS = [(1, 4, 6), (1, 8, 8), (1, 2, 2), (1, 10, 4), (2, 4, 4)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {kind: write_multimodal(tmp_path_factory.mktemp(kind), kind) for kind in ("qwen3_5", "qwen3_5_moe")}


def _pixels(grids, seed=0):
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@torch.no_grad()
def _reference(model_dir, dtype, pixels, grids):
    return reference_tower(model_dir, dtype)(pixels.to(dtype), grid_thw=torch.tensor(grids)).pooler_output


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float64, 1e-9), (torch.float32, 1e-5), (torch.bfloat16, 8e-3)], ids=str
)
def test_tower_matches_transformers(checkpoints, kind, dtype, atol):
    pixels = _pixels(GRIDS)
    ours = load_vision_tower(checkpoints[kind], dtype)(pixels, GRIDS)
    expected = _reference(checkpoints[kind], dtype, pixels, GRIDS)
    assert ours.dtype == dtype and ours.shape == (sum(merged_tokens(g, 2) for g in GRIDS), 64)
    torch.testing.assert_close(ours, expected, rtol=0, atol=atol)


def test_each_image_is_encoded_alone(checkpoints):
    """Images in one batch do not see one another: each one's rows equal its encoding on its own."""
    tower = load_vision_tower(checkpoints["qwen3_5"], torch.float64)
    pixels = _pixels(GRIDS)
    together = tower(pixels, GRIDS).split([merged_tokens(g, 2) for g in GRIDS])
    for rows, alone, grid in zip(pixels.split([t * h * w for t, h, w in GRIDS]), together, GRIDS, strict=True):
        torch.testing.assert_close(tower(rows, [grid]), alone, rtol=0, atol=1e-12)


@torch.no_grad()
def test_images_through_processor_and_tower_match_transformers(checkpoints):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model_dir = checkpoints["qwen3_5"]
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(53, 37), (20, 90)]]
    pixels, grids = preprocess(images, read_image_processing(model_dir))
    expected = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(images=images, return_tensors="pt")
    assert torch.equal(pixels, expected["pixel_values"]) and grids == [
        tuple(g) for g in expected["image_grid_thw"].tolist()
    ]
    ours = load_vision_tower(model_dir, torch.float64)(pixels, grids)
    reference = _reference(model_dir, torch.float64, expected["pixel_values"], expected["image_grid_thw"].tolist())
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-9)


def test_grid_tables_match_transformers():
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    grid_thw = torch.tensor(GRIDS)
    assert torch.equal(rotary_positions(GRIDS, 2), get_vision_position_ids(grid_thw, 2))
    indices, weights = position_taps(GRIDS, 6, 2)
    ref_indices, ref_weights = get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=6, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    assert torch.equal(indices, ref_indices) and torch.equal(weights, ref_weights)


def test_config_reads_the_tower_tokens_and_mrope_sections(checkpoints):
    raw = json.loads((checkpoints["qwen3_5_moe"] / "config.json").read_text())
    config = parse_vision_config(raw)
    assert (config.depth, config.hidden_size, config.num_heads, config.patch_dim, config.position_side) == (
        2,
        32,
        2,
        96,
        6,
    )
    assert (config.image_token_id, config.vision_start_token_id, config.mrope_section) == (500, 502, (11, 11, 10))
    raw["text_config"]["rope_parameters"]["mrope_section"] = [3, 3, 2]
    assert parse_vision_config(raw).mrope_section == (3, 3, 2)
    raw["vision_config"]["num_heads"] = 0
    with pytest.raises(DeltaspecError, match="vision_config.num_heads is 0, not a positive integer"):
        parse_vision_config(raw)


def test_text_only_checkpoint_has_no_tower():
    with pytest.raises(DeltaspecError, match="has no vision tower"):
        parse_vision_config({"model_type": "qwen3_5_text", "hidden_size": 64})


def test_missing_and_misshapen_tensors_are_refused(checkpoints, tmp_path):
    source = checkpoints["qwen3_5"]
    for name in ("config.json", "preprocessor_config.json"):
        (tmp_path / name).write_text((source / name).read_text())
    weights = load_file(source / "model.safetensors")
    del weights["model.visual.merger.linear_fc2.bias"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(
        DeltaspecError, match=r"lacks 1 tensors the tower needs: model\.visual\.merger\.linear_fc2\.bias"
    ):
        load_vision_tower(tmp_path, torch.float32)
    config = json.loads((source / "config.json").read_text())
    config["vision_config"]["intermediate_size"] = 40
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(load_file(source / "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(DeltaspecError, match=r"mlp\.linear_fc1\.weight has shape \[48, 32\] but"):
        load_vision_tower(tmp_path, torch.float32)
