"""Shipped weights of triattn-cupy (installed as the subpackage ``triattn_cupy.default_weights``).

``default.h5`` is the reference module with pair_dim 128 and 4 heads from a fixed seed;
``make_default.py`` regenerates it. The format is described in README.md beside this file.
"""
