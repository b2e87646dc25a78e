#!/usr/bin/env bash
# Profiling session for the device tool: the wgmma TF32 attention at one size, one launch
# per shape given (rows,stages,min_blocks,pipeline): speed of light, compute pipes, warp
# states, occupancy, and per-instruction stall samples (SASS CSV under $OUT).
#   bash scripts/profile_attention.sh 1x1024x128x4 1,2,2,0 1,3,1,1
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
out=${OUT:-/tmp/prof}; mkdir -p "$out"
NCU=/usr/local/cuda/bin/ncu
size=${1:-1x1024x128x4}; shift
shapes=(); for s in "${@:-1,2,2,0}"; do shapes+=(--wgmma "$s"); done
$NCU --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section SourceCounters --section Occupancy --section LaunchStats \
  --section InstructionStats -k regex:attention_tf32_wgmma -o "$out/att" \
  python3 scripts/profile_attention.py $size "${shapes[@]}" > /dev/null 2>&1
$NCU --import "$out/att.ncu-rep" --page source --csv --print-source sass > "$out/att.sass.csv" 2>/dev/null
$NCU --import "$out/att.ncu-rep" > "$out/att.txt" 2>/dev/null
rm -f "$out"/*.ncu-rep
ls -la "$out"
