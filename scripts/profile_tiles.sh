#!/usr/bin/env bash
# Profiling session for the device tool: the persistent projections (project_tiles.cu,
# ln_qkvg_project_tiles and gated_out_project_tiles) at one size and precision, one launch
# each: speed of light, memory workload, warp states, scheduler, and per-instruction stall
# samples (SASS CSV under $OUT).
#   bash scripts/profile_tiles.sh 1x1024x128x4 bf16
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
out=${OUT:-/tmp/prof}; mkdir -p "$out"
NCU=/usr/local/cuda/bin/ncu
size=${1:-1x1024x128x4}
prec=${2:-bf16}
for kernel in ln_qkvg_project_tiles gated_out_project_tiles; do
    name=${kernel%%_project_tiles}_${prec}
    $NCU --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section SourceCounters \
      --section LaunchStats -k regex:$kernel --launch-count 1 -o "$out/$name" \
      python3 scripts/profile_forward.py $size $prec > /dev/null 2>&1
    $NCU --import "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name.sass.csv" 2>/dev/null
    $NCU --import "$out/$name.ncu-rep" > "$out/$name.txt" 2>/dev/null
    rm -f "$out"/*.ncu-rep
done
ls -la "$out"
