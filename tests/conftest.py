"""Shared fixtures: tiny random checkpoints written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.tiny_models import write_checkpoint

# name -> (transformers family, config overrides). Together they cover r = Hv/Hk of 1, 2 and 3,
# tied and untied embeddings, dense SwiGLU, MoE with shared expert, both GDN projection layouts,
# and attention layers first, last and in the middle.
VARIANTS = {
    "qwen3_5_r1_tied": ("qwen3_5", dict(linear_num_key_heads=4, linear_num_value_heads=4, tie_word_embeddings=True)),
    "qwen3_5_r2": (
        "qwen3_5",
        dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
    ),
    "qwen3_next_r3_moe": ("qwen3_next", dict(linear_num_value_heads=6, mlp_only_layers=[1])),
    # the shared expert as wide as the routed ones: on CUDA it runs in their launches (qwen3_next_r3_moe's apart)
    "qwen3_5_moe_r2": ("qwen3_5_moe", dict(num_hidden_layers=5, shared_expert_intermediate_size=32)),
}


def triton_interpreted() -> bool:
    """Kernels run on the CPU through Triton's interpreter (TRITON_INTERPRET=1, triton installed)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def compiled_only(why: str) -> pytest.MarkDecorator:
    """Skip a kernel case under Triton's interpreter (CI's CPU run), keeping it for the compiled run on a GPU: for
    cases whose code paths cheaper interpreted cases already take, `why` names them."""
    return pytest.mark.skipif(triton_interpreted(), reason=f"compiled only (interpreted elsewhere: {why})")


def skip_if_interpreted(why: str) -> None:
    """`compiled_only` from inside a test, for cases picked by a combination of its parameters."""
    if triton_interpreted():
        pytest.skip(f"compiled only (interpreted elsewhere: {why})")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not ("kernel" in item.keywords and triton_interpreted()):
            item.add_marker(skip)


@pytest.fixture
def kernel_device() -> str:
    """Where kernel tests run: the GPU, or the CPU under Triton's interpreter (a slow development aid)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        name: write_checkpoint(root / name, kind, seed=i, **overrides)
        for i, (name, (kind, overrides)) in enumerate(VARIANTS.items())
    }


@pytest.fixture(scope="session")
def text_checkpoint(tmp_path_factory) -> Path:
    """A tiny Qwen3.5 model with the tiny tokenizer and chat template; eos is <|im_end|>."""
    return write_checkpoint(tmp_path_factory.mktemp("text") / "model", "qwen3_5", seed=7, tokenizer=True)
