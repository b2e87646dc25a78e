#!/usr/bin/env bash
# Profiling session for the device tool: the projection kernel (ln_qkvg_project) at one
# size and precision, one launch: speed of light, memory workload (with its tables),
# warp states, scheduler, and per-instruction stall samples (SASS CSV under $OUT;
# columns "Source", "Warp Stall Sampling (All Samples)"). With ABLATE=<variant> of
# scripts/ablate_projection.py (e.g. no_store), that variant's kernel instead.
#   ABLATE=no_store bash scripts/profile_projection.sh 1x1024x128x4 tf32
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
out=${OUT:-/tmp/prof}; mkdir -p "$out"
NCU=/usr/local/cuda/bin/ncu
size=${1:-1x1024x128x4}
prec=${2:-tf32}
name=proj_${prec}${ABLATE:+_$ABLATE}
$NCU --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \
  --section SourceCounters --section Occupancy --section LaunchStats \
  -k regex:ln_qkvg --launch-count 1 -o "$out/$name" \
  python3 scripts/profile_forward.py $size $prec > /dev/null 2>&1
$NCU --import "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name.sass.csv" 2>/dev/null
$NCU --import "$out/$name.ncu-rep" > "$out/$name.txt" 2>/dev/null
rm -f "$out"/*.ncu-rep
ls -la "$out"
