"""Write deltaspec/ops/quant/iq_grids.npz: the codebooks of ggml's i-quants, read from llama.cpp's ggml-common.h.

IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M store, per group of 8 (IQ2, IQ1) or 4 (IQ3) values, an
index into a fixed table of value patterns; each table entry packs its values as bytes of a little-endian 64- or
32-bit word (uint8 magnitudes for IQ2 and IQ3, int8 values for IQ1). These tables are the formats' definition, so
they are taken from ggml's source as they stand and stored unpacked: `iq2xxs` [256, 8], `iq2xs` [512, 8], `iq2s`
[1024, 8], `iq3xxs` [256, 4], `iq3s` [512, 4] (uint8) and `iq1s` [2048, 8] (int8). The sign tables are not
stored: `ksigns_iq2xs[i]` is i with bit 7 set when i has an odd number of bits, which the tool checks. Usage:

    .venv/bin/python tools/make_iq_grids.py /path/to/llama.cpp
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "deltaspec" / "ops" / "quant" / "iq_grids.npz"
TABLES = {  # name in ggml-common.h -> (stored name, entries, bytes per entry, byte dtype)
    "iq2xxs_grid": ("iq2xxs", 256, 8, np.uint8),
    "iq2xs_grid": ("iq2xs", 512, 8, np.uint8),
    "iq2s_grid": ("iq2s", 1024, 8, np.uint8),
    "iq3xxs_grid": ("iq3xxs", 256, 4, np.uint8),
    "iq3s_grid": ("iq3s", 512, 4, np.uint8),
    "iq1s_grid": ("iq1s", 2048, 8, np.int8),
}


def table(source: str, name: str) -> list[int]:
    """The integers between `GGML_TABLE_BEGIN(type, name, size)` and `GGML_TABLE_END()`."""
    body = re.search(rf"GGML_TABLE_BEGIN\(\w+, {name}, \w+\)(.*?)GGML_TABLE_END\(\)", source, flags=re.S)
    if body is None:
        raise SystemExit(f"ggml-common.h has no table {name}")
    return [int(word, 0) for word in re.findall(r"0x[0-9a-fA-F]+|\d+", body[1])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("llama_cpp", type=Path, help="llama.cpp source directory")
    source = (ap.parse_args().llama_cpp / "ggml" / "src" / "ggml-common.h").read_text()
    signs = table(source, "ksigns_iq2xs")
    assert signs == [i | (bin(i).count("1") % 2) << 7 for i in range(128)], "ksigns_iq2xs is not the parity rule"
    assert table(source, "kmask_iq2xs") == [1 << j for j in range(8)]
    arrays = {}
    for name, (stored, entries, width, dtype) in TABLES.items():
        words = np.array(table(source, name), dtype=np.uint64 if width == 8 else np.uint32)
        assert words.shape == (entries,), (name, words.shape)
        arrays[stored] = words.astype(f"<u{width}").view(np.uint8).reshape(entries, width).view(dtype)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
