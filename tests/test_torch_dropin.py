"""`triattn_cupy.torch` on the CPU: the op and its fake implementation, `accelerate` finding the
real models' blocks and leaving the rest alone, its fallbacks (warned once), `restore`, stale
weights, autocast dtypes and torch.compile.

The accelerated path is traced without a GPU by letting CPU tensors reach the op
(`_ACCELERATED_DEVICES`), where it runs the NumPy backend in float64; outputs are compared
with the blocks' own forward in float64 where a row keeps at least one key (elsewhere the
models' -1e9 mask bias and `fully_masked` differ by design)."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import model_blocks as mb  # noqa: E402  (needs torch)
from helpers import every_warning, fallback_messages, rel_l2  # noqa: E402
from torch_spec import TriangleSelfAttention  # noqa: E402

import triattn_cupy.torch as tt  # noqa: E402
from triattn_cupy import random_weights, reference  # noqa: E402
from triattn_cupy.torch import blocks as acc_module  # noqa: E402
from triattn_cupy.torch import ops  # noqa: E402

D, C, H = 16, 4, 4  # pair dim, head width, heads


@pytest.fixture
def cpu_routed(monkeypatch):
    """CPU tensors reach the op (the NumPy backend) instead of falling back."""
    monkeypatch.setattr(acc_module, "_ACCELERATED_DEVICES", {"cuda", "cpu"})


@pytest.fixture
def op_calls(monkeypatch):
    """The number of times the op has computed (a list holding one count)."""
    calls, compute = [0], ops._compute

    def counted(*args):
        calls[0] += 1
        return compute(*args)
    monkeypatch.setattr(ops, "_compute", counted)
    return calls


def row_masks(rng, B, N, padding=True):
    """(B, N, N) float32 0/1 row masks: padding (an outer product) or random rows."""
    if padding:
        kept = np.ones((B, N), bool)
        for b in range(B):
            kept[b, N - 1 - 2 * b:] = False
        keep = kept[:, :, None] & kept[:, None, :]
    else:
        keep = rng.random((B, N, N)) < 0.6
        keep[0, 1, :] = False
    return torch.from_numpy(keep.astype(np.float32))


def kept(mask, starting):
    keep = mask.numpy() != 0
    rows = keep.any(-1)[:, :, None, None] if starting else keep.any(-2)[:, None, :, None]
    return np.broadcast_to(rows, rows.shape[:3] + (D,)) if starting else rows


def float64_forward(module, pair, mask, **kwargs):
    """The block's own forward in float64 on a copy of it."""
    import copy

    twin = copy.deepcopy(module)
    tt.restore(twin)
    twin.double()
    with torch.no_grad():
        return twin(pair.double(), None if mask is None else mask.double(), **kwargs).numpy()


def compare(ours, theirs, mask, starting, tol=1e-6):
    ours = ours.detach().double().numpy()
    rows = np.broadcast_to(kept(mask, starting), ours.shape) if mask is not None \
        else np.ones(ours.shape, bool)
    assert np.isfinite(ours[rows]).all()
    assert rel_l2(ours[rows], theirs[rows]) < tol


def boltz(starting=True, seed=0):
    return mb.randomize(mb.boltz_block(D, C, H, starting=starting), seed).eval()


# --- packaging -------------------------------------------------------------------------------

def test_importing_the_package_never_imports_torch():
    code = "import sys, triattn_cupy; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


# --- the op ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("node", ["starting", "ending"])
def test_functional_form_on_cpu_matches_reference(rng, dtype, node):
    weights = random_weights(D, H, seed=1)
    pair = torch.from_numpy(rng.standard_normal((2, 9, 9, D)).astype(np.float32)).to(dtype)
    mask = row_masks(rng, 2, 9, padding=False)
    out = tt.triangle_attention(pair, mask, weights, mask_layout="row", node=node)
    assert out.dtype == dtype and out.shape == pair.shape
    want = reference.triangle_attention(pair.double().numpy(), mask.numpy(), weights,
                                        mask_layout="row", node=node)
    got = out.double().numpy()
    finite = np.isfinite(want)
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert rel_l2(got[finite], want[finite]) < tol


def test_functional_form_writes_out():
    weights = random_weights(D, H, seed=2)
    pair = torch.randn(7, 7, D)
    out = torch.empty_like(pair)
    assert tt.triangle_attention(pair, None, weights, out=out) is out
    want = reference.triangle_attention(pair.double().numpy(), None, weights)
    assert rel_l2(out.double().numpy(), want) < 1e-6


@pytest.mark.parametrize("call, error, match", [
    (lambda w: tt.triangle_attention(torch.randn(5, 5, D), None, "w"), TypeError,
     "weights must be a triattn_cupy.Weights"),
    (lambda w: tt.triangle_attention(torch.randn(5, 5, D).double(), None, w), TypeError,
     "pair must be float32, bfloat16 or float16; got torch.float64"),
    (lambda w: tt.triangle_attention(torch.randn(5, 4, D), None, w), ValueError,
     r"pair must have shape \(B, N, N, 16\)"),
    (lambda w: tt.triangle_attention(torch.randn(5, 5, D), None, w, precision="fp8"),
     ValueError, "precision must be one of"),
    (lambda w: tt.triangle_attention(torch.randn(5, 5, D), None, w,
                                     out=torch.empty(5, 5, D).transpose(0, 1)), ValueError,
     "out must be a contiguous torch.float32 tensor"),
])
def test_functional_form_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(random_weights(D, H, seed=3))


def test_fake_implementation_gives_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    handle = ops._handle_of(random_weights(D, H, seed=4))
    with FakeTensorMode():
        pair = torch.empty(2, 11, 11, D, dtype=torch.bfloat16).transpose(1, 2)
        out = torch.ops.triattn.triangle_attention(pair, None, handle, "bf16", "zero",
                                                   "row", "ending")
        assert out.shape == pair.shape and out.dtype == torch.bfloat16
        assert out.is_contiguous()


def test_opcheck():
    weights = random_weights(D, H, seed=5)
    handle = ops._handle_of(weights)
    pair, mask = torch.randn(2, 6, 6, D), torch.ones(2, 6, 6)
    torch.library.opcheck(torch.ops.triattn.triangle_attention.default,
                          (pair, mask, handle, "fp32", "zero", "row", "starting"))
    torch.library.opcheck(torch.ops.triattn.triangle_attention_out.default,
                          (pair, mask, handle, "fp32", "zero", "row", "starting",
                           torch.empty_like(pair)))


# --- finding blocks --------------------------------------------------------------------------

def test_accelerate_finds_every_boltz_block_and_leaves_the_rest():
    model = mb.SmallModel(lambda starting: mb.boltz_block(D, C, H, starting=starting), D)
    tt.accelerate(model)
    assert tt.accelerated_blocks(model) == [
        "pairformer_module.layers.0.tri_att_start", "pairformer_module.layers.0.tri_att_end",
        "pairformer_module.layers.1.tri_att_start", "pairformer_module.layers.1.tri_att_end",
        "extra.pair_attention"]
    states = [m.__dict__[acc_module._STATE] for m in model.modules()
              if acc_module._STATE in m.__dict__]
    assert [s.node for s in states] == ["starting", "ending"] * 2 + ["starting"]
    assert all(s.mask_layout == "row" and s.kind.name == "boltz" for s in states)
    assert "forward" not in model.msa_module.row_attention.__dict__
    tt.restore(model)
    assert tt.accelerated_blocks(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(s.handle not in ops._registry for s in states)


@pytest.mark.parametrize("make, kind", [
    (lambda starting: mb.protenix_block(D, C, H, starting=starting), "protenix"),
    (lambda starting: mb.openfold3_block(D, C, H), "openfold3"),
])
def test_accelerate_finds_other_models_blocks(make, kind):
    model = mb.SmallModel(make, D, layers=1)
    tt.accelerate(model)
    found = tt.accelerated_blocks(model)
    assert found == ["pairformer_module.layers.0.tri_att_start",
                     "pairformer_module.layers.0.tri_att_end", "extra.pair_attention"]
    assert all(model.get_submodule(n).__dict__[acc_module._STATE].kind.name == kind
               for n in found)


def test_accelerate_takes_the_spec_module_itself():
    module = TriangleSelfAttention(D, H).eval()
    assert tt.accelerated_blocks(tt.accelerate(module)) == [""]
    state = module.__dict__[acc_module._STATE]
    assert (state.mask_layout, state.node, state.fully_masked) == ("pair", "starting", "nan")


def test_unknown_class_with_block_parameters_keeps_its_forward():
    model = torch.nn.ModuleDict({"block": mb.OpenFoldTriangleAttention(D, C, H)})
    with pytest.warns(tt.FallbackWarning, match="block: .*a forward triattn_cupy.torch "
                                                "does not read"):
        tt.accelerate(model)
    assert tt.accelerated_blocks(model) == []
    assert tt.report(model).refused == {"block": "a block class this package does not read"}


def test_unsupported_head_width_keeps_its_forward(monkeypatch):
    model = torch.nn.ModuleDict({"block": mb.boltz_block(12, 3, 4)})  # head width 3
    with pytest.warns(tt.FallbackWarning, match="block: .*head dimension"):
        tt.accelerate(model)
    assert tt.accelerated_blocks(model) == []
    monkeypatch.setattr(ops, "_compute", lambda *a: pytest.fail("the op ran"))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.block(torch.randn(1, 5, 5, 12), torch.ones(1, 5, 5))
    assert caught == []  # said once, when accelerated
    assert tt.report(model).fallbacks == {"weights the GPU refuses": 1}


def test_template_stack_head_width_is_left_to_its_own_forward(cpu_routed, monkeypatch):
    """Boltz-2's and Protenix's template blocks (h x c = 2 D) are found, refused by the GPU
    check with its reason (warned, counted), and keep their own forward."""
    model = torch.nn.ModuleDict({"tri_att_start": mb.randomize(mb.boltz_block(D, 8, H), 0),
                                 "tri_att_end": mb.randomize(mb.protenix_block(
                                     D, 8, H, starting=False), 1)}).eval()
    pair, mask = torch.randn(1, 6, 6, D), torch.ones(1, 6, 6)
    with torch.no_grad():
        want = [model.tri_att_start(pair, mask), model.tri_att_end(pair, mask=mask)]
    with every_warning() as caught:
        tt.accelerate(model)
    assert tt.accelerated_blocks(model) == []
    warned = fallback_messages(caught)
    for name in ("tri_att_start", "tri_att_end"):
        assert any(message.startswith(f"{name}: ") and "heads x head width = 4 x 8 = 32 "
                   "differs from pair_dim 16" in message for message in warned), warned
    assert set(tt.report(model).refused) == {"tri_att_start", "tri_att_end"}
    monkeypatch.setattr(ops, "_compute", lambda *a: pytest.fail("the op ran"))
    with torch.no_grad():
        got = [model.tri_att_start(pair, mask), model.tri_att_end(pair, mask=mask)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --- fallbacks -------------------------------------------------------------------------------

def test_cpu_tensors_run_the_original_forward_and_warn_once(monkeypatch):
    block = boltz()
    pair, mask = torch.randn(1, 6, 6, D), torch.ones(1, 6, 6)
    with torch.no_grad():
        want = block(pair, mask)
    tt.accelerate(block)
    monkeypatch.setattr(ops, "_compute", lambda *a: pytest.fail("the op ran"))
    with every_warning() as caught, torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(block(pair, mask), want, rtol=0, atol=0)
    (message,) = fallback_messages(caught)
    assert "the pair is on cpu" in message and "move the model" in message
    assert message.startswith("TriangleAttention: the original forward runs")
    assert tt.report(block).fallbacks == {"tensors on cpu": 3}


@pytest.mark.parametrize("reason, call", [
    ("gradients are enabled", lambda block, pair, mask: block(pair, mask)),
    ("expected (*, N, N, 16)", lambda block, pair, mask: block(pair[:, :, :5], mask[:, :, :5])),
    ("the mask has shape", lambda block, pair, mask: block(pair, mask[0])),
    ("argument bogus=1", lambda block, pair, mask: block(pair, mask, bogus=1)),
    ("the pair is torch.float64", lambda block, pair, mask: block(pair.double(), mask)),
])
def test_unsupported_calls_fall_back(cpu_routed, monkeypatch, reason, call):
    block = boltz()
    tt.accelerate(block)
    monkeypatch.setattr(ops, "_compute", lambda *a: pytest.fail("the op ran"))
    pair, mask = torch.randn(2, 6, 6, D), torch.ones(2, 6, 6)
    no_grad = reason != "gradients are enabled"
    with every_warning() as caught, torch.set_grad_enabled(not no_grad):
        for _ in range(2):
            try:
                call(block, pair, mask)
            except (TypeError, RuntimeError):
                pass  # the original forward's own error for what it does not take
    (message,) = fallback_messages(caught)
    assert reason in message
    assert sum(tt.report(block).fallbacks.values()) == 2


def test_openfold3_transposed_bias_falls_back(cpu_routed):
    block = mb.randomize(mb.openfold3_block(D, C, H), 0).eval()
    tt.accelerate(block)
    pair, mask = torch.randn(1, 6, 6, D), torch.ones(1, 6, 6)
    with every_warning() as caught, torch.no_grad():
        block(pair, mask=mask, transpose_bias=True)
    assert "transpose_bias=True" in fallback_messages(caught)[0]
    assert tt.report(block).fallbacks == {"transpose_bias=True": 1}


# --- the accelerated path (on the CPU) -------------------------------------------------------

@pytest.mark.parametrize("starting", [True, False])
@pytest.mark.parametrize("padding", [True, False])
def test_accelerated_boltz_block_matches_its_forward(rng, cpu_routed, op_calls, starting,
                                                    padding):
    block = boltz(starting)
    pair = torch.from_numpy(rng.standard_normal((2, 10, 10, D)).astype(np.float32))
    mask = row_masks(rng, 2, 10, padding)
    want = float64_forward(block, pair, mask)
    tt.accelerate(block)
    with torch.inference_mode():
        got = block(pair, mask, chunk_size=4, use_kernels=False)
    assert got.dtype == torch.float32 and op_calls[0] == 1
    compare(got, want, mask, starting)


def test_accelerated_protenix_and_openfold3_blocks(rng, cpu_routed):
    pair = torch.from_numpy(rng.standard_normal((1, 2, 9, 9, D)).astype(np.float32))
    mask = row_masks(rng, 2, 9, padding=False).unsqueeze(0)
    for block in (mb.protenix_block(D, C, H, starting=False), mb.openfold3_block(D, C, H)):
        block = mb.randomize(block, 1).eval()
        want = float64_forward(block, pair, mask)
        tt.accelerate(block)
        with torch.no_grad():
            got = block(pair, mask=mask)
        compare(got.reshape(2, 9, 9, D), want.reshape(2, 9, 9, D), mask[0],
                getattr(block, "starting", True))


# Each family's block of each node as its model builds it (Boltz-1 and Boltz-2 share
# boltz-community's classes). OpenFold3 runs its ending node with transpose_bias=True, which
# falls back (tested above); OpenFold is not on the package index: its block restated to its
# published shapes.
_FAMILY_BLOCKS = {
    ("boltz", "starting"): lambda: mb.boltz_block(D, C, H, starting=True),
    ("boltz", "ending"): lambda: mb.boltz_block(D, C, H, starting=False),
    ("protenix", "starting"): lambda: mb.protenix_block(D, C, H, starting=True),
    ("protenix", "ending"): lambda: mb.protenix_block(D, C, H, starting=False),
    ("openfold3", "starting"): lambda: mb.openfold3_block(D, C, H),
    ("openfold", "starting"): lambda: mb.openfold_block(D, C, H, starting=True),
    ("openfold", "ending"): lambda: mb.openfold_block(D, C, H, starting=False),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # openfold3: no Triton, no CUDA here
@pytest.mark.parametrize("family, node", list(_FAMILY_BLOCKS),
                         ids=[f"{f}-{n}" for f, n in _FAMILY_BLOCKS])
def test_every_family_accelerated_matches_its_own_forward(rng, cpu_routed, op_calls, family,
                                                          node):
    """Through the op, against the block's own forward in float64: masks of all ones,
    padding and random bits."""
    block = mb.randomize(_FAMILY_BLOCKS[family, node](), 17).eval()
    masks = {"ones": torch.ones(2, 9, 9), "padding": row_masks(rng, 2, 9, padding=True),
             "random": row_masks(rng, 2, 9, padding=False)}
    pair = torch.from_numpy(rng.standard_normal((2, 9, 9, D)).astype(np.float32))
    want = {kind: float64_forward(block, pair, mask) for kind, mask in masks.items()}
    tt.accelerate(block)
    assert tt.accelerated_blocks(block) == [""]
    for kind, mask in masks.items():
        with torch.no_grad():
            got = block(pair, mask=mask)
        compare(got, want[kind], mask, node == "starting")
    assert op_calls[0] == len(masks)


def test_accelerated_spec_module_returns_nan_where_it_does(rng, cpu_routed):
    module = TriangleSelfAttention(D, H).eval()
    pair = torch.randn(2, 7, 7, D)
    mask = torch.ones(2, 7, 7)
    mask[1, 3, :] = 0  # query 3 keeps no key: NaN in every row, as the spec says
    with torch.no_grad():
        want = module.double()(pair.double(), mask.double()).numpy()
    module.float()
    tt.accelerate(module)
    with torch.no_grad():
        got = module(pair, mask).double().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    assert rel_l2(got[finite], want[finite]) < 1e-6


def test_new_weights_are_not_used_stale(rng, cpu_routed):
    block, other = boltz(seed=0), boltz(seed=7)
    pair, mask = torch.randn(1, 6, 6, D), torch.ones(1, 6, 6)
    tt.accelerate(block)
    with torch.no_grad():
        first = block(pair, mask)
        block.load_state_dict(other.state_dict())        # a new checkpoint
        compare(block(pair, mask), float64_forward(other, pair, mask), mask, True)
        block.mha.linear_o.weight.mul_(2)                 # an in-place edit
        compare(block(pair, mask), float64_forward(block, pair, mask), mask, True)
        block.layer_norm.bias = torch.nn.Parameter(torch.ones(D))  # a parameter replaced
        compare(block(pair, mask), float64_forward(block, pair, mask), mask, True)
    assert not torch.equal(first, block(pair, mask))


def test_restore_gives_the_original_forward_back(cpu_routed, monkeypatch):
    block = boltz()
    tt.accelerate(block)
    tt.restore(block)
    monkeypatch.setattr(ops, "_compute", lambda *a: pytest.fail("the op ran"))
    with torch.no_grad():
        block(torch.randn(1, 5, 5, D), torch.ones(1, 5, 5))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_autocast_returns_the_dtype_the_original_returns(cpu_routed, op_calls, precision):
    block = boltz()
    pair, mask = torch.randn(1, 6, 6, D), torch.ones(1, 6, 6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = block(pair, mask)
        tt.accelerate(block, precision=precision)
        got = block(pair, mask)
    assert want.dtype == got.dtype == torch.bfloat16 and op_calls[0] == 1
    assert rel_l2(got.double().numpy(), want.double().numpy()) < 3e-2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiles_with_fullgraph(rng, cpu_routed, op_calls, backend):
    torch._dynamo.reset()
    stack = torch.nn.ModuleList([boltz(True, 0), boltz(False, 1)])

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = stack

        def forward(self, z, mask):
            for block in self.blocks:
                z = z + block(z, mask, chunk_size=None)
            return z

    model = Stack().eval()
    pair = torch.from_numpy(rng.standard_normal((2, 8, 8, D)).astype(np.float32))
    mask = row_masks(rng, 2, 8, padding=True)
    with torch.no_grad():
        want = model(pair, mask)  # padding rows are finite in both: compare the kept ones
    tt.accelerate(model)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad():
        got = compiled(pair, mask)
    assert op_calls[0] == 2
    keep = np.broadcast_to((mask.numpy() != 0).any(-1)[:, :, None, None], got.shape) \
        & np.broadcast_to((mask.numpy() != 0).any(-2)[:, None, :, None], got.shape)
    assert rel_l2(got.numpy()[keep], want.numpy()[keep]) < 1e-5


# --- the GPU path's wiring, with CuPy and the kernels stood in for --------------------------

class _Recorder:
    """Stands in for CuPy: records the device, stream and allocator contexts entered."""

    def __init__(self):
        self.entered, self.active = [], []
        recorder = self

        class Context:
            def __init__(self, *what):
                self.what = what

            def __enter__(self):
                recorder.entered.append(self.what)
                recorder.active.append(self.what)

            def __exit__(self, *exc):
                recorder.active.remove(self.what)

        self.cuda = types.SimpleNamespace(
            Device=lambda index: Context("device", index),
            ExternalStream=lambda ptr, index: Context("stream", ptr, index),
            using_allocator=lambda allocate: Context("allocator", allocate),
            UnownedMemory=lambda ptr, size, owner, index: types.SimpleNamespace(
                ptr=ptr, size=size, owner=owner),
            MemoryPointer=lambda memory, offset: types.SimpleNamespace(
                ptr=memory.ptr + offset, memory=memory))

    def asarray(self, tensor):
        return ("view", tensor)

    def ndarray(self, shape, dtype, memptr, strides):
        """A view as ops._as_cupy makes it: address, shape, dtype, byte strides, owner."""
        return ("view", types.SimpleNamespace(ptr=memptr.ptr, shape=shape,
                                              dtype=np.dtype(dtype), strides=strides,
                                              owner=memptr.memory.owner))


@pytest.fixture
def gpu_stand_ins(monkeypatch):
    """_run_cuda on CPU tensors: CuPy, torch's CUDA stream queries and the kernels replaced;
    returns (recorder, the Forward calls, the capture flag)."""
    import triattn_cupy.cuda_setup as cuda_setup
    import triattn_cupy.gpu.device_weights as device_weights
    import triattn_cupy.gpu.forward as forward

    recorder, calls, capturing = _Recorder(), [], [False]

    class FakeForward:
        def __init__(self, dw, pair, mask, fully_masked, out, precision, route=None,
                     conventions=("pair", "starting"), pair_dtype=None, allocate=None):
            calls.append(dict(dw=dw, pair=pair, mask=mask, fully_masked=fully_masked,
                              out=out, precision=precision, conventions=conventions,
                              pair_dtype=pair_dtype, allocate=allocate,
                              active=list(recorder.active)))

        def run(self):
            pass

    monkeypatch.setattr(cuda_setup, "require_cuda", lambda: recorder)
    monkeypatch.setattr(forward, "Forward", FakeForward)
    monkeypatch.setattr(device_weights, "DeviceWeights", lambda w, i: ("dw", i))
    monkeypatch.setattr(ops, "_streams", {})
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(cuda_stream=4242))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return recorder, calls, capturing


def test_gpu_path_views_stream_allocator_and_conventions(gpu_stand_ins):
    recorder, calls, _ = gpu_stand_ins
    weights = random_weights(D, H, seed=8)
    handle = ops._handle_of(weights)
    pair = torch.randn(2, 5, 5, D).to(torch.bfloat16).transpose(1, 2)
    mask = torch.ones(2, 5, 5, dtype=torch.bfloat16)
    out = torch.empty(2, 5, 5, D, dtype=torch.bfloat16)
    assert ops._run_cuda(pair, mask, handle, "bf16", "zero", "row", "ending", out) is out
    (call,) = calls
    assert call["dw"] == ("dw", pair.device.index)
    assert call["pair_dtype"] == "bfloat16" and call["precision"] == "bf16"
    assert call["conventions"] == ("row", "ending") and call["fully_masked"] == "zero"
    # bfloat16 as its int16 bits, in place: the same memory and strides
    view = call["pair"][1]
    assert view.dtype == np.int16 and view.ptr == pair.data_ptr() and view.owner is pair
    assert view.strides == tuple(2 * s for s in pair.stride())
    assert call["out"][1].ptr == out.data_ptr()
    assert call["mask"][1].dtype == np.bool_  # a bfloat16 mask as 0 or not
    # On torch's stream (4242), with torch's allocator, on the pair's device
    kinds = [what[0] for what in call["active"]]
    assert kinds == ["device", "stream", "allocator"]
    assert call["active"][1][1] == 4242
    assert call["active"][2][1] is call["allocate"]


def test_gpu_path_inside_a_capture_needs_a_warm_up(gpu_stand_ins):
    _, calls, capturing = gpu_stand_ins
    weights = random_weights(D, H, seed=10)
    handle = ops._handle_of(weights)
    pair = torch.randn(1, 6, 6, D)
    out = torch.empty_like(pair)
    capturing[0] = True
    with pytest.raises(RuntimeError, match="have not run on GPU"):
        ops._run_cuda(pair, None, handle, "fp32", "zero", "pair", "starting", out)
    capturing[0] = False
    ops._run_cuda(pair, None, handle, "fp32", "zero", "pair", "starting", out)
    capturing[0] = True
    ops._run_cuda(pair, None, handle, "fp32", "zero", "pair", "starting", out)  # warm
    with pytest.raises(RuntimeError, match="this input geometry has not run before"):
        ops._run_cuda(pair[:, :5, :5], None, handle, "fp32", "zero", "pair", "starting",
                      out[:, :5, :5])
    assert len(calls) == 2


def test_compiles_under_autocast(cpu_routed, op_calls):
    torch._dynamo.reset()
    block = boltz()
    tt.accelerate(block, precision="bf16")
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    pair, mask = torch.randn(1, 6, 6, D), torch.ones(1, 6, 6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert compiled(pair, mask).dtype == torch.bfloat16
    with torch.no_grad():  # unbatched, outside autocast: pair's dtype
        out = compiled(pair[0], mask[0])
    assert out.shape == pair.shape[1:] and out.dtype == torch.float32 and op_calls[0] == 2


def test_openfold_block_by_its_module_path(rng, cpu_routed, op_calls):
    """OpenFold is not on PyPI: its block is the restatement in model_blocks, given the
    class name and module path that OpenFold's own has."""
    model = torch.nn.ModuleDict({"tri_att_end": mb.openfold_block(D, C, H, starting=False)})
    mb.randomize(model, 3).eval()
    pair = torch.from_numpy(rng.standard_normal((2, 8, 8, D)).astype(np.float32))
    mask = row_masks(rng, 2, 8, padding=False)
    want = float64_forward(model.tri_att_end, pair, mask)
    tt.accelerate(model)
    assert tt.accelerated_blocks(model) == ["tri_att_end"]
    with torch.no_grad():
        got = model.tri_att_end(pair, mask)
    assert op_calls[0] == 1
    compare(got, want, mask, starting=False)


def test_functional_handles_die_with_their_weights():
    import gc

    weights = random_weights(D, H, seed=11)
    tt.triangle_attention(torch.randn(5, 5, D), None, weights)
    handle = ops._by_weights[weights]
    assert handle in ops._registry
    del weights
    gc.collect()
    assert handle not in ops._registry


def test_a_freed_model_frees_its_handles():
    import gc

    block = tt.accelerate(boltz())
    handle = block.__dict__[acc_module._STATE].handle
    assert handle in ops._registry
    del block
    gc.collect()
    assert handle not in ops._registry


def test_leading_dims_merge_only_without_a_copy():
    merge = acc_module._merge_leading
    t = torch.zeros(2, 3, 5, 5, 4)
    assert merge(t, 3).shape == (6, 5, 5, 4) and merge(t, 3).data_ptr() == t.data_ptr()
    assert merge(t[0], 3).shape == (3, 5, 5, 4)
    assert merge(t[0, 0], 3).shape == (1, 5, 5, 4)
    assert merge(t.transpose(0, 1), 3) is None
    assert merge(t[:, 1:2], 3).shape == (2, 5, 5, 4)  # a unit dim between: still a view
    assert merge(t[:, ::2], 3) is None
