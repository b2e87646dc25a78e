"""The specification of triangle self-attention, stated in PyTorch.

This is the module every output of triattn-cupy is judged against (in eval mode, where
dropout is the identity), in float64 for the error bounds and in float32, TF32 or bf16 for
the "at most twice PyTorch's error in the same precision" tests. It is our own statement of
the reference module that the project reimplements; `tests/test_torch_spec.py` checks it
against that module's file where it is available.

Notation (the shape comments below use it):
    B  batch, N  sequence length (the pair representation is N x N),
    D  pair_dim, h  num_heads, d = D / h  head dim.

The math, for every batch element b and pair row i (attention runs along the last N axis,
so x[b, i, :, :] is one sequence of N tokens):

    x            = LayerNorm(pair[b, i, k])                          (B, N, N, D)
    g            = sigmoid(x Wg^T + bg)                              (B, N, N, D)
    bias[b,:,j,k] = x[b, j, k] Wb^T          (no bias term)          (B, h, N, N)
    q, k, v      = x Wq^T + bq, x Wk^T + bk, x Wv^T + bv, split into h heads of d
    s[b,i,:,j,k] = q[b,i,j] . k[b,i,k] / sqrt(d) + bias[b,:,j,k]     (B, N, h, N, N)
    s            = -inf where pair_mask[b, j, k] == 0
    o[b,i,j]     = sum_k softmax_k(s[b,i,:,j,:]) v[b,i,k]            (B, N, N, D)
    out          = (g * o) Wo^T + bo                                 (B, N, N, D)

The pair bias and the mask are indexed by (b, j, k) only: both are shared by every row i,
so they fold into one (B, h, N, N) tensor. A query (b, j) whose keys are all masked
(pair_mask[b, j, :] == 0, e.g. a padded position) takes a softmax over all -inf, which is
NaN; the specification returns NaN there.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class TriangleSelfAttention(nn.Module):
    """Gated multi-head self-attention along the last pair axis, with a pair bias.

    Parameters (the state_dict names that the HDF5 weights format uses, with '.' -> '/'):
        layer_norm.weight, layer_norm.bias   (D,)
        query / key / value / gate / out_proj .weight (D, D), .bias (D,)
        bias_proj.weight                     (h, D)
    Linear weights are PyTorch's (out_features, in_features).

    The submodules are created in this order so that, under one `torch.manual_seed`, the
    default initialisation draws the same numbers as the reference module's.
    """

    def __init__(self, pair_dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        if num_heads <= 0 or pair_dim % num_heads:
            raise ValueError(f"pair_dim must be divisible by num_heads; got pair_dim={pair_dim}, "
                             f"num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = pair_dim // num_heads
        self.layer_norm = nn.LayerNorm(pair_dim)
        self.query = nn.Linear(pair_dim, pair_dim)
        self.key = nn.Linear(pair_dim, pair_dim)
        self.value = nn.Linear(pair_dim, pair_dim)
        self.gate = nn.Linear(pair_dim, pair_dim)
        self.bias_proj = nn.Linear(pair_dim, num_heads, bias=False)
        self.out_proj = nn.Linear(pair_dim, pair_dim)
        self.dropout = nn.Dropout(dropout)

    def _heads(self, projection: nn.Linear, x_rows: torch.Tensor) -> torch.Tensor:
        """(B*N, N, D) rows -> that projection split into heads, (B*N, h, N, d)."""
        rows, n, _ = x_rows.shape
        return projection(x_rows).view(rows, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, pair_repr: torch.Tensor, pair_mask: torch.Tensor) -> torch.Tensor:
        """pair_repr (B, N, N, D), pair_mask (B, N, N) with 0 = masked -> (B, N, N, D).

        Runs in the dtype of the module and the input (float64 for the error references).
        """
        if pair_repr.dim() != 4 or pair_repr.shape[1] != pair_repr.shape[2]:
            raise ValueError(f"pair_repr must be (B, N, N, D); got {tuple(pair_repr.shape)}")
        B, N, _, D = pair_repr.shape
        h, d = self.num_heads, self.head_dim

        x = self.layer_norm(pair_repr)                      # (B, N, N, D)
        g = torch.sigmoid(self.gate(x))                     # (B, N, N, D)
        # The pair bias comes from the normalised pair itself, one value per head.
        bias = self.bias_proj(x).permute(0, 3, 1, 2)        # (B, h, N, N): [b, head, j, k]

        # Every pair row i is one sequence: rows of all batch elements side by side.
        x_rows = x.reshape(B * N, N, D)                     # (B*N, N, D)
        q = self._heads(self.query, x_rows)                 # (B*N, h, N, d)
        k = self._heads(self.key, x_rows)                   # (B*N, h, N, d)
        v = self._heads(self.value, x_rows)                 # (B*N, h, N, d)

        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)   # (B*N, h, N, N)
        scores = scores.view(B, N, h, N, N)                 # [b, i, head, j, k]
        # The bias does not depend on the row i: broadcast it over i.
        scores = scores + bias.unsqueeze(1)                 # (B, N, h, N, N)
        # Nor does the mask; its last axis runs over the keys k.
        keep = pair_mask.unsqueeze(1).unsqueeze(2)          # (B, 1, 1, N, N)
        scores = scores.masked_fill(keep == 0, float("-inf"))

        # A row of scores that is all -inf gives NaN here, as the specification says.
        weights = F.softmax(scores.view(B * N, h, N, N), dim=-1)  # (B*N, h, N, N)
        weights = self.dropout(weights)

        o = (weights @ v).transpose(1, 2).reshape(B, N, N, D)     # (B, N, N, D)
        return self.out_proj(g * o)                               # (B, N, N, D)
