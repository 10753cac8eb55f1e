"""The expert products' operands on the host: which expert stacks the kernels take (`fuses`, `experts_sync`) and
as what (`KernelWeight`: type, tensor, strides), whether a shared expert runs as one more routed expert
(`runs_shared_as_expert`) or apart (`shared_output`), and what the kernels of one pass read and write
(`Operands`, which hands the kernels their weight and shared-expert operands)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltaspec.ops import moe as reference
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.ops.triton import activation, quant_matmul
from deltaspec.ops.triton.moe.tiles import ALIGN_MAX_PAIRS, FLOAT_DTYPES
from deltaspec.ops.triton.quant_dequant import KERNEL_TYPES

KernelWeight = tuple[int, torch.Tensor, int, int]  # QTYPE (-1: float), the stack, its stride per expert and per row


def kernel_weight(weight: torch.Tensor | QuantizedWeight) -> KernelWeight | None:
    """(QTYPE, tensor, per-expert stride, per-row stride) of an expert stack (or of one expert's [rows, in]
    weight) the kernels read, else None."""
    if isinstance(weight, torch.Tensor):
        if weight.dtype not in FLOAT_DTYPES or weight.stride(-1) != 1:
            return None
        return -1, weight, weight.stride(0) if weight.dim() == 3 else 0, weight.stride(-2)
    (qtype, data), *rest = weight.segments
    if rest or qtype not in KERNEL_TYPES or weight.input_order is not None or weight.in_features % 256:
        return None
    if not data.is_contiguous():
        return None
    return KERNEL_TYPES[qtype], data, data.stride(0) if data.dim() == 3 else 0, data.stride(-2)


def routed_stacks(
    x_dtype: torch.dtype, gate_up: torch.Tensor | QuantizedWeight, down: torch.Tensor | QuantizedWeight
) -> tuple[KernelWeight, KernelWeight] | None:
    """The routed (gate|up, down) stacks as the kernels read them, or None where `expert_products` takes the
    reference loop (activations or weights the kernels do not take)."""
    if x_dtype not in FLOAT_DTYPES:
        return None
    stacks = (kernel_weight(gate_up), kernel_weight(down))
    return None if None in stacks else stacks


def fuses(x_dtype: torch.dtype, gate_up: torch.Tensor | QuantizedWeight, down: torch.Tensor | QuantizedWeight) -> bool:
    """Whether `expert_products` runs the kernels (else the reference loop, which syncs with the host)."""
    return routed_stacks(x_dtype, gate_up, down) is not None


def experts_sync(
    dtype: torch.dtype, gate_up: torch.Tensor | QuantizedWeight, down: torch.Tensor | QuantizedWeight
) -> bool:
    """`deltaspec.ops.moe.experts_sync` for the kernels: only the products they leave to the reference sync."""
    return not fuses(dtype, gate_up, down)


def _as_expert(
    shared: torch.Tensor | QuantizedWeight, stack: torch.Tensor | QuantizedWeight, routed: KernelWeight
) -> torch.Tensor | None:
    """The shared expert's weight as the kernels read one more expert of the routed `stack` (same shape per
    expert, type and row stride), else None."""
    mine = kernel_weight(shared)
    if mine is None or tuple(shared.shape) != tuple(stack.shape[1:]):
        return None
    qtype, tensor, _, row_stride = mine
    return tensor if (qtype, row_stride, tensor.dtype) == (routed[0], routed[3], routed[1].dtype) else None


def shared_as_expert(
    gate_up: torch.Tensor | QuantizedWeight,
    down: torch.Tensor | QuantizedWeight,
    stacks: tuple[KernelWeight, KernelWeight],
    shared: reference.SharedExpert | None,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The shared expert's (gate|up, down) as the kernels read one more routed expert of `stacks` (the routed
    gate|up and down as `routed_stacks` gives them), when it is shaped and stored like them (the Qwen3.5 /
    Qwen3-Next MoE layers: same intermediate size, same type) and the pass is no longer than the one-program
    grouping takes (decode, verify, batches), else None. A prefill's shared expert is a large dense product,
    faster as one GEMM than as one more expert's blocks (8k tokens of `qwen3.5-35b-a3b` on the H200: 21.2k
    tok/s as expert E, 25.2k apart)."""
    if shared is None or shared.logit.shape[0] * (top_k + 1) > ALIGN_MAX_PAIRS:
        return None
    pair = (_as_expert(shared.gate_up, gate_up, stacks[0]), _as_expert(shared.down, down, stacks[1]))
    return None if None in pair else pair


def runs_shared_as_expert(
    gate_up: torch.Tensor | QuantizedWeight,
    down: torch.Tensor | QuantizedWeight,
    shared: reference.SharedExpert,
    top_k: int,
) -> bool:
    """Whether `expert_products` multiplies `shared` in the routed experts' launches (else before them)."""
    stacks = routed_stacks(shared.logit.dtype, gate_up, down)
    return stacks is not None and shared_as_expert(gate_up, down, stacks, shared, top_k) is not None


@dataclass(frozen=True)
class Operands:
    """What the expert kernels of one pass read and write. Pairs 0..routed_pairs-1 are the routing's (token p //
    top_k, slot p % top_k); with `shared_weights` the shared expert runs in the same launches as expert E, one
    pair per token after the routed ones."""

    x: torch.Tensor  # [N, H]
    gate_up: KernelWeight
    down: KernelWeight
    weights: torch.Tensor  # [N, top_k] float
    experts: torch.Tensor  # [N, top_k] int32
    expert_reads: torch.Tensor  # [1] int64
    shared_logit: torch.Tensor | None  # [N]
    shared_out: torch.Tensor | None  # [N, H] the shared expert's product computed outside the kernels
    shared_weights: tuple[torch.Tensor, torch.Tensor] | None  # gate|up, down of the shared expert as expert E
    inter: torch.Tensor  # [pairs, I] the gated products
    out: torch.Tensor  # [N, H]

    @property
    def routed_pairs(self) -> int:
        return self.experts.numel()

    @property
    def num_experts(self) -> int:
        return self.gate_up[1].shape[0]

    def weight_args(self, down: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int], dict]:
        """The routed gate|up (or down) stack as the kernels take it: the weight operand `w` (the stack, the shared
        expert's weights as expert E, or the stack as their placeholder), its strides per expert and per row, and
        the constexprs QTYPE and SHARED_W."""
        qtype, stack, stride_e, stride_n = self.down if down else self.gate_up
        shared = stack if self.shared_weights is None else self.shared_weights[int(down)]
        return (stack, shared), (stride_e, stride_n), {"QTYPE": qtype, "SHARED_W": self.shared_weights is not None}

    def shared_operand(
        self, shared_out: torch.Tensor | None
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, int]]:
        """The sum kernels' shared expert operand (its product `shared_out` [N, H], its gate logits [N]; the
        output and the routing weights as placeholders where there is none) and its strides."""
        shared_out = shared_out if shared_out is not None else self.out
        shared_logit = self.shared_logit if self.shared_logit is not None else self.weights
        return (shared_out, shared_logit), (shared_out.stride(0), shared_logit.stride(0))


def shared_output(x: torch.Tensor, shared: reference.SharedExpert) -> torch.Tensor:
    """The shared expert's product outside the expert kernels (its weights are not one more expert of the
    stack's kind): the dense GGUF GEMM for blocks, torch's for float weights."""

    def linear(a: torch.Tensor, w: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        return quant_matmul.quantized_linear(a, w) if isinstance(w, QuantizedWeight) else F.linear(a, w)

    return linear(activation.silu_mul(linear(x, shared.gate_up)), shared.down)
