#!/usr/bin/env bash
# Profiling session for the device tool: a projection kernel at one size and precision, one
# launch each: speed of light, memory workload (with its tables), warp states, scheduler,
# and per-instruction stall samples (SASS CSV under $OUT; columns "Source", "Warp Stall
# Sampling (All Samples)"). KERNELS: the kernels' name patterns, one profile each (default
# ln_qkvg: ln_qkvg_project, or ln_qkvg_project_tiles where the persistent projections run;
# "ln_qkvg gated_out" for both stages). With ABLATE=<variant> of
# scripts/ablate_projection.py (e.g. no_store), that variant's kernels instead.
#   ABLATE=no_store bash scripts/profile_projection.sh 1x1024x128x4 tf32
#   KERNELS="ln_qkvg gated_out" bash scripts/profile_projection.sh 1x1024x128x4 bf16
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
out=${OUT:-/tmp/prof}; mkdir -p "$out"
NCU=/usr/local/cuda/bin/ncu
size=${1:-1x1024x128x4}
prec=${2:-tf32}
for kernel in ${KERNELS:-ln_qkvg}; do
    name=${kernel}_${prec}${ABLATE:+_$ABLATE}
    $NCU --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \
      --section SourceCounters --section Occupancy --section LaunchStats \
      -k regex:$kernel --launch-count 1 -o "$out/$name" \
      python3 scripts/profile_forward.py $size $prec > /dev/null 2>&1
    $NCU --import "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name.sass.csv" 2>/dev/null
    $NCU --import "$out/$name.ncu-rep" > "$out/$name.txt" 2>/dev/null
    rm -f "$out"/*.ncu-rep
done
ls -la "$out"
