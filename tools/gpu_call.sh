#!/usr/bin/env bash
# One GPU-machine call of a development session, run from the repo root there with `.whl` and `.scratch` carried:
# install the carried wheels, unpack a committed snapshot (.scratch/snap.tar.gz, its commit in .scratch/snap.commit,
# so that uncommitted edits in the working tree never reach the GPU run; without it, the sent tree itself, which
# must then be clean at the commit in snap.commit) to /tmp/snap with the sent tree's model and
# test data, then run the steps in order. Make the snapshot here with
#   git archive HEAD $(git ls-tree -r --name-only HEAD | grep -v '^deltaspec/default_model/\|^tests/data/\|^benchmarks/') \
#     | gzip > .scratch/snap.tar.gz && git rev-parse --short HEAD > .scratch/snap.commit
# or, where the tree and the wheels leave no room for it (64 MiB a call), only what differs from the commit:
#   git archive HEAD $(git diff --name-only HEAD) | gzip > .scratch/overlay.tar.gz
#   git ls-files --others --exclude-standard > .scratch/untracked.txt; git rev-parse --short HEAD > .scratch/snap.commit
# and, for `train`, a packed corpus in .scratch/pack (train.bin.xz, heldout_{code,chat}.bin; tools/README.md).
# The wheels the GPU image lacks (pip download --no-deps --only-binary=:all: --python-version 3.12 for manylinux
# x86_64 into .whl; the device tool's README says how): gguf, llguidance, fastapi, starlette, pydantic,
# pydantic-core, annotated-types, typing-inspection, uvicorn, sniffio, compressed-tensors, jsonschema,
# jsonschema-specifications, referencing, rpds-py, loguru, fla-core, flash-linear-attention, pytest-xdist and
# execnet, the versions pyproject.toml's pins allow; fastapi 0.16x also imports opentelemetry-api, and the server
# and bench tests import openai (with distro and jiter): without them those files fail to collect (their gpu tests
# are few; openai 2.x takes httpx2, httpcore2, truststore and h11). The image has pillow (12.3 on 2026-12-07). Tree + carried folders stay under 64 MiB: the tree is ~50 MB,
# so a train call carries the pack and few wheels, a tests call the wheels and no pack.
# Steps:
#   kernels:SECONDS    the routed GEMV launches' sweep for 1-16 rows
#   mma:SECONDS        tools/quant_mma_sweep.py: the tensor-core Q4_K product's variants against the routed launches
#   repack:SECONDS     the 27B Q4_K_M shape's verify passes (1-16 rows) and batch-1 decode, block kernels then --repack
#   script:SECONDS     bash .scratch/script.sh in the snapshot (one-off benchmarks), its output in $OUT/script.log
#   train:MINUTES      block drafter training, resumed from .scratch/block_ckpt/checkpoint.pt when present
#   treeprof:SHAPE     cProfile of bench tree-oracle on a random-weight shape (host time of chain vs tree rounds)
#   tests:SECONDS      pytest -m "gpu or kernel" over tests/, 8 workers
#   retest:SECONDS     pytest on the test ids in .scratch/retest.txt
#   peer:STEPS         tools/peer_bench.sh's STEPS (build,file,llama,deltaspec,combine) into $OUT, with llama.cpp's
#                      source at .scratch/llama.cpp-2026-10-src.tar.xz and its build kept in .scratch/peer
set -uo pipefail
export PYTHONUNBUFFERED=1 DELTASPEC_COMMIT=$(cat .scratch/snap.commit)  # the benchmarks' reports name the snapshot
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site
repo=$(pwd); export REPO=$repo  # scripts find the carried folders under $REPO
rm -rf /tmp/snap && mkdir -p /tmp/snap
if [ -f .scratch/snap.tar.gz ]; then tar xzf .scratch/snap.tar.gz -C /tmp/snap
else  # the sent tree brought back to the commit: its untracked files dropped, its changed files as committed
  tar c --exclude=./.whl --exclude=./.scratch . | tar x -C /tmp/snap
  [ -f .scratch/untracked.txt ] && (cd /tmp/snap && xargs -r rm -f < $repo/.scratch/untracked.txt)
  [ -f .scratch/overlay.tar.gz ] && tar xzf .scratch/overlay.tar.gz -C /tmp/snap
fi
cp -r deltaspec/default_model /tmp/snap/deltaspec/ && cp -r tests/data /tmp/snap/tests/
cd /tmp/snap
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; cat $repo/.scratch/snap.commit;
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  PYTHONPATH= python3 -c "import PIL; print('image has pillow', PIL.__version__)" 2>&1 | tail -1; } | tee $OUT/device.txt
for step in "$@"; do
  name=${step%%:*}; arg=${step#*:}
  echo "== $step $(date +%T)"
  case $name in
    kernels)  # the routed launches graph-timed for 1-16 rows, each checked against the reference
      PYTHONPATH=/tmp/snap:/tmp/site timeout ${arg:-180} python3 tools/quant_kernel_sweep.py $OUT/quant_sweep.json --table \
        --rows=1,2,4,8,16 --types=Q4_K,Q6_K,Q8_0,FP8_B128,I4_G128 > $OUT/quant_sweep.stdout 2> $OUT/quant_sweep.log
      echo "sweep exit $?"; tail -12 $OUT/quant_sweep.stdout; grep -c . $OUT/quant_sweep.log ;;
    mma)  # the tensor-core Q4_K product on the repacked layout, swept against the routed launches (issue #44)
      PYTHONPATH=/tmp/snap:/tmp/site timeout ${arg:-400} python3 tools/quant_mma_sweep.py $OUT/mma_sweep.json ${MMA_ARGS:-} \
        > $OUT/mma_sweep.stdout 2> $OUT/mma_sweep.log; echo "mma sweep exit $?"; cat $OUT/mma_sweep.stdout
      tail -3 $OUT/mma_sweep.log ;;
    repack)  # the whole-model effect of --repack (issue #44): the same random-weight file's passes both ways
      q4="--random-weights --shape qwen3.5-27b --device cuda --dtype bfloat16 --quant q4_k_m"
      for way in no-repack repack; do
        PYTHONPATH=/tmp/snap:/tmp/site timeout "$arg" python3 -m deltaspec.cli bench verify --context 128 \
          --rows 1,2,4,8,16 --runs 3 $q4 --$way --out $OUT/verify-27b-q4km-$way.json >> $OUT/repack.log 2>&1
        PYTHONPATH=/tmp/snap:/tmp/site timeout "$arg" python3 -m deltaspec.cli bench decode --context 128 \
          --max-tokens 64 --runs 3 $q4 --$way --out $OUT/decode-27b-q4km-$way.json >> $OUT/repack.log 2>&1
      done; echo "repack A/B exit $?"; grep -h -o '"ratio_to_1_row": [0-9.]*\|"decode_tok_s": [0-9.]*' $OUT/*q4km*.json ;;
    script)  # a one-off list of commands for this call, written beside the snapshot
      PYTHONPATH=/tmp/snap:/tmp/site timeout "$arg" bash $repo/.scratch/script.sh > $OUT/script.log 2>&1
      echo "script exit $?"; tail -40 $OUT/script.log ;;
    train)
      mkdir -p /tmp/dm/block && cp -r deltaspec/default_model/target /tmp/dm/target
      [ -f $repo/.scratch/block_ckpt/checkpoint.pt ] && cp $repo/.scratch/block_ckpt/checkpoint.pt /tmp/dm/block/
      (cd tools && timeout $(( arg * 60 + 150 )) python3 train_block.py --target /tmp/dm/target --pack $repo/.scratch/pack \
        --out /tmp/dm/block --minutes "$arg" --resume ${BLOCK_ARGS:-} > $OUT/block.log 2>&1); echo "train exit $?"
      grep -v "^block step" $OUT/block.log | tail -5; grep "^block step" $OUT/block.log | tail -3
      cp /tmp/dm/block/{config.json,model.safetensors,training_curve.json,checkpoint.pt} $OUT/ 2>/dev/null ;;
    treeprof)  # where a tree round's time goes: host profile of bench tree-oracle on shape $arg
      timeout 300 python3 -m cProfile -o $OUT/tree.prof -m deltaspec.cli bench tree-oracle --random-weights \
        --shape "$arg" --device cuda --dtype bfloat16 --rows 16 --max-tokens 128 --runs 1 --out $OUT/tree_oracle.json \
        > $OUT/treeprof.log 2>&1; echo "treeprof exit $?"; tail -3 $OUT/treeprof.log
      python3 -c "import pstats; pstats.Stats('$OUT/tree.prof').sort_stats('tottime').print_stats(25)" > $OUT/tree_prof.txt 2>&1
      python3 -c "import pstats; pstats.Stats('$OUT/tree.prof').sort_stats('cumulative').print_stats(60)" >> $OUT/tree_prof.txt 2>&1 ;;
    peer)  # llama.cpp and deltaspec side by side on one random-weight GGUF file (issue #44)
      (cd $repo && LLAMA_TARBALL=$repo/.scratch/llama.cpp-2026-10-src.tar.xz WORK=/tmp/peer STEPS="$arg" \
        PYTHONPATH=/tmp/snap:/tmp/site bash /tmp/snap/tools/peer_bench.sh $OUT/peer); echo "peer exit $?"
      cat $OUT/peer/peer_bench.json 2>/dev/null | head -40 ;;
    retest)  # only the test ids listed in .scratch/retest.txt (a failed run's FAILED lines), with ARG as the time limit
      timeout "$arg" python3 -m pytest -q -n 8 -p no:cacheprovider -rfE $(cat $repo/.scratch/retest.txt) \
        > $OUT/gpu_retest.log 2>&1; echo "pytest exit $?"
      grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_retest.log | tail -30 ;;
    tests)
      timeout "$arg" python3 -m pytest -q -m "gpu or kernel" -n 8 -p no:cacheprovider --durations=15 -rfE tests \
        > $OUT/gpu_tests.log 2>&1; echo "pytest exit $?"
      grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.log | tail -30 ;;
  esac
done
ls -la $OUT
