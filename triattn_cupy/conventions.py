"""The two conventions that real models' triangle attention blocks differ in.

Mask layout: which positions a mask value removes.

- ``"pair"``, the spec's: ``mask[b, j, k] == 0`` removes key k from query j, in every row i
  (the mask shares the pair bias's (B, N, N) shape). Accepted as (B, N, N).
- ``"row"``, OpenFold's, Boltz's, Protenix's: ``mask[b, i, k] == 0`` removes key k from
  every query of row i. Accepted as (B, N, N) or as the models' broadcast shape
  (B, N, 1, 1, N) (the same values with two unit axes).

For a padding mask (an outer product ``keep[i] * keep[k]``) the two layouts agree wherever
both the row i and the query j are kept; they differ for any other mask (crops, contacts,
chain masks).

Node: which axis a row runs along.

- ``"starting"``: attention runs along the last N axis of ``pair[b, i, :, :]``.
- ``"ending"``: the block is applied to the transposed pair: ``pair.transpose(-2, -3)``,
  ``mask.transpose(-1, -2)`` (either layout, the (B, N, 1, 1, N) form transposed like the
  (B, N, N) form it stands for), and the output transposed back to the caller's layout.
  The pair bias of query i and key k in column j is that of pair[k, i] (AlphaFold2's
  Algorithm 14; OpenFold, Boltz, Protenix).
- ``"ending_af3"``: as "ending", but the pair bias is taken from the pair before it is
  transposed: that of pair[i, k] for query i and key k. AlphaFold3's code computes its
  ending node so, and OpenFold3 (0.5, ``transpose_bias=True``) follows it.

The models add ``1e9 * (mask - 1)`` to the scores where the spec adds -inf. The two give the
same softmax wherever a query keeps at least one key (``exp(-1e9)`` is 0 in float32 and
float64). They differ only for a query whose keys are all masked: the models then attend over
every key as if nothing were masked (float64) or over scores rounded to multiples of 64
(float32, where ``s - 1e9`` keeps no fraction), a finite value that the models discard
downstream; here such a query follows ``fully_masked`` (zero attention output, or NaN).
"""
from __future__ import annotations

import typing

MASK_LAYOUTS = ("pair", "row")
NODES = ("starting", "ending", "ending_af3")
ENDING_NODES = ("ending", "ending_af3")


class Conventions(typing.NamedTuple):
    """A call's two conventions (the module docstring): `mask_layout` and `node`. A named
    tuple, so that a (mask_layout, node) pair converts with Conventions(*pair)."""
    mask_layout: str = "pair"
    node: str = "starting"

    @classmethod
    def checked(cls, mask_layout, node) -> "Conventions":
        """The conventions, or a ValueError naming the one that is not known."""
        return cls(check_mask_layout(mask_layout), check_node(node))

    @property
    def row_mask(self) -> bool:
        """The mask removes keys per row i (the "row" layout), which the pair bias shared
        by every row cannot hold: the attention applies it."""
        return self.mask_layout == "row"

    @property
    def transposed(self) -> bool:
        """The block runs on the transposed pair and mask (an ending node)."""
        return self.node in ENDING_NODES


def check_mask_layout(mask_layout, arg: str = "mask_layout") -> str:
    if mask_layout not in MASK_LAYOUTS:
        raise ValueError(f"{arg} must be one of {MASK_LAYOUTS}, got {mask_layout!r}")
    return mask_layout


def check_node(node, arg: str = "node") -> str:
    if node not in NODES:
        raise ValueError(f"{arg} must be one of {NODES}, got {node!r}")
    return node


def check_mask_shape(shape, B: int, N: int, batched: bool, mask_layout: str,
                     arg: str = "mask") -> None:
    """A ValueError naming `arg` unless `shape` is a mask's for the pair and the layout:
    (B, N, N) ((N, N) unbatched), or for a "row" mask also (B, N, 1, 1, N) ((N, 1, 1, N))."""
    shape = tuple(shape)
    square = (B, N, N) if batched else (N, N)
    broadcast = (B, N, 1, 1, N) if batched else (N, 1, 1, N)
    if shape == square or (mask_layout == "row" and shape == broadcast):
        return
    expected = f"{square}" + (f" or {broadcast}" if mask_layout == "row" else "")
    raise ValueError(f"{arg} must have shape {expected} to match pair; got {shape} "
                     f"(mask_layout {mask_layout!r})")


def mask_as_square(mask, B: int, N: int, batched: bool, mask_layout: str, arg: str = "mask"):
    """`mask` as a (B, N, N) view (no copy), after checking its shape against the layout.

    A "row" mask may also come as (B, N, 1, 1, N) ((N, 1, 1, N) unbatched)."""
    check_mask_shape(mask.shape, B, N, batched, mask_layout, arg)
    return mask.reshape(B, N, N)  # a view: dropping unit axes never copies
