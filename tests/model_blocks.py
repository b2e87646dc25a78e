"""Real models' triangle attention blocks for the import tests, and small models holding them.

`boltz_block` is Boltz's own module (boltz-community 2.12:
``boltz.model.layers.triangular_attention.attention``), skipping the calling test where it
is not installed (``.ci/run`` installs each model as these tests need it, and sets
``TRIATTN_REQUIRE_MODELS=1``, which makes a model that does not import fail its tests
instead: CI never passes by skipping them).
`boltz2_template_module` is Boltz-2's own template stack (``TemplateV2Module``, whose blocks
have 4 heads x 32 = 128 channels at D = 64). `protenix_block` is Protenix's (2.0:
``protenix.model.triangular.triangular``), imported with ``LAYERNORM_TYPE=torch`` so that it
does not build its CUDA LayerNorm on a machine without CUDA; `protenix_attention` is the
class its ``PairformerBlock`` builds, the template stack's included (its ``TemplateEmbedder``
itself imports rdkit, through ``protenix.data.constants``). `openfold3_block` is OpenFold3's
(0.5: ``openfold3.core.model.layers.triangular_attention``), imported without running the
package's ``__init__``, which needs gemmi. `OpenFoldTriangleAttention` restates OpenFold's
block (``openfold/model/triangular_attention.py`` with ``primitives.Attention``) to its
published shapes and names: OpenFold itself is not on the package index. With Boltz's
settings (no biases) it must equal Boltz's module, which `test_importing.py` checks.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn


MODELS_REQUIRED = os.environ.get("TRIATTN_REQUIRE_MODELS") == "1"


def model_module(name: str, distribution: str):
    """The model's module `name`; where it does not import, the test skips (or, with
    TRIATTN_REQUIRE_MODELS=1, fails with the import error)."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        if MODELS_REQUIRED:
            raise
        pytest.skip(f"{distribution} is not installed or does not import ({err}; .ci/run "
                    f"installs the models and the packages they import)")


def boltz_block(c_in, c_hidden, no_heads, starting=True):
    attention = model_module("boltz.model.layers.triangular_attention.attention",
                             "boltz-community")
    cls = (attention.TriangleAttentionStartingNode if starting
           else attention.TriangleAttentionEndingNode)
    return cls(c_in, c_hidden, no_heads)


def boltz2_template_module(token_z, template_dim=64, template_blocks=1):
    """Boltz-2's ``TemplateV2Module`` with its default heads (4) and head width (32)."""
    trunkv2 = model_module("boltz.model.modules.trunkv2", "boltz-community")
    return trunkv2.TemplateV2Module(token_z, template_dim, template_blocks)


def _protenix_triangular():
    saved = os.environ.get("LAYERNORM_TYPE")
    # Read when protenix's layers are imported: "torch" uses torch's LayerNorm; the default
    # compiles a CUDA extension, which fails (or waits for nvcc) on a machine without CUDA.
    os.environ["LAYERNORM_TYPE"] = "torch"
    try:
        return model_module("protenix.model.triangular.triangular", "protenix")
    finally:
        if saved is None:
            del os.environ["LAYERNORM_TYPE"]
        else:
            os.environ["LAYERNORM_TYPE"] = saved


def protenix_block(c_in, c_hidden, no_heads, starting=True):
    triangular = _protenix_triangular()
    cls = (triangular.TriangleAttentionStartingNode if starting
           else triangular.TriangleAttentionEndingNode)
    return cls(c_in, c_hidden, no_heads)


def protenix_attention(c_in, c_hidden, no_heads):
    """Protenix's ``TriangleAttention`` as its ``PairformerBlock`` builds both blocks
    (``starting=True``; see `protenix_ending`)."""
    return _protenix_triangular().TriangleAttention(c_in=c_in, c_hidden=c_hidden,
                                                    no_heads=no_heads)


def protenix_ending(block, z, mask):
    """What Protenix's ``PairformerBlock`` adds for ``tri_att_end``: the block on the
    transposed pair and mask, transposed back."""
    return block(z.transpose(-2, -3), mask=mask.transpose(-1, -2)).transpose(-2, -3)


def openfold3_block(c_in, c_hidden, no_heads):
    """OpenFold3's ``TriangleAttention`` (starting=True: its pair blocks run ``tri_att_end``
    on the transposed pair with ``transpose_bias=True``; see `openfold3_ending`)."""
    if "openfold3" not in sys.modules:
        spec = importlib.util.find_spec("openfold3")
        if spec is None:
            model_module("openfold3", "openfold3")  # skips, or fails where required
        package = types.ModuleType("openfold3")  # its __init__ imports gemmi
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["openfold3"] = package
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no Triton, no DeepSpeed here
        layers = model_module("openfold3.core.model.layers.triangular_attention", "openfold3")
    return layers.TriangleAttention(c_in, c_hidden, no_heads)


def openfold3_ending(block, z, mask):
    """What OpenFold3's pair block (``tri_att_start_end``) adds for ``tri_att_end``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = block(z.transpose(-2, -3), mask=mask.transpose(-1, -2), transpose_bias=True)
    return out.transpose(-2, -3)


class OpenFoldAttention(nn.Module):
    """``primitives.Attention`` with gating: q, k, v without bias, gate and output with a
    bias where `gate_out_bias` (OpenFold, OpenFold3) or without (Boltz, Protenix)."""

    def __init__(self, c_in, c_hidden, no_heads, gate_out_bias):
        super().__init__()
        self.c_hidden, self.no_heads = c_hidden, no_heads
        width = c_hidden * no_heads
        self.linear_q = nn.Linear(c_in, width, bias=False)
        self.linear_k = nn.Linear(c_in, width, bias=False)
        self.linear_v = nn.Linear(c_in, width, bias=False)
        self.linear_o = nn.Linear(width, c_in, bias=gate_out_bias)
        self.linear_g = nn.Linear(c_in, width, bias=gate_out_bias)

    def forward(self, q_x, kv_x, biases):
        # [*, Q/K, H, C_hidden] -> [*, H, Q/K, C_hidden]
        q = self.linear_q(q_x).view(q_x.shape[:-1] + (self.no_heads, -1)).transpose(-2, -3)
        k = self.linear_k(kv_x).view(kv_x.shape[:-1] + (self.no_heads, -1)).transpose(-2, -3)
        v = self.linear_v(kv_x).view(kv_x.shape[:-1] + (self.no_heads, -1)).transpose(-2, -3)
        q = q / math.sqrt(self.c_hidden)
        a = torch.matmul(q, k.transpose(-1, -2))                       # [*, H, Q, K]
        for b in biases:
            a = a + b
        a = torch.softmax(a, -1)
        o = torch.matmul(a, v).transpose(-2, -3)                         # [*, Q, H, C_hidden]
        g = torch.sigmoid(self.linear_g(q_x))
        o = o * g.view(g.shape[:-1] + (self.no_heads, -1))
        return self.linear_o(o.flatten(-2))                              # [*, Q, C_in]


class OpenFoldTriangleAttention(nn.Module):
    """OpenFold's ``TriangleAttention``: pair bias `pair_bias_name` ("linear"; OpenFold3's
    "linear_z"), mask bias ``inf * (mask - 1)`` indexed [*, I, 1, 1, J]."""

    def __init__(self, c_in, c_hidden, no_heads, starting=True, inf=1e9,
                 gate_out_bias=True, pair_bias_name="linear"):
        super().__init__()
        self.starting, self.inf, self.pair_bias_name = starting, inf, pair_bias_name
        self.layer_norm = nn.LayerNorm(c_in)
        setattr(self, pair_bias_name, nn.Linear(c_in, no_heads, bias=False))
        self.mha = OpenFoldAttention(c_in, c_hidden, no_heads, gate_out_bias)

    def forward(self, x, mask=None):
        if mask is None:
            mask = x.new_ones(x.shape[:-1])                              # [*, I, J]
        if not self.starting:
            x = x.transpose(-2, -3)
            mask = mask.transpose(-1, -2)
        x = self.layer_norm(x)
        mask_bias = (self.inf * (mask - 1))[..., :, None, None, :]      # [*, I, 1, 1, J]
        triangle_bias = getattr(self, self.pair_bias_name)(x)            # [*, I, J, H]
        triangle_bias = triangle_bias.permute(*range(x.dim() - 3), -1, -3, -2)  # [*, H, I, J]
        triangle_bias = triangle_bias.unsqueeze(-4)                      # [*, 1, H, I, J]
        x = self.mha(x, x, [mask_bias, triangle_bias])
        if not self.starting:
            x = x.transpose(-2, -3)
        return x


def openfold_block(c_in, c_hidden, no_heads, starting=True):
    """`OpenFoldTriangleAttention` with the class name and module path of OpenFold's own
    (``openfold.model.triangular_attention.TriangleAttention``), as the drop-in finds it."""
    cls = type("TriangleAttention", (OpenFoldTriangleAttention,),
               {"__module__": "openfold.model.triangular_attention"})
    return cls(c_in, c_hidden, no_heads, starting=starting)


def randomize(module, seed, scale=0.5):
    """Every parameter uniform in [-scale, scale], LayerNorm weights around 1 (the models
    initialise gate and output projections to zero, which would hide them)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            values = (torch.rand(p.shape, generator=generator) * 2 - 1) * scale
            if name.endswith("layer_norm.weight"):
                values = 1 + values / 2
            p.copy_(values)
    return module


class PairformerLayer(nn.Module):
    """A pair stack layer as the models name its modules: triangle multiplications and a
    transition that are not triangle attention, and the two attention blocks."""

    def __init__(self, make_block, c_z):
        super().__init__()
        self.tri_mul_out = nn.ModuleDict({"linear_a_p": nn.Linear(c_z, c_z),
                                          "layer_norm_in": nn.LayerNorm(c_z)})
        self.tri_att_start = make_block(starting=True)
        self.tri_att_end = make_block(starting=False)
        self.transition = nn.Sequential(nn.LayerNorm(c_z), nn.Linear(c_z, 2 * c_z))


class MsaRowAttentionWithPairBias(nn.Module):
    """Names close to a triangle attention block's (layer_norm_m/z, linear_z, mha) that must
    not be taken for one."""

    def __init__(self, c_z):
        super().__init__()
        self.layer_norm_m = nn.LayerNorm(c_z)
        self.layer_norm_z = nn.LayerNorm(c_z)
        self.linear_z = nn.Linear(c_z, 4, bias=False)
        self.mha = OpenFoldAttention(c_z, c_z // 4, 4, gate_out_bias=True)


class SmallModel(nn.Module):
    """``pairformer_module.layers.N.tri_att_start`` / ``tri_att_end`` (Boltz's names),
    an MSA module with pair-biased row attention, and a block at an unnamed path."""

    def __init__(self, make_block, c_z, layers=2):
        super().__init__()
        self.pairformer_module = nn.ModuleDict({"layers": nn.ModuleList(
            PairformerLayer(make_block, c_z) for _ in range(layers))})
        self.msa_module = nn.ModuleDict({"row_attention": MsaRowAttentionWithPairBias(c_z)})
        self.extra = nn.ModuleDict({"pair_attention": make_block(starting=True)})


def to_numpy(tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()
