"""deltaspec.ops.quant.quantize against ggml's own C quantizers, gguf-py's numpy ones, and its own contract.

tests/data/quant/oracle.npz holds a small matrix with edge-case rows and, per output row, digests of what
ggml's `quantize_<type>` made of it without and with an importance vector (tools/make_quant_oracles.py).
"""

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

import deltaspec.ops.quant.quantize as quantize_module
from deltaspec.errors import DeltaspecError
from deltaspec.ops.quant import GGUF_TYPES
from deltaspec.ops.quant.dequant import dequantize
from deltaspec.ops.quant.quantize import QUANTIZERS, quantize

GGML_QUANTIZED = sorted(q for q in QUANTIZERS if q in GGUF_TYPES)  # the types ggml quantizes too

ORACLE = np.load(Path(__file__).parents[1] / "data" / "quant" / "oracle.npz")
WEIGHT = torch.from_numpy(ORACLE["weight"])  # [8, 512]
IMPORTANCE = torch.from_numpy(ORACLE["importance"])  # [512]
ROWS = (
    "N(0,1)",
    "N(0,0.02)",
    "heavy-tailed",
    "zeros",
    "constants",
    "dynamic range",
    "tiny",
    "mixed blocks",
)


def digests(rows: torch.Tensor) -> np.ndarray:
    """uint8 [R, bytes] -> the first 16 bytes of each row's SHA-256 (as the oracle script stores them)."""
    return np.stack([np.frombuffer(hashlib.sha256(row.tobytes()).digest()[:16], np.uint8) for row in rows.numpy()])


def assert_rows_match(got: torch.Tensor, key: str, labels: tuple[str, ...] = ROWS) -> None:
    bad = [labels[i] for i, same in enumerate((digests(got) == ORACLE[key]).all(1)) if not same]
    assert not bad, f"{key}: rows differ from ggml's: {bad}"


@pytest.mark.parametrize("qtype", GGML_QUANTIZED)
def test_matches_ggml_without_importance(qtype):
    assert_rows_match(quantize(WEIGHT, qtype), f"{qtype}/plain")


@pytest.mark.parametrize("qtype", GGML_QUANTIZED)
def test_matches_ggml_with_importance(qtype):
    assert_rows_match(quantize(WEIGHT, qtype, IMPORTANCE), f"{qtype}/importance")


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_float_types_match_ggml(qtype):
    assert_rows_match(quantize(WEIGHT, qtype), f"{qtype}/plain")
    specials = torch.from_numpy(ORACLE["specials"])  # inf, nan, ±0, subnormals, float16 overflow
    assert_rows_match(quantize(specials, qtype), f"{qtype}/specials", ("specials",))


def test_f32_is_the_raw_bytes():
    assert quantize(WEIGHT, "F32").numpy().tobytes() == ORACLE["weight"].tobytes()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"])
def test_matches_gguf_py(qtype):
    gguf = pytest.importorskip("gguf")
    # Not the row of ±0: gguf-py's Q4_1/Q5_1 take m = np.min of (+0, -0, ...) = -0 where ggml keeps the first, +0.
    rows = [i for i, label in enumerate(ROWS) if label != "zeros"]
    expected = gguf.quants.quantize(ORACLE["weight"][rows], gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(quantize(WEIGHT[rows], qtype).numpy(), expected)


def test_chunks_do_not_change_the_bytes(monkeypatch):
    whole = {qtype: quantize(WEIGHT, qtype, IMPORTANCE) for qtype in ("Q4_0", "Q4_K", "IQ4_XS")}
    monkeypatch.setattr(quantize_module, "CHUNK_ELEMENTS", 3 * 512)  # 3 rows per chunk
    for qtype, expected in whole.items():
        assert torch.equal(quantize(WEIGHT, qtype, IMPORTANCE), expected)


def test_error_shrinks_with_bits():
    w = torch.randn(16, 1024, generator=torch.Generator().manual_seed(0))
    order = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]
    mse = [float(((dequantize(quantize(w, qtype), qtype) - w) ** 2).mean()) for qtype in order]
    assert all(a > b for a, b in zip(mse, mse[1:])), dict(zip(order, mse))


def test_importance_lowers_the_weighted_error():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 512, generator=gen)
    importance = torch.exp(2 * torch.randn(512, generator=gen))
    for qtype in ("Q4_K", "Q3_K", "IQ4_XS"):
        plain = ((dequantize(quantize(w, qtype), qtype) - w) ** 2 * importance).mean()
        weighted = ((dequantize(quantize(w, qtype, importance), qtype) - w) ** 2 * importance).mean()
        assert weighted < plain, qtype


def test_output_shape_and_device_follow_the_input():
    q = quantize(WEIGHT[:2], "Q6_K")
    assert q.dtype == torch.uint8 and q.shape == (2, 2 * 210) and q.device == WEIGHT.device
    assert torch.equal(quantize(WEIGHT.to(torch.bfloat16), "Q8_0"), quantize(WEIGHT.to(torch.bfloat16).float(), "Q8_0"))


@pytest.mark.parametrize(
    ("weight", "qtype", "importance", "match"),
    [
        (torch.zeros(2, 256), "Q7_K", None, "Cannot quantize to 'Q7_K'"),
        (torch.zeros(2, 96), "Q4_K", None, "cannot be stored as Q4_K"),
        (torch.zeros(2, 48), "Q8_0", None, "cannot be stored as Q8_0"),
        (torch.zeros(256), "Q4_K", None, "2-D floating-point weight"),
        (torch.zeros(2, 256, dtype=torch.int32), "Q4_K", None, "2-D floating-point weight"),
        (torch.zeros(2, 256), "Q4_K", torch.ones(128), "must have shape"),
        (torch.zeros(2, 256), "Q4_K", torch.full((256,), float("nan")), "importance"),
        (torch.full((2, 256), float("inf")), "Q4_K", None, "NaN or infinite"),
    ],
)
def test_errors_are_one_sentence(weight, qtype, importance, match):
    with pytest.raises(DeltaspecError, match=match) as info:
        quantize(weight, qtype, importance)
    message = str(info.value)
    assert message.endswith(".") and message.count(". ") == 0 and "\n" not in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", GGML_QUANTIZED)
def test_cuda_matches_ggml(qtype):
    weight, importance = WEIGHT.cuda(), IMPORTANCE.cuda()
    assert_rows_match(quantize(weight, qtype).cpu(), f"{qtype}/plain")
    assert_rows_match(quantize(weight, qtype, importance).cpu(), f"{qtype}/importance")
