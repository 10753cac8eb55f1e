"""Corrupt, absurd and escaping checkpoints (`deltaspec.model.safetensors_files`, `deltaspec.model.config_sizes`):
each is refused in one sentence, within seconds and without building anything, and the CLI exits with code 2 and
no traceback; a shard index cannot make the loader open a file outside the model's directory."""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deltaspec.cli import main
from deltaspec.model.safetensors_files import INDEX_NAME
from tests.model.test_loader import copy_checkpoint, edit_config, edit_weights, load, load_error

REPO = Path(__file__).resolve().parents[2]
SECONDS = 5
GIB = 2**30


def generate(path: Path) -> list[str]:
    return ["generate", "--model", str(path), "--prompt", "hi", "--dtype", "float32", "--device", "cpu"]


def refused_by_cli(path: Path, capsys) -> str:
    """Run `deltaspec generate` on `path` in-process: exit code 2 within `SECONDS`, one `error:` line and no
    traceback; the line without its prefix."""
    start = time.monotonic()
    assert main(generate(path)) == 2
    assert time.monotonic() - start < SECONDS
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith("."), err
    assert "Traceback" not in err and out == ""
    return lines[0].removeprefix("error: ")


def peak_rss() -> int:
    """The process's peak resident memory in bytes so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def stored(directory: Path) -> tuple[dict, bytes]:
    """The header (a dict) and the data section of `directory`'s model.safetensors."""
    raw = (directory / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def with_header(header: dict, data: bytes) -> bytes:
    """A safetensors file of `header` and `data`."""
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def first_tensor(header: dict) -> str:
    return next(name for name in header if name != "__metadata__")


def edited_tensor(header: dict, data: bytes, **fields) -> bytes:
    """The file with the first tensor's header `fields` replaced."""
    header[first_tensor(header)].update(fields)
    return with_header(header, data)


def beyond(entry: dict, data: bytes) -> list[int]:
    """`entry`'s data offsets moved past the end of `data` (its size kept)."""
    start, stop = entry["data_offsets"]
    return [len(data), len(data) + stop - start]


def index_everything_in(directory: Path, **moved: str) -> None:
    """Write an index mapping every tensor of model.safetensors there, except those in `moved` (name -> file)."""
    header, _ = stored(directory)
    weight_map = {name: "model.safetensors" for name in header if name != "__metadata__"} | moved
    (directory / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))


CORRUPT_FILES = {
    "empty": (lambda header, data: b"", "has 0 bytes, too few for a safetensors header"),
    "header longer than the file": (
        lambda header, data: struct.pack("<Q", 10**15) + b"{}",
        "says its header is 1000000000000000 bytes but the file holds 10 bytes",
    ),
    "header not JSON": (lambda header, data: struct.pack("<Q", 5) + b"hello", "has a header that is not a JSON object"),
    "header not an object": (
        lambda header, data: struct.pack("<Q", 6) + b"[1, 2]",
        "has a header that is not a JSON object",
    ),
    "unknown dtype": (lambda header, data: edited_tensor(header, data, dtype="Q9"), "as 'Q9', which is not a"),
    "offsets beyond the file": (
        lambda header, data: edited_tensor(header, data, data_offsets=beyond(header[first_tensor(header)], data)),
        "but the file holds",
    ),
    "offsets that do not match dtype and shape": (
        lambda header, data: edited_tensor(header, data, shape=[10**6, 10**6]),
        "of shape [1000000, 1000000] takes 4000000000000 bytes",
    ),
    "truncated": (lambda header, data: with_header(header, data[: len(data) // 2]), "is truncated or corrupt"),
    "shape that is no shape": (lambda header, data: edited_tensor(header, data, shape=[-1, "x"]), "which is no shape"),
}


@pytest.mark.parametrize("indexed", [False, True], ids=["single file", "with an index"])
@pytest.mark.parametrize("kind", CORRUPT_FILES)
def test_a_corrupt_safetensors_file_is_one_sentence_and_exit_code_2(checkpoints, tmp_path, capsys, kind, indexed):
    directory = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    if indexed:  # the index used to send the file to the memory plan's raw safe_open, which crashed
        index_everything_in(directory)
    corrupt, words = CORRUPT_FILES[kind]
    (directory / "model.safetensors").write_bytes(corrupt(*stored(directory)))
    message = refused_by_cli(directory, capsys)
    assert message.startswith(str(directory / "model.safetensors")) and words in message, message
    assert "download it again" in message


def test_an_index_putting_a_tensor_in_a_file_without_it_is_refused(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    save_file({"unrelated": torch.zeros(2)}, directory / "other.safetensors")
    index_everything_in(directory, **{"lm_head.weight": "other.safetensors"})
    message = load_error(directory)
    assert message.endswith("puts the tensor lm_head.weight in other.safetensors, which does not hold it."), message


OPENED: list[str] = []  # paths Python opened while `opens_recorded` is on
RECORDING = [False]


def record_opens(event: str, args: tuple) -> None:
    if RECORDING[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(record_opens)


@pytest.mark.parametrize(
    "shard", ["../outside/model.safetensors", "{outside}/model.safetensors", "sub/../../outside/model.safetensors"]
)
def test_a_shard_index_cannot_name_a_file_outside_the_model_directory(checkpoints, tmp_path, shard):
    directory = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(directory / "model.safetensors", outside / "model.safetensors")  # would load, were it opened
    (directory / "model.safetensors").unlink()
    shard = shard.format(outside=outside)
    index_everything_in(outside)
    (directory / INDEX_NAME).write_text((outside / INDEX_NAME).read_text().replace('"model.safetensors"', f'"{shard}"'))
    OPENED.clear()
    RECORDING[0] = True
    try:
        message = load_error(directory)
    finally:
        RECORDING[0] = False
    assert f"names the shard file '{shard}', which lies outside the model's directory" in message, message
    assert not [path for path in OPENED if os.path.realpath(path).startswith(str(outside.resolve()))], OPENED


def test_a_hub_snapshot_whose_files_link_into_its_blobs_still_loads(checkpoints, tmp_path):
    """The hub cache's layout: snapshots/<revision>/<file> are links to ../../blobs/<hash>."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in checkpoints["qwen3_5_r2"].iterdir():
        shutil.copy(file, blobs / file.name)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", file.name))
    index_everything_in(blobs)
    (snapshot / INDEX_NAME).symlink_to(Path("..", "..", "blobs", INDEX_NAME))
    assert load(snapshot).engine.model_config.num_hidden_layers == 4


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"num_hidden_layers": 10**9}, "sets num_hidden_layers to 1000000000, but num_hidden_layers must be a whole"),
        ({"hidden_size": 10**9}, "sets hidden_size to 1000000000, but hidden_size must be a whole number from 1 to"),
        ({"vocab_size": 10**12}, "sets vocab_size to 1000000000000, but vocab_size must be a whole number from 1"),
        ({"num_hidden_layers": 8, "layer_types": None}, "to 8, but the checkpoint's tensors stop at model.layers.3"),
        ({"num_hidden_layers": 2, "layer_types": None}, "to 2, but the checkpoint holds layers up to model.layers.3"),
        ({"vocab_size": 1024}, "vocab_size to 1024, but the checkpoint's model.embed_tokens.weight has 512 rows"),
        ({"hidden_size": 128}, "hidden_size to 128, but the checkpoint's model.embed_tokens.weight has 64 columns"),
        ({"hidden_size": "big"}, "sets hidden_size to 'big', but hidden_size must be a whole number"),
        ({"layer_types": None, "full_attention_interval": 0}, "sets full_attention_interval to 0, but"),
        ({"rms_norm_eps": "tiny"}, "config.json has a field of the wrong type"),
    ],
)
def test_an_absurd_config_is_refused_at_once(checkpoints, tmp_path, capsys, edit, words):
    directory = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    edit_config(directory, lambda c: [c.pop(k) if v is None else c.update({k: v}) for k, v in edit.items()])
    before = peak_rss()
    message = refused_by_cli(directory, capsys)
    assert words in message, message
    assert peak_rss() - before < GIB  # 10**9 layers once built 7.8 GB of lists before refusing


def test_the_cli_exits_with_code_2_and_no_traceback_on_an_absurd_config(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    edit_config(directory, lambda c: c.update(num_hidden_layers=10**9))
    result = subprocess.run(
        [sys.executable, "-m", "deltaspec.cli", *generate(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: The model config sets num_hidden_layers to 1000000000"), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_wrapper_config_whose_text_config_is_not_an_object_is_refused(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": [1, 2]}))
    assert "text_config must be a JSON object" in load_error(directory)


def test_mtp_tensors_naming_a_far_layer_do_not_build_it(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    edit_weights(directory, lambda w: w.update({"mtp.layers.999999999.input_layernorm.weight": torch.ones(64)}))
    start = time.monotonic()
    message = load_error(directory)
    assert time.monotonic() - start < SECONDS
    assert "MTP tensors name layers 999999999 but MTP layers are numbered from 0 with none missing" in message
