"""The parameters of one triangle self-attention module, on the host.

`Weights` holds float32 NumPy arrays keyed by the reference module's state_dict names
(``"query.weight"``, ...), with PyTorch's (out_features, in_features) layout, and the two
conventions of the module they came from (`triattn_cupy.conventions`): the mask layout and
the node, which a forward uses unless the call overrides them. Reading and writing them as
HDF5 lives in `triattn_cupy.hdf5`; building them from PyTorch in `triattn_cupy.export`,
from real models' checkpoints in `triattn_cupy.importing`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .conventions import check_mask_layout, check_node

# name -> shape, in terms of D (pair_dim) and h (num_heads). The table every loader checks.
LINEAR_NAMES = ("query", "key", "value", "gate", "out_proj")
OPTIONAL_BIASES = tuple(f"{name}.bias" for name in LINEAR_NAMES)


def parameter_shapes(pair_dim: int, num_heads: int) -> dict[str, tuple[int, ...]]:
    """The state_dict names of the reference module and their shapes."""
    D, h = pair_dim, num_heads
    shapes = {"layer_norm.weight": (D,), "layer_norm.bias": (D,)}
    for name in LINEAR_NAMES:
        shapes[f"{name}.weight"] = (D, D)
        shapes[f"{name}.bias"] = (D,)
    shapes["bias_proj.weight"] = (h, D)
    return shapes


@dataclasses.dataclass(eq=False)  # identity equality: device copies are cached per object
class Weights:
    """Host-side parameters: ``params[name]`` is a float32 array of ``parameter_shapes``.

    mask_layout ("pair" or "row") and node ("starting", "ending", "ending_af3"): the
    conventions of the module the parameters belong to; the spec's module is "pair",
    "starting".
    """

    pair_dim: int
    num_heads: int
    layer_norm_eps: float
    params: dict
    mask_layout: str = "pair"
    node: str = "starting"

    def __post_init__(self):
        check_mask_layout(self.mask_layout, "Weights.mask_layout")
        check_node(self.node, "Weights.node")
        if self.pair_dim < 1 or self.num_heads < 1 or self.pair_dim % self.num_heads:
            raise ValueError(
                f"pair_dim must be a positive multiple of num_heads; got pair_dim="
                f"{self.pair_dim}, num_heads={self.num_heads}")
        expected = parameter_shapes(self.pair_dim, self.num_heads)
        problems = []
        params = {}
        for name, shape in expected.items():
            value = self.params.get(name)
            if value is None:
                if name in OPTIONAL_BIASES:
                    value = np.zeros(shape, np.float32)
                else:
                    problems.append(f"{name}: missing (expected shape {shape})")
                    continue
            value = np.ascontiguousarray(value, dtype=np.float32)
            if value.shape != shape:
                problems.append(f"{name}: expected shape {shape}, got {value.shape}")
            elif not np.all(np.isfinite(value)):
                problems.append(f"{name}: contains NaN or Inf")
            params[name] = value
        unknown = sorted(set(self.params) - set(expected))
        if unknown:
            problems.append(f"unexpected parameters: {', '.join(unknown)}")
        if problems:
            raise ValueError("invalid weights:\n  " + "\n  ".join(problems))
        self.params = params
        self.layer_norm_eps = float(self.layer_norm_eps)

    @property
    def head_dim(self) -> int:
        return self.pair_dim // self.num_heads

    def __getitem__(self, name: str) -> np.ndarray:
        return self.params[name]


def random_weights(pair_dim: int, num_heads: int, seed: int = 0, *,
                   layer_norm_eps: float = 1e-5, scale: float = 1.0) -> Weights:
    """Random weights shaped like the reference module's default initialisation.

    LayerNorm affine and every linear bias are random too (not 1 and 0), so a test notices
    a parameter that is ignored. For tests and benchmarks.
    """
    rng = np.random.default_rng(seed)
    bound = scale / np.sqrt(pair_dim)
    params = {}
    for name, shape in parameter_shapes(pair_dim, num_heads).items():
        if name == "layer_norm.weight":
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "layer_norm.bias":
            value = 0.1 * rng.standard_normal(shape)
        else:
            value = rng.uniform(-bound, bound, shape)
        params[name] = value.astype(np.float32)
    return Weights(pair_dim, num_heads, layer_norm_eps, params)
