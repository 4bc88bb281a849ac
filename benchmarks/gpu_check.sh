#!/usr/bin/env bash
# The one GPU check, for a GPU machine, in priority order; each part writes its rows as it goes:
#
#   bash benchmarks/gpu_check.sh OUT_DIR [MINUTES]     # MINUTES: 6.5 by default; run with a limit above it
#
# 0. flash-linear-attention from the wheels in .whl/ (pure Python; `pip download --no-deps -d .whl
#    flash-linear-attention==0.6.0 fla-core==0.6.0`), installed into /tmp/site when the folder is there;
#    fla's paths run last in part 2, so their autotuning (minutes on a new shape) cannot starve the rest;
# 1. the cuda tests (benchmarks/gpu.py part "tests"): 4 workers, 60 s per test, in two passes (the
#    rest, then flash-linear-attention's with the time left: its kernels autotune for minutes), about
#    30 % of the time; each outcome and its traceback written as it happens to OUT/gpu.tests.jsonl (and
#    printed), the ids of the tests that never reported listed;
# 2. training throughput per mechanism, compiled, against the plain PyTorch baseline, with dynamo's
#    graphs, breaks and recompiles, and `attnlab train` itself against the benchmark's step of the same
#    model (benchmarks/gpu_train.py), about 30 %: OUT/gpu_train.json;
# 3. the kernel table (benchmarks/gpu.py: errors against float64 at T = 1024, timings at 8K and 32K),
#    about 25 %: OUT/gpu.json;
# 4. decode rows (benchmarks/decode_speed.py on CUDA), about 15 %: OUT/decode_speed_gpu.json.
# The order is the project's: GPU truth and the trainer first, then the kernels, then decoding. On a
# 15-minute slot (the machine's start included) run it at 6.5 minutes: one run, no rerun.
# At most 8 files come back: gpu.json, gpu.log, gpu.tests.log, gpu.tests.jsonl, gpu_train.json,
# gpu_train.log, decode_speed_gpu.json, decode.log. Commit them under benchmarks/results/gpu_logs/<date>/
# and the JSONs as benchmarks/results/{gpu,gpu_train,decode_speed_gpu}.json (docs/contributing.md).
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR [MINUTES]}
minutes=${2:-6.5}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
part() { python3 -c "print(round($minutes * $1, 2))"; }
# 1. tests
python3 benchmarks/gpu.py --out "$out/gpu.json" --minutes "$(part 0.3)" --tests-minutes "$(part 0.3)" \
  --skip errors,tune,speed,models,train 2>&1 | tee "$out/gpu.log"
# 2. training throughput: the windowed model early (the rows the trainer and kernel issues read first)
python3 benchmarks/gpu_train.py --out "$out/gpu_train.json" --minutes "$(part 0.3)" \
  --models baseline,softmax,windowed,hybrid,trainer,scalar,goat_hybrid,principled,goat,gla,ssd,cosformer 2>&1 \
  | tee "$out/gpu_train.log"
# 3. kernels: fla's paths last, they autotune on each new shape
paths=sdpa-flash,hybrid-gaussian/triton,hybrid-cauchy/triton,hybrid-cauchy-window16+32/triton
paths=$paths,hybrid-gaussian-window16+32/triton,goat/triton,principled/triton,softmax-ktotal/sdpa
paths=$paths,hybrid-gaussian/flex,hybrid-cauchy/flex,goat/flex,cosformer/chunked,gla/chunked,ssd/chunked,gla/fla,ssd/fla
python3 benchmarks/gpu.py --out "$out/gpu.json" --minutes "$(part 0.25)" --T 8192,32768 --err-T 1024 \
  --skip tests,tune,models,train --paths "$paths" --keep-from "$out/gpu.json" 2>&1 | tee -a "$out/gpu.log"
# 4. decode: the rows the targets read first (the window flat from 4K to 128K and its ratio to exact
#    decoding; the compiled exact step against transformers' static cache), the rest as time allows;
#    benchmarks/gpu_decode.sh is the whole decode table, for a slot of its own
left=$(python3 -c "print(int($minutes * 60 * 0.15))")
timeout "$left" python3 benchmarks/decode_speed.py --device cuda --out "$out/decode_speed_gpu.json" --keep --steps 16 \
  --rounds 3 --warmup 3 --methods window_compiled,exact_compiled,window_ops_compiled,hf_static,exact --models windowed --batches 1 \
  --contexts 4096,32768,131072 --window-max 131072 --learned-max 0 --max-hf-context 131072 2>&1 | tee "$out/decode.log"
