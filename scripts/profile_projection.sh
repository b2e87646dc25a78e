#!/usr/bin/env bash
# Profiling session for the device tool: the tf32 projection kernel (ln_qkvg_project) at
# one size, one launch: speed of light, memory, warp states and per-instruction stall
# samples (SASS CSV under $OUT; columns "Source", "Warp Stall Sampling (All Samples)").
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
out=${OUT:-/tmp/prof}; mkdir -p "$out"
NCU=/usr/local/cuda/bin/ncu
size=${1:-1x1024x128x4}
prec=${2:-tf32}
$NCU --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SourceCounters --section Occupancy --section LaunchStats \
  -k regex:ln_qkvg --launch-count 1 -o "$out/proj_$prec" python3 scripts/profile_forward.py $size $prec > /dev/null 2>&1
$NCU --import "$out/proj_$prec.ncu-rep" --page source --csv --print-source sass > "$out/proj_$prec.sass.csv" 2>/dev/null
$NCU --import "$out/proj_$prec.ncu-rep" > "$out/proj_$prec.txt" 2>/dev/null
rm -f "$out"/*.ncu-rep
ls -la "$out"
