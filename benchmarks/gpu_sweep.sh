#!/usr/bin/env bash
# One planned batch of a sweep on a GPU machine, inside one command with a time limit:
#
#   bash benchmarks/gpu_sweep.sh SPEC RUNS OUT_DIR [MINUTES]
#
# SPEC: a sweep spec (e.g. experiments/seed000/at-scale/spec.toml); RUNS: the batch, comma-separated
# variant/seedK names; OUT_DIR: the folder that comes back ($OUT on the
# lent machine); MINUTES: the time limit of the sweep, 9 by default, so that a command limited to 10
# minutes ends with a minute to spare (run the command with timeout_s 600).
#
# The batch trains with `attnlab sweep SPEC --only RUNS --records OUT_DIR`: after each run finishes
# (trained and evaluated), OUT_DIR/<spec folder>-<spec hash>.records.json is rewritten, atomically, with
# the record of every run of the batch finished so far: its summary, metrics, loss and τ curves and the
# machine, everything results.json and the report need, and no checkpoint (they stay on the machine). At
# the time limit the sweep gets SIGTERM: the run in progress checkpoints and stops, and the file keeps
# the runs finished before it. Two files come back: the records file and OUT_DIR/sweep.log (this
# script's output, the throughput of each finished run at its end). Runs the committed results.json
# already records are not trained again (the log names them). Afterwards, on the machine that commits:
#
#   attnlab sweep SPEC --merge DIR_THE_FILES_CAME_BACK_TO     # results.json, report.md, plots; commit
#
# A run must finish within the command: its checkpoint stays on the machine. For runs longer than one
# command, benchmarks/gpu_science.sh carries the run in progress from batch to batch.
set -uo pipefail
spec=${1:?usage: bash benchmarks/gpu_sweep.sh SPEC RUNS OUT_DIR [MINUTES]}
runs=${2:?usage: bash benchmarks/gpu_sweep.sh SPEC RUNS OUT_DIR [MINUTES]}
out=${3:?usage: bash benchmarks/gpu_sweep.sh SPEC RUNS OUT_DIR [MINUTES]}
minutes=${4:-9}
[ -f "$spec" ] || { echo "gpu_sweep: SPEC $spec does not exist" >&2; exit 2; }
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
log="$out/sweep.log"
limit=$("$py" -c "import sys; m = float(sys.argv[1]); assert 0 < m <= 60; print(int(m * 60))" "$minutes") \
  || { echo "gpu_sweep: MINUTES must be a number in (0, 60], got $minutes" >&2; exit 2; }
{
  echo "gpu_sweep: $spec, runs $runs, limit ${limit}s, records into $out ($(date -u +%FT%TZ))"
  "$py" -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
} 2>&1 | tee "$log"
# SIGTERM at the limit: the run in progress checkpoints and stops; SIGKILL 45 s later if it has not
timeout --signal=TERM --kill-after=45 "$limit" "$py" -m attnlab sweep "$spec" --only "$runs" --records "$out" \
  --no-progress 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
[ "$status" = 124 ] && echo "gpu_sweep: stopped at the ${limit}s limit; the records hold the runs finished before it" | tee -a "$log"
# what came back, and the numbers the next plan needs: wall time and throughput per run
"$py" - "$out" "$spec" "$runs" <<'EOF' 2>&1 | tee -a "$log"
import json, sys
from pathlib import Path
out, spec, runs = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
files = sorted(out.glob("*.records.json"))
done = set()
if not files:
    print("gpu_sweep: no run finished: no records file")
for f in files:
    body = json.loads(f.read_text())
    print(f"gpu_sweep: {f.name}: {len(body['runs'])} finished run(s)")
    for r in body["runs"]:
        done.add(f"{r['variant']}/seed{r['seed']}")
        tps = r.get("tokens_per_s")
        print(f"  {r['variant']}/seed{r['seed']}: {r['tokens']:,} tokens, wall {r.get('wall_seconds') or 0:.0f} s, "
              f"train {r.get('train_seconds') or 0:.0f} s, {tps or 0:,.0f} tokens/s, val_loss {r.get('val_loss')}")
for name in (n.strip() for n in runs if n.strip() and n.strip() not in done):  # how far an unfinished run got
    variant, _, seed = name.partition("/")
    rows = []
    try:
        lines = (spec.parent / "runs" / variant / seed / "log.jsonl").read_text().splitlines()
        rows = [r for r in map(json.loads, filter(str.strip, lines)) if r.get("kind") == "train"]
    except (OSError, ValueError):
        pass
    if rows:
        rate = sorted(r.get("tokens_per_s") or 0 for r in rows)[len(rows) // 2]
        print(f"  {name}: not finished; reached step {rows[-1]['step']} at a median {rate:,.0f} tokens/s")
    else:
        print(f"  {name}: not in the records, no training step logged (the sweep's lines above say why)")
EOF
exit "$status"
