#!/usr/bin/env bash
# Profiling session for the device tool: per-instruction stall samples (ncu source
# counters, SASS, CSV under $OUT) of the attention kernels of every precision and of the
# tf32 projection, at 1x1024x128x4 (one launch each). Read with a CSV reader: columns
# "Source", "Warp Stall Sampling (All Samples)", stall_*.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
out=${OUT:-/tmp/prof}; mkdir -p "$out"
NCU=/usr/local/cuda/bin/ncu
size=${1:-1x1024x128x4}
for prec in bf16 tf32; do
  $NCU --clock-control none --section SourceCounters --section WarpStateStats --section SchedulerStats \
    -k regex:attention_ --launch-count 1 -o "$out/attn_$prec" python3 scripts/profile_forward.py $size $prec > /dev/null 2>&1
  $NCU --import "$out/attn_$prec.ncu-rep" --page source --csv --print-source sass > "$out/attn_$prec.sass.csv" 2>/dev/null
  $NCU --import "$out/attn_$prec.ncu-rep" 2>/dev/null | grep -E "Duration|Issued Warp|Eligible Warps|Active Warps Per|No Eligible|Warp Cycles Per Issued" > "$out/attn_$prec.txt"
done
rm -f "$out"/*.ncu-rep
OUT=$out bash scripts/profile_projection.sh "$size" tf32  # its own profile, then lists $out
