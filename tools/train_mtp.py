"""Train the MTP head of a trained target on the packed corpus, with the target frozen.

The head is the layout Qwen3.5 checkpoints ship (`mtp.*`): for row i it reads the target's final
hidden state h_i and the embedding of t_{i+1}, `fc(cat[norm_e(embed(t_{i+1})), norm_h(h_i)])`,
one full-attention decoder layer (initialised from the target's last attention layer) at
position i, `norm`, and the target's own LM head; it learns to predict t_{i+2}. The trained
tensors are added to the checkpoint as one more safetensors shard, and `mtp_num_hidden_layers`
is set in config.json. Reports top-1 accuracy at position +2 on the held-out code and chat.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from corpus_io import frozen_target, load_tokens
from torch import nn
from train_model import lr_at, sample_batch


class MTPHead(nn.Module):
    def __init__(self, target):
        super().__init__()
        import importlib

        modeling = importlib.import_module(type(target).__module__)
        config = target.config
        hidden = config.hidden_size
        attention_layer = max(i for i, t in enumerate(config.layer_types) if t == "full_attention")
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        nn.init.normal_(self.fc.weight, std=0.02)
        self.pre_fc_norm_embedding = modeling.Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = modeling.Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([modeling.Qwen3_5DecoderLayer(config, attention_layer)])
        self.layers[0].load_state_dict(target.model.layers[attention_layer].state_dict())
        self.norm = modeling.Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm.load_state_dict(target.model.norm.state_dict())

    def forward(self, target, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_ids [B, L] (t_{i+1}), hidden [B, L, H] (h_i) -> logits for t_{i+2} [B, L, V]."""
        dtype = self.fc.weight.dtype
        embeds, hidden = target.model.embed_tokens(next_ids).to(dtype), hidden.to(dtype)
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)[None, None].expand(3, x.shape[0], -1)
        y = self.layers[0](x, position_embeddings=target.model.rotary_emb(x, positions), attention_mask=None)
        y = y[0] if isinstance(y, tuple) else y
        return target.lm_head(self.norm(y))


def mtp_step(head, target, batch: torch.Tensor, autocast):
    """batch [B, L+2] -> (loss, correct, count) for predicting t_{i+2} from (h_i, t_{i+1})."""
    with torch.no_grad(), autocast:
        hidden = target.model(batch[:, :-2]).last_hidden_state
    with autocast:
        logits = head(target, batch[:, 1:-1], hidden)
    labels = batch[:, 2:]
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    correct = (logits.argmax(-1) == labels).sum().item()
    return loss, correct, labels.numel()


@torch.no_grad()
def evaluate_mtp(head, target, tokens: np.ndarray, seq_len: int, device, autocast, batch: int = 16) -> dict:
    windows = (len(tokens) - 2) // seq_len
    correct = count = 0
    for first in range(0, windows, batch):
        rows = np.stack(
            [tokens[w * seq_len : (w + 1) * seq_len + 2] for w in range(first, min(first + batch, windows))]
        )
        _, c, n = mtp_step(head, target, torch.from_numpy(rows.astype(np.int64)).to(device), autocast)
        correct, count = correct + c, count + n
    return {"tokens": count, "top1_at_plus2": correct / max(count, 1)}


def save_head(head: MTPHead, target_dir: Path) -> None:
    from safetensors.torch import save_file

    tensors = {f"mtp.{k}": v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in head.state_dict().items()}
    shard = "model-mtp.safetensors"
    save_file(tensors, target_dir / shard, metadata={"format": "pt"})
    index_path = target_dir / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        from safetensors import safe_open

        with safe_open(target_dir / "model.safetensors", "pt") as f:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    index["weight_map"].update({k: shard for k in tensors})
    index_path.write_text(json.dumps(index, indent=2))
    config = json.loads((target_dir / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (target_dir / "config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True, help="trained target directory (updated in place)")
    ap.add_argument("--pack", type=Path, default=Path("build/pack"))
    ap.add_argument("--tokens", type=float, default=12e6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    target = frozen_target(args.target, device)
    head = MTPHead(target).to(device)
    train = load_tokens(args.pack / "train.bin")
    heldout = {name: load_tokens(args.pack / f"heldout_{name}.bin") for name in ("code", "chat")}
    steps = int(args.tokens // (args.batch * args.seq_len))
    opt = torch.optim.AdamW(
        head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=device.type == "cuda"
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    rng = np.random.default_rng(args.seed)
    curve, t0 = {"step": [], "train_loss": [], "train_top1": []}, time.time()
    print(f"MTP head: {sum(p.numel() for p in head.parameters()) / 1e6:.2f} M parameters, {steps} steps", flush=True)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, args.warmup)
        loss, correct, count = mtp_step(
            head, target, sample_batch(train, args.batch, args.seq_len + 1, rng, device), autocast
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == steps - 1:
            curve["step"].append(step)
            curve["train_loss"].append(loss.item())
            curve["train_top1"].append(correct / count)
            print(f"mtp step {step}/{steps} loss {loss.item():.4f} top1@+2 {correct / count:.3f}", flush=True)
    head = head.to(torch.bfloat16)
    target = target.to(torch.bfloat16)
    curve["final_bf16"] = {
        name: evaluate_mtp(head, target, toks, args.seq_len, device, autocast) for name, toks in heldout.items()
    }
    curve["seconds"] = time.time() - t0
    print("final MTP (bfloat16, all held-out tokens): " + json.dumps(curve["final_bf16"]), flush=True)
    save_head(head, args.target)
    (args.target / "mtp_training_curve.json").write_text(json.dumps(curve, indent=1))


if __name__ == "__main__":
    main()
