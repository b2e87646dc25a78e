"""Every block of the process routed by its class (`triattn_cupy.torch.enable`, `accelerated`),
fallbacks that warn and count, strict mode and `report`, on the CPU with each model's own
classes: Boltz's pairformer (boltz-community 2.12), Protenix's and OpenFold3's blocks, the
spec's module and an OpenFold-shaped block.

Without a GPU every call falls back (tensors on cpu); the calls through the kernels are traced
by letting CPU tensors reach the op (`cpu_routed`), where it runs the NumPy backend."""
from __future__ import annotations

import copy
import pickle
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import model_blocks as mb  # noqa: E402  (needs torch)
from helpers import every_warning, fallback_messages, rel_l2  # noqa: E402
from torch_spec import TriangleSelfAttention  # noqa: E402

import triattn_cupy.torch as tt  # noqa: E402
from triattn_cupy.gpu.checks import UnsupportedOnGpu  # noqa: E402
from triattn_cupy.torch import blocks, ops, routing  # noqa: E402

D, C, H = 16, 4, 4


@pytest.fixture(autouse=True)
def routing_off():
    """Every test leaves the classes as it found them."""
    yield
    while tt.enabled():
        tt.disable()


@pytest.fixture
def cpu_routed(monkeypatch):
    monkeypatch.setattr(blocks, "_ACCELERATED_DEVICES", {"cuda", "cpu"})


def boltz_pairformer(layers=2, seed=0):
    pairformer = pytest.importorskip(
        "boltz.model.layers.pairformer",
        reason="boltz-community is not installed (pip install --no-deps "
               "boltz-community==2.12.0 einops scipy)")
    model = pairformer.PairformerModule(token_s=8, token_z=D, num_blocks=layers, num_heads=2,
                                        pairwise_head_width=C, pairwise_num_heads=H)
    return mb.randomize(model, seed).eval()


def pairformer_inputs(N=7):
    generator = torch.Generator().manual_seed(5)
    return (torch.randn(1, N, 8, generator=generator),
            torch.randn(1, N, N, D, generator=generator), torch.ones(1, N), torch.ones(1, N, N))


def run_pairformer(model):
    with torch.no_grad():
        return model(*pairformer_inputs())[1]


# --- Boltz's own model, however it is made -----------------------------------------------

def test_boltz_pairformer_blocks_run_on_the_op_and_match_its_forward(cpu_routed):
    model = boltz_pairformer()
    want = run_pairformer(model)
    with tt.accelerated():
        got = run_pairformer(model)
        assert tt.accelerated_blocks(model) == [
            f"layers.{i}.{name}" for i in range(2) for name in ("tri_att_start", "tri_att_end")]
        report = tt.report(model)
    assert (report.blocks, report.kernel_calls, report.fallbacks) == (4, 4, {})
    assert str(tt.report()) == ("4 triangle attention blocks accelerated, 4 calls through the "
                                "kernels, 0 fell back")
    assert rel_l2(got.double().numpy(), want.double().numpy()) < 1e-5


def test_a_checkpoint_loaded_after_construction_is_used(cpu_routed, tmp_path):
    """Boltz's way: the model built from its config, then its checkpoint loaded."""
    trained = boltz_pairformer(seed=1)
    want = run_pairformer(trained)
    torch.save(trained.state_dict(), tmp_path / "small.ckpt")
    with tt.accelerated():
        model = boltz_pairformer(seed=2)
        run_pairformer(model)  # its first weights imported
        model.load_state_dict(torch.load(tmp_path / "small.ckpt"))
        got = run_pairformer(model)
        assert tt.report(model).kernel_calls == 8
    assert rel_l2(got.double().numpy(), want.double().numpy()) < 1e-5


def test_unpickled_and_copied_models_are_routed(cpu_routed, tmp_path):
    model = boltz_pairformer()
    want = run_pairformer(model)
    torch.save(model, tmp_path / "model.pt")
    with tt.accelerated():
        for other in (torch.load(tmp_path / "model.pt", weights_only=False),
                      copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            got = run_pairformer(other)
            assert tt.report(other).kernel_calls == 4
            assert rel_l2(got.double().numpy(), want.double().numpy()) < 1e-5
        pickle.dumps(model)  # a routed model still pickles


def test_blocks_are_named_by_their_path_in_their_model():
    with tt.accelerated(), every_warning() as caught:
        model = boltz_pairformer(layers=1)
        run_pairformer(model)
    assert sorted(fallback_messages(caught)) == [
        f"PairformerModule.layers.0.{name}: the original forward runs, not the kernels: the "
        f"pair is on cpu, not on a GPU: move the model and its inputs to a CUDA device"
        for name in ("tri_att_end", "tri_att_start")]
    # attributed to the model's line that calls the block
    assert {Path(w.filename).as_posix().split("/boltz/")[-1] for w in caught
            if issubclass(w.category, tt.FallbackWarning)} == {"model/layers/pairformer.py"}


def test_cpu_calls_fall_back_warned_once_per_block_and_counted():
    model = boltz_pairformer()
    want = run_pairformer(model)
    with tt.accelerated(), every_warning() as caught:
        for _ in range(3):
            torch.testing.assert_close(run_pairformer(model), want, rtol=0, atol=0)
        with torch.enable_grad():
            model(*pairformer_inputs())  # model.eval() without no_grad
    messages = fallback_messages(caught)
    assert len(messages) == 8
    assert sum("gradients are enabled: run the model under torch.inference_mode()" in m
               for m in messages) == 4
    report = tt.report()
    assert report.fallbacks == {"tensors on cpu": 12, "gradients enabled": 4}
    assert str(report) == ("4 triangle attention blocks accelerated, 0 calls through the "
                           "kernels, 16 fell back (12: tensors on cpu; 4: gradients enabled)")


def test_strict_raises_naming_the_block():
    with tt.accelerated(strict=True):
        model = boltz_pairformer(layers=1)
        with pytest.raises(tt.FallbackError, match=r"PairformerModule\.layers\.0\.tri_att_"
                                                   r"start: .*\(strict\): the pair is on cpu"):
            run_pairformer(model)


def test_compiles_before_and_after_the_first_call(cpu_routed):
    """A graph compiled before the blocks' first call breaks at it (their weights imported
    in eager mode) and keeps their states; after it, fullgraph traces the routed forward."""
    torch._dynamo.reset()
    model = boltz_pairformer(layers=1)
    want = run_pairformer(model)
    with tt.accelerated():
        compiled = torch.compile(model, backend="eager")
        for calls in (2, 4):
            torch.testing.assert_close(run_pairformer(compiled), want, rtol=1e-5, atol=1e-5)
            assert tt.report(model).kernel_calls == calls
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        torch.testing.assert_close(run_pairformer(compiled), want, rtol=1e-5, atol=1e-5)
        assert tt.report(model).kernel_calls == 6


def test_accelerate_strict_raises_at_a_call_the_kernels_do_not_compute(monkeypatch):
    model = torch.nn.ModuleDict({"pair_attention": TriangleSelfAttention(D, H).eval()})
    tt.accelerate(model, strict=True)
    monkeypatch.setattr(ops, "_compute", lambda *a: pytest.fail("the op ran"))
    pair, mask = torch.randn(1, 5, 5, D), torch.ones(1, 5, 5)
    # Explicitly: a model's command run in this process earlier may have switched them off.
    with torch.enable_grad(), pytest.raises(
            tt.FallbackError, match=r"pair_attention: the kernels do not compute this call "
                                    r"\(strict\): gradients are enabled"):
        model.pair_attention(pair, mask)
    with torch.no_grad(), pytest.raises(tt.FallbackError, match="the pair is on cpu"):
        model.pair_attention(pair, mask)
    tt.accelerate(model)  # not strict: the same calls fall back
    with torch.no_grad(), every_warning() as caught:
        model.pair_attention(pair, mask)
    assert len(fallback_messages(caught)) == 1


# --- the other families' own classes -----------------------------------------------------

@pytest.mark.parametrize("family", ["protenix", "openfold3", "openfold", "spec"])
def test_every_family_is_routed_by_its_class(cpu_routed, family, rng):
    openfold = type("TriangleAttention", (mb.OpenFoldTriangleAttention,),
                    {"__module__": "openfold.model.triangular_attention"})
    make = {"protenix": lambda starting: mb.protenix_block(D, C, H, starting=starting),
            "openfold3": lambda starting: mb.openfold3_block(D, C, H),
            "openfold": lambda starting: openfold(D, C, H, starting=starting),
            "spec": lambda starting: TriangleSelfAttention(D, H)}[family]
    make(True)  # the class imported (skips where the model is not installed)
    with tt.accelerated():
        model = mb.randomize(mb.SmallModel(make, D, layers=1), 4).eval()
        pair = torch.from_numpy(rng.standard_normal((1, 6, 6, D)).astype(np.float32))
        mask = torch.ones(1, 6, 6)
        block = model.pairformer_module["layers"][0].tri_att_end
        with torch.no_grad():
            got = block(pair, mask)
        assert tt.accelerated_blocks(model) == ["pairformer_module.layers.0.tri_att_end"]
        assert tt.report(model).kernel_calls == 1
    with torch.no_grad():  # routing off: the block's own forward
        want = block.double()(pair.double(), mask.double()).numpy()
    assert rel_l2(got.double().numpy(), want) < 1e-6


def test_openfold3_pairformer_stack(cpu_routed, rng):
    """OpenFold3's own stack: tri_att_start on the op; tri_att_end runs its original forward
    (transpose_bias=True, AlphaFold3's ending node), warned and counted."""
    mb.openfold3_block(D, C, H)  # the package, as model_blocks imports it (skips if missing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no Triton, no CUDA here
        try:
            from openfold3.core.model.latent.pairformer import PairFormerStack
        except ImportError as error:
            pytest.skip(f"openfold3's pairformer does not import: {error}")
    with tt.accelerated(), every_warning() as caught:
        stack = PairFormerStack(
            c_s=8, c_z=D, c_hidden_pair_bias=4, no_heads_pair_bias=2, c_hidden_mul=8,
            c_hidden_pair_att=C, no_heads_pair=H, no_blocks=2, transition_type="swiglu",
            transition_n=2, pair_dropout=0.25, fuse_projection_weights=False,
            blocks_per_ckpt=None, inf=1e9)
        stack = mb.randomize(stack, 6).eval()
        s = torch.from_numpy(rng.standard_normal((1, 6, 8)).astype(np.float32))
        z = torch.from_numpy(rng.standard_normal((1, 6, 6, D)).astype(np.float32))
        with torch.no_grad():
            got = stack(s, z, torch.ones(1, 6), torch.ones(1, 6, 6))[1]
        report = tt.report(stack)
    assert (report.blocks, report.kernel_calls) == (4, 2)
    assert report.fallbacks == {"transpose_bias=True": 2}
    assert [m.split(":")[0] for m in fallback_messages(caught)] == [
        f"PairFormerStack.blocks.{i}.pair_stack.tri_att_end" for i in range(2)]
    with torch.no_grad():
        want = stack(s, z, torch.ones(1, 6), torch.ones(1, 6, 6))[1]
    assert rel_l2(got.double().numpy(), want.double().numpy()) < 1e-5


# --- refusals of the GPU-side checks -------------------------------------------------------

def test_weights_the_gpu_checks_refuse_fall_back(monkeypatch):
    """Any UnsupportedOnGpu of gpu.checks.check_weights (head widths, h x c != D, ...)."""
    def refuse(weights):
        raise UnsupportedOnGpu(f"pair_dim {weights.pair_dim} is refused here")
    monkeypatch.setattr(blocks, "check_weights", refuse)
    model = torch.nn.ModuleDict({"tri_att_start": TriangleSelfAttention(D, H).eval()})
    with every_warning() as caught:
        tt.accelerate(model)
    assert fallback_messages(caught) == [
        "tri_att_start: the original forward runs, not the kernels: pair_dim 16 is refused "
        "here (the NumPy backend, triattn_cupy.reference, computes them)"]
    with torch.no_grad():
        model.tri_att_start(torch.randn(1, 5, 5, D), torch.ones(1, 5, 5))
    report = tt.report(model)
    assert report.refused == {"tri_att_start": "weights the GPU refuses"}
    assert report.fallbacks == {"weights the GPU refuses": 1} and report.blocks == 0
    with pytest.raises(tt.FallbackError, match="tri_att_start: not accelerated \\(strict\\): "
                                               "pair_dim 16 is refused here"):
        tt.accelerate(model, strict=True)
    assert tt.accelerated_blocks(model) == [] and "forward" not in model.tri_att_start.__dict__


def test_the_gpu_checks_refuse_heads_times_width_other_than_the_pair_dim():
    from triattn_cupy.gpu.checks import check_weights

    weights = types.SimpleNamespace(pair_dim=64, num_heads=4, head_dim=32)  # Boltz-2 templates
    with pytest.raises(UnsupportedOnGpu, match=r"heads x head width = 4 x 32 = 128 differs "
                                                r"from pair_dim 64"):
        check_weights(weights)


def test_boltz_template_blocks_with_wider_heads_run_their_own_forward():
    """Boltz-2's template stack (PairformerNoSeqModule): heads x head width != D. Refused
    where the weights do not import or the GPU refuses them; warned, counted, not routed."""
    pairformer = pytest.importorskip("boltz.model.layers.pairformer")
    with tt.accelerated(), every_warning() as caught:
        stack = pairformer.PairformerNoSeqModule(token_z=D, num_blocks=1, pairwise_head_width=8,
                                                 pairwise_num_heads=H).eval()
        with torch.no_grad():
            stack(torch.randn(1, 5, 5, D), torch.ones(1, 5, 5))
        report = tt.report(stack)
    assert report.blocks == 0 and report.kernel_calls == 0
    assert set(report.refused) == {f"PairformerNoSeqModule.layers.0.{name}"
                                   for name in ("tri_att_start", "tri_att_end")}
    assert set(report.refused.values()) <= {"parameters that do not import",
                                            "weights the GPU refuses"}
    messages = fallback_messages(caught)
    assert len(messages) == 2 and all("4 x 8 = 32" in m for m in messages)


def test_a_device_that_refuses_the_weights_at_the_first_call(cpu_routed, monkeypatch):
    calls = []

    def refuse(*args):
        calls.append(args)
        raise UnsupportedOnGpu("pair_dim 16 needs more shared memory than GPU 0 allows")
    monkeypatch.setattr(ops, "_compute", refuse)
    block = TriangleSelfAttention(D, H).eval()
    with tt.accelerated(), every_warning() as caught, torch.no_grad():
        for _ in range(3):
            block(torch.randn(1, 5, 5, D), torch.ones(1, 5, 5))
        report = tt.report()
    assert len(calls) == 1  # refused once, then the original forward straight away
    assert report.fallbacks == {"weights the GPU refuses": 3} and report.blocks == 0
    assert list(report.refused.values()) == ["weights the GPU refuses"]
    (message,) = fallback_messages(caught)
    assert "needs more shared memory than GPU 0 allows" in message


# --- switching on and off ----------------------------------------------------------------

def test_disable_gives_the_classes_their_forwards_back():
    own = TriangleSelfAttention.__dict__["forward"]
    subclass = type("TriangleSelfAttention", (torch.nn.Module,), {})  # no forward of its own
    with tt.accelerated(precision="bf16"):
        assert TriangleSelfAttention.forward is not own
        assert "forward" in subclass.__dict__  # routed where it is defined (before: a scan)
        late = type("TriangleSelfAttention", (TriangleSelfAttention,), {})
        assert "forward" not in late.__dict__  # a subclass inherits the routed forward
        with tt.accelerated(precision="tf32", strict=True):
            assert routing._settings[-1] == routing._Settings("tf32", True)
        assert routing._settings[-1] == routing._Settings("bf16", False)
    assert TriangleSelfAttention.__dict__["forward"] is own
    assert "forward" not in subclass.__dict__ and "forward" not in late.__dict__
    assert "__init_subclass__" not in torch.nn.Module.__dict__
    assert not tt.enabled()


def test_accelerate_inside_routing_falls_back_without_recursing(monkeypatch):
    block = TriangleSelfAttention(D, H).eval()
    with tt.accelerated():
        tt.accelerate(block)
        monkeypatch.setattr(ops, "_compute", lambda *a: pytest.fail("the op ran"))
        with torch.no_grad(), every_warning() as caught:
            out = block(torch.randn(1, 5, 5, D), torch.ones(1, 5, 5))
    assert out.shape == (1, 5, 5, D) and len(fallback_messages(caught)) == 1
    assert tt.report(block).fallbacks == {"tensors on cpu": 1}


def test_precision_is_checked():
    with pytest.raises(ValueError, match="precision must be one of"):
        tt.enable(precision="fp16")
    assert not tt.enabled()


def test_report_line():
    report = tt.Report(blocks=1, kernel_calls=0, fallbacks={"gradients enabled": 3},
                       refused={"a": "weights the GPU refuses", "b": "weights the GPU refuses"})
    assert report.fallback_calls == 3
    assert str(report) == ("1 triangle attention block accelerated, 0 calls through the "
                           "kernels, 3 fell back (3: gradients enabled), 2 blocks refused "
                           "(2: weights the GPU refuses)")
