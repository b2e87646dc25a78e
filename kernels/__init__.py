"""Raw CUDA C sources of triattn-cupy (installed as the subpackage ``triattn_cupy.kernels``).

The ``.cu`` files are read through ``importlib.resources`` and compiled at run time by
``cupy.RawModule`` (NVRTC); see ``triattn_cupy.gpu.compile``.
"""
