"""Dtype names: the model's and the state's (`parse_dtype`) and the KV cache's storage (`parse_kv_dtype`)."""

from __future__ import annotations

import torch

from deltaspec.errors import DeltaspecError

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_ALIASES = {
    "double": "float64",
    "float": "float32",
    "fp32": "float32",
    "bf16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a dtype name ("bfloat16", "bf16", "float32", ...) to a torch dtype."""
    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
        name = str(name).removeprefix("torch.")
    key = DTYPE_ALIASES.get(name, name)
    if key not in DTYPES:
        raise DeltaspecError(f"Unknown dtype {name!r}; use one of {', '.join(DTYPES)}.")
    return DTYPES[key]


KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}


def parse_kv_dtype(name: str, dtype: str | torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype: a quantized one (`KV_CACHE_DTYPES`), or the model's `dtype` for "auto" (or
    that dtype's own name, as a resolved config spells it)."""
    if name in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[name]
    model_dtype = parse_dtype(dtype)
    if name != "auto" and (name not in DTYPES or DTYPES[name] != model_dtype):
        raise DeltaspecError(
            f"Unknown --kv-cache-dtype {name!r}; use auto (the model's dtype), fp8_e4m3 (or fp8) or int8."
        )
    return model_dtype
