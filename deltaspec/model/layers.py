"""Shared building blocks: linear layers that go through the op table, projections fused into one
weight, zero-centred RMSNorm, SwiGLU MLP, and the mixture-of-experts MLP.

Modules are built with the checkpoint's separate projections (so loading is a name lookup) and
`fuse()`d once after loading: projections that read the same input become one weight, one GEMM
per pass. `hf_weights()` gives the checkpoint-named weights back as views into the fused ones.
"""

import torch
from torch import nn

from deltaspec.config.model import ModelConfig, MoEConfig
from deltaspec.ops.dispatch import OpTable
from deltaspec.ops.moe import SharedExpert, expected_distinct_experts
from deltaspec.ops.quant.weight import FLOAT_TYPES, QuantizedWeight, shared_order


def project(ops: OpTable, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """`x @ weight.T` through the op table: its quantized product for a weight kept as GGUF blocks."""
    if isinstance(weight, QuantizedWeight):
        return ops.quantized_linear(x, weight)
    return ops.linear(x, weight)


def set_weight(module: nn.Module, name: str, weight: torch.Tensor | QuantizedWeight) -> None:
    """Make `weight` (a float tensor or a QuantizedWeight) `module.<name>`, whatever was there."""
    if hasattr(module, name):
        delattr(module, name)
    setattr(module, name, weight if isinstance(weight, QuantizedWeight) else nn.Parameter(weight, requires_grad=False))


class Linear(nn.Module):
    """`x @ weight.T (+ bias)` through the op table's `linear` (the device's skinny-GEMM routing)."""

    def __init__(self, in_features: int, out_features: int, ops: OpTable, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.ops = ops

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]: the whole product (a fused projection's parts side by side)."""
        y = project(self.ops, x, self.weight)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)


class FusedLinear(Linear):
    """Projections of the same input stacked into one weight [sum(out), in]; forward returns the
    outputs split back per projection."""

    def __init__(self, parts: dict[str, Linear], ops: OpTable):
        first = next(iter(parts.values()))
        with torch.device("meta"):
            super().__init__(
                first.weight.shape[1], sum(p.out_features for p in parts.values()), ops, bias=first.bias is not None
            )
        self.names = tuple(parts)
        self.sizes = [p.out_features for p in parts.values()]
        with torch.no_grad():
            weights = [p.weight for p in parts.values()]
            floats = [w for w in weights if not isinstance(w, QuantizedWeight)]
            if len(floats) == len(weights):
                set_weight(self, "weight", torch.cat(weights))
            elif all(w.dtype in FLOAT_TYPES for w in floats):  # float parts join the blocks as float segments
                order = shared_order([w for w in weights if isinstance(w, QuantizedWeight)])
                as_blocks = [
                    w if isinstance(w, QuantizedWeight) else QuantizedWeight.from_float(w, order) for w in weights
                ]
                set_weight(self, "weight", QuantizedWeight.cat(as_blocks))
            else:  # float64 parts (reference runs): the blocks dequantized to them, exactly, give the same products
                dtype = floats[0].dtype
                whole = [w.dense(dtype) if isinstance(w, QuantizedWeight) else w for w in weights]
                set_weight(self, "weight", torch.cat(whole))
            if self.bias is not None:
                self.bias = nn.Parameter(torch.cat([p.bias for p in parts.values()]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.product(x).split(self.sizes, dim=-1)

    def hf_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        """`{prefix}.{name}.weight` (and `.bias`) of each part, as views into the fused tensors; `prefix` is
        the module holding the parts."""
        out = {}
        for name, weight in zip(self.names, self.weight.split(self.sizes)):
            out[f"{prefix}.{name}.weight"] = weight
        if self.bias is not None:
            out.update({f"{prefix}.{name}.bias": b for name, b in zip(self.names, self.bias.split(self.sizes))})
        return out


def fuse(module: nn.Module, fused_name: str, part_names: list[str], ops: OpTable) -> None:
    """Replace `module`'s Linear children `part_names` by one FusedLinear called `fused_name`."""
    parts = {name: getattr(module, name) for name in part_names}
    setattr(module, fused_name, FusedLinear(parts, ops))
    for name in part_names:
        delattr(module, name)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: `norm(x) * (1 + weight)`."""

    def __init__(self, dim: int, eps: float, ops: OpTable):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x) in one op."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`, gate and up fused into `gate_up_proj` once loaded."""

    def __init__(self, hidden: int, intermediate: int, ops: OpTable):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, ops)
        self.up_proj = Linear(hidden, intermediate, ops)
        self.down_proj = Linear(intermediate, hidden, ops)
        self.ops = ops

    def fuse(self) -> None:
        fuse(self, "gate_up_proj", ["gate_proj", "up_proj"], self.ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(project(self.ops, x, self.gate_up_proj.weight)))


class Experts(nn.Module):
    """Routed experts, stored fused: gate_up_proj [E, 2I, H], down_proj [E, H, I] (or GGUF blocks of those
    shapes); the op table's `moe_experts` multiplies them."""

    def __init__(self, moe: MoEConfig, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(moe.held_experts, 2 * moe.moe_intermediate_size, hidden))
        self.down_proj = nn.Parameter(torch.empty(moe.held_experts, hidden, moe.moe_intermediate_size))


class QuantizedEmbedding(nn.Module):
    """An embedding table kept as GGUF blocks: each lookup dequantizes only the rows it gathers."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.weight, self.dtype = weight, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., hidden]"""
        return self.weight.rows(ids.reshape(-1), self.dtype).view(*ids.shape, self.weight.in_features)


class SparseMoE(nn.Module):
    """Softmax router (fp32), top-k experts (renormalised), plus a sigmoid-gated shared expert.

    Once loaded (`fuse`), the router and the shared expert's gate read x in one GEMM (`router`), which the op
    table's `moe_router` follows with the top-k choice (one kernel for both on CUDA), and the op table's
    `moe_experts` multiplies the shared expert along with the routed ones (the kernels as one more
    expert) and adds its gated output. `expert_reads` [1] int64
    counts, over all passes, the distinct experts each pass read (benchmarks turn it into bytes per step).
    Under expert parallelism the layer holds experts `first_expert` .. + `moe.held_experts` - 1 (rank r's are
    the r-th run of them) and adds the products of those alone."""

    def __init__(self, moe: MoEConfig, hidden: int, ops: OpTable, rank: int = 0):
        super().__init__()
        self.moe = moe
        self.ops = ops
        self.first_expert = rank * moe.held_experts if moe.expert_parallel_size > 1 else 0
        self.gate = Linear(hidden, moe.num_experts, ops)
        self.experts = Experts(moe, hidden)
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(hidden, moe.shared_expert_intermediate_size, ops)
            self.shared_expert_gate = Linear(hidden, 1, ops)

    def fuse(self) -> None:
        fuse(
            self,
            "router",
            ["gate", "shared_expert_gate"] if self.moe.shared_expert_intermediate_size else ["gate"],
            self.ops,
        )
        self.expert_reads = torch.zeros(1, dtype=torch.int64, device=self.experts.gate_up_proj.device)

    def expected_expert_bytes(self, tokens: int) -> float:
        """The expert bytes a pass of `tokens` tokens reads here on average: the distinct routed experts a uniform
        routing selects (`expected_distinct_experts`) and the shared expert (float weights or GGUF blocks)."""
        moe = self.moe
        per_expert = (self.experts.gate_up_proj.nbytes + self.experts.down_proj.nbytes) / moe.held_experts
        held_share = moe.held_experts / moe.num_experts  # of the distinct experts, those this rank holds
        routed = expected_distinct_experts(tokens, moe.num_experts, moe.num_experts_per_tok) * held_share * per_expert
        if not moe.shared_expert_intermediate_size:
            return routed
        shared = self.shared_expert
        return routed + sum(t.nbytes for t in (*shared.parameters(), *shared.buffers()))  # floats or GGUF blocks

    def syncs_with_host(self, dtype: torch.dtype) -> bool:
        """Whether a pass in `dtype` reads a device value on the host here (so it cannot run in a CUDA graph)."""
        return self.ops.moe_experts_sync(dtype, self.experts.gate_up_proj, self.experts.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe, router = self.moe, self.router
        logits, weights, experts = self.ops.moe_router(
            x,
            router.weight,
            router.bias,
            router.product,
            moe.num_experts,
            moe.num_experts_per_tok,
            moe.norm_topk_prob,
            self.first_expert,
            moe.held_experts,
        )  # [N, E (+ 1: the shared expert's gate)], [N, top_k], [N, top_k] (held experts' indices, else -1)
        shared = None
        if moe.shared_expert_intermediate_size:
            mlp = self.shared_expert
            shared = SharedExpert(mlp.gate_up_proj.weight, mlp.down_proj.weight, logits[:, moe.num_experts])
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        return self.ops.moe_experts(x, gate_up, down, weights, experts, self.expert_reads, shared)


def make_mlp(config: ModelConfig, use_moe: bool, ops: OpTable, rank: int = 0) -> nn.Module:
    """The layer's MLP: a `SparseMoE` (holding tensor-parallel rank `rank`'s experts) or a dense `MLP`."""
    if use_moe and config.moe is not None:
        return SparseMoE(config.moe, config.hidden_size, ops, rank)
    return MLP(config.hidden_size, config.intermediate_size, ops)
