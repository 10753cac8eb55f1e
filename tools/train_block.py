"""Train a block drafter (DFlash layout) for a trained target on the packed corpus, with the target frozen.

The drafter is deltaspec's own `BlockDrafterModel` (deltaspec/model/block_drafter.py) on the torch reference
ops, so training runs exactly the forward the engine drafts with. Per training sequence, the frozen target
(transformers) gives the outputs of the tapped layers at every position; random anchor positions a each
open a block [t_a, mask, ..., mask] at positions a..a+B-1 that sees the context before a, and block position
k >= 1 learns t_{a+k} with cross-entropy weighted by exp(-(k - 1) / gamma) (early positions matter most: a
draft is accepted up to its first miss), as in DFlash's recipe. The target's embeddings (the mask token's
row included) and LM head stay frozen and are not saved.

Writes OUT/config.json and OUT/model.safetensors (bf16) in the DFlash layout, which `--speculative block
--draft-model OUT` loads, and OUT/training_curve.json with held-out top-1 per block position and the block
acceptance length (leading correct drafts per block, greedy).

GPU time comes in short leases: `--minutes M` ends the run after M minutes of training steps, and every run
ends by writing OUT/checkpoint.pt (drafter and optimizer state, step, data-sampling state, curve so far) next
to the drafter; `--resume` continues from it with the same learning-rate schedule, so two ten-minute runs
train the same model as one twenty-minute run would (up to GPU non-determinism).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from corpus_io import frozen_target, load_tokens
from train_model import lr_at, sample_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltaspec.model.block_drafter import BlockDrafterConfig, BlockDrafterModel  # noqa: E402
from deltaspec.model.hf_config import parse_model_config, read_config_json  # noqa: E402
from deltaspec.ops.dispatch import ops_for  # noqa: E402


def new_drafter(args, device, final_norm: torch.Tensor) -> BlockDrafterModel:
    """A drafter shaped like DFlash's for the target (`BlockDrafterConfig.sized_for`) with the flags' changes,
    weights drawn with std 0.02, norms at 1 but the last, which starts as the target's final norm
    (`final_norm`: its zero-centred weight), so the shared LM head sees hidden states of the scale it knows."""
    target = parse_model_config(read_config_json(args.target))
    config = BlockDrafterConfig.sized_for(target, args.block_size, args.layers)
    config = replace(
        config,
        intermediate_size=args.intermediate or config.intermediate_size,
        rope_theta=args.rope_theta or config.rope_theta,
        target_layer_ids=tuple(args.taps) if args.taps else config.target_layer_ids,
        mask_token_id=config.mask_token_id if args.mask_token is None else args.mask_token,
    )
    net = BlockDrafterModel(config, ops_for(device, reference_only=True), torch.float32, device)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(torch.ones(p.shape) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.02)
        net.norm.weight.copy_(1.0 + final_norm.float().cpu())
    return net.to(device)


def target_features(target, ids: torch.Tensor, taps: tuple[int, ...]) -> torch.Tensor:
    """ids [b, T] -> the tapped layers' outputs side by side [b, T, taps * H] (transformers' hidden_states[i+1])."""
    with torch.no_grad():
        states = target.model(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1] for i in taps], dim=-1)


def block_logits(net, target, ids: torch.Tensor, anchors: torch.Tensor, autocast) -> torch.Tensor:
    """ids [b, T]; anchors [b, A] (the block anchors of each row) -> logits of block positions 1..B-1
    [b * A, B-1, V], from one batched drafter forward (`BlockDrafterModel.forward_anchored`)."""
    cfg, width = net.config, net.config.block_size
    batch, seq_len = ids.shape
    features = target_features(target, ids, cfg.target_layer_ids)  # [b, T, taps * H]
    embed = target.get_input_embeddings()
    with autocast:
        positions = torch.arange(seq_len, device=ids.device).repeat(batch)
        context = [
            (k.view(batch, seq_len, *k.shape[1:]), v.view(batch, seq_len, *v.shape[1:]))
            for k, v in net.context_keys_values(features.flatten(0, 1), positions)
        ]
        block_ids = ids.new_full((*anchors.shape, width), cfg.mask_token_id)
        block_ids[:, :, 0] = ids.gather(1, anchors)
        hidden = net.forward_anchored(embed(block_ids.view(batch, -1)), context, anchors)
        return target.lm_head(hidden.view(-1, width, cfg.hidden_size)[:, 1:])


def block_labels(ids: torch.Tensor, anchors: torch.Tensor, width: int) -> torch.Tensor:
    """[b * A, B-1]: the tokens block positions 1..B-1 should draft."""
    offsets = anchors[:, :, None] + torch.arange(1, width, device=ids.device)  # [b, A, B-1]
    return ids.gather(1, offsets.flatten(1)).view(-1, width - 1)


def position_weights(width: int, gamma: float, device) -> torch.Tensor:
    """exp(-(k - 1) / gamma) for block positions k = 1..B-1, summing to 1."""
    w = torch.exp(-torch.arange(width - 1, device=device, dtype=torch.float32) / gamma)
    return w / w.sum()


@torch.no_grad()
def evaluate(net, target, tokens: np.ndarray, seq_len: int, stride: int, device, autocast, batch: int = 8) -> dict:
    """Held-out windows with an anchor every `stride` positions: top-1 per block position and the mean number of
    leading correct drafts per block (the acceptance length greedy verification would give)."""
    width = net.config.block_size
    windows = len(tokens) // seq_len
    correct, leading, blocks = torch.zeros(width - 1), 0.0, 0
    for first in range(0, windows, batch):
        rows = np.stack([tokens[w * seq_len : (w + 1) * seq_len] for w in range(first, min(first + batch, windows))])
        ids = torch.from_numpy(rows.astype(np.int64)).to(device)
        anchors = torch.arange(1, seq_len - width + 1, stride, device=device).expand(ids.shape[0], -1)
        hits = block_logits(net, target, ids, anchors, autocast).argmax(-1) == block_labels(ids, anchors, width)
        correct += hits.sum(0).float().cpu()
        leading += hits.int().cumprod(-1).sum().item()
        blocks += hits.shape[0]
    return {
        "blocks": blocks,
        "top1_per_position": [round(c, 4) for c in (correct / max(blocks, 1)).tolist()],
        "acceptance_length": leading / max(blocks, 1),
    }


def save(net: BlockDrafterModel, num_target_layers: int, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in net.state_dict().items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = net.config.to_json(num_target_layers)
    config.update(dtype="bfloat16", max_position_embeddings=4096)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def save_checkpoint(path: Path, net, opt, rng: np.random.Generator, step: int, spent: float, curve: dict) -> None:
    """Everything `--resume` needs: the next step, the drafter and optimizer state, the data sampler's state."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "seconds": spent, "curve": curve, "rng": rng.bit_generator.state}
    torch.save({**state, "net": net.state_dict(), "opt": opt.state_dict()}, path)


def load_checkpoint(path: Path, net, opt, rng: np.random.Generator) -> tuple[int, float, dict]:
    state = torch.load(path, map_location=next(net.parameters()).device, weights_only=False)
    net.load_state_dict(state["net"])
    opt.load_state_dict(state["opt"])
    rng.bit_generator.state = state["rng"]
    return state["step"], state["seconds"], state["curve"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True, help="trained target directory (read only)")
    ap.add_argument("--out", type=Path, required=True, help="directory the drafter is written to")
    ap.add_argument("--pack", type=Path, default=Path("build/pack"))
    ap.add_argument("--layers", type=int, default=2, help="draft layers (and, by DFlash's default, target taps)")
    ap.add_argument("--taps", type=int, nargs="*", help="target layers to read (default: DFlash's spacing)")
    ap.add_argument("--intermediate", type=int, default=0, help="MLP width (default: the target's)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--mask-token", type=int, default=None, help="default: the last vocabulary id")
    ap.add_argument("--rope-theta", type=float, default=None, help="default: the target's")
    ap.add_argument("--tokens", type=float, default=24e6, help="training tokens read by the target")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--anchors", type=int, default=64, help="blocks per training sequence")
    ap.add_argument("--gamma", type=float, default=7.0, help="decay of the loss weight over block positions")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-stride", type=int, default=32, help="held-out anchor spacing")
    ap.add_argument("--eval-tokens", type=int, default=1 << 18, help="held-out tokens read per stream")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop training after this many minutes (0: no limit)")
    ap.add_argument(
        "--anneal-by-time",
        action="store_true",
        help="with --minutes: end the learning-rate decay when the minutes end, if that comes before --tokens",
    )
    ap.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt when it exists")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    target = frozen_target(args.target, device)
    net = new_drafter(args, device, target.model.norm.weight)
    width = args.block_size
    train = load_tokens(args.pack / "train.bin")
    heldout = {name: load_tokens(args.pack / f"heldout_{name}.bin")[: args.eval_tokens] for name in ("code", "chat")}
    steps = max(int(args.tokens // (args.batch * args.seq_len)), 1)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    weights = position_weights(width, args.gamma, device)
    rng = np.random.default_rng(args.seed)
    curve, first_step, spent = {"step": [], "train_loss": [], "train_top1": []}, 0, 0.0
    checkpoint_path = args.out / "checkpoint.pt"
    if args.resume and checkpoint_path.is_file():
        first_step, spent, curve = load_checkpoint(checkpoint_path, net, opt, rng)
        print(f"resumed from {checkpoint_path} at step {first_step} ({spent / 60:.1f} min trained)")
    t0, deadline = time.time(), time.time() + args.minutes * 60 if args.minutes > 0 else math.inf
    params = sum(p.numel() for p in net.parameters())
    print(f"block drafter: {params / 1e6:.2f} M parameters, taps {net.config.target_layer_ids}, {steps} steps")
    for step in range(first_step, steps):
        if time.time() > deadline:
            print(f"time budget of {args.minutes} min reached at step {step}/{steps}")
            break
        horizon = steps
        if args.anneal_by_time and math.isfinite(deadline) and step > first_step:  # the steps the time left allows
            per_step = (time.time() - t0) / (step - first_step)
            horizon = min(steps, step + int((deadline - time.time()) / per_step))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, horizon, args.lr, min(args.warmup, steps))
        ids = sample_batch(train, args.batch, args.seq_len - 1, rng, device)  # [b, seq_len]
        starts, count = np.arange(1, args.seq_len - width + 1), min(args.anchors, args.seq_len - width)
        anchors = torch.from_numpy(
            np.stack([np.sort(rng.choice(starts, count, replace=False)) for _ in range(ids.shape[0])])
        )
        anchors = anchors.to(device)
        logits = block_logits(net, target, ids, anchors, autocast).float()  # [blocks, B-1, V]
        labels = block_labels(ids, anchors, width)
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        loss = (nll.view(labels.shape) * weights).sum(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == steps - 1:
            top1 = (logits.argmax(-1) == labels)[:, 0].float().mean().item()
            curve["step"].append(step)
            curve["train_loss"].append(loss.item())
            curve["train_top1"].append(top1)
            rate = (step + 1 - first_step) * args.batch * args.seq_len / (time.time() - t0)
            print(f"block step {step}/{steps} loss {loss.item():.4f} top1@+1 {top1:.3f} {rate / 1e3:.1f} k tok/s")
    else:
        step = steps
    spent += time.time() - t0
    save_checkpoint(checkpoint_path, net, opt, rng, step, spent, curve)
    net.requires_grad_(False)
    curve["final"] = {
        name: evaluate(net, target, toks, args.seq_len, args.eval_stride, device, autocast)
        for name, toks in heldout.items()
    }
    curve["seconds"], curve["steps_done"], curve["steps_planned"] = spent, step, steps
    curve["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print("final (held-out): " + json.dumps(curve["final"]), flush=True)
    save(net, target.config.num_hidden_layers, args.out)
    (args.out / "training_curve.json").write_text(json.dumps(curve, indent=1))
    print(f"saved {args.out} after {math.ceil(curve['seconds'])} s")


if __name__ == "__main__":
    main()
