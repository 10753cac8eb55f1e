"""The sizes a checkpoint's config may claim, checked before anything is built from them.

Owns the range of every size field of a model config (generous: several times the largest released model's),
so that a corrupt or hostile `config.json` or GGUF metadata (10**9 layers, a 10**12-token vocabulary) is refused
at once instead of after minutes of building lists and modules, and the check of a config's sizes against the
tensors its checkpoint's headers list (the embedding's rows and width, the decoder layers), naming the field and
what the checkpoint holds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from deltaspec.config.model import ModelConfig
from deltaspec.errors import DeltaspecError
from deltaspec.model.safetensors_files import StoredTensor

# field -> (smallest, largest) value accepted
SIZE_RANGES = {
    "num_hidden_layers": (1, 1024),
    "hidden_size": (1, 2**17),
    "vocab_size": (1, 2**24),
    "intermediate_size": (0, 2**20),
    "num_attention_heads": (1, 4096),
    "num_key_value_heads": (1, 4096),
    "head_dim": (1, 4096),
    "max_position_embeddings": (1, 2**30),
    "linear_num_key_heads": (1, 4096),
    "linear_num_value_heads": (1, 4096),
    "linear_key_head_dim": (1, 4096),
    "linear_value_head_dim": (1, 4096),
    "linear_conv_kernel_dim": (1, 64),
    "full_attention_interval": (1, 1024),
    "num_experts": (0, 2**14),
    "moe_intermediate_size": (1, 2**20),
    "shared_expert_intermediate_size": (0, 2**20),
    "decoder_sparse_step": (1, 1024),
    "mtp_num_hidden_layers": (0, 64),
}
EMBEDDING = "model.embed_tokens.weight"
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def config_size(text: Mapping[str, Any], key: str, default: Any = ...) -> int:
    """`text[key]` as a size within `SIZE_RANGES[key]`: `default` when the field is absent or null, and a
    KeyError for an absent field without one."""
    value = text[key] if default is ... else text.get(key)
    value = default if value is None and default is not ... else value
    return checked_size(SIZE_RANGES[key], key, value)


def checked_size(size_range: tuple[int, int], field: str, value: Any) -> int:
    """`value` as a whole number within `size_range`; one sentence naming `field` otherwise."""
    low, high = size_range
    whole = isinstance(value, int) and not isinstance(value, bool)
    whole = whole or (isinstance(value, float) and value.is_integer())
    if not whole or not low <= value <= high:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise DeltaspecError(
            f"The model config sets {field} to {shown}, but {field} must be a whole number from {low} to {high}; "
            "the config is corrupt, so restore the checkpoint's original one."
        )
    return int(value)


def check_config_against_tensors(config: ModelConfig, tensors: Mapping[str, StoredTensor]) -> None:
    """Refuse a config whose sizes the checkpoint's tensors contradict, before any model is built from it.

    `tensors` maps the model's parameter names (the checkpoint's names mapped as the loader maps them) to the
    tensors as the headers list them; the embedding is compared only when stored in float (a quantized one's
    shape is its blocks')."""
    embedding = tensors.get(EMBEDDING)
    if embedding is not None and len(embedding.shape) == 2 and embedding.dtype in FLOAT_DTYPES:
        rows, columns = embedding.shape
        for field, held, what in (("vocab_size", rows, "rows"), ("hidden_size", columns, "columns")):
            if getattr(config, field) != held:
                raise DeltaspecError(
                    f"The model config sets {field} to {getattr(config, field)}, but the checkpoint's {EMBEDDING} "
                    f"has {held} {what}; restore the checkpoint's original config."
                )
    layers = {int(m.group(1)) for name in tensors if (m := LAYER_RE.match(name))}
    last = max(layers, default=config.num_hidden_layers - 1)
    if last + 1 < config.num_hidden_layers:
        raise DeltaspecError(
            f"The model config sets num_hidden_layers to {config.num_hidden_layers}, but the checkpoint's tensors "
            f"stop at model.layers.{last}; restore the checkpoint's original config, or the files holding the later "
            "layers."
        )
    if last + 1 > config.num_hidden_layers:
        raise DeltaspecError(
            f"The model config sets num_hidden_layers to {config.num_hidden_layers}, but the checkpoint holds layers "
            f"up to model.layers.{last}; restore the checkpoint's original config."
        )
