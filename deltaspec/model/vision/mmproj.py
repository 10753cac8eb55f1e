"""llama.cpp's multimodal projector files (`mmproj-*.gguf`, written by `convert_hf_to_gguf.py --mmproj`) for the
Qwen3.5 family (`clip.projector_type` qwen3vl_merger): the vision tower they hold as a `VisionTower`, its
config from the `clip.vision.*` metadata, and the image processing llama.cpp applies.

The converter renames every tower tensor (`v.blk.N.attn_qkv`, `mm.0`, `v.post_ln`, ...; `NAMES` maps them back) and
splits the patch embedding's 3-D convolution into its two temporal slices (`v.patch_embd.weight`, `.weight.1`),
which are stacked back. Float files (F32, F16, BF16) and quantized ones (Q8_0 and the other GGUF block types) are
read, each tensor dequantized into the requested dtype. The file leaves out what the text model knows (the image
tokens' ids, the M-RoPE sections: from the text GGUF's tokenizer and `rope.dimension_sections`) and what llama.cpp
fixes for this projector: two frames per patch, LayerNorm epsilon 1e-6, GELU-tanh, RoPE theta 10000 in the tower,
and images resized to between 8 and 4096 image tokens (`clip.vision.image_min_pixels` / `image_max_pixels` when the
file sets them), bicubically."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from deltaspec.errors import DeltaspecError
from deltaspec.model.gguf_raw import RawGGUF, read_raw
from deltaspec.model.vision.config import VisionConfig, parse_vision_config
from deltaspec.model.vision.load import check_tower_tensors
from deltaspec.model.vision.preprocess import ImageProcessing, parse_image_processing
from deltaspec.model.vision.tower import VisionTower
from deltaspec.ops.quant.dequant import dequantize

PROJECTOR = "qwen3vl_merger"
NAMES = [  # llama.cpp's name (a regular expression over the block index) -> the tower's parameter
    (r"v\.blk\.(\d+)\.attn_qkv\.(weight|bias)", r"blocks.\1.attn.qkv.\2"),
    (r"v\.blk\.(\d+)\.attn_out\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (r"v\.blk\.(\d+)\.ffn_up\.(weight|bias)", r"blocks.\1.mlp.linear_fc1.\2"),
    (r"v\.blk\.(\d+)\.ffn_down\.(weight|bias)", r"blocks.\1.mlp.linear_fc2.\2"),
    (r"v\.blk\.(\d+)\.ln1\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (r"v\.blk\.(\d+)\.ln2\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (r"mm\.0\.(weight|bias)", r"merger.linear_fc1.\1"),
    (r"mm\.2\.(weight|bias)", r"merger.linear_fc2.\1"),
    (r"v\.post_ln\.(weight|bias)", r"merger.norm.\1"),
    (r"v\.patch_embd\.bias", "patch_embed.proj.bias"),
    (r"v\.position_embd\.weight", "pos_embed.weight"),
]
PATCH = ("v.patch_embd.weight", "v.patch_embd.weight.1")  # the convolution's two temporal slices
TOKENS = dict(
    image_token_id="<|image_pad|>", vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>"
)
IMAGE_TOKENS = (8, 4096)  # llama.cpp's bounds on a Qwen-VL image's tokens when the file sets no pixel bounds


def _tensor(tensor, dtype: torch.dtype) -> torch.Tensor:
    """A GGUF tensor (float, or quantized blocks) in `dtype`, in torch's layout."""
    data = np.array(tensor.data)
    if tensor.qtype == "BF16":
        values = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    elif tensor.qtype in ("F32", "F16", "F64"):
        values = torch.from_numpy(data)
    else:
        values = dequantize(torch.from_numpy(data), tensor.qtype)
    return values.reshape(tensor.shape).to(dtype)


def _parameter(name: str) -> str | None:
    for pattern, replacement in NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    return None


def mmproj_config(raw: RawGGUF, token_id, mrope_section: tuple[int, int, int]) -> tuple[VisionConfig, ImageProcessing]:
    """The tower's config and the image processing of the mmproj file `raw` (its metadata and tensor shapes);
    `token_id(text)` finds the image tokens' ids in the text model's tokenizer."""
    meta = raw.metadata
    if meta.get("general.architecture") != "clip" or meta.get("clip.projector_type") != PROJECTOR:
        raise DeltaspecError(
            f"{raw.path} is not a Qwen3.5 / Qwen3-VL multimodal projector (architecture "
            f"{meta.get('general.architecture')!r}, projector {meta.get('clip.projector_type')!r}); give the mmproj "
            "file made for this model."
        )
    if any(meta.get("clip.vision.is_deepstack_layers") or []):
        raise DeltaspecError(f"{raw.path} holds a Qwen3-VL tower with deepstack layers; deltaspec runs Qwen3.5's.")
    ids = {}
    for key, text in TOKENS.items():
        if (found := token_id(text)) is None:
            raise DeltaspecError(f"The text model's tokenizer has no {text} token, so it cannot take images.")
        ids[key] = found
    positions = raw.tensors.get("v.position_embd.weight")
    vision = dict(
        depth=meta.get("clip.vision.block_count"),
        hidden_size=meta.get("clip.vision.embedding_length"),
        intermediate_size=meta.get("clip.vision.feed_forward_length"),
        num_heads=meta.get("clip.vision.attention.head_count"),
        patch_size=meta.get("clip.vision.patch_size"),
        spatial_merge_size=meta.get("clip.vision.spatial_merge_size", 2),
        out_hidden_size=meta.get("clip.vision.projection_dim"),
        num_position_embeddings=positions.shape[0] if positions is not None else None,
    )
    text = {"rope_parameters": {"mrope_section": list(mrope_section)}}
    config = parse_vision_config({"model_type": "qwen3_5", "vision_config": vision, "text_config": text, **ids})
    unit = (config.patch_size * config.spatial_merge_size) ** 2
    processing = parse_image_processing(
        {
            "patch_size": config.patch_size,
            "temporal_patch_size": config.temporal_patch_size,
            "merge_size": config.spatial_merge_size,
            "image_mean": meta.get("clip.vision.image_mean"),
            "image_std": meta.get("clip.vision.image_std"),
            "min_pixels": meta.get("clip.vision.image_min_pixels", IMAGE_TOKENS[0] * unit),
            "max_pixels": meta.get("clip.vision.image_max_pixels", IMAGE_TOKENS[1] * unit),
        }
    )
    return config, processing


def mmproj_tensors(raw: RawGGUF, config: VisionConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tower's parameters (by name, in `dtype`) from the mmproj file `raw`; one sentence for a tensor it lacks,
    does not know or has in another shape."""
    tensors, unknown = {}, []
    for name, tensor in raw.tensors.items():
        parameter = _parameter(name)
        if parameter is not None:
            tensors[parameter] = _tensor(tensor, dtype)
        elif name not in PATCH:
            unknown.append(name)
    if unknown:
        raise DeltaspecError(f"{raw.path} has tensors deltaspec does not know: {', '.join(sorted(unknown)[:5])}.")
    if not all(name in raw.tensors for name in PATCH):
        raise DeltaspecError(f"{raw.path} lacks the patch embedding's two slices {PATCH}; the file is incomplete.")
    tensors["patch_embed.proj.weight"] = torch.stack([_tensor(raw.tensors[name], dtype) for name in PATCH], dim=2)
    tower = dict(VisionTower(config, dtype).named_parameters())
    check_tower_tensors(tower, {name: t.shape for name, t in tensors.items()}, "", str(raw.path))
    return tensors


def load_mmproj_tower(
    path: Path, token_id, mrope_section: tuple[int, int, int], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[VisionTower, ImageProcessing]:
    """The vision tower of the mmproj file at `path` on `device`, and its image processing (see `mmproj_config`)."""
    raw = read_raw(path)
    config, processing = mmproj_config(raw, token_id, mrope_section)
    tower = VisionTower(config, dtype, device)
    tensors = mmproj_tensors(raw, config, dtype)
    tower.load_state_dict({name: t.to(device) for name, t in tensors.items()}, assign=True, strict=True)
    return tower, processing
