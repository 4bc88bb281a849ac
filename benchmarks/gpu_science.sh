#!/usr/bin/env bash
# The science batch, for a GPU machine, after the GPU check (docs/contributing.md, the standing order):
#
#   bash benchmarks/gpu_science.sh OUT_DIR [MINUTES] [--spec SPEC] [--state DIR]    # MINUTES: 6 by default
#
# Trains the next unfinished piece of experiments/seed000/window-language-at-scale (or SPEC) for at most
# MINUTES: the corpus it reads checked against its manifest first, the run in progress restored from the
# spec folder's state/ and resumed from its checkpoint, then the runs results.json lacks, one after
# another; at the cap the running run checkpoints and stops and is packed into OUT_DIR
# (benchmarks/gpu_science.py has the steps). What comes back (at most 8 files, each under 16 MiB):
# science.log, science.json, the records file of the finished runs and state.tar.NNN. Then, here:
#
#   python benchmarks/gpu_science.py absorb DIR_THE_FILES_CAME_BACK_TO      # merge, state/, batches.json; commit
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_science.sh OUT_DIR [MINUTES] [--spec SPEC] [--state DIR]}
minutes=${2:-6}
shift $(( $# < 2 ? $# : 2 ))
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
limit=$("$py" -c "import sys; m = float(sys.argv[1]); assert 0 < m <= 30; print(int(m * 60 + 45))" "$minutes") \
  || { echo "gpu_science: MINUTES must be a number in (0, 30], got $minutes" >&2; exit 2; }
# the batch stops itself 30 s before MINUTES end; this limit (45 s after them, SIGKILL 15 s later) only
# backs it up (SIGTERM: it stops the run, which checkpoints, and packs it)
timeout --signal=TERM --kill-after=15 "$limit" "$py" benchmarks/gpu_science.py batch "$out" "$minutes" "$@" 2>&1 \
  | tee "$out/science.log"
exit "${PIPESTATUS[0]}"
