"""The dispatch point: which implementation of each op a model on a given device calls.

Every op has a torch reference (the spec, runs anywhere). A backend (the Triton kernels on CUDA,
`deltaspec.ops.triton.backend.KERNELS`) gives implementations with the same signature and semantics under
the op's name; `ops_for` resolves the table once per device, so the model never looks anything up on the
hot path.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from deltaspec.ops import activation, attention, conv, gdn, moe, norms, rope
from deltaspec.ops.quant.w8a8 import fp8_dynamic_linear
from deltaspec.ops.quant.weight import quantized_linear


@dataclass(frozen=True)
class OpTable:
    linear: Callable
    quantized_linear: Callable  # x @ weight.T for a QuantizedWeight
    fp8_dynamic_linear: Callable  # quantized_linear, FP8 segments of wide products with e4m3 activations (W8A8)
    rms_norm: Callable
    add_rms_norm: Callable
    gated_rms_norm: Callable
    silu_mul: Callable
    norm_rope: Callable
    causal_conv1d: Callable
    gdn_gates: Callable
    gated_delta_rule: Callable
    write_kv: Callable
    paged_attention: Callable
    moe_route: Callable
    moe_router: Callable  # the router's product and moe_route of its experts' logits
    moe_experts: Callable
    moe_experts_sync: Callable  # whether moe_experts of (dtype, gate_up, down) reads device values on the host


REFERENCE = OpTable(
    linear=F.linear,
    quantized_linear=quantized_linear,
    fp8_dynamic_linear=fp8_dynamic_linear,
    rms_norm=norms.rms_norm,
    add_rms_norm=norms.add_rms_norm,
    gated_rms_norm=norms.gated_rms_norm,
    silu_mul=activation.silu_mul,
    norm_rope=rope.norm_rope,
    causal_conv1d=conv.causal_conv1d,
    gdn_gates=gdn.gdn_gates,
    gated_delta_rule=gdn.gated_delta_rule,
    write_kv=attention.write_kv,
    paged_attention=attention.paged_attention,
    moe_route=moe.route,
    moe_router=moe.router,
    moe_experts=moe.expert_products,
    moe_experts_sync=moe.experts_sync,
)

_BACKENDS: dict[str, dict[str, Callable]] = {}  # device type -> op name -> its kernel, read at the first table


def ops_for(device: torch.device | str, reference_only: bool = False, fp8_activations: str = "none") -> OpTable:
    """The op table for `device`: its backend's kernels where present, torch references elsewhere.
    On CUDA the Triton kernels are imported the first time they are asked for. With `fp8_activations`
    "dynamic" a model's quantized products are `fp8_dynamic_linear`s (`--fp8-activations`)."""
    table = REFERENCE
    if not reference_only:
        kind = torch.device(device).type
        if kind == "cuda" and kind not in _BACKENDS:
            from deltaspec.ops.triton.backend import KERNELS

            _BACKENDS[kind] = dict(KERNELS)
        table = replace(REFERENCE, **_BACKENDS.get(kind, {}))
    if fp8_activations == "dynamic":
        table = replace(table, quantized_linear=table.fp8_dynamic_linear)
    return table
