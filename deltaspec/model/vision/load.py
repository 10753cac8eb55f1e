"""Build a checkpoint's vision tower and fill it from the tower's safetensors tensors (`model.visual.*`, or
`visual.*` in older layouts), each read on its own and converted to the requested dtype on the target device."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from deltaspec.errors import DeltaspecError
from deltaspec.model.hf_config import read_config_json
from deltaspec.model.safetensors_files import StoredTensor, checkpoint_tensors, open_safetensors
from deltaspec.model.vision.config import parse_vision_config
from deltaspec.model.vision.tower import VisionTower

TOWER_PREFIXES = ("model.visual.", "visual.")


def _listing(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:5])
    return shown + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")


def tower_tensors(tensors: dict[str, StoredTensor]) -> tuple[str, dict[str, StoredTensor]]:
    """The tower's prefix in the checkpoint and its tensors, named without it (empty when it has none)."""
    for prefix in TOWER_PREFIXES:
        found = {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}
        if found:
            return prefix, found
    return TOWER_PREFIXES[0], {}


def load_vision_tower(model_dir: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> VisionTower:
    """The vision tower of the checkpoint at `model_dir`, every parameter read from its files."""
    config = parse_vision_config(read_config_json(model_dir))
    prefix, stored = tower_tensors(checkpoint_tensors(model_dir))
    if not stored:
        raise DeltaspecError(
            f"The checkpoint at {model_dir} has no vision-tower tensors ({prefix}*), so it cannot read images."
        )
    tower = VisionTower(config, dtype, device)
    params = dict(tower.named_parameters())
    check_tower_tensors(params, {name: t.shape for name, t in stored.items()}, prefix, f"The checkpoint at {model_dir}")
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in params:
        by_file[stored[name].file].append(name)
    loaded = {}
    for file, names in by_file.items():
        with open_safetensors(file) as f:
            for name in names:
                loaded[name] = f.get_tensor(prefix + name).to(device=device, dtype=dtype)
    tower.load_state_dict(loaded, assign=True, strict=True)
    return tower


def check_tower_tensors(params: dict[str, torch.Tensor], shapes: dict, prefix: str, where: str) -> None:
    """One sentence if the stored tensors (`shapes`, by parameter name) miss, add to or misshape the tower's
    parameters; `where` names the file or checkpoint, `prefix` how it names them."""
    unexpected = sorted(prefix + name for name in shapes if name not in params)
    missing = sorted(prefix + name for name in params if name not in shapes)
    if unexpected or missing:
        what = (
            f"lacks {len(missing)} tensors the tower needs: {_listing(missing)}"
            if missing
            else (f"has {len(unexpected)} vision tensors deltaspec does not know: {_listing(unexpected)}")
        )
        raise DeltaspecError(f"{where} {what}.")
    for name, param in params.items():
        if tuple(shapes[name]) != tuple(param.shape):
            raise DeltaspecError(
                f"{where}'s {prefix}{name} has shape {list(shapes[name])} but its vision config makes it "
                f"{list(param.shape)}; restore the files."
            )
