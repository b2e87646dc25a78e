"""Time the whole forward of one precision with the wgmma attention taken from different N
thresholds (_configs._WGMMA_ABOVE_N), to choose where a mode switches from the mma.sync
kernel to the wgmma one (CUDA events, median; time_ours.time_size's timing).

    python3 scripts/sweep_wgmma_threshold.py fp32 0,128,288 2x128x64x4 1x160x128x4 1x256x128x4
"""
import sys

from triattn_cupy import _configs
from time_ours import time_size  # scripts/ is on sys.path when run as a script


def main(precision, thresholds, sizes):
    original = _configs._WGMMA_ABOVE_N[precision]
    try:
        for size in sizes:
            for threshold in thresholds:
                _configs._WGMMA_ABOVE_N[precision] = threshold
                _configs.attention_kernel.cache_clear()
                print(f"wgmma above N = {threshold}: ", end="")
                time_size(size, precision)
    finally:
        _configs._WGMMA_ABOVE_N[precision] = original
        _configs.attention_kernel.cache_clear()


if __name__ == "__main__":
    main(sys.argv[1], [int(t) for t in sys.argv[2].split(",")], sys.argv[3:])
