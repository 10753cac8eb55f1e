"""`read_gguf` on GGUF files made by llama.cpp's own converter (tests/data/gguf/, tools/make_gguf_fixtures.py)
from tiny Hugging Face checkpoints, which are rebuilt here (deterministically) to compare against: the config,
every tensor, the tokenizer, split files, and broken files."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from deltaspec.errors import DeltaspecError
from deltaspec.model.gguf_file import read_gguf
from deltaspec.model.hf_config import parse_model_config
from deltaspec.model.tokenizer import Tokenizer
from tools.make_gguf_fixtures import FIXTURES, write_hf_checkpoint

DATA = Path(__file__).parents[1] / "data" / "gguf"
FAMILIES = tuple(FIXTURES)
ENCODED_TYPES = [(family, outtype) for family, spec in FIXTURES.items() for outtype in spec[4] if outtype != "f32"]
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
# the converter stored these +1 (RMSNorm weights) or as -exp(A_log): float32 rounding stays in the last bit
VALUE_CHANGED = re.compile(r"(?<!linear_attn\.)norm(_embedding|_hidden)?\.weight$|\.A_log$")
ONE_ULP = float(np.finfo(np.float32).eps)
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def sum_of_squares(values: list[float]) -> float:\n    return sum(v * v for v in values)\n",
    "Numbers 0 1 42 3.14 -1e-6 2024-05-01, I'VE and he'll've.\n\n\t  trailing   ",
    "<|im_start|>user\nWhat time is it in Tokyo?<|im_end|>\n<|im_start|>assistant\n<think>\nok</think>",
    "Ünïcödé: café naïve 東京 Привет 🚀 e\u0301 (combining)",
]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_hf")
    return {family: write_hf_checkpoint(root / family, family) for family in FAMILIES}


def hf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as read_gguf names and shapes them: experts stacked, conv weights [C, K]."""
    out, experts = {}, {}
    for name, value in load_file(hf_dir / "model.safetensors").items():
        if match := EXPERT.match(name):
            experts.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = value
            continue
        out[name] = (value.squeeze(1) if name.endswith("conv1d.weight") else value).numpy()
    for name, parts in experts.items():
        out[name] = torch.stack([parts[i] for i in sorted(parts)]).numpy()
    return out


def dequantized(tensor) -> np.ndarray:
    if tensor.data.dtype != np.uint8:
        return tensor.data.astype(np.float32)
    return gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType[tensor.qtype]).reshape(tensor.shape)


def hf_config(hf_dir: Path):
    return parse_model_config(json.loads((hf_dir / "config.json").read_text()))


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trips(family, hf_dirs):
    checkpoint = read_gguf(DATA / f"{family}-f32.gguf")
    assert parse_model_config(checkpoint.config) == hf_config(hf_dirs[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_is_recovered_from_f32(family, hf_dirs):
    expected = hf_tensors(hf_dirs[family])
    tensors = read_gguf(DATA / f"{family}-f32.gguf", grouped_qkvz=True).tensors
    assert sorted(tensors) == sorted(expected)
    for name, want in expected.items():
        got = tensors[name]
        assert got.qtype == "F32" and got.shape == want.shape and got.input_order is None, name
        if VALUE_CHANGED.search(name):
            np.testing.assert_allclose(got.data, want, rtol=0, atol=ONE_ULP, err_msg=name)
        else:
            np.testing.assert_array_equal(got.data, want, err_msg=name)


def test_qwen3_next_gdn_projections_load_as_separate_ones(hf_dirs):
    """The engine reads a Qwen3-Next file's attn_qkv, attn_gate and ssm_ba as Qwen3.5's in_proj_qkv / z / b / a:
    the checkpoint's per-key-head groups [q, k, v, z] and [b, a] taken apart."""
    config = hf_config(hf_dirs["qwen3next"])
    hk, r = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    expected = hf_tensors(hf_dirs["qwen3next"])
    tensors = read_gguf(DATA / "qwen3next-f32.gguf").tensors
    layer = "model.layers.0.linear_attn."
    assert layer + "in_proj_qkvz.weight" not in tensors and layer + "in_proj_ba.weight" not in tensors
    qkvz = expected[layer + "in_proj_qkvz.weight"].reshape(hk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
    b, a = np.split(expected[layer + "in_proj_ba.weight"].reshape(hk, 2 * r, -1), [r], axis=1)
    flat = [x.reshape(-1, x.shape[-1]) for x in (q, k, v, z, b, a)]
    np.testing.assert_array_equal(tensors[layer + "in_proj_qkv.weight"].data, np.concatenate(flat[:3]))
    for name, want in zip(("in_proj_z", "in_proj_b", "in_proj_a"), flat[3:]):
        np.testing.assert_array_equal(tensors[layer + f"{name}.weight"].data, want, err_msg=name)


def test_f32_matrices_are_views_of_the_file():
    tensors = read_gguf(DATA / "qwen3next-f32.gguf").tensors
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.experts.gate_proj", "lm_head.weight"):
        assert isinstance(tensors[name].data, np.memmap) and not tensors[name].data.flags.owndata, name


@pytest.mark.parametrize(("family", "outtype"), ENCODED_TYPES)
def test_f16_bf16_q8_0_match_within_their_precision(family, outtype, hf_dirs):
    expected = hf_tensors(hf_dirs[family])
    tensors = read_gguf(DATA / f"{family}-{outtype}.gguf", grouped_qkvz=True).tensors
    assert sorted(tensors) == sorted(expected)
    qtypes = set()
    for name, want in expected.items():
        got = tensors[name]
        qtypes.add(got.qtype)
        assert got.shape == want.shape, name
        if got.input_order is not None:
            want = want[:, got.input_order]
        values = dequantized(got)
        if got.qtype == "Q8_0":  # 32-value blocks scaled by max|x| / 127 (an F16 scale): half a step, and a bit
            bound = np.abs(want).max(axis=-1, keepdims=True) / 127
        else:
            bound = np.abs(want) * {"F32": ONE_ULP, "F16": 2.0**-11, "BF16": 2.0**-8}[got.qtype] + 1e-7
        assert np.all(np.abs(values - want) <= bound), name
    assert {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[outtype] in qtypes


def test_quantized_out_proj_columns_follow_the_value_heads(hf_dirs):
    """Qwen3.5 value heads were tiled in out_proj's columns: whole Q8_0 blocks (heads of 32) move back; heads of
    8 share a block, so the columns stay as stored and `input_order` says which input each one takes."""
    name = "model.layers.{}.linear_attn.out_proj.weight"
    aligned = read_gguf(DATA / "qwen35-q8_0.gguf").tensors[name.format(0)]
    want = hf_tensors(hf_dirs["qwen35"])[name.format(0)]
    assert aligned.qtype == "Q8_0" and aligned.input_order is None
    assert np.abs(dequantized(aligned) - want).max() <= np.abs(want).max() / 127

    straddling = read_gguf(DATA / "qwen35moe-q8_0.gguf").tensors[name.format(1)]
    want = hf_tensors(hf_dirs["qwen35moe"])[name.format(1)]
    assert straddling.qtype == "Q8_0" and straddling.input_order is not None
    assert sorted(straddling.input_order) == list(range(want.shape[1]))
    x = np.random.default_rng(0).standard_normal(want.shape[1]).astype(np.float32)
    np.testing.assert_allclose(dequantized(straddling) @ x[straddling.input_order], want @ x, atol=0.02)
    assert not np.allclose(dequantized(straddling) @ x, want @ x, atol=0.02)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_matches_tokenizer_json(family, hf_dirs):
    from_gguf = read_gguf(DATA / f"{family}-q8_0.gguf").tokenizer
    original = Tokenizer.from_dir(hf_dirs[family])
    assert from_gguf.vocab_size == original.vocab_size == 384
    assert from_gguf.eos_token_ids == original.eos_token_ids == {379}
    for text in TEXTS:
        ids = original.encode(text)
        assert from_gguf.encode(text) == ids, text
        for skip in (True, False):
            assert from_gguf.decode(ids, skip_special_tokens=skip) == original.decode(ids, skip_special_tokens=skip)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "call the tool",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"sunny": true}'},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for kwargs in ({}, {"tools": tools}, {"enable_thinking": False}):
        assert from_gguf.apply_chat_template(messages, **kwargs) == original.apply_chat_template(messages, **kwargs)


def test_split_file_reads_like_the_whole_file():
    whole = read_gguf(DATA / "qwen3next-q8_0.gguf")
    split = read_gguf(DATA / "qwen3next-q8_0-split-00001-of-00004.gguf")
    assert split.config == whole.config
    assert sorted(split.tensors) == sorted(whole.tensors)
    for name, tensor in whole.tensors.items():
        part = split.tensors[name]
        assert (part.qtype, part.shape) == (tensor.qtype, tensor.shape), name
        np.testing.assert_array_equal(part.data, tensor.data, err_msg=name)
    assert split.tokenizer.encode(TEXTS[3]) == whole.tokenizer.encode(TEXTS[3])


def test_split_file_errors(tmp_path):
    for part in DATA.glob("qwen3next-q8_0-split-*.gguf"):
        if "-00004-of-" not in part.name:
            shutil.copy(part, tmp_path / part.name)
    with pytest.raises(DeltaspecError, match=r"lacks its part\(s\) qwen3next-q8_0-split-00004-of-00004.gguf"):
        read_gguf(tmp_path / "qwen3next-q8_0-split-00001-of-00004.gguf")
    with pytest.raises(DeltaspecError, match="is part 2 of a split GGUF file; give its first part"):
        read_gguf(DATA / "qwen3next-q8_0-split-00002-of-00004.gguf")
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(DATA / "qwen3next-q8_0-split-00001-of-00004.gguf", renamed)
    with pytest.raises(DeltaspecError, match="says it is part of a 4-part GGUF file but its name says 1"):
        read_gguf(renamed)


def rewrite(source: Path, target: Path, tensors=None, drop_keys: str | None = None, arch: str | None = None, **add):
    """Copy a GGUF file with the gguf writer; `tensors(name, array, qtype)` may return replacements
    [(name, array, qtype)]; keys starting with `drop_keys` are left out; `add` maps keys (with `__` for `.`) to
    (value, GGUFValueType) to add."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, arch or reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or (drop_keys and key.startswith(drop_keys)):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for key, (value, value_type) in add.items():
        writer.add_key_value(key.replace("__", "."), value, value_type)
    for tensor in reader.tensors:
        for name, data, qtype in (tensors or (lambda *t: [t]))(tensor.name, np.array(tensor.data), tensor.tensor_type):
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_converter_fusions_are_split_back(tmp_path):
    """--fuse-qkv (attention q, k, v as one attn_qkv) and --fuse-gate-up-exps (one ffn_gate_up_exps), made here as
    conversion/base.py `ModelBase.modify_tensors` makes them, read back as the separate tensors."""
    held = {}

    def fuse(name, data, qtype):
        part = re.match(r"blk\.0\.(attn_[qkv]|ffn_(?:gate|up)_exps)\.weight$", name)
        if part is None:
            return [(name, data, qtype)]
        held[part[1]] = data
        if {"attn_q", "attn_k", "attn_v"} <= held.keys():
            return [("blk.0.attn_qkv.weight", np.concatenate([held.pop(f"attn_{p}") for p in "qkv"]), qtype)]
        if {"ffn_gate_exps", "ffn_up_exps"} <= held.keys():
            fused = np.concatenate([held.pop("ffn_gate_exps"), held.pop("ffn_up_exps")], axis=1)
            return [("blk.0.ffn_gate_up_exps.weight", fused, qtype)]
        return []

    source = DATA / "qwen35moe-q8_0.gguf"
    fused = read_gguf(rewrite(source, tmp_path / "fused.gguf", fuse))
    plain = read_gguf(source)
    assert not held and sorted(fused.tensors) == sorted(plain.tensors)
    for name, tensor in plain.tensors.items():
        np.testing.assert_array_equal(fused.tensors[name].data, tensor.data, err_msg=name)


def test_no_tokenizer_metadata_gives_no_tokenizer(tmp_path):
    checkpoint = read_gguf(rewrite(DATA / "qwen35-q8_0.gguf", tmp_path / "bare.gguf", drop_keys="tokenizer."))
    assert checkpoint.tokenizer is None
    assert "eos_token_id" not in checkpoint.config and checkpoint.config["num_hidden_layers"] == 2


def test_bos_is_added_when_the_file_says_so(tmp_path):
    path = rewrite(
        DATA / "qwen35-q8_0.gguf",
        tmp_path / "bos.gguf",
        tokenizer__ggml__bos_token_id=(378, gguf.GGUFValueType.UINT32),
        tokenizer__ggml__add_bos_token=(True, gguf.GGUFValueType.BOOL),
    )
    tokenizer = read_gguf(path).tokenizer
    plain = tokenizer.encode("Hello world")
    assert tokenizer.encode("Hello world", add_special_tokens=True) == [378, *plain]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user")
    assert tokenizer._special_tokens["bos_token"] == "<|im_start|>"


def test_unknown_architecture_is_named(tmp_path):
    path = rewrite(DATA / "qwen35-q8_0.gguf", tmp_path / "llama.gguf", arch="llama")
    with pytest.raises(DeltaspecError, match=r"holds a 'llama' model; .* architectures qwen35, qwen35moe, qwen3next\."):
        read_gguf(path)


def test_value_change_on_a_quantized_tensor_is_refused(tmp_path):
    def quantize_norm(name, data, qtype):
        if name == "blk.0.attn_norm.weight":
            return [(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)]
        return [(name, data, qtype)]

    path = rewrite(DATA / "qwen35-q8_0.gguf", tmp_path / "q_norm.gguf", quantize_norm)
    with pytest.raises(DeltaspecError, match=r"blk\.0\.attn_norm\.weight is stored as Q8_0, but deltaspec can only"):
        read_gguf(path)


def test_qkvz_parts_of_a_float_and_a_quantized_type_are_not_grouped(tmp_path):
    """The engine reads them as separate projections; only the grouped reading (for writing a file back, which
    needs float tensors anyway) cannot put one float and one quantized part into one in_proj_qkvz."""

    def gate_as_f16(name, data, qtype):
        if name == "blk.0.attn_gate.weight":
            values = gguf.quants.dequantize(data, qtype).astype(np.float16)
            return [(name, values, gguf.GGMLQuantizationType.F16)]
        return [(name, data, qtype)]

    path = rewrite(DATA / "qwen3next-q8_0.gguf", tmp_path / "mixed.gguf", gate_as_f16)
    separate = read_gguf(path).tensors
    assert separate["model.layers.0.linear_attn.in_proj_z.weight"].qtype == "F16"
    assert separate["model.layers.0.linear_attn.in_proj_qkv.weight"].qtype == "Q8_0"
    with pytest.raises(
        DeltaspecError, match=r"stores blk\.0\.attn_qkv\.weight as Q8_0 but blk\.0\.attn_gate\.weight as F16"
    ):
        read_gguf(path, grouped_qkvz=True)


def test_matrices_stored_without_their_dimensions_of_one_read_at_their_rank(tmp_path):
    """llama-quantize (ggml's gguf writer) stores a tensor's dimensions only up to the last one above 1: the shared
    expert's gate [1, hidden] as [hidden], and an expert stack of one expert as a matrix. Both read back as the
    model's parameters have them."""

    def as_ggml_writes(name, data, qtype):  # the first row (expert) alone, its dimension of 1 left out
        if name.endswith(("ffn_gate_inp_shexp.weight", "ffn_up_exps.weight")):
            return [(name, data[:1].reshape(data.shape[1:]), qtype)]
        return [(name, data, qtype)]

    plain = read_gguf(DATA / "qwen35moe-q8_0.gguf").tensors
    squeezed = rewrite(DATA / "qwen35moe-q8_0.gguf", tmp_path / "squeezed.gguf", as_ggml_writes)
    shapes = {t.name: tuple(t.shape.tolist()) for t in gguf.GGUFReader(squeezed).tensors}
    assert len(shapes["blk.0.ffn_gate_inp_shexp.weight"]) == 1 and len(shapes["blk.0.ffn_up_exps.weight"]) == 2
    read = read_gguf(squeezed).tensors
    gate = "model.layers.0.mlp.shared_expert_gate.weight"
    assert read[gate].shape == plain[gate].shape == (1, 32)
    np.testing.assert_array_equal(read[gate].data, plain[gate].data)
    up = "model.layers.0.mlp.experts.up_proj"
    assert read[up].shape == (1, *plain[up].shape[1:])  # the first expert alone, as a stack of one
    np.testing.assert_array_equal(read[up].data[0], plain[up].data[0])


def test_a_type_the_gguf_package_does_not_know_is_one_sentence(tmp_path):
    """A file from a llama.cpp newer than the installed gguf package (e.g. its Q2_0, type 42)."""
    reader = gguf.GGUFReader(DATA / "qwen35-f32.gguf")
    tensor = reader.tensors[0]
    type_at = tensor.field.offset + 8 + len(tensor.name.encode()) + 4 + 8 * len(tensor.shape)  # name, n_dims, dims
    raw = bytearray((DATA / "qwen35-f32.gguf").read_bytes())
    assert int.from_bytes(raw[type_at : type_at + 4], "little") == tensor.tensor_type
    raw[type_at : type_at + 4] = (42).to_bytes(4, "little")
    path = tmp_path / "newer.gguf"
    path.write_bytes(bytes(raw))
    with pytest.raises(
        DeltaspecError, match=r"ggml type 42, which the installed gguf package \(gguf [\d.]+\) does"
    ) as e:
        read_gguf(path)
    assert "\n" not in str(e.value) and "IQ2_XXS" in str(e.value)


def test_unknown_tensor_is_named(tmp_path):
    def extra(name, data, qtype):
        return [(name, data, qtype)] + ([("blk.0.mystery.weight", data, qtype)] if name == "output_norm.weight" else [])

    with pytest.raises(DeltaspecError, match=r"has a tensor blk\.0\.mystery\.weight that deltaspec does not know"):
        read_gguf(rewrite(DATA / "qwen35-q8_0.gguf", tmp_path / "extra.gguf", extra))


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("block_count", 10**9, "sets qwen35.block_count to 1000000000, but qwen35.block_count must be a whole number"),
        ("embedding_length", 10**9, "sets hidden_size to 1000000000, but hidden_size must be a whole number"),
        ("attention.head_count", 0, "has metadata of the wrong type or value (integer division or modulo by zero)"),
    ],
)
def test_absurd_metadata_is_refused_at_once(tmp_path, key, value, words):
    """Sizes that would build lists of 10**9 layers, or divide by zero, are one sentence within a second."""
    path = rewrite(
        DATA / "qwen35-q8_0.gguf",
        tmp_path / "absurd.gguf",
        drop_keys=f"qwen35.{key}",
        **{f"qwen35__{key.replace('.', '__')}": (value, gguf.GGUFValueType.UINT32)},
    )
    start = time.monotonic()
    with pytest.raises(DeltaspecError) as error:
        parse_model_config(read_gguf(path).config)
    assert time.monotonic() - start < 1
    message = str(error.value)
    assert words in message and "\n" not in message and message.endswith("."), message


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is not a GGUF file"),
        (b"PK\x03\x04 this is a zip, not a model" * 8, "is not a GGUF file"),
        ("header", "is truncated or corrupt"),
        ("metadata", "is truncated or corrupt"),
        ("tensors", "is truncated"),
        ("last byte", "is truncated"),
    ],
)
def test_broken_files_are_one_sentence(tmp_path, content, message):
    whole = (DATA / "qwen35-f32.gguf").read_bytes()
    cut = {"header": 20, "metadata": 5000, "tensors": len(whole) // 2, "last byte": len(whole) - 1}
    path = tmp_path / "broken.gguf"
    path.write_bytes(content if isinstance(content, bytes) else whole[: cut[content]])
    with pytest.raises(DeltaspecError, match=message) as error:
        read_gguf(path)
    assert "\n" not in str(error.value) and str(error.value).endswith((".", ")."))


def test_missing_file_is_one_sentence(tmp_path):
    with pytest.raises(DeltaspecError, match="No GGUF file at"):
        read_gguf(tmp_path / "absent.gguf")
