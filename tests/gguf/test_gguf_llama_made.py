"""GGUF files that llama.cpp's own tools made (tests/data/gguf_llama/, tools/make_llama_made_fixtures.py): tiny
trained models of the three architectures converted by convert_hf_to_gguf.py and quantized by llama-quantize
(some with an importance matrix from llama-imatrix, one also split by llama-gguf-split), as users download them.

Every file loads; each quantized tensor dequantizes as gguf-py's numpy code (llama.cpp's own reference) does;
deltaspec's float64 next-token distributions on each file are what llama-perplexity recorded on the same file once
llama.cpp's 8-bit activations are reproduced (`tests.ggml_activations`; llama.cpp computes in float32, so within
bounds about three times the KL measured, and the top token the same at 99 % of the positions or more), and close
to them with deltaspec's exact activations; the split parts load as one file; the quantized NextN (MTP) block
drafts token-exactly.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from deltaspec import LLM, SamplingParams
from deltaspec.model.gguf_raw import read_raw
from deltaspec.ops.quant import dequantize
from tests.ggml_activations import ggml_activations
from tests.gguf_records import kl_over_kept, log_probs_of, scored_log_probs

DATA = Path(__file__).parents[1] / "data" / "gguf_llama"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
RECORDS = np.load(DATA / "llama_logits.npz")
MADE = {stem: made for case in MANIFEST["cases"].values() for stem, made in case["files"].items()}  # by record
CASE = {stem: case for case, entry in MANIFEST["cases"].items() for stem in entry["files"]}
FLOAT_TYPES = ("F32", "F16", "BF16")
# (mean, max) KL bounds over 310 positions, about three times the largest measured: with llama.cpp's 8-bit
# activations reproduced, what is left is float32 rounding (measured 1.6e-5 to 3.3e-5 mean, 1.5e-4 to 3.6e-4
# max); as deltaspec runs the files (exact activations), llama.cpp's 8-bit rounding itself (2.7e-4 to 1.4e-3 mean,
# 4.7e-3 to 0.18 max: IQ2_M)
GGML_BOUNDS = (1e-4, 1.2e-3)
EXACT_BOUNDS = (5e-3, 0.6)


def record(stem: str) -> dict[str, np.ndarray]:
    return {key: RECORDS[f"{stem}/{key}"] for key in ("tokens", "quants", "scale", "min_log_prob")}


def llm_of(stem: str, **options) -> LLM:
    path = DATA / MADE[stem]["load"]
    return LLM(str(path), dtype="float64", device="cpu", max_num_seqs=2, max_model_len=128, **options)


def stored_types(stem: str) -> dict[str, str]:
    """{GGUF tensor: ggml type} of the file (all its parts)."""
    made = MADE[stem]
    readers = [gguf.GGUFReader(DATA / part) for part in made.get("parts", [made["load"]])]
    return {t.name: t.tensor_type.name for reader in readers for t in reader.tensors}


def test_the_files_are_llama_cpp_s_output():
    """The manifest names what made each file; the file's types are the ones llama-quantize gave it."""
    for stem, made in MADE.items():
        assert made["command"][0] == "llama-quantize" and made["command"][-2].lower() in stem
        types = list(stored_types(stem).values())
        assert {name: types.count(name) for name in set(types)} == made["types"]
        if stem.endswith("-imatrix"):
            fields = gguf.GGUFReader(DATA / made["load"]).fields
            assert fields["quantize.imatrix.chunks_count"].contents() > 0


@pytest.mark.parametrize("stem", MADE)
def test_every_quantized_tensor_dequantizes_as_gguf_py_does(stem):
    for tensor in read_raw(DATA / MADE[stem]["load"]).tensors.values():
        if tensor.qtype in FLOAT_TYPES:
            continue
        raw = np.array(tensor.data)  # a writable copy of the mapped file's bytes
        want = gguf_dequantize(raw, gguf.GGMLQuantizationType[tensor.qtype])
        got = dequantize(torch.from_numpy(raw), tensor.qtype).numpy()
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), (stem, tensor.qtype)


def compared(stem: str, context) -> tuple[torch.Tensor, float]:
    """KL(llama.cpp || deltaspec) per scored position, and the share of positions whose top tokens agree."""
    theirs, kept = log_probs_of(record(stem))
    with context():
        ours = scored_log_probs(llm_of(stem).engine, record(stem)["tokens"])
    assert theirs.shape == ours.shape and theirs.shape[0] * theirs.shape[1] >= 300
    return kl_over_kept(theirs, ours, kept), (theirs.argmax(-1) == ours.argmax(-1)).double().mean().item()


@pytest.mark.parametrize("stem", MADE)
def test_next_token_distributions_are_llama_cpp_s(stem):
    """With llama.cpp's activation rounding reproduced, deltaspec computes what llama-perplexity computed on the
    file: the KL is float32 rounding's, and the top tokens agree at 99 % of the positions or more (measured 99.0 to
    100 %)."""
    kl, top1 = compared(stem, ggml_activations)
    mean_bound, max_bound = GGML_BOUNDS
    assert kl.mean().item() < mean_bound and kl.max().item() < max_bound, (kl.mean().item(), kl.max().item())
    assert top1 >= 0.99


@pytest.mark.parametrize("stem", MADE)
def test_as_deltaspec_runs_them_only_llama_cpp_s_activation_rounding_differs(stem):
    """With exact activations (deltaspec's products) the difference is llama.cpp's 8-bit activations: KL within
    bounds measured, top tokens the same where llama.cpp's margin exceeds that rounding (measured 97.7 to 99.0 %)."""
    kl, top1 = compared(stem, contextlib.nullcontext)
    mean_bound, max_bound = EXACT_BOUNDS
    assert kl.mean().item() < mean_bound and kl.max().item() < max_bound, (kl.mean().item(), kl.max().item())
    assert top1 >= 0.97


def test_split_parts_are_read_as_one_file():
    """llama-gguf-split's parts are read from the first, every part's tensors together (the distribution tests above
    load this file so)."""
    (stem,) = [stem for stem, made in MADE.items() if "parts" in made]
    parts = sorted(MADE[stem]["parts"])
    assert len(parts) > 2 and MADE[stem]["load"] == parts[0] and parts[0].endswith(f"-00001-of-{len(parts):05d}.gguf")
    counts = [len(gguf.GGUFReader(DATA / part).tensors) for part in parts]
    assert len(read_raw(DATA / parts[0]).tensors) == sum(counts) and min(counts) > 0


@pytest.mark.parametrize("stem", [s for s in MADE if MANIFEST["cases"][CASE[s]]["mtp_layers"]])
def test_the_quantized_nextn_block_drafts_exactly(stem):
    """The NextN block as llama-quantize left it (its matrices quantized) loads as the MTP head; greedy decoding
    with it drafting equals plain greedy."""
    layers = MANIFEST["cases"][CASE[stem]]["config"]["num_hidden_layers"]
    assert stored_types(stem)[f"blk.{layers}.nextn.eh_proj.weight"] not in FLOAT_TYPES
    prompts = [{"prompt_token_ids": record(stem)["tokens"][w, :24].tolist()} for w in (0, 1)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm_of(stem).generate(prompts, params)]
    spec = llm_of(stem, speculative="mtp", draft_tokens=3)
    assert spec.engine.model.mtp is not None
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == plain


@pytest.mark.gpu
@pytest.mark.parametrize("stem", MADE)
def test_the_files_run_on_cuda_as_on_the_cpu(stem):
    """On CUDA in float32 (block kernels for Q8_0, Q4_K and Q6_K; the other types dequantized by the reference, then
    cuBLAS; experts of the kernel types through the grouped kernels) the scored positions' log-probabilities are the
    CPU reference's within float32 rounding, and greedy decoding from the file gives the CPU's tokens."""
    tokens = record(stem)["tokens"][:3]
    want = scored_log_probs(llm_of(stem).engine, tokens)
    path = str(DATA / MADE[stem]["load"])
    cuda = LLM(path, dtype="float32", device="cuda", max_num_seqs=2, max_model_len=128)
    got = scored_log_probs(cuda.engine, tokens).cpu()
    likely = want > -10.0
    assert (got - want).abs()[likely].max().item() < 1e-3
    prompts = [{"prompt_token_ids": tokens[w, :24].tolist()} for w in range(2)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm_of(stem).generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in cuda.generate(prompts, params)] == plain
