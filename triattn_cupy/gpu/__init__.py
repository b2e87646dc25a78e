"""The GPU engine: gpus (what each compute capability runs: the GPU table), routes (which
kernels serve a forward), kernel_configs (each kernel's configuration), layouts (how the projection stores q, k, v and the bias for the
attention), tiles (block shapes and shared memory; tuned_tiles: the tuned tile tables per
GPU), launch_plan (the launches of one input geometry), forward (one call), launch and
compile (kernels through the CUDA driver and NVRTC), scales (fp16 range scales),
device_weights, checks, captured (a forward captured as a CUDA graph and replayed),
kernel_catalog (every configuration the routes can launch, for the compile checks),
row_blocks (long N).

Importing it never touches the GPU: CuPy is imported when a forward is first prepared.
"""
from . import (captured, checks, compile, device_weights, forward, gpus, kernel_catalog,
               kernel_configs, launch, launch_plan, layouts, routes, row_blocks, scales, tiles,
               tuned_tiles)

__all__ = ["captured", "checks", "compile", "device_weights", "forward", "gpus",
           "kernel_catalog", "kernel_configs", "launch", "launch_plan", "layouts", "routes",
           "row_blocks", "scales", "tiles", "tuned_tiles"]
