#!/usr/bin/env bash
# Issue #6's device benchmarks on a random-weight Qwen3.5-27B-shaped model (bf16), one JSON report
# and one log per benchmark in OUT_DIR. Usage: tools/gpu_bench.sh OUT_DIR [decode] [verify]
# [concurrency] [prefill] [spec-oracle] [longctx] [agents] [profile] (default: all but longctx, agents and
# profile). Set SHAPE to bench another shape, QUANT (q4_k_m, q8_0, ...) for GGUF blocks. longctx asks a
# follow-up about a 63k-token document (prefix caching); agents is issue #7's scenario (16 agents, ~17.9k-token documents, two follow-ups each, through
# the server); profile lists the kernels of decode steps at 32 streams (`bench profile`).
set -uo pipefail
out=${1:?usage: tools/gpu_bench.sh OUT_DIR [benchmarks...]}
shift
mkdir -p "$out"
benches=("$@")
[ ${#benches[@]} -eq 0 ] && benches=(decode verify concurrency prefill spec-oracle)
model=(--random-weights --shape "${SHAPE:-qwen3.5-27b}" --device cuda --dtype bfloat16)
declare -A extra=(
  [decode]="--context 128 --max-tokens 64 --runs 3 --compare-hf"
  [verify]="--context 128 --rows 1,2,4,8,16,32,64 --runs 3"
  [concurrency]="--concurrency 1,4,16,32 --context 128 --max-tokens 64 --runs 3"
  [prefill]="--lengths 1024,8192,32768 --runs 3 --prefill-chunk 8192 --max-num-batched-tokens 8192"
  [spec-oracle]="--oracle-al 3 --draft-tokens 4 --context 128 --max-tokens 64 --runs 3"
  [longctx]="--doc-tokens 63000 --question-tokens 64 --max-tokens 64 --runs 3 --prefill-chunk 8192 --max-num-batched-tokens 8192"
  [agents]="--agents 16 --doc-chars 68000 --stagger 0.5 --max-tokens 32 --runs 3 --max-model-len 32768 --max-num-seqs 16 --max-num-batched-tokens 8192 --prefill-chunk 2048"
  [profile]="--streams 32 --context 128 --steps 8"
)
if [ -n "${QUANT:-}" ]; then  # transformers cannot run GGUF blocks: no --compare-hf
  model+=(--quant "$QUANT")
  extra[decode]="--context 128 --max-tokens 64 --runs 3"
fi
for bench in "${benches[@]}"; do
  # shellcheck disable=SC2086
  if python3 -m deltaspec.cli bench "$bench" ${extra[$bench]} "${model[@]}" --out "$out/$bench.json" \
      > /dev/null 2> "$out/$bench.log"; then
    echo "$bench: done"
  else
    echo "$bench: failed"; tail -5 "$out/$bench.log"
  fi
done
