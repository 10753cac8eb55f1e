"""The vision tower's shape and the image-token ids, read from a multimodal checkpoint's `config.json`.

`qwen3_5` and `qwen3_5_moe` checkpoints hold the tower's shape in `vision_config` and the ids of the image
placeholder and its delimiters at the top level; defaults are transformers' (`Qwen3_5VisionConfig`,
`Qwen3_5Config`) for what a file leaves out. The text model's M-RoPE sections live in `text_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltaspec.errors import DeltaspecError

VISION_TYPES = ("qwen3_5", "qwen3_5_moe")
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_act -> F.gelu's `approximate`
DEFAULTS = dict(
    depth=27,
    hidden_size=1152,
    hidden_act="gelu_pytorch_tanh",
    intermediate_size=4304,
    num_heads=16,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=3584,
    num_position_embeddings=2304,
)
TOKEN_DEFAULTS = dict(image_token_id=248056, vision_start_token_id=248053, vision_end_token_id=248054)
MROPE_SECTION_DEFAULT = (11, 11, 10)


@dataclass(frozen=True)
class VisionConfig:
    """The tower's shape, its rotary base, the image-token ids and the text model's M-RoPE sections."""

    depth: int
    hidden_size: int
    hidden_act: str
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, int, int]
    layer_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def position_side(self) -> int:
        """The side of the square learned position table."""
        return int(self.num_position_embeddings**0.5)

    @property
    def gelu_approximate(self) -> str:
        return ACTIVATIONS[self.hidden_act]


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DeltaspecError(
            f"config.json's {key} is {value!r}, not a positive integer; restore the checkpoint's config.json."
        )
    return value


def parse_vision_config(raw: dict[str, Any]) -> VisionConfig:
    """The tower of the checkpoint whose parsed `config.json` is `raw`; one sentence if it has none."""
    vision = raw.get("vision_config")
    if raw.get("model_type") not in VISION_TYPES or not isinstance(vision, dict):
        raise DeltaspecError(
            f"This checkpoint (model_type {raw.get('model_type')!r}) has no vision tower, so it cannot read images; "
            "use a multimodal Qwen3.5 checkpoint (model_type qwen3_5 or qwen3_5_moe with a vision_config)."
        )
    sizes = {key: vision.get(key, default) for key, default in DEFAULTS.items()}
    for key, value in sizes.items():
        if key != "hidden_act":
            _positive_int(value, f"vision_config.{key}")
    if sizes["hidden_act"] not in ACTIVATIONS:
        raise DeltaspecError(
            f"The vision tower's activation {sizes['hidden_act']!r} is not supported; deltaspec runs "
            f"{', '.join(ACTIVATIONS)}."
        )
    if sizes["hidden_size"] % sizes["num_heads"] or (sizes["hidden_size"] // sizes["num_heads"]) % 4:
        raise DeltaspecError(
            "config.json's vision_config.hidden_size must split into heads whose size is a multiple of 4; restore "
            "the checkpoint's config.json."
        )
    rope = vision.get("rope_parameters") or {}
    text_rope = (raw.get("text_config") or {}).get("rope_parameters") or {}
    section = tuple(text_rope.get("mrope_section") or MROPE_SECTION_DEFAULT)
    if len(section) != 3:
        raise DeltaspecError(
            f"config.json's mrope_section is {list(section)}, not three sizes; restore the checkpoint's config.json."
        )
    tokens = {key: _positive_int(raw.get(key, default), key) for key, default in TOKEN_DEFAULTS.items()}
    return VisionConfig(**sizes, rope_theta=float(rope.get("rope_theta", 10000.0)), mrope_section=section, **tokens)
