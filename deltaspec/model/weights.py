"""Find a checkpoint and load its weights into a `HybridModel`, lazily, tensor by tensor.

`resolve_model_path` turns a directory or a Hugging Face hub id into a local directory (`model_dir_for`:
the embedded default model when none is given).
`load_model` first checks the config's sizes against the tensors the checkpoint's headers list
(`deltaspec.model.config_sizes`; the files and headers are checked by `deltaspec.model.safetensors_files`), then
builds the model on the meta device, reads each safetensors tensor on its own (never a whole file), converts it
to the requested dtype on the target device, and assigns it.
Checkpoint names are mapped to the model's parameter names (`deltaspec.model.checkpoint_names`), and per-expert
MoE tensors are packed into the fused expert tensors here. A tensor-parallel rank reads
only its slices of each tensor (`deltaspec.parallel.shard.Shard`; safetensors reads slices without the rest).
A quantized checkpoint's matrices (FP8 block-scaled, int4 W4A16) become blocks (`deltaspec.model.hf_quant`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from deltaspec.config.model import ModelConfig
from deltaspec.errors import DeltaspecError
from deltaspec.model.checkpoint_names import checkpoint_name, target_name
from deltaspec.model.config_sizes import check_config_against_tensors
from deltaspec.model.hf_quant import Blocks, checkpoint_quantization
from deltaspec.model.hybrid import HybridModel, fused_once_loaded
from deltaspec.model.layers import set_weight
from deltaspec.model.safetensors_files import checkpoint_tensors, open_safetensors
from deltaspec.ops.dispatch import OpTable
from deltaspec.ops.quant.checkpoint_layout import weight_name
from deltaspec.parallel.group import SINGLE, TensorParallel
from deltaspec.parallel.pipeline import holds
from deltaspec.parallel.shard import Shard, shard_config

EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")
HUB_ID_RE = re.compile(r"^[\w.-]+/[\w.-]+$")


def default_model_path() -> Path:
    """The embedded default model, shipped inside the package."""
    return Path(__file__).resolve().parent.parent / "default_model" / "target"


def model_dir_for(model: str | None) -> Path:
    """The checkpoint directory (or GGUF file) of `model`, or of the embedded default model when it is None."""
    if model is not None:
        return resolve_model_path(model)
    path = default_model_path()
    if not (path / "config.json").is_file():
        raise DeltaspecError(
            "No model was given and the embedded default model is not installed; "
            "pass a checkpoint directory or hub id with --model / LLM(model=...)."
        )
    return path


def resolve_model_path(model: str) -> Path:
    """A local checkpoint directory for `model` (a directory, or a hub id fetched when online)."""
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.suffix == ".gguf":
        raise DeltaspecError(f"No GGUF file at {model}; give the path of an existing .gguf file.")
    if path.exists():
        raise DeltaspecError(
            f"{model} is a file but not a .gguf one; --model takes a checkpoint directory, a GGUF file or a Hugging "
            "Face hub id."
        )
    if not HUB_ID_RE.match(model) or model.startswith((".", "/", "~")):
        raise DeltaspecError(
            f"No checkpoint directory at {model}; give an existing directory or a hub id like Qwen/Qwen3.5-27B."
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt"]))
    except Exception as exc:  # noqa: BLE001 - any hub failure becomes one sentence for the user
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DeltaspecError(
            f"Could not fetch {model} from the Hugging Face hub ({reason}); "
            "check the id and the network, or download it and pass the directory."
        ) from None


def count_mtp_layers(names) -> int:
    """How many MTP layers the checkpoint tensor `names` hold: `mtp.layers.0.` up to the last, none missing (so a
    name cannot make the model build more layers than the checkpoint has)."""
    layers = {int(m.group(1)) for n in names if (m := MTP_LAYER_RE.match(n))}
    if layers and len(layers) != max(layers) + 1:  # distinct numbers from 0: all of 0..max only then
        raise DeltaspecError(
            f"The checkpoint's MTP tensors name layers {_listing([str(i) for i in layers])} but MTP layers are "
            "numbered from 0 with none missing; the checkpoint is corrupt."
        )
    return len(layers)


def _layout(name: str, stored: list[int] | torch.Size, shape: torch.Size) -> str:
    """How a checkpoint tensor stored as `stored` becomes parameter shape `shape`: "same"; "squeeze" (conv
    weights come as [C, 1, K]); "transpose" (fused experts sometimes come as [E, H, 2I])."""
    stored = tuple(stored)
    if stored == tuple(shape):
        return "same"
    if len(stored) == len(shape) + 1 and stored[1] == 1 and stored[:1] + stored[2:] == tuple(shape):
        return "squeeze"
    if len(stored) == 3 and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        if (stored[0], stored[2], stored[1]) == tuple(shape):
            return "transpose"
    raise DeltaspecError(
        f"Tensor {name} has shape {list(stored)} in the checkpoint but the config implies {list(shape)}; "
        "config.json and the weights do not belong together."
    )


def _arranged(stored: torch.Tensor, layout: str) -> torch.Tensor:
    """A checkpoint tensor (or a slice of it) in its parameter's layout (`_layout`)."""
    if layout == "squeeze":
        return stored.squeeze(1)
    return stored.transpose(1, 2) if layout == "transpose" else stored


def read_part(name: str, target: str, source, shape: torch.Size, shard: Shard) -> torch.Tensor:
    """`shard`'s part of the checkpoint tensor `name` (a safetensors slice `source`) as parameter `target` of full
    `shape`: only the pieces the rank holds are read."""
    layout = _layout(name, source.get_shape(), shape)
    pieces = shard.pieces(target, shape)
    if pieces is None:
        return shard.take(target, _arranged(source[:], layout))
    dim, spans = pieces
    stored_dim = {1: 2, 2: 1}.get(dim, dim) if layout == "transpose" else dim
    parts = []
    for start, stop in spans:
        index = [slice(None)] * len(source.get_shape())
        index[stored_dim] = slice(start, stop)
        parts.append(_arranged(source[tuple(index)], layout))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _listing(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:5])
    return shown + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")


@fused_once_loaded
def load_model(
    model_dir: Path,
    config: ModelConfig,
    raw_config: dict,
    dtype: torch.dtype,
    device: torch.device,
    ops: OpTable,
    progress: bool = True,
    with_mtp: bool = True,
    tp: TensorParallel = SINGLE,
    layers: range | None = None,
) -> HybridModel:
    """Build the model and fill every parameter from the checkpoint at `model_dir` (the MTP head, when the
    checkpoint has one, only `with_mtp`: it is a drafter's memory); a rank of a tensor-parallel group `tp` builds
    and reads its share, a pipeline stage its decoder `layers` only. A quantized checkpoint's matrices are kept as
    blocks."""
    quantization = checkpoint_quantization(raw_config, model_dir)
    tensors = checkpoint_tensors(model_dir)
    by_param = {target: t for name, t in tensors.items() if (target := target_name(weight_name(name))) is not None}
    check_config_against_tensors(config, by_param)
    files = {name: tensor.file for name, tensor in tensors.items()}
    num_mtp_layers = count_mtp_layers(files) if with_mtp else 0
    with torch.device("meta"):
        rank_config = shard_config(config, tp.size, tp.expert_parallel)
        model = HybridModel(rank_config, ops, dtype, device, num_mtp_layers, tp, layers)
        full = HybridModel(config, ops, dtype, device, num_mtp_layers, layers=layers) if tp.sharded else model
    shapes = {name: param.shape for name, param in full.named_parameters()}  # the checkpoint's (full) shapes
    shard = Shard(config, tp.rank, tp.size, tp.expert_parallel)
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    loaded: dict[str, torch.Tensor] = {}
    blocks = Blocks(files, quantization, shard, params, shapes, device)
    expert_parts: dict[str, set] = defaultdict(set)
    unexpected = []
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, file in files.items():
        by_file[file].append(name)
    bar = tqdm(total=len(files), desc="Loading weights", unit="tensor", disable=not progress)
    for file, names in by_file.items():
        with open_safetensors(file) as f:
            for name in names:
                bar.update(1)
                target = target_name(weight_name(name), with_mtp)
                if target is None or not holds(model.layers, target) or blocks.skipped(name):
                    continue
                source = f.get_slice(name)
                if expert := EXPERT_RE.match(target):
                    if not blocks.add_expert(expert, name, source, expert_parts):
                        _load_expert(expert, source, params, shapes, shard, loaded, expert_parts, dtype, device)
                    continue
                if target not in params:
                    unexpected.append(name)
                    continue
                if not blocks.add(name, target, source):
                    part = read_part(name, target, source, shapes[target], shard)
                    loaded[target] = part.to(device=device, dtype=dtype)
    bar.close()
    quantized = blocks.weights()
    for target, weight in quantized.items():
        module_name, _, attribute = target.rpartition(".")
        set_weight(modules[module_name], attribute, weight)
    if "lm_head.weight" not in loaded and config.tie_word_embeddings and "model.embed_tokens.weight" in loaded:
        loaded["lm_head.weight"] = loaded["model.embed_tokens.weight"]
    _check_experts(expert_parts, params)
    missing = [checkpoint_name(n) for n in params if n not in loaded and n not in quantized]
    if unexpected:
        raise DeltaspecError(
            f"The checkpoint at {model_dir} has {len(unexpected)} tensors deltaspec does not "
            f"know: {_listing(unexpected)}."
        )
    if missing:
        raise DeltaspecError(
            f"The checkpoint at {model_dir} lacks {len(missing)} tensors the model needs: {_listing(missing)}."
        )
    model.load_state_dict(loaded, assign=True, strict=True)
    return model


def _load_expert(match: re.Match, source, params, shapes, shard: Shard, loaded, expert_parts, dtype, device) -> None:
    """Copy one per-expert projection (this rank's part of it, or with expert parallelism the whole of it when
    the rank holds the expert) into its slice of the fused expert tensor."""
    prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
    fused_name = f"{prefix}.down_proj" if proj == "down_proj" else f"{prefix}.gate_up_proj"
    if fused_name not in params:
        raise DeltaspecError(f"Tensor {match.group(0)} belongs to a MoE layer but config.json describes a dense one.")
    if fused_name not in loaded:
        loaded[fused_name] = torch.empty(params[fused_name].shape, dtype=dtype, device=device)
    fused, full = loaded[fused_name], shapes[fused_name]
    if not 0 <= expert < full[0]:
        raise DeltaspecError(f"Tensor {match.group(0)} names expert {expert}, but config.json has {full[0]} experts.")
    expert = shard.held_expert(expert)
    if expert is None:  # expert parallelism: another rank's
        return
    half = fused.shape[1] // 2
    rows = {"gate_proj": slice(0, half), "up_proj": slice(half, None), "down_proj": slice(None)}[proj]
    full_shape = torch.Size((full[1] // 2, full[2]) if proj != "down_proj" else full[1:])  # one expert's, unsharded
    fused[expert, rows].copy_(read_part(match.group(0), match.group(0), source, full_shape, shard).to(dtype))
    expert_parts[fused_name].add((expert, proj))


def _check_experts(expert_parts, params) -> None:
    for fused_name, parts in expert_parts.items():
        projs = ("down_proj",) if fused_name.endswith("down_proj") else ("gate_proj", "up_proj")
        want = {(e, p) for e in range(params[fused_name].shape[0]) for p in projs}
        if lacking := sorted(want - parts):
            e, p = lacking[0]
            prefix = fused_name.rsplit(".", 1)[0]
            raise DeltaspecError(f"The checkpoint lacks {len(lacking)} expert tensors, e.g. {prefix}.{e}.{p}.weight.")
