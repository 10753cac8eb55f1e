"""Plot the default model's training curves (train loss and held-out loss over tokens) to one PNG."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--curves", type=Path, default=Path("tools/training"), help="folder of *_curve.json files")
    ap.add_argument("--out", type=Path, default=Path("tools/training/curves.png"))
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in ("target", "draft"):
        path = args.curves / f"{name}_curve.json"
        if not path.is_file():
            continue
        curve = json.loads(path.read_text())
        axes[0].plot([t / 1e6 for t in curve["tokens"]], curve["train_loss"], label=f"{name} train", alpha=0.7)
        for split, style in (("code", "o-"), ("chat", "s--")):
            points = [(e["tokens"] / 1e6, e[split]["loss"]) for e in curve["eval"]]
            if "final_bf16" in curve:
                points.append((curve["tokens"][-1] / 1e6, curve["final_bf16"][split]["loss"]))
            if points:
                axes[0].plot(*zip(*points), style, label=f"{name} held-out {split}")
    axes[0].set(xlabel="training tokens (M)", ylabel="loss (nats/token)", title="Target and draft", ylim=(0, 8))
    axes[0].legend(fontsize=8)
    mtp = args.curves / "mtp_curve.json"
    if mtp.is_file():
        curve = json.loads(mtp.read_text())
        axes[1].plot(curve["step"], curve["train_top1"], label="MTP top-1 at +2 (train batches)")
        axes[1].plot(curve["step"], [min(x, 8) / 8 for x in curve["train_loss"]], label="MTP loss / 8")
    block = args.curves / "block_curve.json"
    if block.is_file():
        curve = json.loads(block.read_text())
        axes[1].plot(curve["step"], curve["train_top1"], label="block drafter top-1 at +1 (train batches)")
        axes[1].plot(curve["step"], [min(x, 8) / 8 for x in curve["train_loss"]], label="block drafter loss / 8")
    if mtp.is_file() or block.is_file():
        axes[1].set(xlabel="step", title="Drafters on the frozen target", ylim=(0, 1))
        axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
