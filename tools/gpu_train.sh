#!/usr/bin/env bash
# The GPU half of the default-model chain (run from the repo root on a CUDA machine, with the
# packed corpus in build/pack and the tokenizer in build/tokenizer, made by tools/build_corpus.py,
# tools/train_tokenizer.py and tools/pack_corpus.py on any machine):
#   target model -> MTP head on the frozen target -> draft model -> block drafter on the frozen target
#   -> curves plot.
# Wheels of flash-linear-attention (fla-core) in .whl/ are installed first when present.
# Usage: tools/gpu_train.sh OUT_DIR [target|mtp|draft|block|plot ...]   (default: all five steps)
set -euo pipefail
out=${1:?usage: tools/gpu_train.sh OUT_DIR [steps...]}
shift
steps=${*:-target mtp draft block plot}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import fla; print('fla', fla.__version__)" || echo "fla not installed: GDN runs the torch reference"
mkdir -p "$out"
root=$(pwd)
cd tools
for step in $steps; do
  case $step in
    target) python3 train_model.py --shape target --pack "$root/build/pack" --tokenizer "$root/build/tokenizer" \
              --out "$out/target" ${TARGET_ARGS:-} 2>&1 | tee "$out/target.log"
            cp "$out/target/training_curve.json" "$out/target_curve.json" ;;
    mtp)    python3 train_mtp.py --target "$out/target" --pack "$root/build/pack" ${MTP_ARGS:-} 2>&1 | tee "$out/mtp.log"
            cp "$out/target/mtp_training_curve.json" "$out/mtp_curve.json" ;;
    draft)  python3 train_model.py --shape draft --lr 3e-3 --tokens 48e6 --pack "$root/build/pack" --tokenizer "$root/build/tokenizer" \
              --out "$out/draft" ${DRAFT_ARGS:-} 2>&1 | tee "$out/draft.log"
            cp "$out/draft/training_curve.json" "$out/draft_curve.json" ;;
    block)  python3 train_block.py --target "$out/target" --pack "$root/build/pack" --out "$out/block" ${BLOCK_ARGS:-} 2>&1 \
              | tee "$out/block.log"
            cp "$out/block/training_curve.json" "$out/block_curve.json" ;;
    plot)   python3 plot_curves.py --curves "$out" --out "$out/curves.png" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
