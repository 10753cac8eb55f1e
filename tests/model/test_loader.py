"""Checkpoint loading: user errors as one clear sentence, and every supported checkpoint layout loads exactly."""

from __future__ import annotations

import json
import shutil
import socket

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltaspec import LLM, DeltaspecError, SamplingParams
from tests.conftest import VARIANTS
from tests.engine_helpers import forward_in_chunks
from tests.tiny_models import make_model

PROMPT = [(17 * i + 5) % 500 + 3 for i in range(40)]
SUPPORTED = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


# ---------------------------------------------------------------- helpers


def load(path, dtype="float32", **options) -> LLM:
    return LLM(str(path), dtype=dtype, device="cpu", **options)


def load_error(path, **options) -> str:
    """Load `path`, expect a DeltaspecError, check it is one sentence and return its message."""
    with pytest.raises(DeltaspecError) as info:
        load(path, **options)
    assert type(info.value) is DeltaspecError
    message = str(info.value)
    assert "\n" not in message, message
    assert message.endswith("."), message
    assert "Traceback" not in message
    return message


def copy_checkpoint(checkpoints, name, tmp_path):
    return shutil.copytree(checkpoints[name], tmp_path / name)


def edit_weights(directory, edit) -> None:
    path = directory / "model.safetensors"
    weights = load_file(path)
    edit(weights)
    save_file(weights, path, metadata={"format": "pt"})


def edit_config(directory, edit) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))


def logits(path, dtype="float64") -> torch.Tensor:
    return forward_in_chunks(load(path, dtype).engine, PROMPT, [len(PROMPT)])


# ---------------------------------------------------------------- where the checkpoint is


def test_missing_path(tmp_path):
    missing = tmp_path / "no" / "such-checkpoint"
    message = load_error(missing)
    assert str(missing) in message
    assert message.startswith("No checkpoint directory at")


def test_path_that_is_a_file(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"not a directory")
    message = load_error(file)
    assert str(file) in message
    assert "is a file" in message and "checkpoint directory" in message


def test_hub_id_offline_fails_clearly_without_network(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    # The env var is read when huggingface_hub is imported (maybe already done), so set the constant too.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    attempts = []

    def no_network(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    hub_id = "nonexistent-org/nonexistent-model-xyz"
    message = load_error(hub_id)
    assert hub_id in message
    assert "Hugging Face hub" in message
    assert attempts == []


# ---------------------------------------------------------------- config.json


def test_directory_without_config(tmp_path):
    message = load_error(tmp_path)
    assert str(tmp_path) in message
    assert "no config.json" in message


def test_config_that_is_not_json(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    (path / "config.json").write_text('{"model_type": "qwen3_5_text", oops')
    message = load_error(path)
    assert str(path / "config.json") in message
    assert "not valid JSON" in message


def test_unknown_model_type_names_supported_types(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    edit_config(path, lambda c: c.update(model_type="llama"))
    message = load_error(path)
    assert "'llama'" in message and "not supported" in message
    for name in SUPPORTED:
        assert name in message


@pytest.mark.parametrize("field", ["linear_num_key_heads", "hidden_size", "vocab_size"])
def test_config_missing_required_field(checkpoints, tmp_path, field):
    path = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    edit_config(path, lambda c: c.pop(field))
    message = load_error(path)
    assert f"'{field}'" in message
    assert "config.json lacks" in message


def test_quantized_checkpoint_is_refused(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    edit_config(path, lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}))
    message = load_error(path)
    assert str(path) in message
    assert "quantized" in message


# ---------------------------------------------------------------- safetensors weights


def test_no_safetensors_files(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    (path / "model.safetensors").unlink()
    message = load_error(path)
    assert str(path) in message
    assert "*.safetensors" in message


def test_config_that_is_not_an_object(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    (directory / "config.json").write_text("[1, 2]")
    assert "must hold a JSON object" in load_error(directory)


def test_index_naming_a_missing_shard(checkpoints, tmp_path):
    directory = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    with safe_open(directory / "model.safetensors", "pt") as f:
        names = list(f.keys())
    weight_map = {n: "model.safetensors" for n in names}
    weight_map[names[0]] = "model-00002-of-00002.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert "model-00002-of-00002.safetensors" in load_error(directory)
    (directory / "model.safetensors.index.json").write_text("{}")
    assert "is not a valid safetensors index" in load_error(directory)


@pytest.mark.parametrize(
    "tensor",
    [
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.3.self_attn.q_norm.weight",
        # GDN tensors the loader renames internally: the message must still use the checkpoint's spelling
        "model.layers.1.linear_attn.conv1d.weight",
        "model.layers.2.linear_attn.norm.weight",
    ],
)
def test_missing_tensor_is_named(checkpoints, tmp_path, tensor):
    path = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    edit_weights(path, lambda w: w.pop(tensor))
    message = load_error(path)
    assert message.endswith(f"lacks 1 tensors the model needs: {tensor}.")
    assert str(path) in message


def test_many_missing_tensors_are_summarised(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    kept = "model.layers.3.post_attention_layernorm.weight"  # (a checkpoint without layer 3 has too few layers)
    edit_weights(path, lambda w: [w.pop(n) for n in list(w) if n.startswith("model.layers.3.") and n != kept])
    message = load_error(path)
    assert "lacks 10 tensors" in message
    assert message.endswith("(and 5 more).")
    assert "model.layers.3.input_layernorm.weight" in message


def test_wrong_shape_names_tensor_and_both_shapes(checkpoints, tmp_path):
    tensor = "model.layers.0.mlp.gate_proj.weight"
    path = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    edit_weights(path, lambda w: w.update({tensor: w[tensor][:95].clone()}))
    message = load_error(path)
    assert tensor in message
    assert "[95, 64]" in message and "[96, 64]" in message


def test_unexpected_tensor_is_named(checkpoints, tmp_path):
    extra = "model.layers.0.mlp.surprise_proj.weight"
    path = copy_checkpoint(checkpoints, "qwen3_5_r2", tmp_path)
    edit_weights(path, lambda w: w.update({extra: torch.zeros(4, 64)}))
    message = load_error(path)
    assert "1 tensors deltaspec does not know" in message
    assert message.endswith(f"{extra}.")


def test_missing_expert_tensor(checkpoints, tmp_path):
    tensor = "model.layers.2.mlp.experts.3.up_proj.weight"
    path = copy_checkpoint(checkpoints, "qwen3_next_r3_moe", tmp_path)
    edit_weights(path, lambda w: w.pop(tensor))
    message = load_error(path)
    assert "lacks 1 expert tensors" in message
    assert tensor in message


def test_expert_index_beyond_config(checkpoints, tmp_path):
    extra = "model.layers.0.mlp.experts.6.down_proj.weight"  # the config has 6 experts: 0..5
    path = copy_checkpoint(checkpoints, "qwen3_next_r3_moe", tmp_path)
    edit_weights(path, lambda w: w.update({extra: torch.zeros(64, 32)}))
    message = load_error(path)
    assert extra in message and "6 experts" in message


def test_expert_tensor_in_dense_layer(checkpoints, tmp_path):
    extra = "model.layers.1.mlp.experts.0.gate_proj.weight"  # layer 1 is in mlp_only_layers
    path = copy_checkpoint(checkpoints, "qwen3_next_r3_moe", tmp_path)
    edit_weights(path, lambda w: w.update({extra: torch.zeros(32, 64)}))
    message = load_error(path)
    assert extra in message and "dense" in message


# ---------------------------------------------------------------- layouts that must load exactly


@pytest.mark.parametrize("name", ["qwen3_5_r2", "qwen3_next_r3_moe"])
def test_sharded_checkpoint_matches_unsharded(checkpoints, tmp_path, name):
    kind, overrides = VARIANTS[name]
    seed = list(VARIANTS).index(name)  # the seed conftest wrote this variant with
    sharded = tmp_path / "sharded"
    make_model(kind, seed, **overrides).save_pretrained(sharded, max_shard_size="30KB")
    shards = sorted(sharded.glob("*.safetensors"))
    assert (sharded / "model.safetensors.index.json").is_file() and len(shards) > 2
    assert not (sharded / "model.safetensors").exists()
    assert torch.equal(logits(sharded), logits(checkpoints[name]))


@pytest.mark.parametrize("name", ["qwen3_5_r2", "qwen3_5_r1_tied"])
def test_multimodal_wrapper_checkpoint_matches_plain(checkpoints, tmp_path, name):
    plain = checkpoints[name]
    wrapped = copy_checkpoint(checkpoints, name, tmp_path)
    text = json.loads((plain / "config.json").read_text())
    assert text["model_type"] == "qwen3_5_text"
    tied = text.pop("tie_word_embeddings")  # only the wrapper carries it: it must reach the text model
    (wrapped / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3_5",
                "architectures": ["Qwen3_5ForConditionalGeneration"],
                "text_config": text,
                "vision_config": {"depth": 1, "hidden_size": 16},
                "tie_word_embeddings": tied,
            }
        )
    )

    def wrap(weights):
        for name_ in list(weights):
            if name_.startswith("model."):
                weights["model.language_model." + name_[len("model.") :]] = weights.pop(name_)
        weights["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(48, 16)

    edit_weights(wrapped, wrap)
    with safe_open(wrapped / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert "model.language_model.embed_tokens.weight" in names and "model.embed_tokens.weight" not in names
    assert ("lm_head.weight" in names) is not tied
    with pytest.raises(DeltaspecError, match="--limit-mm-per-prompt image=0"):  # its one-tensor tower is no tower
        load(wrapped, "float64")
    llm = load(wrapped, "float64", limit_mm_per_prompt="image=0")  # the text model alone
    assert llm.engine.model_config.tie_word_embeddings is tied
    ours = forward_in_chunks(llm.engine, PROMPT, [len(PROMPT)])
    assert torch.equal(ours, logits(plain))


@pytest.mark.parametrize(
    "dtype, atol", [(torch.float64, 0.0), (torch.float32, 1e-5), (torch.bfloat16, 5e-2), (torch.float16, 1e-2)]
)
def test_load_in_dtype(checkpoints, dtype, atol):
    name = "qwen3_5_r2"
    llm = load(checkpoints[name], str(dtype).removeprefix("torch."))
    model = llm.engine.model
    assert model.model.embed_tokens.weight.dtype == dtype
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.model.embed_tokens.weight.device.type == "cpu"
    stored = load_file(checkpoints[name] / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight, stored.to(dtype))
    ours = forward_in_chunks(llm.engine, PROMPT, [len(PROMPT)])
    assert ours.dtype == dtype
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.double(), logits(checkpoints[name]), rtol=0, atol=atol)


def test_tied_embeddings_share_storage(checkpoints):
    with safe_open(checkpoints["qwen3_5_r1_tied"] / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    model = load(checkpoints["qwen3_5_r1_tied"]).engine.model
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
    assert torch.equal(head, embed)


def test_untied_lm_head_is_its_own_tensor(checkpoints):
    stored = load_file(checkpoints["qwen3_5_r2"] / "model.safetensors")
    model = load(checkpoints["qwen3_5_r2"]).engine.model
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert head.untyped_storage().data_ptr() != embed.untyped_storage().data_ptr()
    assert torch.equal(head, stored["lm_head.weight"])


def test_checkpoint_without_tokenizer(checkpoints):
    path = checkpoints["qwen3_5_r2"]
    assert not (path / "tokenizer.json").exists()
    llm = load(path)
    assert llm.tokenizer is None
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPT[:7]}, params)[0]
    assert len(out.outputs[0].token_ids) == 5
    assert all(0 <= t < 512 for t in out.outputs[0].token_ids)
    assert out.outputs[0].text == ""
    assert out.prompt_token_ids == PROMPT[:7]
    with pytest.raises(DeltaspecError) as info:
        llm.generate("def add(a, b):", params)
    message = str(info.value)
    assert "\n" not in message and message.endswith(".")
    assert "tokenizer" in message and "prompt_token_ids" in message


def test_progress_bar(checkpoints, capsys):
    load(checkpoints["qwen3_5_r2"], progress=False)
    assert "Loading weights" not in capsys.readouterr().err
    load(checkpoints["qwen3_5_r2"], progress=True)
    err = capsys.readouterr().err
    assert "Loading weights" in err
    with safe_open(checkpoints["qwen3_5_r2"] / "model.safetensors", framework="pt") as f:
        total = len(f.keys())
    assert f"{total}/{total}" in err
