"""Checkpoint tensor names <-> the model's parameter names: the multimodal wrapper prefix `model.language_model.` is
dropped, the vision tower skipped, and the GDN conv and gated-norm weights renamed (they are plain parameters here)."""

from __future__ import annotations

SKIPPED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")
# checkpoint spelling -> parameter name (GDN conv and gated-norm weights are plain parameters here)
RENAMES = {
    ".linear_attn.conv1d.weight": ".linear_attn.conv1d_weight",
    ".linear_attn.norm.weight": ".linear_attn.norm_weight",
}


def target_name(name: str, with_mtp: bool = True) -> str | None:
    """The model parameter a checkpoint tensor name maps to (None: skipped on purpose; the MTP head's
    tensors too unless `with_mtp`)."""
    if name.startswith(SKIPPED_PREFIXES) or (not with_mtp and name.startswith("mtp.")):
        return None
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model.") :]
    for checkpoint_suffix, param_suffix in RENAMES.items():
        if name.endswith(checkpoint_suffix):
            return name[: -len(checkpoint_suffix)] + param_suffix
    return name


def checkpoint_name(param: str) -> str:
    """The checkpoint spelling of a parameter name (inverse of `target_name`'s renames)."""
    for checkpoint_suffix, param_suffix in RENAMES.items():
        if param.endswith(param_suffix):
            return param[: -len(param_suffix)] + checkpoint_suffix
    return param
