"""``triattn-export`` on real models' checkpoints: --list, --prefix, --all."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import rel_l2
from triattn_cupy.export import block_file_name, main
from triattn_cupy.hdf5 import load_weights
from triattn_cupy.reference import triangle_attention

torch = pytest.importorskip("torch")
import model_blocks as mb  # noqa: E402  (needs torch)

D, C, H = 32, 8, 4
START0 = "pairformer_module.layers.0.tri_att_start."


@pytest.fixture
def model():
    def make_block(starting):
        return mb.boltz_block(D, C, H, starting=starting)
    return mb.randomize(mb.SmallModel(make_block, D), seed=11)


@pytest.fixture
def ckpt(tmp_path, model):
    """A Lightning checkpoint of the model."""
    path = tmp_path / "model.ckpt"
    torch.save({"epoch": 1, "state_dict": model.state_dict(),
                "hyper_parameters": {"c_z": D}}, path)
    return path


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("triattn-export: error: ")
    return err


def test_list(ckpt, capsys):
    assert main([str(ckpt), "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["prefix", "family", "D", "heads", "head", "width", "node",
                                "biases"]
    rows = [line.split() for line in lines[1:-1]]
    assert rows == [
        [START0, "openfold", "32", "4", "8", "starting", "none"],
        ["pairformer_module.layers.0.tri_att_end.", "openfold", "32", "4", "8", "ending", "none"],
        ["pairformer_module.layers.1.tri_att_start.", "openfold", "32", "4", "8", "starting",
         "none"],
        ["pairformer_module.layers.1.tri_att_end.", "openfold", "32", "4", "8", "ending", "none"],
        ["extra.pair_attention.", "openfold", "32", "4", "8", "?", "(--node)", "none"],
    ]
    assert lines[-1].startswith("5 triangle attention blocks; biases:")


def test_list_shows_biases_head_widths_and_refused_blocks(tmp_path, capsys, rng):
    sd = {}
    for prefix, block in [("a.tri_att_end.", mb.OpenFoldTriangleAttention(D, C, H)),
                          ("b.tri_att_start.", mb.OpenFoldTriangleAttention(
                              D, C, H, pair_bias_name="linear_z")),
                          ("c.tri_att_start.", mb.randomize(mb.boltz_block(D, 16, H), 3)),
                          ("d.tri_att_start.", mb.OpenFoldTriangleAttention(D, C, H))]:
        sd.update({prefix + k: v for k, v in block.state_dict().items()})
    for name in ("q", "k", "v", "g"):  # 30 channels: no width of 4 heads
        sd[f"d.tri_att_start.mha.linear_{name}.weight"] = torch.zeros(30, D)
    sd["d.tri_att_start.mha.linear_g.bias"] = torch.zeros(30)
    sd["d.tri_att_start.mha.linear_o.weight"] = torch.zeros(D, 30)
    torch.save(sd, tmp_path / "m.pt")
    capsys.readouterr()  # (the rng fixture's seed line)
    assert main([str(tmp_path / "m.pt"), "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["a.tri_att_end.", "openfold", "32", "4", "8", "ending", "g,o"]
    assert out[2].split() == ["b.tri_att_start.", "openfold3", "32", "4", "8", "starting", "g,o"]
    # 4 heads x 16 = 64 channels at D = 32, as the template stacks (D 64, 4 x 32)
    assert out[3].split() == ["c.tri_att_start.", "openfold", "32", "4", "16", "starting", "none"]
    assert out[4].split() == ["d.tri_att_start.", "openfold", "32", "4", "?", "starting", "g,o"]
    assert out[5].strip() == ("cannot be exported: the projections' width 30 is not a "
                              "positive multiple of the 4 heads")
    assert out[6].startswith("4 triangle attention blocks;")
    assert main([str(tmp_path / "m.pt"), str(tmp_path / "d.h5"), "--prefix",
                 "d.tri_att_start"]) == 2
    assert "the projections' width 30 is not a positive multiple" in one_error_line(capsys)
    assert main([str(tmp_path / "m.pt"), str(tmp_path / "c.h5"), "--prefix",
                 "c.tri_att_start"]) == 0
    weights = load_weights(tmp_path / "c.h5")
    assert (weights.pair_dim, weights.num_heads, weights.head_dim) == (D, H, 16)
    block = mb.boltz_block(D, 16, H)
    block.load_state_dict({k[len("c.tri_att_start."):]: v for k, v in sd.items()
                           if k.startswith("c.tri_att_start.")})
    pair = rng.standard_normal((2, 9, 9, D))
    with torch.no_grad():
        expected = block.double()(torch.from_numpy(pair), torch.ones(2, 9, 9).double()).numpy()
    assert rel_l2(triangle_attention(pair, None, weights), expected) < 1e-12


def test_boltz2_template_stack_list_and_all(tmp_path, capsys, rng):
    """Boltz-2's template stack in its own module: --list shows D 64, 4 heads of width 32;
    --all writes both blocks, and each file computes what its block computes, in Python and
    through triattn-infer on the CPU."""
    model = mb.randomize(torch.nn.ModuleDict(
        {"template_module": mb.boltz2_template_module(token_z=16, template_dim=64)}), seed=21)
    path = tmp_path / "boltz2.ckpt"
    torch.save({"state_dict": model.state_dict()}, path)
    capsys.readouterr()  # (the rng fixture's seed line)
    assert main([str(path), "--list"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:-1]]
    prefix = "template_module.pairformer.layers.0."
    assert rows == [[prefix + "tri_att_start.", "openfold", "64", "4", "32", "starting", "none"],
                    [prefix + "tri_att_end.", "openfold", "64", "4", "32", "ending", "none"]]
    assert main([str(path), "--all", str(tmp_path / "blocks")]) == 0
    layer = model["template_module"].pairformer.layers[0].double().eval()
    pair = rng.standard_normal((2, 8, 8, 64))
    keep = (rng.random((2, 8, 8)) < 0.7).astype(np.float64)
    keep[:, :, 0] = keep[:, 0, :] = 1  # every row and column keeps a key
    expected = {}
    for name, block in (("tri_att_start", layer.tri_att_start),
                        ("tri_att_end", layer.tri_att_end)):
        weights = load_weights(tmp_path / "blocks" / f"{prefix}{name}.h5")
        assert (weights.pair_dim, weights.num_heads, weights.head_dim) == (64, 4, 32)
        with torch.no_grad():
            expected[name] = block(torch.from_numpy(pair), torch.from_numpy(keep)).numpy()
        assert rel_l2(triangle_attention(pair, keep, weights), expected[name]) < 1e-12, name
    # and through triattn-infer on the CPU, the mask as the model takes it
    from triattn_cupy.cli.main import main as infer_main

    (tmp_path / "in").mkdir()
    np.savez(tmp_path / "in" / "x.npz", pair=pair.astype(np.float32),
             mask=keep.astype(np.float32))
    assert infer_main([str(tmp_path / "in"), "-o", str(tmp_path / "out"), "--weights",
                       str(tmp_path / "blocks" / f"{prefix}tri_att_end.h5"), "--device", "cpu",
                       "--output-format", "npy", "-q"]) == 0
    assert rel_l2(np.load(tmp_path / "out" / "x.npy"), expected["tri_att_end"]) < 1e-5


def test_prefix_exports_what_the_block_computes(tmp_path, ckpt, model, rng, capsys):
    out = tmp_path / "end.h5"
    assert main([str(ckpt), str(out), "--prefix", "pairformer_module.layers.1.tri_att_end"]) == 0
    weights = load_weights(out)
    assert (weights.mask_layout, weights.node) == ("row", "ending")
    block = model.pairformer_module["layers"][1].tri_att_end.double().eval()
    pair = rng.standard_normal((2, 10, 10, D))
    keep = (rng.random((2, 10, 10)) < 0.7).astype(np.float64)
    keep[:, 0, :] = keep[:, :, 0] = 1
    with torch.no_grad():
        expected = block(torch.from_numpy(pair), torch.from_numpy(keep)).numpy()
    assert rel_l2(triangle_attention(pair, keep, weights), expected) < 1e-12


def _own_forward(family, node):
    """How the model's own stack calls a block of that node: (block, z, mask) -> output."""
    if family == "openfold3" and node == "ending":  # its pair block's tri_att_end
        return mb.openfold3_ending
    if family == "protenix" and node == "ending":   # its PairformerBlock's tri_att_end
        return mb.protenix_ending
    return lambda block, z, mask: block(z, mask=mask)


# Boltz-1 and Boltz-2 share these classes (boltz-community 2.12). Protenix and OpenFold3
# build every block starting=True and transpose the pair for tri_att_end, as their stacks do.
FAMILY_BLOCKS = {
    "boltz": lambda starting: mb.boltz_block(D, C, H, starting=starting),
    "protenix": lambda starting: mb.protenix_attention(D, C, H),
    "openfold3": lambda starting: mb.openfold3_block(D, C, H),
    # OpenFold is not on the package index: its block restated to its published shapes
    "openfold": lambda starting: mb.openfold_block(D, C, H, starting=starting),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # openfold3: no Triton, no CUDA here
@pytest.mark.parametrize("node", ["starting", "ending"])
@pytest.mark.parametrize("family", list(FAMILY_BLOCKS))
def test_every_family_exports_what_its_block_computes(tmp_path, rng, family, node):
    """A checkpoint of each family's own block at a pair stack's path, exported with
    --prefix: the file computes what the model's stack computes with it, in float64,
    masks of all ones, padding and random bits."""
    name = "tri_att_start" if node == "starting" else "tri_att_end"
    model = torch.nn.ModuleDict({"pairformer": torch.nn.ModuleList([torch.nn.ModuleDict(
        {name: FAMILY_BLOCKS[family](node == "starting")})])})
    mb.randomize(model, seed=31)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    out = tmp_path / "block.h5"
    assert main([str(tmp_path / "model.pt"), str(out), "--prefix", f"pairformer.0.{name}"]) == 0
    weights = load_weights(out)
    assert weights.node == ("ending_af3" if (family, node) == ("openfold3", "ending") else node)
    block, forward = model["pairformer"][0][name].double().eval(), _own_forward(family, node)
    N = 9
    padded = np.ones((2, N), bool)
    padded[0, 6:] = padded[1, 8:] = False
    random_bits = rng.random((2, N, N)) < 0.6
    random_bits[:, :, 0] = random_bits[:, 0, :] = True  # every row and column keeps a key
    for kind, keep in (("ones", np.ones((2, N, N), bool)),
                       ("padding", padded[:, :, None] & padded[:, None, :]),
                       ("random", random_bits)):
        pair = rng.standard_normal((2, N, N, D))
        keep = keep.astype(np.float64)
        with torch.no_grad():
            expected = forward(block, torch.from_numpy(pair), torch.from_numpy(keep)).numpy()
        rows = keep.any(-1)[:, :, None, None] if node == "starting" else (
            keep.any(-2)[:, None, :, None])
        assert rel_l2(triangle_attention(pair, keep, weights), expected, where=rows) < 1e-12, (
            kind)


def test_several_blocks_need_a_prefix(tmp_path, ckpt, capsys):
    assert main([str(ckpt), str(tmp_path / "w.h5")]) == 2
    line = one_error_line(capsys)
    assert "5 triangle attention blocks found" in line and "(--prefix; --list lists them)" in line
    assert not (tmp_path / "w.h5").exists()


def test_unnamed_node_needs_the_flag(tmp_path, ckpt, capsys):
    out = tmp_path / "w.h5"
    assert main([str(ckpt), str(out), "--prefix", "extra.pair_attention"]) == 2
    assert "does not name the node" in one_error_line(capsys)
    assert main([str(ckpt), str(out), "--prefix", "extra.pair_attention", "--node",
                 "ending"]) == 0
    assert load_weights(out).node == "ending"
    assert main([str(ckpt), str(out), "--prefix", START0, "--node", "ending"]) == 2
    assert "its module path says 'starting'" in one_error_line(capsys)


def test_all(tmp_path, ckpt, capsys):
    folder = tmp_path / "blocks"
    assert main([str(ckpt), "--all", str(folder)]) == 2
    assert "'extra.pair_attention.' (openfold): its module path does not name the node" in (
        one_error_line(capsys))
    assert main([str(ckpt), "--all", str(folder), "--node", "starting",
                 "--layer-norm-eps", "1e-6"]) == 0
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted([f"{START0}h5", "pairformer_module.layers.0.tri_att_end.h5",
                            "pairformer_module.layers.1.tri_att_start.h5",
                            "pairformer_module.layers.1.tri_att_end.h5",
                            "extra.pair_attention.h5"])
    nodes = {name: load_weights(folder / name).node for name in names}
    assert nodes["pairformer_module.layers.1.tri_att_end.h5"] == "ending"
    assert nodes["extra.pair_attention.h5"] == "starting"
    assert load_weights(folder / names[0]).layer_norm_eps == 1e-6


def test_block_file_name():
    assert block_file_name(START0) == "pairformer_module.layers.0.tri_att_start.h5"
    assert block_file_name("") == "triangle_attention.h5"
    assert block_file_name("a b/c.") == "a_b_c.h5"


def test_safetensors_and_pickled_model(tmp_path, model, capsys):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(model.state_dict(), str(path))
    assert main([str(path), str(tmp_path / "a.h5"), "--prefix", START0]) == 0
    whole = tmp_path / "whole.pt"
    torch.save(model, whole)
    assert main([str(whole), str(tmp_path / "b.h5"), "--prefix", START0]) == 2
    assert "--allow-pickle" in one_error_line(capsys)
    assert main([str(whole), str(tmp_path / "b.h5"), "--prefix", START0,
                 "--allow-pickle"]) == 0
    a, b = load_weights(tmp_path / "a.h5"), load_weights(tmp_path / "b.h5")
    for name in a.params:
        assert np.array_equal(a[name], b[name]), name


@pytest.mark.parametrize("argv,message", [
    (["--list", "out.h5"], "--list takes no OUTPUT"),
    (["--all", "dir", "out.h5"], "--all takes no OUTPUT"),
    (["--list", "--prefix", "a"], "it does not go with --list"),
    (["--all", "dir", "--prefix", "a"], "it does not go with --all"),
    ([], "OUTPUT is required (or --list, or --all DIR)"),
    (["--list", "--all", "dir"], "not allowed with argument"),
    (["out.h5", "--node", "middle"], "invalid choice: 'middle'"),
])
def test_usage_errors(ckpt, argv, message, capsys):
    assert main([str(ckpt), *argv]) == 2
    assert message in capsys.readouterr().err


def test_checkpoint_to_triattn_infer_on_the_cpu(tmp_path, ckpt, model, rng):
    """The worked example: --list, --prefix, then triattn-infer with no convention flag."""
    from triattn_cupy.cli.main import main as infer_main

    weights_path = tmp_path / "tri_att_end.h5"
    assert main([str(ckpt), str(weights_path), "--prefix",
                 "pairformer_module.layers.0.tri_att_end"]) == 0
    pair = rng.standard_normal((2, 12, 12, D)).astype(np.float32)
    keep = np.ones((2, 12, 12), np.float32)
    keep[1, :, 9:] = 0  # a crop of the keys
    keep[0, 3, :] = 0   # a row without keys
    keep[0, :, 5] = 0   # a column without keys: a row of the transposed pair
    (tmp_path / "in").mkdir()
    np.savez(tmp_path / "in" / "x.npz", pair=pair, mask=keep)
    assert infer_main([str(tmp_path / "in"), "-o", str(tmp_path / "out"), "--weights",
                       str(weights_path), "--device", "cpu", "--output-format", "npy",
                       "-q"]) == 0
    out = np.load(tmp_path / "out" / "x.npy")
    block = model.pairformer_module["layers"][0].tri_att_end.double().eval()
    with torch.no_grad():
        expected = block(torch.from_numpy(pair.astype(np.float64)),
                         torch.from_numpy(keep.astype(np.float64))).numpy()
    where = keep.any(-2)[:, None, :, None]  # ending node: column j keeps a key
    assert rel_l2(out, expected, where=where) < 1e-5


def test_list_without_blocks(tmp_path, capsys):
    torch.save({"encoder.weight": torch.zeros(3, 3)}, tmp_path / "other.pt")
    assert main([str(tmp_path / "other.pt"), "--list"]) == 2
    assert "no triangle attention block found" in one_error_line(capsys)


def test_help_names_the_new_options(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for option in ("--list", "--all", "--prefix", "--node", "--allow-pickle", "ending_af3"):
        assert option in text
