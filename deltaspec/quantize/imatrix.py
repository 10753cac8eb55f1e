"""The importance matrix (llama.cpp's imatrix) of a float model, measured on calibration text.

Owns what `llama-imatrix` collects: for every projection of the decoder layers, the mean over the calibration
tokens of each input column's squared activation, and for the routed experts the same per expert over the
tokens routed to it (down_proj's input being that expert's `silu(gate) * up`); an expert no token reached gets
ones, as llama-quantize does. The text is tokenized as one stream and cut into whole windows of `window` tokens
(a shorter tail is left out), each prefilled from its own start through the engine
(`deltaspec.evaluate_kl.window_logits`), as llama-imatrix runs its chunks. Forward pre-hooks read the inputs;
the model's own forward is unchanged. Like llama-imatrix, the embedding, the LM head and the MTP head (which a
plain forward does not run) get no importance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from deltaspec.errors import DeltaspecError
from deltaspec.evaluate_kl import tokens_of, window_logits
from deltaspec.llm import LLM
from deltaspec.model.layers import MLP, FusedLinear, Linear, SparseMoE, project


class ImportanceCollector:
    """Sums of squared inputs per projection weight (checkpoint names), kept while registered on a model."""

    def __init__(self, layers: nn.ModuleList, prefix: str = "model.layers"):
        self.sums: dict[str, torch.Tensor] = {}  # weight -> [cols], or [E, cols] for routed experts (float32)
        self.counts: dict[str, int | torch.Tensor] = {}  # weight -> tokens seen (per expert: [E])
        self.handles = []
        by_moe_hook = set()  # ids of modules a MoE layer's ops multiply without a module call
        for name, module in layers.named_modules(prefix=prefix):
            if id(module) in by_moe_hook:
                continue
            if isinstance(module, FusedLinear):
                parent = name.rpartition(".")[0]
                self._hook(module, [f"{parent}.{part}.weight" for part in module.names])
            elif isinstance(module, Linear):
                self._hook(module, [f"{name}.weight"])
            elif isinstance(module, MLP):  # its gate_up_proj is multiplied without a module call
                self._hook(module, [f"{name}.gate_proj.weight", f"{name}.up_proj.weight"])
            elif isinstance(module, SparseMoE):  # its router and shared expert too: the layer's hook records them
                by_moe_hook.update(id(m) for m in module.router.modules())
                if hasattr(module, "shared_expert"):
                    by_moe_hook.update(id(m) for m in module.shared_expert.modules())
                self.handles.append(module.register_forward_pre_hook(self._experts_hook(name)))

    def _hook(self, module: nn.Module, weights: list[str]) -> None:
        def hook(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1])  # [T, cols]
            squares = x.float().square().sum(0)  # [cols]
            for weight in weights:
                self._add(weight, squares, x.shape[0])

        self.handles.append(module.register_forward_pre_hook(hook))

    def _experts_hook(self, layer: str):
        name = f"{layer}.experts"

        def hook(moe: SparseMoE, args):
            """The router's and the shared expert's inputs, and the routing of the layer's input, computed again
            here (the op table's `moe_router` and `moe_experts` multiply them, not module calls)."""
            x = args[0]  # [N, H]
            squares = x.float().square().sum(0)  # [H]
            for part in moe.router.names:  # the experts' router and the shared expert's gate
                self._add(f"{layer}.{part}.weight", squares, x.shape[0])
            if hasattr(moe, "shared_expert"):
                self._shared_expert(f"{layer}.shared_expert", moe.shared_expert.gate_up_proj.weight, x, squares)
            module, n_experts = moe.experts, moe.moe.num_experts
            logits = project(moe.ops, x, moe.router.weight)[:, :n_experts]  # [N, E]
            top_idx = moe.ops.moe_route(logits, moe.moe.num_experts_per_tok, moe.moe.norm_topk_prob)[1].long()
            inner = module.down_proj.shape[-1]
            gate_up = torch.zeros(n_experts, x.shape[-1], device=x.device)
            down = torch.zeros(n_experts, inner, device=x.device)
            counts = torch.bincount(top_idx.reshape(-1), minlength=n_experts)  # [E]
            for expert in top_idx.unique().tolist():
                rows = torch.where(top_idx == expert)[0]  # one entry per (token, slot) routed here
                xe = x[rows]  # [n, H]
                gate, up = F.linear(xe, module.gate_up_proj[expert]).chunk(2, dim=-1)
                gate_up[expert] = xe.float().square().sum(0)
                down[expert] = (F.silu(gate) * up).float().square().sum(0)
            for part, squares in (("gate_proj", gate_up), ("up_proj", gate_up), ("down_proj", down)):
                self._add(f"{name}.{part}", squares, counts)

        return hook

    def _shared_expert(self, name: str, gate_up: torch.Tensor, x: torch.Tensor, squares: torch.Tensor) -> None:
        """A shared expert sees every token: its gate and up read x (`squares`: x's squared columns summed), its
        down `silu(gate) * up`."""
        self._add(f"{name}.gate_proj.weight", squares, x.shape[0])
        self._add(f"{name}.up_proj.weight", squares, x.shape[0])
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        self._add(f"{name}.down_proj.weight", (F.silu(gate) * up).float().square().sum(0), x.shape[0])

    def _add(self, weight: str, squares: torch.Tensor, count: int | torch.Tensor) -> None:
        self.sums[weight] = self.sums[weight] + squares if weight in self.sums else squares
        self.counts[weight] = self.counts.get(weight, 0) + count

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def means(self) -> dict[str, torch.Tensor]:
        """weight -> mean squared input [cols] (or [E, cols]) on the CPU; ones for an expert that saw no token."""
        out = {}
        for weight, sums in self.sums.items():
            count = self.counts[weight]
            if isinstance(count, int):
                out[weight] = (sums / count).cpu()
                continue
            mean = sums / count.clamp(min=1).unsqueeze(-1)  # [E, cols]
            mean[count == 0] = 1.0
            out[weight] = mean.cpu()
        return out


def collect_importance(llm: LLM, text: str, window: int, max_windows: int | None, progress: bool = True):
    """(weight -> mean squared input, windows run) of `llm`'s float model on `text` (see the module docstring)."""
    ids = tokens_of(llm, text)
    windows = [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)][:max_windows]
    if not windows:
        raise DeltaspecError(
            f"The calibration text has {len(ids)} tokens, less than one window of {window}; give more text or a "
            "smaller --window."
        )
    collector = ImportanceCollector(llm.engine.model.model.layers)
    try:
        with torch.inference_mode():
            for w in tqdm(windows, desc="Calibrating", unit="window", disable=not progress):
                window_logits(llm.engine, w)
    finally:
        collector.remove()
    return collector.means(), len(windows)
