"""triattn-cupy: triangle self-attention in raw CUDA C kernels on CuPy arrays.

Importing this package never touches the GPU; CuPy is imported only when a GPU function
is called.
"""
from ._version import __version__
from . import reference
from .weights import Weights, parameter_shapes, random_weights
from .api import TriangleAttention, gpu_available, triangle_attention

__all__ = [
    "__version__", "reference", "Weights", "parameter_shapes", "random_weights",
    "TriangleAttention", "gpu_available", "triangle_attention",
]
