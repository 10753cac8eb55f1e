"""Bytes a decode step reads, and the roofline they imply (DESIGN §6).

A decode step of one sequence reads every weight once (a quantized one as its GGUF blocks, so the roofline is
the format's own), except the embedding table, of which it reads one row (the LM head is read whole; with tied
embeddings that is the same table, read twice). MTP head weights count only when the MTP drafter runs; routed
MoE experts count for the distinct experts a step's routing selected: measured by `experts_per_step` (the MoE
layers count them on the device), else the top-k of one token. On top of the weights: the attention KV of the
context, and each GDN layer's recurrent state and conv window, read and written once, per stream. Activations
and logits are left out (a few MB).
"""

from __future__ import annotations

import math

import torch

from deltaspec.bench.device import start
from deltaspec.engine.engine import Engine
from deltaspec.model.layers import SparseMoE
from deltaspec.ops.quant.weight import QuantizedWeight
from deltaspec.parallel.pipeline import stage_config
from deltaspec.parallel.shard import shard_config


def _weights(engine: Engine):
    """(name, bytes, bytes of one row) of every weight, a shared one under each of its names: float parameters in
    their dtype, weights kept as GGUF blocks (`QuantizedWeight`) as their blocks."""
    for name, param in engine.model.named_parameters(remove_duplicate=False):
        yield name, param.numel() * param.element_size(), param.shape[-1] * param.element_size()
    for name, module in engine.model.named_modules(remove_duplicate=False):
        if isinstance(module, QuantizedWeight):
            yield name, module.nbytes, module.nbytes // math.prod(module.shape[:-1])


def _expert_counters(engine: Engine) -> list[torch.Tensor]:
    """The distinct-experts counters of the decoder's MoE layers (not the MTP head's)."""
    return [m.expert_reads for m in engine.model.model.layers.modules() if isinstance(m, SparseMoE)]


def experts_per_step(engine: Engine, prompts: list[list[int]], max_tokens: int) -> float | None:
    """The distinct experts one MoE layer reads per step, averaged over the steps after the prompts' prefill
    of a greedy run of `prompts` (all together) for `max_tokens` tokens; None for a dense model."""
    counters = _expert_counters(engine)
    if not counters:
        return None
    seqs = start(engine, prompts, max_tokens)
    while not all(s.output_ids for s in seqs):
        engine.step()
    before, steps = int(sum(c.item() for c in counters)), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (sum(c.item() for c in counters) - before) / (len(counters) * max(steps, 1))


def weight_bytes_per_step(engine: Engine, mtp: bool = False, experts: float | None = None) -> int:
    """Weight bytes one step reads; `experts` distinct experts per MoE layer (default: the top-k of one token);
    under expert parallelism, of those this rank holds (`experts` counts them)."""
    config = engine.model_config
    expert_shards = engine.config.parallel.tensor_parallel_size if engine.config.parallel.enable_expert_parallel else 1
    held = config.moe.num_experts // expert_shards if config.moe is not None else 0  # routed experts per rank
    total = 0
    for name, size, row in _weights(engine):
        if name.startswith("mtp.") and not mtp:
            continue
        if "embed_tokens" in name:
            size = row  # one row
        elif ".experts." in name and config.moe is not None:
            top_k = config.moe.num_experts_per_tok * held / config.moe.num_experts  # those held, on average
            chosen = top_k if experts is None or name.startswith("mtp.") else experts
            size = int(size * chosen / held)
        total += size
    return total


def bytes_per_step(
    engine: Engine, context: float, mtp: bool = False, streams: int = 1, experts: float | None = None
) -> dict:
    """{"weights", "kv", "gdn_state", "total"} bytes one decode step of `streams` sequences reads (and, for
    states, writes) at `context` tokens of attention KV each, reading `experts` distinct experts per MoE layer; under
    tensor parallelism, one rank's: its weights, its heads' KV and states (of its pipeline stage's layers)."""
    layout = engine.config.parallel.tensor_parallel_size, engine.config.parallel.enable_expert_parallel
    config, dtype_size = (
        stage_config(shard_config(engine.model_config, *layout), engine.model.layers),
        engine.dtype.itemsize,
    )
    state_size = torch.empty(0, dtype=engine.cache.gdn.state[0].dtype).element_size() if config.gdn_layer_ids else 0
    kv_layers = len(config.attention_layer_ids) + (
        engine.model.num_kv_layers - len(config.attention_layer_ids) if mtp else 0
    )
    kv = int(streams * context * kv_layers * 2 * config.num_key_value_heads * config.head_dim * dtype_size)
    per_gdn_layer = (
        config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * state_size
        + (config.linear_conv_kernel_dim - 1) * config.gdn_conv_dim * dtype_size
    )
    gdn = 2 * streams * len(config.gdn_layer_ids) * per_gdn_layer  # read and written
    weights = weight_bytes_per_step(engine, mtp, experts)
    return {"weights": weights, "kv": kv, "gdn_state": gdn, "total": weights + kv + gdn}


def roofline(decode_tok_s: float, bytes_step: int, bandwidth: float, one_token_per_step: bool = True) -> dict:
    """Roofline fields of a measured decode rate: bandwidth in bytes/s, bytes read per step. With speculative
    decoding (`one_token_per_step` False) a step can commit several tokens, so beating the one-token roofline
    is not a violation."""
    roofline_tok_s = bandwidth / bytes_step
    return {
        "bytes_per_step": bytes_step,
        "bandwidth_gb_s": bandwidth / 1e9,
        "roofline_tok_s": roofline_tok_s,
        "roofline_step_ms": 1000 / roofline_tok_s,
        "roofline_fraction": decode_tok_s / roofline_tok_s,
        "roofline_violation": one_token_per_step and decode_tok_s > roofline_tok_s,
    }
