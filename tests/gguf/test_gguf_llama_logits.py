"""deltaspec against llama.cpp itself on the same GGUF files: the next-token distributions llama-perplexity
recorded (tests/data/gguf/llama_logits.npz, made by tools/make_llama_logits.py) on the embedded default model in
f32, q8_0 and q4_k_m and a tiny 256-wide Qwen3.5-MoE in q4_k_m and q6_k — files `deltaspec quantize`'s writer
makes, byte-exact with llama.cpp's converter and llama-quantize — within KL bounds measured here.

llama.cpp computes in float32 and, for products with quantized weights, first quantizes the activations to
8 bits (so its result is not the file's exact value, which deltaspec's float64 path gives); its record keeps
each log-probability to 16 bits over the top 16 nats (the KL is taken over those entries). The bounds are
about three times the values measured, so a wrong tensor, transformation or kernel (KL of order 0.1 and more)
cannot pass, and the f32 file's bound checks that both programs compute the same model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from deltaspec import LLM
from tests.gguf_records import kl_over_kept, log_probs_of, scored_log_probs
from tools.make_llama_logits import written_file

DATA = Path(__file__).parents[1] / "data" / "gguf"
RECORD = np.load(DATA / "llama_logits.npz")
# file -> (mean KL bound, max KL bound): about three times what was measured (mean / max KL over 62 positions,
# llama.cpp build of llama-cpp-python 0.3.36's source): f32 3.2e-8 / 1.9e-7 (the record's 16-bit rounding);
# q8_0 1.7e-4 / 6.7e-4 and q4_k_m 2.6e-4 / 1.6e-3 of the default model; the MoE's q4_k_m 3.4e-5 / 1.5e-3 and
# q6_k 2.6e-5 / 1.0e-3 (llama.cpp's 8-bit activations)
BOUNDS = {
    "default-f32": (1e-7, 1e-6),
    "default-q8_0": (5e-4, 2e-3),
    "default-q4_k_m": (1e-3, 5e-3),
    "moe-256-q4_k_m": (1e-4, 5e-3),
    "moe-256-q6_k": (1e-4, 3e-3),
}


def record(name: str) -> dict[str, np.ndarray]:
    return {key: RECORD[f"{name}/{key}"] for key in ("tokens", "quants", "scale", "min_log_prob")}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """The directory the GGUF files are written to, as the tool wrote them."""
    return tmp_path_factory.mktemp("llama_logits")


def deltaspec_log_probs(path: Path, name: str) -> torch.Tensor:
    """deltaspec's float64 log-softmax at the positions llama-perplexity scored: c/2 .. c-2 of each window."""
    llm = LLM(str(path), dtype="float64", device="cpu", max_num_seqs=1, max_model_len=128)
    return scored_log_probs(llm.engine, RECORD[f"{name}/tokens"])


@pytest.mark.parametrize("name", list(BOUNDS))
def test_next_token_distributions_match_llama_cpp(name, files):
    case, kind = name.rsplit("-", 1)
    path = written_file(files, case, kind.upper())
    (theirs, kept), ours = log_probs_of(record(name)), deltaspec_log_probs(path, name)
    assert theirs.shape == ours.shape
    kl = kl_over_kept(theirs, ours, kept)
    mean_bound, max_bound = BOUNDS[name]
    assert kl.mean().item() < mean_bound and kl.max().item() < max_bound, (kl.mean().item(), kl.max().item())
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean().item() >= 0.9  # measured: 0.95 to 1
