#!/usr/bin/env bash
# The one GPU check, for a GPU machine: its parts in order of what is still unknown and worth most, each
# under a hard cap, each writing its rows as it goes (benchmarks/gpu_check.py has the schedule):
#
#   bash benchmarks/gpu_check.sh OUT_DIR [MINUTES] [--resume DIR]   # MINUTES: 6.5 by default
#   bash benchmarks/gpu_check.sh OUT_DIR 1 --smoke                  # anywhere: every part's code on the CPU
#
# 1. tests: the cuda tests that have never passed on a GPU, 4 workers, at most 40 s a test
#    (flash-linear-attention's last, at their first autotuning config that runs), 22 % of the time;
# 2. train: training throughput, compiled, against the plain PyTorch baseline (baseline, windowed,
#    softmax, `attnlab train`, hybrid at T = 1024; softmax at configs/25m.toml's shape; the four at
#    T = 8192), each row at most 60 s (the trainer 100 s), 36 %;
# 3. kernels: forward + backward at 8K against SDPA flash, each path at most 40 s, fla's paths after
#    the others, 20 %;
# 4. decode: the windowed model's compiled step at 4K, 32K and 128K beside exact decoding, 12 %;
# 5. recheck and 6. errors (the cuda tests that passed before; the kernel-error table) with the time left.
# A part's unused time goes to the next. At its cap a part is killed with its whole process group and
# every process it started; the next starts only when none is left. Run again on the same OUT_DIR (or
# with --resume DIR, an earlier check's folder), it measures only what the files lack.
# Files (8): gpu_check.json, gpu_check.log, gpu_tests.json, gpu_tests.jsonl, gpu_tests.log,
# gpu_train.json, gpu.json, decode_speed_gpu.json; commit them under benchmarks/results/gpu_logs/<date>/
# (docs/contributing.md).
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR [MINUTES] [--smoke] [--resume DIR]}
minutes=${2:-6.5}
shift $(( $# < 2 ? $# : 2 ))
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
limit=$("$py" -c "import sys; m = float(sys.argv[1]); assert 0 < m <= 30; print(int(m * 60 + 30))" "$minutes") \
  || { echo "gpu_check: MINUTES must be a number in (0, 30], got $minutes" >&2; exit 2; }
case " $* " in
  *" --smoke "*) ;;
  *) if ls .whl/*.whl >/dev/null 2>&1; then  # flash-linear-attention (pure Python; the machine has no internet)
       "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
         && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
     fi ;;
esac
# the schedule ends itself within MINUTES; this limit only backs it up (SIGTERM: it kills its running
# part and every process that part started, then stops)
exec timeout --foreground --kill-after=20 "$limit" "$py" benchmarks/gpu_check.py "$out" "$minutes" "$@"
