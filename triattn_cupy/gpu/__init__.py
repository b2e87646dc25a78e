"""The GPU engine: routes (which kernels serve a forward), layouts (how the projection stores
q, k, v and the bias for the attention), tiles (the tuned tile tables), plan (the launches of
one input geometry), forward (one call), launch and compile (kernels through the CUDA driver
and NVRTC), scales (fp16 range scales), device_weights, checks, captured (a forward
captured as a CUDA graph and replayed).

Importing it never touches the GPU: CuPy is imported when a forward is first prepared.
"""
from . import (captured, checks, compile, device_weights, forward, launch, layouts, plan,
               routes, scales, tiles)

__all__ = ["captured", "checks", "compile", "device_weights", "forward", "launch", "layouts",
           "plan", "routes", "scales", "tiles"]
