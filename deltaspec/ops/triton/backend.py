"""The Triton kernels that are the CUDA implementations of the ops, by op name (`KERNELS`, read by
`deltaspec.ops.dispatch.ops_for` the first time a CUDA op table is asked for).

`linear` is not among them: its route depends on the model's weight shapes, so the engine
builds a `deltaspec.ops.gemm_routing.GemmRouter` once the model is loaded and installs its
`linear` (see `Engine`).
"""

from deltaspec.ops.triton import activation, attention, conv, gdn, gdn_gates, moe, norms, quant_matmul, rope, w8a8

KERNELS = {
    "rms_norm": norms.rms_norm,
    "add_rms_norm": norms.add_rms_norm,
    "gated_rms_norm": norms.gated_rms_norm,
    "silu_mul": activation.silu_mul,
    "norm_rope": rope.norm_rope,
    "causal_conv1d": conv.causal_conv1d,
    "gdn_gates": gdn_gates.gdn_gates,
    "gated_delta_rule": gdn.gated_delta_rule,
    "write_kv": attention.write_kv,
    "paged_attention": attention.paged_attention,
    "quantized_linear": quant_matmul.quantized_linear,
    "fp8_dynamic_linear": w8a8.fp8_dynamic_linear,
    "moe_route": moe.route,
    "moe_router": moe.router,
    "moe_experts": moe.expert_products,
    "moe_experts_sync": moe.experts_sync,
}
