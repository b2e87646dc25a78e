"""The parameters of one triangle self-attention module, on the host.

`Weights` holds float32 NumPy arrays keyed by the reference module's state_dict names
(``"query.weight"``, ...), with PyTorch's (out_features, in_features) layout, and the two
conventions of the module they came from (`triattn_cupy.conventions`): the mask layout and
the node, which a forward uses unless the call overrides them. The projections map D
channels to h heads of width c (``head_dim``) and back; c is D / h in the spec's module, but
need not be (Boltz-2's and Protenix's template stacks: D = 64, 4 heads of 32). Reading and
writing them as HDF5 lives in `triattn_cupy.hdf5`; building them from PyTorch in
`triattn_cupy.export`, from real models' checkpoints in `triattn_cupy.importing`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .conventions import check_mask_layout, check_node

# name -> shape, in terms of D (pair_dim), h (num_heads) and c (head_dim). The table every
# loader checks.
LINEAR_NAMES = ("query", "key", "value", "gate", "out_proj")
OPTIONAL_BIASES = tuple(f"{name}.bias" for name in LINEAR_NAMES)


def parameter_shapes(pair_dim: int, num_heads: int,
                     head_dim: int | None = None) -> dict[str, tuple[int, ...]]:
    """The state_dict names of the reference module and their shapes: q, k, v and the gate
    map D to h x c channels, the output projection h x c back to D (head_dim None: c = D / h,
    so every projection is (D, D))."""
    D, h = pair_dim, num_heads
    hidden = D if head_dim is None else h * head_dim
    shapes = {"layer_norm.weight": (D,), "layer_norm.bias": (D,)}
    for name in LINEAR_NAMES[:4]:
        shapes[f"{name}.weight"] = (hidden, D)
        shapes[f"{name}.bias"] = (hidden,)
    shapes["out_proj.weight"] = (D, hidden)
    shapes["out_proj.bias"] = (D,)
    shapes["bias_proj.weight"] = (h, D)
    return shapes


@dataclasses.dataclass(eq=False)  # identity equality: device copies are cached per object
class Weights:
    """Host-side parameters: ``params[name]`` is a float32 array of ``parameter_shapes``.

    mask_layout ("pair" or "row") and node ("starting", "ending", "ending_af3"): the
    conventions of the module the parameters belong to; the spec's module is "pair",
    "starting". head_dim: each head's width c; None (the spec's module) means D / h, and
    then D must be a multiple of h. The GPU kernels take only h x c = D; the NumPy backend
    takes any c.
    """

    pair_dim: int
    num_heads: int
    layer_norm_eps: float
    params: dict
    mask_layout: str = "pair"
    node: str = "starting"
    head_dim: int | None = None

    def __post_init__(self):
        check_mask_layout(self.mask_layout, "Weights.mask_layout")
        check_node(self.node, "Weights.node")
        if self.head_dim is None:
            if self.pair_dim < 1 or self.num_heads < 1 or self.pair_dim % self.num_heads:
                raise ValueError(
                    f"pair_dim must be a positive multiple of num_heads (or head_dim given); "
                    f"got pair_dim={self.pair_dim}, num_heads={self.num_heads}")
            self.head_dim = self.pair_dim // self.num_heads
        elif self.pair_dim < 1 or self.num_heads < 1 or self.head_dim < 1:
            raise ValueError(
                f"pair_dim, num_heads and head_dim must be positive; got pair_dim="
                f"{self.pair_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}")
        expected = parameter_shapes(self.pair_dim, self.num_heads, self.head_dim)
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
    def hidden_dim(self) -> int:
        """h x c: the width q, k, v and the gate are projected to (pair_dim on the GPU)."""
        return self.num_heads * self.head_dim

    def __getitem__(self, name: str) -> np.ndarray:
        return self.params[name]


def random_weights(pair_dim: int, num_heads: int, seed: int = 0, *,
                   layer_norm_eps: float = 1e-5, scale: float = 1.0,
                   head_dim: int | None = None) -> Weights:
    """Random weights shaped like the reference module's default initialisation.

    LayerNorm affine and every linear bias are random too (not 1 and 0), so a test notices
    a parameter that is ignored. head_dim: each head's width (None: pair_dim / num_heads).
    For tests and benchmarks.
    """
    rng = np.random.default_rng(seed)
    bound = scale / np.sqrt(pair_dim)
    params = {}
    for name, shape in parameter_shapes(pair_dim, num_heads, head_dim).items():
        if name == "layer_norm.weight":
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "layer_norm.bias":
            value = 0.1 * rng.standard_normal(shape)
        else:
            value = rng.uniform(-bound, bound, shape)
        params[name] = value.astype(np.float32)
    return Weights(pair_dim, num_heads, layer_norm_eps, params, head_dim=head_dim)
