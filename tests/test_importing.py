"""`triattn_cupy.importing`: real models' triangle attention blocks, found in their state dicts
and checkpoints, computed by the NumPy backend in float64 against the models' own code.

Compared where a row of the block keeps at least one key: elsewhere the models' -1e9 mask
bias and this module's `fully_masked` policy differ by design (see `conventions`)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from helpers import rel_l2
from triattn_cupy import import_weights, random_weights
from triattn_cupy.importing import (block_weights, find_blocks, import_all, load_checkpoint,
                                    node_from_path, state_dict_of)
from triattn_cupy.reference import triangle_attention

torch = pytest.importorskip("torch")
import model_blocks as mb  # noqa: E402  (needs torch)

TOL64 = 1e-12
D, C, H = 32, 8, 4  # pair dim, head width, heads


def masks(rng, kind, B, N):
    """(B, N, N) float64 0/1 masks: all ones, or of three kinds that each have a
    fully-masked row and a fully-masked column somewhere (a row without keys for either
    node)."""
    if kind == "ones":
        return np.ones((B, N, N))
    if kind == "padding":
        kept = np.ones((B, N), bool)
        for b in range(B):
            kept[b, N - 1 - b * 2:] = False
        keep = kept[:, :, None] & kept[:, None, :]
    elif kind == "crop":  # a block of rows sees only a window of keys
        keep = np.ones((B, N, N), bool)
        keep[:, 1:N // 2, N // 3:] = False
        keep[0, N - 2, :] = False
        keep[-1, :, N - 3] = False
    else:  # random row masks
        keep = rng.random((B, N, N)) < 0.6
        keep[:, :, 0] |= rng.random((B, N)) < 0.5
        keep[0, 1, :] = False
        keep[-1, :, N - 3] = False
    return keep.astype(np.float64)


def kept_rows(keep, starting):
    """Output positions whose row (in the block's frame) keeps at least one key."""
    if starting:
        return keep.any(-1)[:, :, None, None]   # row i of the pair
    return keep.any(-2)[:, None, :, None]       # column j of the pair: row j of its transpose


def model_forward(module, pair, keep):
    with torch.no_grad():
        return mb.to_numpy(module(torch.from_numpy(pair), torch.from_numpy(keep)))


def check_block(module, rng, starting, B=2, N=13):
    """Import a float32 module, run it in float64 against the NumPy backend, every mask."""
    weights = import_weights(module, node=None)
    assert weights.mask_layout == "row"
    assert weights.node == ("starting" if starting else "ending")
    check_weights(weights, module, rng, starting, B, N)


def check_weights(weights, module, rng, starting, B=2, N=13, forward=None):
    """`weights` against the block's own forward in float64 (`forward(module, z, mask)`,
    default: the module called on them): padding, crop and random masks, all ones, None."""
    D = weights.pair_dim
    model = module.double().eval()
    call = forward or (lambda m, z, mask: m(z, mask))

    def own_forward(pair, keep):
        with torch.no_grad():
            return mb.to_numpy(call(model, torch.from_numpy(pair), torch.from_numpy(keep)))

    for kind in ("padding", "crop", "random"):
        pair = rng.standard_normal((B, N, N, D))
        keep = masks(rng, kind, B, N)
        where = kept_rows(keep, starting)
        assert where.any() and not where.all(), kind
        expected = own_forward(pair, keep)
        out = triangle_attention(pair, keep, weights)
        assert rel_l2(out, expected, where=where) < TOL64, kind
        # the models' broadcast mask shape
        out5 = triangle_attention(pair, keep[:, :, None, None, :], weights)
        assert np.array_equal(out5, out)
    # a mask of all ones, and None
    pair = rng.standard_normal((1, 7, 7, D))
    expected = own_forward(pair, np.ones((1, 7, 7)))
    assert rel_l2(triangle_attention(pair, None, weights), expected) < TOL64


# --- against the models' own code ------------------------------------------------------------

@pytest.mark.parametrize("make_block", [mb.boltz_block, mb.protenix_block],
                         ids=["boltz", "protenix"])
@pytest.mark.parametrize("starting", [True, False])
def test_models_own_blocks(rng, make_block, starting):
    module = mb.randomize(make_block(D, C, H, starting=starting), seed=1)
    weights = import_weights(module)
    assert weights.node == ("starting" if starting else "ending")  # from the class: not named
    check_block(module, rng, starting)


@pytest.mark.filterwarnings("ignore::UserWarning")  # openfold3: no Triton, no CUDA here
def test_openfold3_blocks_as_its_pair_block_runs_them(rng):
    """OpenFold3 0.5's own module, called as its pair block calls tri_att_start and
    tri_att_end: the ending node with the untransposed pair's bias ("ending_af3")."""
    model = torch.nn.ModuleDict({"pairformer_stack": torch.nn.ModuleDict({"blocks": (
        torch.nn.ModuleList([torch.nn.ModuleDict({
            "tri_att_start": mb.openfold3_block(D, C, H),
            "tri_att_end": mb.openfold3_block(D, C, H)})]))})})
    mb.randomize(model, seed=9)
    sd = state_dict_of(model)
    blocks = find_blocks(sd)
    assert [(b.prefix, b.family.name, b.node, b.biases) for b in blocks] == [
        ("pairformer_stack.blocks.0.tri_att_start.", "openfold3", "starting", ()),
        ("pairformer_stack.blocks.0.tri_att_end.", "openfold3", "ending_af3", ())]
    start = import_weights(sd, "pairformer_stack.blocks.0.tri_att_start")
    end = import_weights(sd, "pairformer_stack.blocks.0.tri_att_end")
    layer = model["pairformer_stack"]["blocks"][0].double().eval()
    for kind in ("ones", "padding", "crop", "random"):
        pair = rng.standard_normal((2, 12, 12, D))
        keep = masks(rng, kind, 2, 12)
        z, m = torch.from_numpy(pair), torch.from_numpy(keep)
        with torch.no_grad():
            expected_start = mb.to_numpy(layer["tri_att_start"](z, mask=m))
            expected_end = mb.to_numpy(mb.openfold3_ending(layer["tri_att_end"], z, m))
        assert rel_l2(triangle_attention(pair, keep, start), expected_start,
                      where=kept_rows(keep, True)) < TOL64, kind
        assert rel_l2(triangle_attention(pair, keep, end), expected_end,
                      where=kept_rows(keep, False)) < TOL64, kind
        # the AlphaFold2 ending node is not what OpenFold3 computes
        assert rel_l2(triangle_attention(pair, keep, end, node="ending"), expected_end,
                      where=kept_rows(keep, False)) > 1e-3
    # a module alone: its starting flag says nothing of how OpenFold3 runs it
    with pytest.raises(ValueError, match=r"does not name the node"):
        import_weights(model["pairformer_stack"]["blocks"][0]["tri_att_end"])
    # an older OpenFold3's ending node can be asked for by name
    assert import_weights(sd, "pairformer_stack.blocks.0.tri_att_end", node="ending").node == (
        "ending")


def test_protenix_imports_without_building_its_cuda_layer_norm(monkeypatch):
    """Protenix compiles a CUDA LayerNorm when its layers are imported, unless
    LAYERNORM_TYPE says otherwise: on a machine without CUDA its blocks must import
    without it (model_blocks sets the variable for the import, then restores it)."""
    monkeypatch.delenv("LAYERNORM_TYPE", raising=False)
    mb.protenix_block(D, C, H)
    assert "protenix.model.layer_norm.layer_norm" not in sys.modules
    assert "LAYERNORM_TYPE" not in os.environ


def test_a_model_that_does_not_import_skips_or_fails_where_required(monkeypatch):
    monkeypatch.setattr(mb, "MODELS_REQUIRED", False)
    with pytest.raises(pytest.skip.Exception, match=r"not-a-model is not installed or does "
                                                    r"not import"):
        mb.model_module("triattn_no_such_model", "not-a-model")
    monkeypatch.setattr(mb, "MODELS_REQUIRED", True)
    with pytest.raises(ImportError, match=r"triattn_no_such_model"):
        mb.model_module("triattn_no_such_model", "not-a-model")


def test_openfold_port_is_boltz_without_biases(rng):
    boltz = mb.randomize(mb.boltz_block(D, C, H, starting=False), seed=2).double()
    port = mb.OpenFoldTriangleAttention(D, C, H, starting=False, gate_out_bias=False).double()
    port.load_state_dict(boltz.state_dict())
    pair = rng.standard_normal((2, 9, 9, D))
    keep = masks(rng, "random", 2, 9)
    assert np.array_equal(model_forward(port, pair, keep), model_forward(boltz, pair, keep))


@pytest.mark.parametrize("pair_bias_name,gate_out_bias", [("linear", True), ("linear_z", True),
                                                          ("linear", False)])
@pytest.mark.parametrize("starting", [True, False])
@pytest.mark.parametrize("head_width", [C, 2 * C])  # heads x head width = D, 2 D
def test_openfold_family_blocks(rng, pair_bias_name, gate_out_bias, starting, head_width):
    """OpenFold (biases on gate and output), OpenFold3 (linear_z), Protenix (no biases).
    OpenFold is not on the package index: its naming is tested on this restatement of its
    block to its published shapes (model_blocks.OpenFoldTriangleAttention)."""
    module = mb.randomize(mb.OpenFoldTriangleAttention(
        D, head_width, H, starting=starting, gate_out_bias=gate_out_bias,
        pair_bias_name=pair_bias_name), seed=3)
    weights = import_weights(module, node="starting" if starting else "ending")
    assert weights.head_dim == head_width
    if gate_out_bias:
        assert not np.array_equal(weights["gate.bias"], np.zeros(H * head_width))
    else:
        assert not weights["gate.bias"].any() and not weights["out_proj.bias"].any()
    assert not weights["query.bias"].any()
    family = {"linear": "openfold", "linear_z": "openfold3"}[pair_bias_name]
    (block,) = find_blocks(state_dict_of(module))
    assert block.family.name == family
    assert block.biases == (("gate", "out_proj") if gate_out_bias else ())
    model = module.double().eval()
    for kind in ("padding", "crop", "random"):
        pair = rng.standard_normal((3, 11, 11, D))
        keep = masks(rng, kind, 3, 11)
        out = triangle_attention(pair, keep, weights)
        expected = model_forward(model, pair, keep)
        assert rel_l2(out, expected, where=kept_rows(keep, starting)) < TOL64, kind


def test_reference_family_is_the_spec(rng):
    from spec import load_spec_module

    module = mb.randomize(load_spec_module().TriangleSelfAttention(D, H), seed=4)
    module.layer_norm.eps = 1e-6
    weights = import_weights(module)
    assert (weights.mask_layout, weights.node, weights.layer_norm_eps) == ("pair", "starting",
                                                                           1e-6)
    for name, value in module.state_dict().items():
        assert np.array_equal(weights[name], value.numpy()), name


# --- a model holding several blocks ----------------------------------------------------------

@pytest.fixture
def small_model():
    def make_block(starting):
        return mb.boltz_block(D, C, H, starting=starting)
    return mb.randomize(mb.SmallModel(make_block, D), seed=5)


def test_finds_every_block_of_a_model(small_model):
    blocks = find_blocks(state_dict_of(small_model))
    assert [(b.prefix, b.node) for b in blocks] == [
        ("pairformer_module.layers.0.tri_att_start.", "starting"),
        ("pairformer_module.layers.0.tri_att_end.", "ending"),
        ("pairformer_module.layers.1.tri_att_start.", "starting"),
        ("pairformer_module.layers.1.tri_att_end.", "ending"),
        ("extra.pair_attention.", None),
    ]
    for b in blocks:
        assert (b.family.name, b.pair_dim, b.num_heads, b.head_width, b.biases, b.problem) == (
            "openfold", D, H, C, (), None)


@pytest.mark.parametrize("prefix", ["pairformer_module.layers.1.tri_att_end.",
                                    "pairformer_module.layers.1.tri_att_end"])
def test_import_by_prefix_matches_the_submodule(rng, small_model, prefix):
    weights = import_weights(small_model, prefix=prefix)
    block = small_model.pairformer_module["layers"][1].tri_att_end.double().eval()
    pair = rng.standard_normal((2, 9, 9, D))
    keep = masks(rng, "random", 2, 9)
    assert weights.node == "ending"
    assert rel_l2(triangle_attention(pair, keep, weights), model_forward(block, pair, keep),
                  where=kept_rows(keep, False)) < TOL64


def test_state_dict_and_numpy_arrays(small_model):
    sd = small_model.state_dict()
    prefix = "pairformer_module.layers.0.tri_att_start."
    from_module = import_weights(small_model, prefix)
    from_dict = import_weights(sd, prefix)
    from_numpy = import_weights({k: v.numpy() for k, v in sd.items()}, prefix)
    for w in (from_dict, from_numpy):
        assert (w.mask_layout, w.node) == ("row", "starting")
        for name in from_module.params:
            assert np.array_equal(w[name], from_module[name]), name


def test_errors(small_model):
    sd = state_dict_of(small_model)
    with pytest.raises(ValueError, match=r"5 triangle attention blocks found \("
                                         r"'pairformer_module.layers.0.tri_att_start.', .*\); "
                                         r"pick one with prefix="):
        import_weights(sd)
    with pytest.raises(ValueError, match=r"no triangle attention block at prefix "
                                         r"'msa_module.row_attention.': missing "
                                         r"layer_norm.weight, layer_norm.bias; blocks found"):
        import_weights(sd, "msa_module.row_attention")
    with pytest.raises(ValueError, match=r"block 'extra.pair_attention.' \(openfold\): its "
                                         r"module path does not name the node; pass "
                                         r"node='starting', 'ending' or 'ending_af3' "
                                         r"\(--node\)"):
        import_weights(sd, "extra.pair_attention")
    assert import_weights(sd, "extra.pair_attention", node="ending").node == "ending"
    with pytest.raises(ValueError, match=r"node='ending' disagrees with block "
                                         r"'pairformer_module.layers.0.tri_att_start.' "
                                         r"\(openfold\): its module path says 'starting'"):
        import_weights(sd, "pairformer_module.layers.0.tri_att_start", node="ending")
    with pytest.raises(ValueError, match=r"node must be one of"):
        import_weights(sd, "extra.pair_attention", node="end")
    with pytest.raises(ValueError, match=r"num_heads=8 disagrees with linear.weight.shape\[0\] "
                                         r"= 4"):
        import_weights(sd, "pairformer_module.layers.0.tri_att_end", num_heads=8)
    with pytest.raises(ValueError, match=r"no triangle attention block found"):
        import_weights({"a.weight": np.zeros(3)})
    with pytest.raises(TypeError, match=r"must be a checkpoint path, a state_dict mapping or "
                                        r"a torch.nn.Module, got list"):
        import_weights([])


# --- heads x head width other than D: the template stacks -----------------------------------

@pytest.mark.parametrize("head_width", [4, 16])  # 4 x 4 = D / 2, 4 x 16 = 2 D
@pytest.mark.parametrize("starting", [True, False])
def test_boltz_blocks_of_any_head_width(rng, head_width, starting):
    module = mb.randomize(mb.boltz_block(D, head_width, H, starting=starting), seed=13)
    (block,) = find_blocks(state_dict_of(module))
    assert (block.pair_dim, block.num_heads, block.head_width, block.problem) == (
        D, H, head_width, None)
    assert import_weights(module).head_dim == head_width
    check_block(module, rng, starting)


def test_boltz2_template_stack(rng):
    """Boltz-2's own template stack (TemplateV2Module, template_dim 64): 4 heads x 32."""
    module = mb.randomize(mb.boltz2_template_module(token_z=16, template_dim=64), seed=14)
    sd = state_dict_of(module)
    blocks = find_blocks(sd)
    assert [(b.prefix, b.pair_dim, b.num_heads, b.head_width, b.node, b.problem)
            for b in blocks] == [
        ("pairformer.layers.0.tri_att_start.", 64, 4, 32, "starting", None),
        ("pairformer.layers.0.tri_att_end.", 64, 4, 32, "ending", None)]
    layer = module.pairformer.layers[0]
    for block, submodule in zip(blocks, (layer.tri_att_start, layer.tri_att_end)):
        weights = import_weights(sd, block.prefix)
        assert (weights.head_dim, weights.hidden_dim) == (32, 128)
        check_weights(weights, submodule, rng, block.node == "starting", N=9)


def test_protenix_template_stack(rng):
    """Protenix's template stack (TemplateEmbedder: c = 64, its PairformerBlock's 4 heads x
    32), its two blocks of Protenix's own class, called as its PairformerBlock calls them
    (TemplateEmbedder itself imports rdkit, not installed for these tests)."""
    model = torch.nn.ModuleDict({"template_embedder": torch.nn.ModuleDict({
        "pairformer_stack": torch.nn.ModuleDict({"blocks": torch.nn.ModuleList([
            torch.nn.ModuleDict({"tri_att_start": mb.protenix_attention(64, 32, 4),
                                 "tri_att_end": mb.protenix_attention(64, 32, 4)})])})})})
    mb.randomize(model, seed=15)
    sd = state_dict_of(model)
    prefix = "template_embedder.pairformer_stack.blocks.0."
    assert [(b.prefix, b.family.name, b.head_width, b.node) for b in find_blocks(sd)] == [
        (prefix + "tri_att_start.", "openfold", 32, "starting"),
        (prefix + "tri_att_end.", "openfold", 32, "ending")]
    layer = model["template_embedder"]["pairformer_stack"]["blocks"][0]
    check_weights(import_weights(sd, prefix + "tri_att_start"), layer["tri_att_start"], rng,
                  True, N=9)
    check_weights(import_weights(sd, prefix + "tri_att_end"), layer["tri_att_end"], rng,
                  False, N=9, forward=mb.protenix_ending)


def test_projection_width_that_is_no_head_width_is_refused():
    sd = {k: v for k, v in mb.OpenFoldTriangleAttention(D, C, H).state_dict().items()}
    for name in ("q", "k", "v", "g"):
        sd[f"mha.linear_{name}.weight"] = torch.zeros(30, D)
    sd["mha.linear_g.bias"] = torch.zeros(30)
    sd["mha.linear_o.weight"] = torch.zeros(D, 30)
    (block,) = find_blocks(sd)
    assert block.head_width == 0
    assert block.problem == "the projections' width 30 is not a positive multiple of the 4 heads"
    with pytest.raises(ValueError, match=r"block '' \(openfold\): the projections' width 30 "
                                         r"is not a positive multiple of the 4 heads"):
        import_weights(sd, node="starting")


def test_wrong_shapes_are_named_in_the_models_names():
    sd = {k: v.clone() for k, v in mb.boltz_block(D, C, H).state_dict().items()}
    sd["mha.linear_k.weight"] = torch.zeros(D, D - 1)
    (block,) = find_blocks(sd)
    assert block.problem == f"mha.linear_k.weight has shape ({D}, {D - 1}), expected ({D}, {D})"


def test_integer_parameter_is_refused():
    sd = dict(mb.boltz_block(D, C, H).state_dict())
    sd["layer_norm.bias"] = torch.zeros(D, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"layer_norm.bias: expected a floating-point tensor, "
                                         r"got dtype torch.int64"):
        import_weights(sd, node="starting")


def test_bfloat16_parameters_are_widened():
    module = mb.randomize(mb.boltz_block(D, C, H), seed=6)
    weights = import_weights({k: v.to(torch.bfloat16) for k, v in module.state_dict().items()},
                             node="starting")
    expected = module.state_dict()["mha.linear_q.weight"].to(torch.bfloat16).float().numpy()
    assert np.array_equal(weights["query.weight"], expected)


@pytest.mark.parametrize("path,node", [
    ("pairformer_module.layers.3.tri_att_start.", "starting"),
    ("evoformer.blocks.0.core.tri_att_end.", "ending"),
    ("template.pair_stack.blocks.1.triangle_attention_starting_node.", "starting"),
    ("x.triangle_attention_ending_node.", "ending"),
    ("model.TriangleAttentionEndingNode.", "ending"),
    ("layers.tri_att_end.0.", "ending"),
    ("tri_attn.", None), ("", None), ("pair_attention.", None), ("legend.", None),
])
def test_node_from_path(path, node):
    assert node_from_path(path) == node


# --- checkpoint files ------------------------------------------------------------------------

def test_import_all(small_model):
    imported, refused = import_all(small_model, node="starting")
    assert refused == []
    assert list(imported) == [b.prefix for b in find_blocks(state_dict_of(small_model))]
    assert [w.node for w in imported.values()] == ["starting", "ending", "starting", "ending",
                                                   "starting"]


def test_lightning_checkpoint(tmp_path, small_model):
    sd = {f"model.{k}": v for k, v in small_model.state_dict().items()}
    path = tmp_path / "model.ckpt"
    torch.save({"epoch": 3, "global_step": 10, "state_dict": sd,
                "hyper_parameters": {"c_z": D, "name": "small"},
                "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(3)}}}]}, path)
    loaded = load_checkpoint(path)
    assert set(loaded) == set(sd)
    weights = import_weights(path, "model.pairformer_module.layers.1.tri_att_start.")
    expected = import_weights(small_model, "pairformer_module.layers.1.tri_att_start.")
    for name in expected.params:
        assert np.array_equal(weights[name], expected[name]), name


def test_nested_checkpoint(tmp_path, small_model):
    path = tmp_path / "model.pt"
    torch.save({"model": small_model.state_dict(), "step": 4}, path)
    prefixes = [b.prefix for b in find_blocks(load_checkpoint(path))]
    assert prefixes[0] == "model.pairformer_module.layers.0.tri_att_start."


def test_safetensors(tmp_path, small_model):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(small_model.state_dict(), str(path))
    weights = import_weights(path, "pairformer_module.layers.0.tri_att_end")
    expected = import_weights(small_model, "pairformer_module.layers.0.tri_att_end")
    assert weights.node == "ending"
    for name in expected.params:
        assert np.array_equal(weights[name], expected[name]), name


def test_full_model_pickle_needs_allow_pickle(tmp_path, small_model):
    path = tmp_path / "whole.pt"
    torch.save(small_model, path)
    with pytest.raises(ValueError, match=r"a pickled module is refused.*allow_pickle=True "
                                         r"\(--allow-pickle\)"):
        import_weights(path, "pairformer_module.layers.0.tri_att_start")
    weights = import_weights(path, "pairformer_module.layers.0.tri_att_start",
                             allow_pickle=True)
    assert weights.node == "starting"


def test_checkpoint_errors(tmp_path):
    with pytest.raises(ValueError, match=r"absent.pt: no such file"):
        load_checkpoint(tmp_path / "absent.pt")
    with pytest.raises(ValueError, match=r"is a folder"):
        load_checkpoint(tmp_path)
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    pytest.importorskip("safetensors")
    with pytest.raises(ValueError, match=r"cannot load checkpoint .*junk.safetensors"):
        load_checkpoint(tmp_path / "junk.safetensors")


def test_block_weights_default_eps_and_bad_eps(small_model):
    sd = state_dict_of(small_model)
    block = find_blocks(sd)[0]
    assert block_weights(sd, block).layer_norm_eps == 1e-5
    assert block_weights(sd, block, layer_norm_eps=1e-6).layer_norm_eps == 1e-6
    with pytest.raises(ValueError, match=r"layer_norm_eps must be a positive finite number"):
        block_weights(sd, block, layer_norm_eps=0.0)


def test_weights_without_torch_from_numpy():
    """A mapping of NumPy arrays in the reference's names needs no torch."""
    w = random_weights(16, 4, seed=7)
    imported = import_weights({f"module.{k}": v for k, v in w.params.items()})
    assert (imported.mask_layout, imported.node) == ("pair", "starting")
    for name, value in w.params.items():
        assert np.array_equal(imported[name], value)
