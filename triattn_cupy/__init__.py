"""triattn-cupy: triangle self-attention in raw CUDA C kernels on CuPy arrays.

Importing this package never touches the GPU; CuPy is imported only when a GPU function
is called, PyTorch only when weights are exported or `triattn_cupy.torch` (the drop-in for
PyTorch models) is imported.
"""
from ._version import __version__
from . import reference
from .gpu.checks import PRECISIONS, HeadWidthError
from .api import TriangleAttention, gpu_available, triangle_attention
from .export import export_weights
from .importing import import_weights
from .hdf5 import (WeightsFormatError, default_weights_path, load_default_weights,
                   load_weights, save_weights)
from .weights import Weights, parameter_shapes, random_weights

__all__ = [
    "__version__", "reference", "PRECISIONS", "Weights", "parameter_shapes", "random_weights",
    "TriangleAttention", "gpu_available", "triangle_attention",
    "load_weights", "save_weights", "load_default_weights", "default_weights_path",
    "WeightsFormatError", "export_weights", "import_weights", "HeadWidthError",
]
