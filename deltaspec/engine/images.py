"""The engine's image input (`ImageInput`): a multimodal checkpoint's vision tower and image processing, and a
request's images turned into its prompt's `PromptImages` when the request arrives.

A prompt marks each image with a run of image tokens, usually one (the chat template's
`<|vision_start|><|image_pad|><|vision_end|>`; a run already expanded by another processor is taken too); each run
becomes as many image tokens as its image has embeddings, the tower encodes the images one at a time (so
its workspace is one image's, whatever the count), and the three RoPE position streams and the prefix-cache ids of
the expanded prompt are computed once. What the planner counts: the tower's weights and one image's workspace at
the processor's largest size (`tower_workspace`)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from torch.func import functional_call

from deltaspec.errors import DeltaspecError
from deltaspec.model.vision.config import MROPE_SECTION_DEFAULT, VisionConfig
from deltaspec.model.vision.grid import Grid
from deltaspec.model.vision.load import TOWER_PREFIXES, load_vision_tower
from deltaspec.model.vision.mmproj import load_mmproj_tower
from deltaspec.model.vision.preprocess import ImageProcessing, decode_image, preprocess, read_image_processing
from deltaspec.model.vision.prompt import PromptImages, image_cache_ids
from deltaspec.model.vision.rope_index import expand_image_tokens, mrope_positions
from deltaspec.model.vision.tower import VisionTower

DECODE_PIXEL_LIMIT = 64 * 2**20  # the most pixels an image file may declare before it is decoded at all


def has_vision_tower(raw: dict, tensor_names) -> bool:
    """Whether a checkpoint (its parsed config.json and tensor names) is multimodal with its tower stored."""
    return "vision_config" in raw and any(name.startswith(TOWER_PREFIXES) for name in tensor_names)


def mrope_sections(raw: dict) -> tuple[int, int, int]:
    """The text model's M-RoPE sections from its config (a GGUF file's `rope.dimension_sections`), else Qwen3.5's."""
    text = raw.get("text_config") or raw
    return tuple((text.get("rope_parameters") or {}).get("mrope_section") or MROPE_SECTION_DEFAULT)[:3]


def tower_workspace(config: VisionConfig, processing: ImageProcessing, dtype: torch.dtype) -> int:
    """Bytes the tower holds while it encodes one image of the processor's largest size: the float32 patches and,
    per patch, the block's widest activations (the input, q, k, v, the attention output and the MLP's hidden)."""
    patches = processing.max_pixels // processing.patch_size**2
    widest = 5 * config.hidden_size + config.intermediate_size
    return patches * (config.patch_dim * 4 + widest * dtype.itemsize)


class TextOnly:
    """The image input of a model that takes no images: a text-only checkpoint, or one whose tower stays unloaded."""

    def __init__(self, model_dir: Path | None):
        self.model_dir = model_dir

    def check(self, count: int) -> None:
        """One sentence if a prompt carries images."""
        if count:
            raise DeltaspecError(
                f"The model at {self.model_dir} takes no images (a text-only checkpoint, or --limit-mm-per-prompt "
                "image=0); send text only."
            )

    def prompt(
        self, prompt_ids: list[int], images: tuple[bytes, ...] | PromptImages | None, history_len: int
    ) -> tuple[list[int], PromptImages | None, int]:
        """The prompt as it is; one sentence if it carries images."""
        if images:
            self.check(1 if isinstance(images, PromptImages) else len(images))
        return list(prompt_ids), None, history_len


class ImageInput:
    """The vision tower of the checkpoint at `model_dir` on `device` in `dtype`, taking at most `limit` images per
    prompt."""

    def __init__(
        self, tower: VisionTower, processing: ImageProcessing, device: torch.device, limit: int, offload: bool = False
    ):
        self.tower, self.config, self.processing = tower, tower.config, processing
        self.limit, self.device, self.offload = limit, device, offload
        if offload and device.type == "cuda":  # pinned, so that lending them is one asynchronous copy each
            for tensor in (*self.tower.parameters(), *self.tower.buffers()):
                tensor.data = tensor.data.pin_memory()
        self._encoding = threading.Lock()  # one request's images at a time: the workspace (and a lent tower) is one

    def encode(self, images: list) -> tuple[list[Grid], list[torch.Tensor]]:
        """Each decoded image's grid and embeddings [tokens, hidden] on the device, one image at a time; with
        `offload`, the tower's weights are lent device memory for these images only."""
        grids, embeds = [], []
        with self._encoding:
            weights = None
            if self.offload:
                held = {**dict(self.tower.named_parameters()), **dict(self.tower.named_buffers())}
                weights = {name: t.to(self.device, non_blocking=True) for name, t in held.items()}
            for image in images:
                pixels, (grid,) = preprocess([image], self.processing)
                grids.append(grid)
                args = (pixels, [grid])
                embeds.append(self.tower(*args) if weights is None else functional_call(self.tower, weights, args))
        return grids, embeds

    @classmethod
    def from_checkpoint(cls, model_dir: Path, dtype: torch.dtype, device: torch.device, limit: int, offload: bool):
        """The tower and image processing of the safetensors checkpoint at `model_dir`."""
        tower = load_vision_tower(model_dir, dtype, "cpu" if offload else device)
        return cls(tower, read_image_processing(model_dir), device, limit, offload)

    @classmethod
    def from_mmproj(
        cls, path: Path, token_id, mrope_section, dtype: torch.dtype, device: torch.device, limit: int, offload: bool
    ):
        """The tower of llama.cpp's mmproj file at `path` (`deltaspec.model.vision.mmproj`) and its processing."""
        tower, processing = load_mmproj_tower(path, token_id, mrope_section, dtype, "cpu" if offload else device)
        return cls(tower, processing, device, limit, offload)

    def check(self, count: int) -> None:
        """One sentence if a prompt carries more images than the limit."""
        if count > self.limit:
            raise DeltaspecError(
                f"The prompt carries {count} images, more than the limit of {self.limit}; send fewer or raise "
                "--limit-mm-per-prompt."
            )

    def prompt(
        self, prompt_ids: list[int], images: tuple[bytes, ...] | PromptImages | None, history_len: int
    ) -> tuple[list[int], PromptImages | None, int]:
        """The prompt with each run of image tokens expanded to its image's size, its `PromptImages` (None without
        images) and `history_len` counted in the expanded prompt (a history ends with a text token: it keeps as many
        text tokens as before); one sentence for too many images, undecodable bytes, an image over the pixel limit
        or placeholders that do not match."""
        if not images:
            return list(prompt_ids), None, history_len
        if isinstance(images, PromptImages):  # encoded already, its prompt expanded (`deltaspec.server`)
            return list(prompt_ids), images, history_len
        self.check(len(images))
        token, merge = self.config.image_token_id, self.config.spatial_merge_size
        runs = [t for i, t in enumerate(prompt_ids) if t != token or i == 0 or prompt_ids[i - 1] != token]
        if runs.count(token) != len(images):
            raise DeltaspecError(
                f"The prompt has {runs.count(token)} image placeholders for {len(images)} images; put one image token "
                "(the chat template's <|image_pad|>) where each image goes."
            )
        grids, embeds = self.encode([decode_image(data, DECODE_PIXEL_LIMIT) for data in images])
        ids = expand_image_tokens(runs, grids, token, merge)
        positions, delta = mrope_positions(ids, grids, token, merge)
        rows, count = [], 0
        for t in ids:
            rows.append(count if t == token else -1)
            count += t == token
        text = sum(1 for t in prompt_ids[:history_len] if t != token)
        ends = [i + 1 for i, row in enumerate(rows) if row < 0]  # after each text token
        found = PromptImages(
            torch.cat(embeds),
            positions,
            delta,
            tuple(rows),
            image_cache_ids(ids, token, list(images)),
            self.config.mrope_section,
            tuple(images),
        )
        return ids, found, ends[text - 1] if text else 0
