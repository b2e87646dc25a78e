#!/usr/bin/env bash
# Profiling session for the device tool: the wgmma attention at one size, one launch per
# shape given (WgmmaTiles fields: rows,stages,min_blocks,pingpong[,pv_groups,bulk]) of the
# variant $VARIANT (default tf32): speed of light, compute pipes, warp states, occupancy,
# and per-instruction stall samples (SASS CSV under $OUT).
#   VARIANT=bf16 bash scripts/profile_attention.sh 1x1024x128x4 1,2,2,0,2,1
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
out=${OUT:-/tmp/prof}; mkdir -p "$out"
NCU=/usr/local/cuda/bin/ncu
size=${1:-1x1024x128x4}; shift
variant=${VARIANT:-tf32}
shapes=(); for s in "${@:-1,2,2,0}"; do shapes+=(--wgmma "$s"); done
$NCU --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section SourceCounters --section Occupancy --section LaunchStats \
  --section InstructionStats -k regex:attention_${variant}_wgmma -o "$out/att" \
  python3 scripts/profile_attention.py $size --variant $variant "${shapes[@]}" > /dev/null 2>&1
$NCU --import "$out/att.ncu-rep" --page source --csv --print-source sass > "$out/att.sass.csv" 2>/dev/null
$NCU --import "$out/att.ncu-rep" > "$out/att.txt" 2>/dev/null
rm -f "$out"/*.ncu-rep
ls -la "$out"
