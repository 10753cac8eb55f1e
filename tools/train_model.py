"""Train a Qwen3.5-architecture code model (the default model's target or its draft) on the packed corpus.

Runs on CUDA (bf16 autocast, flash-linear-attention's GDN kernels when installed) or, slowly, on
the CPU for a smoke test. Reads `PACK/train.bin` (or `train.bin.xz`) of uint16 tokens, samples
random windows with a fixed seed, trains with AdamW and a warmup + cosine schedule, evaluates
held-out loss, perplexity and bits per byte, and saves a standard Hugging Face directory
(bfloat16 safetensors, with the tokenizer files) plus its training curve as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from corpus_io import evaluate_lm, load_tokens, token_byte_lengths

SHAPES = {
    # 8 layers, 3 GDN : 1 attention, tied 8k embeddings: ~10.6 M parameters
    "target": dict(
        hidden_size=320,
        num_hidden_layers=8,
        intermediate_size=704,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    ),
    # 4 layers: ~2.5 M parameters
    "draft": dict(
        hidden_size=160,
        num_hidden_layers=4,
        intermediate_size=448,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    ),
}


def build_config(shape: str, vocab_size: int, eos_ids: list[int], pad_id: int, max_len: int):
    import transformers as tf

    return tf.Qwen3_5TextConfig(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        max_position_embeddings=max_len,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        bos_token_id=None,
        **SHAPES[shape],
    )


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def sample_batch(tokens: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator, device) -> torch.Tensor:
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    rows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows).to(device, non_blocking=True)  # [B, L+1]


def param_groups(model, weight_decay: float):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", type=Path, default=Path("build/pack"))
    ap.add_argument("--tokenizer", type=Path, default=Path("build/tokenizer"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="target")
    ap.add_argument("--tokens", type=float, default=56e6, help="training tokens in total")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=4096, help="max_position_embeddings written to the config")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-tokens", type=int, default=400_000, help="held-out tokens per periodic eval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    import transformers as tf

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    meta = json.loads((args.pack / "meta.json").read_text())
    train = load_tokens(args.pack / "train.bin")
    heldout = {name: load_tokens(args.pack / f"heldout_{name}.bin") for name in ("code", "chat")}
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_file=str(args.tokenizer / "tokenizer.json"))
    byte_lengths = token_byte_lengths(tokenizer)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    config = build_config(args.shape, meta["vocab_size"], eos, eos[1], args.max_len)
    model = tf.Qwen3_5ForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    steps = int(args.tokens // (args.batch * args.seq_len))
    print(
        f"{args.shape}: {n_params / 1e6:.2f} M parameters, {steps} steps of {args.batch}x{args.seq_len} tokens, "
        f"{len(train) / 1e6:.1f} M training tokens",
        flush=True,
    )
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(
        param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused
    )
    rng = np.random.default_rng(args.seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    curve, t0, seen = {"step": [], "tokens": [], "train_loss": [], "lr": [], "eval": []}, time.time(), 0
    model.train()
    for step in range(steps):
        lr = lr_at(step, steps, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = sample_batch(train, args.batch, args.seq_len, rng, device)
        with autocast:
            logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += batch[:, 1:].numel()
        if step % 25 == 0 or step == steps - 1:
            curve["step"].append(step)
            curve["tokens"].append(seen)
            curve["train_loss"].append(loss.item())
            curve["lr"].append(lr)
            print(
                f"step {step}/{steps} loss {loss.item():.4f} lr {lr:.2e} {seen / (time.time() - t0) / 1e3:.0f} k tok/s",
                flush=True,
            )
        if (step + 1) % args.eval_every == 0 and step != steps - 1:
            model.eval()
            result = {
                name: evaluate_lm(model, toks[: args.eval_tokens], byte_lengths, args.seq_len, device)
                for name, toks in heldout.items()
            }
            model.train()
            curve["eval"].append({"step": step, "tokens": seen, **result})
            print(f"eval @ {step}: " + json.dumps(result), flush=True)
    curve["seconds"] = time.time() - t0
    model = model.to(torch.bfloat16).eval()
    curve["final_bf16"] = {
        name: evaluate_lm(model, toks, byte_lengths, args.seq_len, device) for name, toks in heldout.items()
    }
    print("final (bfloat16 weights, all held-out tokens): " + json.dumps(curve["final_bf16"]), flush=True)
    curve["parameters"] = n_params
    curve["args"] = {k: str(v) for k, v in vars(args).items()}
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, max_shard_size="12MB")
    tf.GenerationConfig(eos_token_id=eos, pad_token_id=eos[1], do_sample=False).save_pretrained(args.out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(args.tokenizer / name, args.out / name)
    (args.out / "training_curve.json").write_text(json.dumps(curve, indent=1))
    print(f"saved {args.out} after {curve['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
