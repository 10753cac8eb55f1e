"""Write tests/data/quant/oracle.npz: what ggml's own C quantizers make of a small test matrix.

Compiles llama.cpp's ggml/src/ggml-quants.c (with stubs for the four ggml.c functions it calls) into a shared
library in a temporary directory, the way llama.cpp's release build compiles ggml-base on x86-64: -O2, NDEBUG,
no FMA contraction. Then it runs, on the matrix below, `quantize_<type>(src, dst, nrow, n_per_row, imatrix)`
(what llama-quantize reaches through ggml_quantize_chunk) without and with an importance vector, and
ggml_compute_fp32_to_fp16 / _bf16 for the float types. The file keeps the inputs and, per output row, the first
16 bytes of its SHA-256, which keeps it a few KB; tests/ops/test_quant_quantize.py hashes its own rows the same way.

With --llama-quantize (a built llama-quantize binary of the same tree) it also writes
tests/data/quant/presets.json.gz: the type `llama-quantize --dry-run` gives every tensor of four made-up GGUF
files under Q4_K_M, Q5_K_M, Q6_K and Q8_0. The files carry the tensor names, counts and row widths of Qwen3.5
models (qwen35 with 64 layers; a narrow qwen35 with an MTP layer and tied embeddings; qwen35moe with 8 experts;
qwen3next with its fused ssm_in / ssm_ba projections) over sparse all-zero data, which a dry run never reads.
Usage:

    .venv/bin/python tools/make_quant_oracles.py /path/to/llama.cpp [--llama-quantize build/bin/llama-quantize]
"""

from __future__ import annotations

import argparse
import ctypes
import gzip
import hashlib
import json
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "quant" / "oracle.npz"
PRESETS_OUT = ROOT / "tests" / "data" / "quant" / "presets.json.gz"
PRESETS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")

# ggml type id, block size, bytes per block (ggml/include/ggml.h, ggml/src/ggml-common.h)
TYPES = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q2_K": (10, 256, 84),
    "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
    "IQ4_NL": (20, 32, 18),
    "IQ4_XS": (23, 256, 136),
}

STUBS = r"""
#include "ggml.h"
#include "ggml-impl.h"
#include <stdio.h>
#include <stdlib.h>

static size_t sizes[64][2] = { %(sizes)s };
size_t ggml_type_size(enum ggml_type t) { return sizes[t][1]; }
size_t ggml_row_size(enum ggml_type t, int64_t ne) { return sizes[t][1] * ne / sizes[t][0]; }
const char * ggml_type_name(enum ggml_type t) { (void) t; return "?"; }
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    (void) fmt; fprintf(stderr, "ggml_abort %%s:%%d\n", file, line); abort();
}
void oracle_f16(const float * x, uint16_t * y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = GGML_FP32_TO_FP16(x[i]);
}
void oracle_bf16(const float * x, uint16_t * y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = GGML_FP32_TO_BF16(x[i]).bits;
}
"""


def build_library(llama_cpp: Path, workdir: Path) -> ctypes.CDLL:
    """Compile ggml-quants.c + stubs into workdir/libggmlq.so and load it."""
    ggml = llama_cpp / "ggml"
    sizes = ", ".join(f"[{tid}] = {{{bs}, {ts}}}" for tid, bs, ts in TYPES.values())
    stubs = workdir / "stubs.c"
    stubs.write_text(STUBS % {"sizes": sizes})
    lib = workdir / "libggmlq.so"
    command = ["gcc", "-O2", "-DNDEBUG", "-ffp-contract=off", "-fPIC", "-shared"]
    command += [str(ggml / "src" / "ggml-quants.c"), str(stubs), f"-I{ggml / 'include'}", f"-I{ggml / 'src'}"]
    subprocess.run([*command, "-o", str(lib), "-lm"], check=True)
    return ctypes.CDLL(str(lib))


def test_matrix() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The weights [8, 512], an importance vector [512] and float special values [1, 32], all float32.

    Rows: 0 N(0,1); 1 N(0,0.02) (LLM-like); 2 heavy-tailed; 3 zeros and negative zeros; 4 two constants;
    5 magnitudes 1e-8..1e4; 6 values below ggml's GROUP_MAX_EPS, then tiny ones with subnormals; 7 one kind
    of 32-block each (zero, constant, positive only, negative only, sparse, small integers (ties), an outlier).
    The importance has exact zeros, and a whole zero 32-column block.
    """
    rng = np.random.default_rng(20240611)
    w = np.empty((8, 512), dtype=np.float64)
    w[0] = rng.standard_normal(512)
    w[1] = rng.standard_normal(512) * 0.02
    w[2] = rng.standard_t(3, 512) * 0.05
    w[3] = np.where(np.arange(512) % 2 == 0, 0.0, -0.0)
    w[4, :256], w[4, 256:] = 0.37, -1.5
    w[5] = rng.standard_normal(512) * 10.0 ** rng.uniform(-8, 4, 512)
    w[6, :256] = rng.standard_normal(256) * 1e-20
    w[6, 256:] = rng.standard_normal(256) * 1e-7
    w[6, 256::7] = 1e-40
    kinds = [
        np.zeros(32),
        np.full(32, 0.5),
        rng.uniform(0.0, 1.0, 32),
        -rng.uniform(0.5, 1.0, 32),
        np.where(rng.uniform(size=32) < 0.8, 0.0, rng.standard_normal(32)),
        rng.integers(-8, 8, 32).astype(np.float64),
        rng.integers(-2, 3, 32) * 0.25,
        np.concatenate([[1e3], rng.standard_normal(31) * 0.01]),
    ]
    w[7] = np.concatenate(kinds + [rng.standard_normal(32) * s for s in (1, 0.1, 3, 1e-3, 10, 0.5, 2, 1e-2)])
    importance = np.exp(rng.standard_normal(512) * 1.5)
    importance[rng.uniform(size=512) < 0.1] = 0.0
    importance[64:96] = 0.0
    specials = np.array(
        [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 1e-8, 6e-8, 1e-40, -1e-45, 3.4e38]
        + list(rng.standard_normal(18) * 1e3)
    )
    return w.astype(np.float32), importance.astype(np.float32), specials.astype(np.float32).reshape(1, 32)


def row_digests(rows: np.ndarray) -> np.ndarray:
    """uint8 [R, bytes] -> the first 16 bytes of each row's SHA-256, uint8 [R, 16]."""
    return np.stack([np.frombuffer(hashlib.sha256(row.tobytes()).digest()[:16], np.uint8) for row in rows])


def run_quantizer(lib: ctypes.CDLL, qtype: str, w: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    """ggml's quantize_<qtype> of w [R, C] -> uint8 [R, row bytes]."""
    _, block, size = TYPES[qtype]
    out = np.zeros((w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
    fn = getattr(lib, "quantize_" + qtype.lower().replace("_k", "_K"))
    fn.restype = ctypes.c_size_t
    fp = ctypes.POINTER(ctypes.c_float)
    imp = None if importance is None else importance.ctypes.data_as(fp)
    fn(
        w.ctypes.data_as(fp),
        out.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_int64(w.shape[0]),
        ctypes.c_int64(w.shape[1]),
        imp,
    )
    return out


def run_float(lib: ctypes.CDLL, name: str, x: np.ndarray) -> np.ndarray:
    """ggml's float32 -> F16 / BF16 conversion of x [R, C] -> uint8 [R, 2C]."""
    out = np.zeros(x.shape, dtype=np.uint16)
    getattr(lib, name)(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
    return out.view(np.uint8)


def qwen35_tensors(
    n_layers: int, hidden: int, ff: int, n_mtp: int = 0, tied: bool = False, experts: int = 0, fused_ssm: bool = False
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, torch shape) of a Qwen3.5-family GGUF: gated-DeltaNet layers with full attention every fourth,
    optional MTP layers after them, dense or routed-expert FFNs (with a shared expert)."""
    heads, head_dim, k_heads, v_heads, state = 2, 128, 2, 4, 64
    q_dim, kv_dim, v_dim = 2 * heads * head_dim, head_dim, v_heads * state
    conv_dim = 2 * k_heads * state + v_dim
    tensors = [("token_embd.weight", (1000, hidden)), ("output_norm.weight", (hidden,))]
    if not tied:
        tensors.append(("output.weight", (1000, hidden)))
    for i in range(n_layers + n_mtp):
        block = {"attn_norm.weight": (hidden,), "post_attention_norm.weight": (hidden,)}
        if i % 4 == 3 or i >= n_layers:
            block |= {
                "attn_q.weight": (q_dim, hidden),
                "attn_k.weight": (kv_dim, hidden),
                "attn_v.weight": (kv_dim, hidden),
                "attn_output.weight": (hidden, heads * head_dim),
                "attn_q_norm.weight": (head_dim,),
                "attn_k_norm.weight": (head_dim,),
            }
        else:
            if fused_ssm:
                block |= {"ssm_in.weight": (conv_dim + v_dim, hidden), "ssm_ba.weight": (2 * v_heads, hidden)}
            else:
                block |= {
                    "attn_qkv.weight": (conv_dim, hidden),
                    "attn_gate.weight": (v_dim, hidden),
                    "ssm_beta.weight": (v_heads, hidden),
                    "ssm_alpha.weight": (v_heads, hidden),
                }
            block |= {
                "ssm_conv1d.weight": (conv_dim, 4),
                "ssm_dt.bias": (v_heads,),
                "ssm_a": (v_heads,),
                "ssm_norm.weight": (state,),
                "ssm_out.weight": (hidden, v_dim),
            }
        if experts:
            block |= {
                "ffn_gate_inp.weight": (experts, hidden),
                "ffn_gate_exps.weight": (experts, ff, hidden),
                "ffn_up_exps.weight": (experts, ff, hidden),
                "ffn_down_exps.weight": (experts, hidden, ff),
                "ffn_gate_inp_shexp.weight": (hidden,),
                "ffn_gate_shexp.weight": (ff, hidden),
                "ffn_up_shexp.weight": (ff, hidden),
                "ffn_down_shexp.weight": (hidden, ff),
            }
        else:
            block |= {"ffn_gate.weight": (ff, hidden), "ffn_up.weight": (ff, hidden), "ffn_down.weight": (hidden, ff)}
        if i >= n_layers:
            block |= {
                "nextn.eh_proj.weight": (hidden, 2 * hidden),
                "nextn.enorm.weight": (hidden,),
                "nextn.hnorm.weight": (hidden,),
                "nextn.shared_head_norm.weight": (hidden,),
            }
        tensors += [(f"blk.{i}.{name}", shape) for name, shape in block.items()]
    return tensors


# name -> (arch, layers, MTP layers, experts, qwen35_tensors arguments)
FAKE_MODELS = {
    "qwen35-27b-like": ("qwen35", 64, 0, 0, dict(hidden=256, ff=512)),
    "qwen35-narrow-mtp-tied": ("qwen35", 8, 1, 0, dict(hidden=64, ff=128, tied=True)),
    "qwen35moe-8-experts": ("qwen35moe", 16, 0, 8, dict(hidden=256, ff=256)),
    "qwen3next-fused": ("qwen3next", 12, 0, 32, dict(hidden=256, ff=256, fused_ssm=True)),
}


def write_fake_gguf(path: Path, arch: str, n_layers: int, n_mtp: int, experts: int, tensors: list) -> list:
    """A GGUF with the model's hyperparameters and tensor table over sparse zero data; returns
    [[name, torch shape, type], ...] (F32 for 1-D tensors, F16 otherwise)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    hidden = dict(tensors)["token_embd.weight"][1]
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(n_layers + n_mtp)
    writer.add_feed_forward_length(512)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_key_length(128)
    writer.add_value_length(128)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(64)
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_ssm_conv_kernel(4)
    writer.add_ssm_inner_size(256)
    writer.add_ssm_state_size(64)
    writer.add_ssm_time_step_rank(4)
    writer.add_ssm_group_count(2)
    writer.add_full_attention_interval(4)
    if n_mtp:
        writer.add_nextn_predict_layers(n_mtp)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(256)
        writer.add_expert_shared_feed_forward_length(256)
    table = []
    for name, shape in tensors:
        dtype = np.float32 if len(shape) == 1 else np.float16
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
        table.append([name, list(shape), "F32" if dtype == np.float32 else "F16"])
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    writer.write_padding(fout, fout.tell())
    data = sum(-(-int(np.prod(shape)) * (4 if len(shape) == 1 else 2) // 32) * 32 for _, shape in tensors)
    fout.truncate(fout.tell() + data)
    writer.close()
    return table


def dry_run(llama_quantize: Path, path: Path, preset: str) -> dict[str, str]:
    """`llama-quantize --dry-run` of the file under `preset`: {tensor name: type it would be written as}."""
    result = subprocess.run(
        [str(llama_quantize), "--dry-run", str(path), preset], check=True, capture_output=True, text=True
    )
    line = re.compile(r"\]\s+(\S+)\s+- \[.*type =\s*(\w+), .*?(?:\((\w+)\))?\s*$")
    chosen = {}
    for text in (result.stdout + result.stderr).splitlines():
        match = line.search(text)
        if match:
            chosen[match.group(1)] = (match.group(3) or match.group(2)).upper()
    return chosen


def make_presets(llama_quantize: Path) -> None:
    """Write PRESETS_OUT: per fake model, its tensor table and llama-quantize's type for each preset."""
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, n_layers, n_mtp, experts, shape_args) in FAKE_MODELS.items():
            path = Path(tmp) / f"{name}.gguf"
            tensors = qwen35_tensors(n_layers, n_mtp=n_mtp, experts=experts, **shape_args)
            table = write_fake_gguf(path, arch, n_layers, n_mtp, experts, tensors)
            choices = {preset: dry_run(llama_quantize, path, preset) for preset in PRESETS}
            for preset, chosen in choices.items():
                if len(chosen) != len(table):
                    raise RuntimeError(f"{name} {preset}: parsed {len(chosen)} of {len(table)} tensors")
            models[name] = {
                "n_layers": n_layers + n_mtp,
                "n_expert": experts,
                "tensors": table,
                "choices": {preset: [chosen[t[0]] for t in table] for preset, chosen in choices.items()},
            }
    with gzip.open(PRESETS_OUT, "wt") as out:
        json.dump(models, out, separators=(",", ":"))
    print(f"wrote {PRESETS_OUT} ({PRESETS_OUT.stat().st_size} bytes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("llama_cpp", type=Path, help="a llama.cpp source tree")
    parser.add_argument("--llama-quantize", type=Path, help="that tree's llama-quantize, to record the presets")
    args = parser.parse_args()
    if args.llama_quantize:
        make_presets(args.llama_quantize)
    w, importance, specials = test_matrix()
    arrays = {"weight": w, "importance": importance, "specials": specials}
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_library(args.llama_cpp, Path(tmp))
        for qtype in TYPES:
            arrays[f"{qtype}/plain"] = row_digests(run_quantizer(lib, qtype, w, None))
            arrays[f"{qtype}/importance"] = row_digests(run_quantizer(lib, qtype, w, importance))
        for qtype, fn in (("F16", "oracle_f16"), ("BF16", "oracle_bf16")):
            arrays[f"{qtype}/plain"] = row_digests(run_float(lib, fn, w))
            arrays[f"{qtype}/specials"] = row_digests(run_float(lib, fn, specials))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
