#!/usr/bin/env bash
# The GPU check in one command: the GPU test suite in parallel groups, then the forward's
# timings (tools/time_forward.py), the route comparison against an older tree when
# TRIATTN_COMPARE_OLD names its folder (tools/compare_routes.py), and the benchmark when
# TRIATTN_BENCH holds benchmarks/run.py's arguments.
#   bash tools/gpu_check.sh [pytest arguments, default: -m gpu tests/]
# Writes logs under $OUT, or benchmarks/results/latest.
# TRIATTN_GROUP_TIMEOUT=s stops each test group after s seconds (its log is still written);
# TRIATTN_NO_TIMING=1 leaves out the timings.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/latest}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# Arguments replace the default selection: every GPU test, in nine pytest processes at
# once on the one GPU (its tests are small; the suite takes ~10 minutes in one process),
# each group logged on its own. The float64 references
# run on the CPU: each process gets its share of the cores (16 on the H200 machine)
# rather than all of them each.
if [ $# -gt 0 ]; then
    python3 -m pytest -q -ra -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu_tests.log"
    status=${PIPESTATUS[0]}
else
    status=0
    pids=()
    groups=("attention_mma:tests/test_attention_mma.py"
            "gpu_fp32:tests/test_gpu.py -k fp32"
            "gpu_tf32:tests/test_gpu.py -k 'tf32 and not fp32'"
            "gpu_bf16:tests/test_gpu.py -k 'not fp32 and not tf32'"
            "cli_tiles:tests/test_cli.py tests/test_project_tiles.py"
            "conventions:tests/test_gpu_conventions.py tests/test_large_magnitudes.py"
            "torch_dtypes:tests/test_torch_dropin_gpu.py tests/test_pair_dtypes.py"
            "row_blocks:tests/test_gpu_row_blocks.py"
            "rest:tests/ --ignore=tests/test_attention_mma.py --ignore=tests/test_gpu.py --ignore=tests/test_cli.py --ignore=tests/test_project_tiles.py --ignore=tests/test_gpu_conventions.py --ignore=tests/test_large_magnitudes.py --ignore=tests/test_torch_dropin_gpu.py --ignore=tests/test_pair_dtypes.py --ignore=tests/test_gpu_row_blocks.py")
    threads=$(( $(nproc) / ${#groups[@]} ))
    export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
    export OPENBLAS_NUM_THREADS=$OMP_NUM_THREADS MKL_NUM_THREADS=$OMP_NUM_THREADS
    for group in "${groups[@]}"; do
        eval "timeout ${TRIATTN_GROUP_TIMEOUT:-0} python3 -m pytest -q -ra -p no:cacheprovider -m gpu ${group#*:}" \
            > "$out/gpu_tests_${group%%:*}.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"; rc=$?
        # (the last group holds GPU tests of files yet to come: none is no failure)
        if [ $rc -ne 0 ] && ! { [ $rc -eq 5 ] && [ "$i" -eq $(( ${#pids[@]} - 1 )) ]; }; then
            status=1
        fi
    done
    tail -n 3 "$out"/gpu_tests_*.log > "$out/gpu_tests.log"
    cat "$out/gpu_tests.log"
fi
if [ -z "${TRIATTN_NO_TIMING:-}" ]; then
    python3 tools/time_forward.py 2>&1 | tee "$out/time_forward.log"
fi
if [ -n "${TRIATTN_COMPARE_OLD:-}" ]; then
    python3 tools/compare_routes.py --old "$TRIATTN_COMPARE_OLD" 2>&1 | tee "$out/compare_routes.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -n "${TRIATTN_BENCH:-}" ] && [ -f benchmarks/run.py ]; then
    python3 benchmarks/run.py --out "$out/bench" $TRIATTN_BENCH 2>&1 | tee "$out/bench.log"
fi
exit "$status"
