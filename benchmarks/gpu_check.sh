#!/usr/bin/env bash
# The device check in one command, for a GPU machine (see benchmarks/gpu.py and gpu_train.py):
#
#   bash benchmarks/gpu_check.sh OUT_DIR [MINUTES]
#
# 1. flash-linear-attention from the wheels in .whl/ (pure Python; `pip download --no-deps -d .whl
#    flash-linear-attention==0.6.0 fla-core==0.6.0`), installed into /tmp/site when the folder is there;
# 2. benchmarks/gpu.py: the cuda tests (every test marked `cuda`, in parallel, their log beside the JSON),
#    errors against float64 (at T = 1024) and timings
#    of the paths not yet measured (principled, training through the window in Triton, GLA/SSD through fla and chunked, the softmax scalings,
#    cosFormer, GOAT through the Triton kernel), the earlier rows kept from benchmarks/results/gpu.json;
# 3. benchmarks/gpu_train.py: training throughput per mechanism against the plain PyTorch baseline.
# The time is split between 2 (70 %, of it 2.5 minutes of tests) and 3 (27 %); each writes its JSON as it goes.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR [MINUTES]}
minutes=${2:-7}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# fla's kernels last: they autotune on each new shape, which can take minutes
paths=sdpa-flash,principled/triton,hybrid-cauchy-window16+32/triton,hybrid-gaussian-window16+32/triton,goat/triton
paths=$paths,principled/tiled,softmax-ktotal/sdpa,softmax-kmean/sdpa
paths=$paths,softmax-krms/sdpa,cosformer/chunked,gla/chunked,ssd/chunked,gla/fla,ssd/fla
first=$(python3 -c "print(round($minutes * 0.7, 1))")
rest=$(python3 -c "print(round($minutes * 0.27, 1))")
python3 benchmarks/gpu.py --out "$out/gpu.json" --minutes "$first" --tests-minutes 2.5 --err-T 1024 \
  --skip tune,models,train --paths "$paths" --keep-from benchmarks/results/gpu.json 2>&1 | tee "$out/gpu.log"
python3 benchmarks/gpu_train.py --out "$out/gpu_train.json" --minutes "$rest" 2>&1 | tee "$out/gpu_train.log"
