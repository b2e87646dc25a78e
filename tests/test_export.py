"""PyTorch -> HDF5: export_weights, the triattn-export command, and default.h5's recipe."""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from helpers import rel_l2
from spec import load_spec_module
from triattn_cupy.export import export_weights, main
from triattn_cupy.hdf5 import load_default_weights, load_weights
from triattn_cupy.reference import triangle_attention

REPO = pathlib.Path(__file__).resolve().parent.parent
D, H = 24, 4


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def module(torch):
    """A spec module with every parameter random (LayerNorm affine and biases included)."""
    torch.manual_seed(0)
    m = load_spec_module().TriangleSelfAttention(D, H).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(-0.5, 0.5)
    return m


def assert_matches(weights, state_dict):
    """Bitwise equality of the loaded float32 arrays and the float32 tensors."""
    assert weights.params.keys() == state_dict.keys()
    for name, tensor in state_dict.items():
        assert np.array_equal(weights[name], tensor.numpy()), name


# --- export_weights -----------------------------------------------------------------------

def test_module_round_trip_is_exact(tmp_path, module):
    module.layer_norm.eps = 1e-3
    returned = export_weights(module, tmp_path / "w.h5")
    loaded = load_weights(tmp_path / "w.h5")
    assert (loaded.pair_dim, loaded.num_heads, loaded.layer_norm_eps) == (D, H, 1e-3)
    assert_matches(loaded, module.state_dict())
    assert_matches(returned, module.state_dict())


def test_state_dict_round_trip_is_exact(tmp_path, module):
    export_weights(module.state_dict(), tmp_path / "w.h5")
    loaded = load_weights(tmp_path / "w.h5")
    assert (loaded.pair_dim, loaded.num_heads, loaded.layer_norm_eps) == (D, H, 1e-5)
    assert_matches(loaded, module.state_dict())


def test_state_dict_of_another_head_width(tmp_path, torch):
    """q, k, v and the gate projected to h x c = 2 D channels: the head width comes from
    query.weight's rows, and the file records it."""
    from triattn_cupy import random_weights

    wide = random_weights(D, H, seed=4, head_dim=2 * D // H)
    state_dict = {name: torch.from_numpy(value) for name, value in wide.params.items()}
    returned = export_weights(state_dict, tmp_path / "w.h5")
    loaded = load_weights(tmp_path / "w.h5")
    assert returned.head_dim == loaded.head_dim == 2 * D // H
    assert_matches(loaded, state_dict)


def test_module_prefix_is_stripped(tmp_path, module):
    state_dict = {f"module.{k}": v for k, v in module.state_dict().items()}
    export_weights(state_dict, tmp_path / "w.h5", num_heads=H, layer_norm_eps=1e-6)
    loaded = load_weights(tmp_path / "w.h5")
    assert loaded.layer_norm_eps == 1e-6
    assert_matches(loaded, module.state_dict())


def test_returned_weights_are_a_copy(tmp_path, module, torch):
    weights = export_weights(module, tmp_path / "w.h5")
    with torch.no_grad():
        module.query.weight.zero_()
    assert np.array_equal(weights["query.weight"], load_weights(tmp_path / "w.h5")["query.weight"])


def test_float64_module_is_rounded_to_float32(tmp_path, module):
    expected = {k: v.clone() for k, v in module.state_dict().items()}
    module.double()  # exact: the values are float32
    assert_matches(export_weights(module, tmp_path / "w.h5"), expected)


def test_loaded_weights_match_module_in_float64(tmp_path, module, torch):
    """The exported file through the NumPy reference = the module itself, both in float64."""
    export_weights(module, tmp_path / "w.h5")
    weights = load_weights(tmp_path / "w.h5")
    rng = np.random.default_rng(0)
    B, N = 2, 13
    pair = rng.standard_normal((B, N, N, D))
    mask = (rng.random((B, N, N)) > 0.3).astype(np.float64)
    mask[..., 0] = 1  # no fully-masked query: the spec would return NaN there
    with torch.no_grad():
        expected = module.double()(torch.from_numpy(pair), torch.from_numpy(mask)).numpy()
    out = triangle_attention(pair, mask, weights, dtype=np.float64)
    assert rel_l2(out, expected) < 1e-12


@pytest.mark.parametrize("kwargs, message", [
    ({"num_heads": 2}, r"num_heads=2 disagrees with module.num_heads = 4"),
    ({"layer_norm_eps": 1e-3}, r"layer_norm_eps=0.001 disagrees with module.layer_norm.eps"),
])
def test_module_disagreement(tmp_path, module, kwargs, message):
    with pytest.raises(ValueError, match=message):
        export_weights(module, tmp_path / "w.h5", **kwargs)


def test_state_dict_errors(tmp_path, module, torch):
    sd = dict(module.state_dict())
    with pytest.raises(ValueError, match=r"num_heads=8 disagrees with "
                                         r"bias_proj.weight.shape\[0\] = 4"):
        export_weights(sd, tmp_path / "w.h5", num_heads=8)
    with pytest.raises(ValueError, match="unexpected parameters: extra.weight"):
        export_weights({**sd, "extra.weight": torch.zeros(3)}, tmp_path / "w.h5")
    with pytest.raises(ValueError, match="query.weight: expected shape \\(24, 24\\), got "
                                         "\\(24, 23\\)"):
        export_weights({**sd, "query.weight": torch.zeros(D, D - 1)}, tmp_path / "w.h5")
    with pytest.raises(ValueError, match=r"state_dict\['key.bias'\]: expected a floating-"
                                         r"point tensor, got dtype torch.int64"):
        export_weights({**sd, "key.bias": torch.zeros(D, dtype=torch.int64)}, tmp_path / "w.h5")
    del sd["bias_proj.weight"]
    with pytest.raises(ValueError, match="cannot infer num_heads"):
        export_weights(sd, tmp_path / "w.h5")
    with pytest.raises(TypeError, match="must be a torch.nn.Module or a state_dict mapping, "
                                        "got list"):
        export_weights([], tmp_path / "w.h5")
    assert not (tmp_path / "w.h5").exists()


def test_missing_torch_is_a_clear_import_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
    # both commands: by name from an index, by path from a source checkout
    with pytest.raises(ImportError, match=r'pip install "triattn-cupy\[export\]" \(from a '
                                          r'source checkout: pip install "\.\[export\]"\)'):
        export_weights({}, tmp_path / "w.h5")


def test_package_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; "
            "import triattn_cupy, triattn_cupy.hdf5, triattn_cupy.export")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env={"PYTHONPATH": str(REPO), "PATH": ""})


# --- triattn-export -----------------------------------------------------------------------

@pytest.fixture
def checkpoint(tmp_path, module, torch):
    path = tmp_path / "model.pt"
    torch.save(module.state_dict(), path)
    return path


def test_cli(tmp_path, module, checkpoint, capsys):
    out = tmp_path / "w.h5"
    assert main([str(checkpoint), str(out), "--layer-norm-eps", "1e-6"]) == 0
    loaded = load_weights(out)
    assert (loaded.num_heads, loaded.layer_norm_eps) == (H, 1e-6)
    assert_matches(loaded, module.state_dict())
    assert main([str(checkpoint), str(out), "--num-heads", str(H)]) == 0


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("triattn-export: error: ")
    return err


def test_cli_inconsistent_num_heads(tmp_path, checkpoint, capsys):
    assert main([str(checkpoint), str(tmp_path / "w.h5"), "--num-heads", "8"]) == 2
    assert "num_heads=8 disagrees with bias_proj.weight.shape[0] = 4" in one_error_line(capsys)
    assert not (tmp_path / "w.h5").exists()


def test_cli_missing_checkpoint(tmp_path, capsys):
    assert main([str(tmp_path / "absent.pt"), str(tmp_path / "w.h5")]) == 2
    assert "absent.pt: no such file" in one_error_line(capsys)


def test_cli_not_a_checkpoint(tmp_path, capsys):
    path = tmp_path / "junk.pt"
    path.write_bytes(np.random.default_rng(0).bytes(1000))
    assert main([str(path), str(tmp_path / "w.h5")]) == 2
    assert "cannot load checkpoint" in one_error_line(capsys)


def test_cli_pickled_module_is_refused(tmp_path, module, torch, capsys):
    path = tmp_path / "whole.pt"
    torch.save(module, path)  # a whole module: weights_only=True refuses to unpickle it
    assert main([str(path), str(tmp_path / "w.h5")]) == 2
    assert ("weights_only=True); expected a torch.save'd state_dict (a pickled module is "
            "refused): Unsupported global") in one_error_line(capsys)


def test_cli_not_a_state_dict(tmp_path, torch, capsys):
    path = tmp_path / "list.pt"
    torch.save([torch.zeros(3)], path)
    assert main([str(path), str(tmp_path / "w.h5")]) == 2
    assert "holds a list, expected a state_dict" in one_error_line(capsys)


def test_cli_unwritable_output(tmp_path, checkpoint, capsys):
    assert main([str(checkpoint), str(tmp_path / "nowhere" / "w.h5")]) == 2
    assert "does not exist" in one_error_line(capsys)


@pytest.mark.parametrize("flags", [["--num-heads", "0"], ["--layer-norm-eps", "-1"],
                                   ["--layer-norm-eps", "nan"], ["--bogus"]])
def test_cli_bad_flags(tmp_path, checkpoint, flags, capsys):
    assert main([str(checkpoint), str(tmp_path / "w.h5"), *flags]) == 2
    assert "triattn-export: error:" in capsys.readouterr().err


def test_cli_help(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "--num-heads" in text and "--layer-norm-eps" in text


# --- default.h5 ---------------------------------------------------------------------------

def test_default_weights_match_their_recipe(torch):
    """default.h5 is what weights/make_default.py builds (regenerate it if this fails)."""
    path = REPO / "weights" / "make_default.py"
    spec = importlib.util.spec_from_file_location("make_default", path)
    make_default = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_default)
    module = make_default.make_module(load_spec_module())
    weights = load_default_weights()
    assert (weights.pair_dim, weights.num_heads, weights.layer_norm_eps) == (128, 4, 1e-5)
    assert_matches(weights, module.state_dict())


# --- checkpoints that are not what they seem ----------------------------------------------

def test_cli_fifo_checkpoint_is_refused_without_opening(tmp_path):
    """Opening a FIFO blocks until a writer comes: the export hung. In a child process,
    so that a hang fails the test instead of stalling it."""
    import os

    from cli_support import child_env

    os.mkfifo(tmp_path / "model.pt")
    proc = subprocess.run([sys.executable, "-m", "triattn_cupy.export",
                           str(tmp_path / "model.pt"), str(tmp_path / "w.h5")],
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "model.pt: not a regular file; not opened" in proc.stderr


def test_cli_meta_tensors_are_a_clear_error(tmp_path, module, torch, capsys):
    path = tmp_path / "meta.pt"
    torch.save({k: torch.empty_like(v, device="meta") for k, v in module.state_dict().items()},
               path)
    assert main([str(path), str(tmp_path / "w.h5")]) == 2
    assert "layer_norm.weight: a meta tensor, which holds no values" in one_error_line(capsys)
    with pytest.raises(ValueError, match=r"state_dict\['layer_norm.weight'\]: a meta tensor"):
        export_weights(module.to("meta"), tmp_path / "w.h5")
    assert not (tmp_path / "w.h5").exists()


def test_cli_expanded_tensors_are_copied_with_their_values(tmp_path, module, torch):
    """Stride-0 tensors (expand()) hold real values: exported as the full arrays."""
    expanded = {k: v.reshape(-1)[:1].expand(v.shape) for k, v in module.state_dict().items()}
    path = tmp_path / "expanded.pt"
    torch.save(expanded, path)
    assert main([str(path), str(tmp_path / "w.h5")]) == 0
    assert_matches(load_weights(tmp_path / "w.h5"), {k: v.contiguous()
                                                     for k, v in expanded.items()})


def test_cli_expanded_tensors_beyond_the_loaders_limit_are_refused(tmp_path, torch, capsys):
    """A 5 KB checkpoint of stride-0 tensors declaring D = 6000 became a 720 MB file that
    load_weights refuses: refused before anything is copied."""
    D_big = 6000
    sd = {"layer_norm.weight": torch.ones(1).expand(D_big),
          "layer_norm.bias": torch.zeros(1).expand(D_big),
          "bias_proj.weight": torch.ones(1).expand(4, D_big)}
    for name in ("query", "key", "value", "gate", "out_proj"):
        sd[f"{name}.weight"] = torch.full((1,), 0.01).expand(D_big, D_big)
        sd[f"{name}.bias"] = torch.zeros(1).expand(D_big)
    path = tmp_path / "big.pt"
    torch.save(sd, path)
    assert main([str(path), str(tmp_path / "w.h5")]) == 2
    assert ("shape (6000, 6000) holds 36000000 values, more than any parameter of a weights "
            "file (pair_dim at most 4096)") in one_error_line(capsys)
    assert not (tmp_path / "w.h5").exists()


def test_save_weights_never_writes_what_load_weights_refuses(tmp_path, monkeypatch):
    """pair_dim beyond MAX_PAIR_DIM (lowered here so that the test stays small)."""
    from triattn_cupy import hdf5, random_weights

    monkeypatch.setattr(hdf5, "MAX_PAIR_DIM", 8)
    with pytest.raises(ValueError, match="weights.pair_dim 16 is beyond the largest "
                                         "load_weights reads, 8"):
        hdf5.save_weights(random_weights(16, 4), tmp_path / "w.h5")
    assert list(tmp_path.iterdir()) == []
