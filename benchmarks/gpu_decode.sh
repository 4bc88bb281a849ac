#!/usr/bin/env bash
# Decode step latency on a GPU machine (the GPU half of benchmarks/decode_speed.py), in one command:
#
#   bash benchmarks/gpu_decode.sh OUT_DIR            # on the GPU machine
#   bash benchmarks/gpu_decode.sh OUT_DIR --smoke    # anywhere: every method at tiny sizes on the CPU (< 1 min)
#
# 1. the cuda tests of the static decoder under CUDA graphs (exact, trained window, learned selection,
#    the key stores and recurrent states), at most three minutes;
# 2. decode_speed.py on CUDA: the windowed shape at batch 1 (4K, 32K, 128K) and batch 8 (4K, 32K), then
#    gpt2-small-windowed at batch 1 (4K, 32K, 128K) and batch 8 (4K, 32K); methods exact (growing caches),
#    exact_compiled, window_compiled, learned_compiled (CUDA graphs; the exact steps split-K from 4K
#    positions) and transformers' static-cache generate on a Llama of the same dimensions. Each row has
#    step_ms, tokens_per_s, bytes_per_step (weights + the cache entries the method reads), floor_ms
#    (those bytes at the GPU's data-sheet bandwidth) and x_floor. Rows are written as they come, so a
#    run cut at its limit keeps what it measured: commit OUT_DIR/decode_speed_gpu.json as
#    benchmarks/results/decode_speed_gpu.json.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_decode.sh OUT_DIR [--smoke]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ "${2:-}" = "--smoke" ]; then
  $py benchmarks/decode_speed.py --smoke --out "$out/decode_speed_smoke.json" 2>&1 | tee "$out/decode.log"
  exit "${PIPESTATUS[0]}"
fi
timeout 180 $py -m pytest -q -m cuda tests/test_static_decode.py -p no:cacheprovider 2>&1 | tee "$out/decode_tests.log"
common="--device cuda --out $out/decode_speed_gpu.json --keep --steps 16 --rounds 3 --warmup 3"
common="$common --methods exact,exact_compiled,window_compiled,window_ops_compiled,learned_compiled,hf_static --max-hf-context 131072"
common="$common --window-max 131072 --learned-max 0 --max-gpt2-context 131072"
$py benchmarks/decode_speed.py $common --models windowed --batches 1 --contexts 4096,32768,131072 2>&1 | tee "$out/decode.log"
$py benchmarks/decode_speed.py $common --models windowed --batches 8 --contexts 4096,32768 2>&1 | tee -a "$out/decode.log"
$py benchmarks/decode_speed.py $common --models gpt2-small-windowed --batches 1 --contexts 4096,32768,131072 2>&1 \
  | tee -a "$out/decode.log"
$py benchmarks/decode_speed.py $common --models gpt2-small-windowed --batches 8 --contexts 4096,32768 2>&1 \
  | tee -a "$out/decode.log"
