"""Shared by the training tools: read packed token streams, count the bytes each token stands for,
measure held-out loss, perplexity and bits per byte of a transformers causal LM, and load a trained
target frozen (for the drafters trained on it)."""

from __future__ import annotations

import lzma
import math
from pathlib import Path

import numpy as np
import torch


def load_tokens(path: Path) -> np.ndarray:
    """uint16 tokens from `path`, or from `path` + ".xz" when only the compressed file exists."""
    if path.is_file():
        return np.fromfile(path, dtype="<u2")
    with lzma.open(str(path) + ".xz") as f:
        return np.frombuffer(f.read(), dtype="<u2")


def token_byte_lengths(tokenizer) -> np.ndarray:
    """Raw bytes of text each token id stands for (byte-level BPE: one byte per symbol; special
    tokens such as document separators stand for none).  # [vocab]"""
    vocab = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    tokens = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    added = {t.content for t in tokenizer.added_tokens_decoder.values()}
    return np.array(
        [0 if i in special else (len(t.encode()) if t in added else len(t)) for i, t in enumerate(tokens)],
        dtype=np.int64,
    )


@torch.no_grad()
def evaluate_lm(model, tokens: np.ndarray, byte_lengths: np.ndarray, seq_len: int, device, batch: int = 16) -> dict:
    """Mean next-token loss over non-overlapping windows of `seq_len`, as perplexity and bits per byte."""
    windows = (len(tokens) - 1) // seq_len
    total_nll, total_tokens, total_bytes = 0.0, 0, 0
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    for first in range(0, windows, batch):
        rows = np.stack(
            [tokens[w * seq_len : (w + 1) * seq_len + 1] for w in range(first, min(first + batch, windows))]
        )
        ids = torch.from_numpy(rows.astype(np.int64)).to(device)
        with autocast:
            logits = model(ids[:, :-1]).logits
        nll = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        total_nll += nll.item()
        total_tokens += ids[:, 1:].numel()
        total_bytes += int(byte_lengths[rows[:, 1:]].sum())
    return {
        "tokens": total_tokens,
        "loss": total_nll / total_tokens,
        "ppl": math.exp(total_nll / total_tokens),
        "bits_per_byte": total_nll / math.log(2) / max(total_bytes, 1),
    }


def frozen_target(path: Path, device: torch.device):
    """The transformers model at `path` in float32 on `device`, in eval mode with no gradients."""
    import transformers as tf

    target = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    target.requires_grad_(False)
    return target
