#!/usr/bin/env bash
# Issue #44: llama.cpp and deltaspec side by side on the same random-weight GGUF file and GPU, in one JSON
# (OUT_DIR/peer_bench.json): batch-1 decode, a 512-token prefill and 32 streams. Run from the repository root on
# the GPU machine, with llama.cpp's source (../shared/peers/llama.cpp-2026-10-src.tar.xz) copied into the
# checkout beforehand (LLAMA_TARBALL, default .scratch/llama.cpp-2026-10-src.tar.xz).
#
#   tools/peer_bench.sh OUT_DIR
#
# SHAPE (default qwen3.5-27b) and TYPE (default q4_k_m) choose the file. STEPS (default all of
# build,file,llama,deltaspec,combine) runs some steps only, so that the work fits separate calls: each step keeps
# its results in OUT_DIR and WORK (default .scratch/peer: the llama.cpp build and the GGUF file), which later
# steps read. Logs go to OUT_DIR/*.log.
set -euo pipefail
out=${1:?usage: tools/peer_bench.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
shape=${SHAPE:-qwen3.5-27b}
type=${TYPE:-q4_k_m}
steps=${STEPS:-build,file,llama,deltaspec,combine}
tarball=${LLAMA_TARBALL:-.scratch/llama.cpp-2026-10-src.tar.xz}
work=${WORK:-.scratch/peer}
mkdir -p "$work"
work=$(cd "$work" && pwd)
file=$work/$shape-$type-random.gguf
bin=$work/llama.cpp/build/bin
streams=32
has() { [[ ",$steps," == *",$1,"* ]]; }
step() { echo "$(date +%T) $1" >&2; }

if has build; then
  step "build: llama.cpp with CUDA ($tarball)"
  rm -rf "$work/llama.cpp"
  tar xJf "$tarball" -C "$work"
  (cd "$work/llama.cpp" &&
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF &&
    cmake --build build -j "$(($(nproc) - 1))" --target llama-bench llama-batched-bench) > "$out/build.log" 2>&1
  # the tarball has no .git, so llama-bench's build_commit is "unknown": name the source and its ggml version
  ggml=$(sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))$/\2/p' "$work/llama.cpp/ggml/CMakeLists.txt" |
    paste -sd.)
  echo "$(basename "$tarball") (ggml $ggml)" > "$out/llama-source.txt"
fi

if has file; then
  step "file: $shape $type random weights -> $file"
  # gguf-py writes the file; where the image lacks it, the copy in llama.cpp's source serves
  python3 -c "import gguf" 2> /dev/null || export PYTHONPATH=$work/llama.cpp/gguf-py${PYTHONPATH:+:$PYTHONPATH}
  python3 -m deltaspec.cli quantize --random-weights --shape "$shape" --type "$type" "$file" > "$out/file.log" 2>&1
fi

if has llama; then
  step "llama: llama-bench (pp512, tg128) and llama-batched-bench (1 and $streams streams)"
  "$bin/llama-bench" -m "$file" -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o json > "$out/llama-bench.json" \
    2> "$out/llama-bench.log"
  "$bin/llama-batched-bench" -m "$file" -ngl 99 -fa on -c $((streams * 256)) -b 2048 -ub 512 -npp 128 -ntg 128 \
    -npl "1,$streams" --output-format jsonl > "$out/llama-batched-bench.jsonl" 2> "$out/llama-batched-bench.log"
fi

if has deltaspec; then
  model=(--model "$file" --device cuda)
  step "deltaspec: bench decode"
  python3 -m deltaspec.cli bench decode "${model[@]}" --context 128 --max-tokens 128 --runs 3 \
    --out "$out/deltaspec-decode.json" > /dev/null 2> "$out/deltaspec-decode.log"
  step "deltaspec: bench prefill"
  python3 -m deltaspec.cli bench prefill "${model[@]}" --lengths 512 --runs 3 \
    --out "$out/deltaspec-prefill.json" > /dev/null 2> "$out/deltaspec-prefill.log"
  step "deltaspec: bench concurrency"
  python3 -m deltaspec.cli bench concurrency "${model[@]}" --concurrency "1,$streams" --context 128 --max-tokens 128 \
    --runs 3 --out "$out/deltaspec-concurrency.json" > /dev/null 2> "$out/deltaspec-concurrency.log"
fi

if has combine; then
  step "combine -> $out/peer_bench.json"
  python3 tools/peer_bench.py "$out" --shape "$shape" --type "$type" --streams "$streams" --file "$file"
fi
