set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -m gpu tests/test_key_extent.py tests/test_gpu.py tests/test_attention_mma.py -k "extent or fp32_projection_parts or fp32_out_projection or f16x3 or f16s or s16" -p no:cacheprovider 2>&1 | tee $OUT/targeted_tests.txt | tail -25
python3 scripts/device_time.py 2x128x64x4 2>&1 | tee $OUT/device_time.txt
python3 scripts/time_ours.py 2>&1 | tee $OUT/time_ours.txt
TRIATTN_BF16_S16=1 python3 scripts/time_ours.py --precisions=bf16 1x384x128x4 1x1024x128x4 2>&1 | tee $OUT/time_ours_s16.txt
python3 scripts/host_overhead.py 2x128x64x4 2>&1 | head -5 | tee $OUT/host_overhead.txt
